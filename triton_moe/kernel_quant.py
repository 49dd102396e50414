"""x quantized to E4M3 inside GEMM1's A load (``QUANT_A``; THE rule is
:func:`triton_moe.plan.x_quant_in_gemm1`), for both grouped GEMM kernels.

GEMM1 then reads bf16 x [T, K] through its usual row gather (A row = pair // top_k) and quantizes
each K step's tile in registers before the MMA, with ``quantize_kernel``'s helpers and masks
(:func:`~triton_moe.kernel_parts._abs_bits`, ``_scale_of``, ``_quantize``), so its codes and scales
are that launch's bit for bit and the layer's output does not change:

* fp8_block (BLOCK_K = 128, K steps at multiples of 128): the step's tile is one 1×128 group of
  each row; its amax is an integer max of the bits (NaN kept), masked columns zeros as in the
  separate pass, and its scales feed the block-scaled MMA instead of loaded ones;
* fp8_channel: before the K loop each program reads its rows over all of K for their amaxes
  (:func:`_a_scale`), then quantizes every step's tile with them and dequantizes by them after the loop;
* static fp8_tensor: ``a1_scale``, read (a bad one sets ``BAD_A1_SCALE``, as ``quantize_kernel`` did).

Padding rows get the scale 1.0 the separate path's masked loads give them. The cost: the A tile
travels global → registers → shared memory instead of straight to WGMMA, at 2 bytes per element,
once per N tile (notes/triton_moe.md, "FP8 data flow").
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_moe.kernel_parts import (
    BAD_A1_SCALE,
    PER_BLOCK,
    PER_CHANNEL,
    PER_TENSOR,
    _abs_bits,
    _quantize,
    _scale_bad,
    _scale_of,
)


@triton.jit
def _a_scale(
    a_ptr,
    a_scale_ptr,
    a_row,
    row_ok,
    error_ptr,
    K,
    QUANT: tl.constexpr,
    QUANT_A: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Before the K loop, x's scale for the whole loop where GEMM1 quantizes x (``QUANT_A``): static
    per-tensor: ``a1_scale`` (checked); per-channel: each gathered row's, from an integer max of the
    bits over all of K (NaN kept; padding rows 1.0). Otherwise a placeholder nobody reads (fp8_block's
    scales come per K step, :func:`_quantize_a`)."""
    if QUANT_A and QUANT == PER_TENSOR:
        s = tl.load(a_scale_ptr)
        tl.atomic_or(error_ptr, BAD_A1_SCALE, mask=_scale_bad(s) != 0)
        return s
    elif QUANT_A and QUANT == PER_CHANNEL:
        offs_k = tl.arange(0, BLOCK_K)
        ptrs = a_ptr + a_row[:, None].to(tl.int64) * K + offs_k[None, :]
        bits = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(ptrs + k0, mask=row_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            bits = tl.maximum(bits, _abs_bits(v))
        amax = tl.max(bits, axis=1).to(tl.float32, bitcast=True)
        return tl.where(row_ok, _scale_of(amax), 1.0)
    else:
        return tl.full([BLOCK_M], 1.0, dtype=tl.float32)


@triton.jit
def _quantize_a(a, a_ok, a_s, row_ok, QUANT: tl.constexpr, QUANT_A: tl.constexpr, INTERPRETER: tl.constexpr):
    """One K step's x tile [BLOCK_M, BLOCK_K] (zeros where ``a_ok`` is False) → (its E4M3 codes, their
    scales): fp8_block's per row from this tile (one 1×128 group), the others ``a_s`` of
    :func:`_a_scale`. Masked elements get the code 0, as the separate path's masked loads of E4M3 x
    (0 / a bad scale would be NaN). Without ``QUANT_A`` the tile is already E4M3: (a, a_s) unchanged."""
    if not QUANT_A:
        return a, a_s
    elif QUANT == PER_BLOCK:
        v = a.to(tl.float32)
        s = _scale_of(tl.max(_abs_bits(v), axis=1).to(tl.float32, bitcast=True))
        s = tl.where(row_ok, s, 1.0)
        return _zero_masked(_quantize(v, s[:, None], INTERPRETER), a_ok), s
    elif QUANT == PER_CHANNEL:
        return _zero_masked(_quantize(a, a_s[:, None], INTERPRETER), a_ok), a_s
    else:
        return _zero_masked(_quantize(a, a_s, INTERPRETER), a_ok), a_s


@triton.jit
def _zero_masked(q, a_ok):
    """E4M3 codes with the byte 0 where ``a_ok`` is False."""
    return tl.where(a_ok, q.to(tl.uint8, bitcast=True), 0).to(tl.float8e4nv, bitcast=True)

"""The row-wise kernels of the MoE layer: FP8 quantization of activations, and the combine.

``amax_kernel``      partial amaxes of x [rows, K] (per-tensor FP8 with a dynamic scale)
``quantize_kernel``  a [rows, K] (bf16 or fp32) → E4M3 [rows, K] + scales
``combine_kernel``   out[t] = Σ_j y[t·top_k + j] in a fixed order (deterministic)

Quantization, before each GEMM, once
    ``q = e4m3(clamp(a / s, ±448))``, ``s = max(amax, 1e−12) / 448`` — bit for bit the reference
    quantization of :mod:`moe_spec.quant` (IEEE division, round to nearest even), with the scales in
    its shapes ([1], [rows, 1], [rows, ⌈cols/128⌉]). x under per-tensor needs the global amax first
    (``amax_kernel``: ≤ 128 partial amaxes, one read of x, nothing to zero) unless the scale is
    static; per-channel and block scales depend only on the row / the 1×128 group, so
    ``quantize_kernel`` finds the amax and quantizes in one program. The intermediate's amax comes
    from GEMM1's epilogue (its buffer zeroed by x's quantization, or — where GEMM1 quantizes x —
    made zero and left zero by the intermediate's quantization after reading it); the intermediate
    stays fp32 until this pass (a bf16-rounded copy would move some values across an E4M3 rounding boundary:
    notes/triton_moe.md, "Pipeline"). Where its scale is known inside one GEMM1 tile — static
    per-tensor, or 1×128 groups in a tile of whole groups (:func:`triton_moe.plan.epilogue_quant`) —
    GEMM1's epilogue quantizes it instead, with the same helpers (``_scale_of``, ``_quantize``), and
    this pass does not run for it; a dynamic per-tensor or per-row scale needs values of other tiles.
    The scale's floor and the saturating clamp keep NaN (``propagate_nan=ALL``), as the amaxes do
    (:mod:`triton_moe.kernels`, "NaN and inf").

One program per row (or per partial amax); they share the helpers and constants of
:mod:`triton_moe.kernels`, whose grouped GEMM reads what the quantization writes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_moe.kernel_parts import (
    FP8_BLOCK,
    PER_BLOCK,
    PER_CHANNEL,
    PER_TENSOR,
    _abs_bits,
    _bits_ptr,
    _cast_out,
    _quantize,
    _scale_bad,
    _scale_of,
)

#: Partial amaxes of x under fp8_tensor (``amax_kernel``'s programs), reduced by ``quantize_kernel``.
AMAX_PARTS = tl.constexpr(128)


@triton.jit(do_not_specialize=["num_rows"])
def amax_kernel(x_ptr, amax_ptr, num_rows, K, BLOCK: tl.constexpr):
    """Partial amaxes of x [rows, K] (per-tensor FP8). x is cut into pieces of BLOCK columns of one row,
    numbered row by row; program g of G stores the amax bits of pieces g, g + G, … in ``amax_ptr[g]``
    (no atomics, nothing to zero; NaN kept); ``quantize_kernel`` reduces them. A few rows are still
    spread over up to G programs (a decode step's one row of 7168 columns: 7 pieces, 7 programs)."""
    part = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    pieces_per_row = tl.cdiv(K, BLOCK)
    row_max = tl.zeros([BLOCK], dtype=tl.int32)
    for piece in range(part, num_rows * pieces_per_row, tl.num_programs(0)):
        row = piece // pieces_per_row
        k0 = (piece - row * pieces_per_row) * BLOCK
        v = tl.load(x_ptr + row.to(tl.int64) * K + k0 + cols, mask=cols < K - k0, other=0.0)
        row_max = tl.maximum(row_max, _abs_bits(v))
    tl.store(_bits_ptr(amax_ptr) + part, tl.max(row_max, axis=0))


@triton.jit(do_not_specialize=["num_rows", "num_amax", "zero_count"])
def quantize_kernel(
    a_ptr,
    amax_ptr,
    q_ptr,
    scale_ptr,
    zero_ptr,
    num_rows,
    K,
    num_amax,
    zero_count,
    QUANT: tl.constexpr,
    AMAX_GIVEN: tl.constexpr,
    GROUPS: tl.constexpr,
    INTERPRETER: tl.constexpr,
    STATIC_BIT: tl.constexpr = 0,
    ZERO_AFTER: tl.constexpr = False,
):
    """a [rows, K] (bf16 or fp32) → q [rows, K] E4M3 and scales, exactly as moe_spec.quant does.
    Programs (row, j) of a grid [rows, S]: program j of a row quantizes its steps j, j + S, … of GROUPS × 128
    columns (S > 1 spreads a decode step's few long rows over more SMs; the host picks S, and S is 1
    under ``ZERO_AFTER``, whose zeroing is per row). The scale is static (``STATIC_BIT`` ≠ 0,
    per-tensor: read at ``scale_ptr``; ``amax_ptr`` is the error word, where a scale not finite and
    positive sets ``STATIC_BIT``) or comes from an amax, given (``AMAX_GIVEN``: x's ``num_amax``
    partial amaxes; the intermediate's, from GEMM1's epilogue) or found here (per-channel reads the
    row twice). Scales in moe_spec.quant's shapes: [1], [rows, 1], [rows, ⌈K/128⌉]. Quantizing x
    also zeroes GEMM1's amax buffer (``zero_count`` elements at ``zero_ptr``): no launch fills it.
    ``ZERO_AFTER``: the zeroing comes last, after every load of the program — the intermediate's
    quantization zeroing the amax it has just read (each program its row's), where GEMM1 quantizes x
    (:func:`triton_moe.plan.x_quant_in_gemm1`) and so no x launch zeroes it before GEMM1."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    first = split == 0  # the program of a row that writes what the row's programs share
    groups = tl.arange(0, GROUPS)
    cols = tl.arange(0, FP8_BLOCK)
    K_GROUPS = tl.cdiv(K, FP8_BLOCK)
    if not ZERO_AFTER:
        _zero_share(zero_ptr, row * splits + split, num_rows * splits, zero_count)
    if QUANT == PER_TENSOR and STATIC_BIT:
        s = tl.load(scale_ptr)
        tl.atomic_or(amax_ptr, STATIC_BIT, mask=(row == 0) & first & (_scale_bad(s) != 0))
    elif QUANT == PER_TENSOR:
        parts = tl.arange(0, AMAX_PARTS)
        amax = tl.max(tl.load(_bits_ptr(amax_ptr) + parts, mask=parts < num_amax, other=0), axis=0)
        s = _scale_of(amax.to(tl.float32, bitcast=True))
        tl.store(scale_ptr, s, mask=(row == 0) & first)
    elif QUANT == PER_CHANNEL:
        if AMAX_GIVEN:
            amax = tl.load(amax_ptr + row)
        else:
            row_max = tl.zeros([GROUPS, FP8_BLOCK], dtype=tl.int32)
            for g0 in range(0, K_GROUPS, GROUPS):
                k = (g0 + groups)[:, None] * FP8_BLOCK + cols[None, :]
                v = tl.load(a_ptr + row * K + k, mask=k < K, other=0.0)
                row_max = tl.maximum(row_max, _abs_bits(v))
            amax = tl.max(tl.max(row_max, axis=1), axis=0).to(tl.float32, bitcast=True)
        s = _scale_of(amax)
        tl.store(scale_ptr + row, s, mask=first)
    for g0 in range(split * GROUPS, K_GROUPS, splits * GROUPS):
        k = (g0 + groups)[:, None] * FP8_BLOCK + cols[None, :]
        v = tl.load(a_ptr + row * K + k, mask=k < K, other=0.0).to(tl.float32)
        if QUANT == PER_BLOCK:
            g_ok = g0 + groups < K_GROUPS
            if AMAX_GIVEN:
                amax = tl.load(amax_ptr + row * K_GROUPS + g0 + groups, mask=g_ok, other=1.0)
            else:
                amax = tl.max(_abs_bits(v), axis=1).to(tl.float32, bitcast=True)
            s_g = _scale_of(amax)
            tl.store(scale_ptr + row * K_GROUPS + g0 + groups, s_g, mask=g_ok)
            q = _quantize(v, s_g[:, None], INTERPRETER)
        else:
            q = _quantize(v, s, INTERPRETER)
        tl.store(q_ptr + row * K + k, q, mask=k < K)
    if ZERO_AFTER:
        tl.debug_barrier()  # every thread's amax loads precede the zeros
        _zero_share(zero_ptr, row, num_rows, zero_count)


@triton.jit
def _zero_share(zero_ptr, row, num_rows, zero_count):
    """Zero program ``row``'s share of ``zero_count`` fp32 at ``zero_ptr``: ⌈zero_count / num_rows⌉
    elements from row · share (for an amax per row or per (row, 1×128 group): that row's own)."""
    cols = tl.arange(0, FP8_BLOCK)
    per_row = tl.cdiv(zero_count, num_rows)
    for z0 in range(0, per_row, FP8_BLOCK):
        z = row * per_row + z0 + cols
        tl.store(zero_ptr + z, tl.zeros_like(z).to(tl.float32), mask=(z0 + cols < per_row) & (z < zero_count))


@triton.jit(do_not_specialize=["num_tokens"])
def combine_kernel(y_ptr, out_ptr, num_tokens, K, TOP_K: tl.constexpr, BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
    """out[t] = Σ_j y[t·TOP_K + j] in fp32, j ascending (y rows already carry the routing weight)."""
    t = tl.program_id(0).to(tl.int64)  # row offsets (t·TOP_K + j)·K may pass 2³¹
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < K
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(TOP_K):
        total += tl.load(y_ptr + (t * TOP_K + j) * K + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * K + cols, _cast_out(total, out_ptr.dtype.element_ty, INTERPRETER), mask=ok)

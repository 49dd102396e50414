"""FP8 (E4M3FN) quantization formats, in torch: the reference both backends must reproduce.

Every format stores ``q = saturate(round_to_nearest_even(v / s))`` in float8_e4m3fn with an fp32
scale ``s = max(amax, 1e-12) / 448`` (448 = :data:`~moe_spec.quant.FP8_MAX`), and reads a value
back as ``q · s``. The formats differ only in the set of values that share one scale:

==============  ==================================  ==========================================
format          weight [E, N_out, K_in]: scale      activation [T, K]: scale (dynamic)
==============  ==================================  ==========================================
fp8_tensor      [E]        (one per expert matrix)  [1]              (whole tensor)
fp8_channel     [E, N_out] (one per output row)     [T, 1]           (one per token)
fp8_block       [E, ⌈N_out/128⌉, ⌈K_in/128⌉]         [T, ⌈K/128⌉]     (1×128 groups along K)
==============  ==================================  ==========================================

A kernel's GEMM then computes Σ_k (qa·sa)(qw·sw); for the first two formats both scales factor out
of the K sum and are applied once after the loop; for ``fp8_block`` they change every 128 of K and
are applied per K step.

Amax is computed in fp32 on the values as given (a bf16 activation is exact in fp32).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

#: The quantization formats of the backend contract. ``None`` is plain bf16.
#:
#: ``fp8_tensor``  one fp32 scale per expert weight matrix; one dynamic scale for a whole activation.
#: ``fp8_channel`` one scale per output channel (weight row); one dynamic scale per token (row).
#: ``fp8_block``   one scale per 128×128 weight block; one dynamic scale per 1×128 activation group
#:                 (DeepSeek-V3 style).
QUANT_FORMATS = (None, "fp8_tensor", "fp8_channel", "fp8_block")

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite E4M3FN value. Quantization saturates to ±FP8_MAX.
FP8_MAX = 448.0
#: Edge of a weight block / activation group in ``fp8_block``.
FP8_BLOCK = 128


def check_quant(quant) -> Optional[str]:
    """Return ``quant`` if it names a format of :data:`QUANT_FORMATS`, else raise ValueError."""
    if quant not in QUANT_FORMATS:
        raise ValueError(f"quant: expected one of {QUANT_FORMATS}, got {quant!r}")
    return quant

#: Smallest amax a scale is computed from, so an all-zero group gets a finite, non-zero scale.
AMAX_FLOOR = 1e-12


def _cast_fp8(v: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of fp32 ``v`` to E4M3FN."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, 1e-12) / 448`` as an IEEE division on every device.

    The divisor is a tensor on purpose: PyTorch's CUDA kernel divides by a Python scalar as a
    multiplication by its reciprocal, which is one ulp off for some amax values (the CPU divides
    exactly). One ulp in a scale decides the rounding of values that sit exactly on a midpoint of
    the e4m3 grid — frequent for bf16 inputs — and the re-quantized intermediate amplifies such a
    flip to ~1 % of the output (measured on the H200: GPU vs CPU oracle 8.5e-3 rel L2 before this).
    """
    amax = amax.float().clamp_min(AMAX_FLOOR)
    return amax / torch.full_like(amax, FP8_MAX)


def _pad_to(v: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -v.shape[dim] % multiple
    if not extra:
        return v
    pad = [0, 0] * (v.dim() - 1 - dim % v.dim()) + [0, extra]
    return torch.nn.functional.pad(v, pad)


def _block_amax(v: torch.Tensor) -> torch.Tensor:
    """Amax over 128×128 blocks of the last two dims of [E, N, K] → [E, ⌈N/128⌉, ⌈K/128⌉]."""
    E, N, K = v.shape
    p = _pad_to(_pad_to(v.abs(), 1, FP8_BLOCK), 2, FP8_BLOCK)
    nb, kb = p.shape[1] // FP8_BLOCK, p.shape[2] // FP8_BLOCK
    return p.view(E, nb, FP8_BLOCK, kb, FP8_BLOCK).amax(dim=(2, 4))


def _expand_blocks(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[.., ⌈n/128⌉, ⌈k/128⌉] block scales → [.., n, k] element scales."""
    return s.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]


def weight_scale_shape(fmt: str, E: int, n_out: int, k_in: int) -> tuple:
    """The shape of the fp32 scale tensor of a [E, n_out, k_in] weight in format ``fmt``."""
    check_quant(fmt)
    if fmt == "fp8_tensor":
        return (E,)
    if fmt == "fp8_channel":
        return (E, n_out)
    if fmt == "fp8_block":
        return (E, math.ceil(n_out / FP8_BLOCK), math.ceil(k_in / FP8_BLOCK))
    raise ValueError(f"quant: {fmt!r} has no weight scale")


def quantize_weight(w: torch.Tensor, fmt: str):
    """Quantize expert weights ``w`` [E, N_out, K_in] to ``(q float8_e4m3fn, scale float32)``."""
    check_quant(fmt)
    if fmt is None:
        raise ValueError("quant: quantize_weight needs an fp8 format, got None")
    if w.dim() != 3:
        raise ValueError(f"w: expected [E, N_out, K_in], got shape {tuple(w.shape)}")
    v = w.float()
    E, N, K = v.shape
    if fmt == "fp8_tensor":
        scale = _scale_of(v.abs().amax(dim=(1, 2)))
        q = _cast_fp8(v / scale[:, None, None])
    elif fmt == "fp8_channel":
        scale = _scale_of(v.abs().amax(dim=2))
        q = _cast_fp8(v / scale[:, :, None])
    else:
        scale = _scale_of(_block_amax(v))
        q = _cast_fp8(v / _expand_blocks(scale, N, K))
    return q.contiguous(), scale.contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype=torch.float32) -> torch.Tensor:
    """``q · scale`` broadcast per ``fmt``, in ``dtype`` (fp32 by default; the oracle uses fp64)."""
    check_quant(fmt)
    v, s = q.to(dtype), scale.to(dtype)
    E, N, K = q.shape
    if fmt == "fp8_tensor":
        return v * s.view(E, 1, 1)
    if fmt == "fp8_channel":
        return v * s.view(E, N, 1)
    if fmt == "fp8_block":
        return v * _expand_blocks(s, N, K)
    raise ValueError(f"quant: dequantize_weight needs an fp8 format, got {fmt!r}")


def activation_scale_shape(fmt: str, T: int, K: int) -> tuple:
    check_quant(fmt)
    return {"fp8_tensor": (1,), "fp8_channel": (T, 1), "fp8_block": (T, math.ceil(K / FP8_BLOCK))}[fmt]


def quantize_activation(a: torch.Tensor, fmt: str):
    """Dynamic quantization of activations ``a`` [T, K] → ``(q float8_e4m3fn, scale float32)``."""
    check_quant(fmt)
    if fmt is None:
        raise ValueError("quant: quantize_activation needs an fp8 format, got None")
    if a.dim() != 2:
        raise ValueError(f"a: expected [T, K], got shape {tuple(a.shape)}")
    v = a.float()
    T, K = v.shape
    if fmt == "fp8_tensor":
        scale = _scale_of(v.abs().amax()).reshape(1) if v.numel() else torch.ones(1, device=v.device)
        q = _cast_fp8(v / scale)
    elif fmt == "fp8_channel":
        scale = _scale_of(v.abs().amax(dim=1, keepdim=True)) if K else torch.ones(T, 1, device=v.device)
        q = _cast_fp8(v / scale)
    else:
        groups = math.ceil(K / FP8_BLOCK)
        p = _pad_to(v.abs(), 1, FP8_BLOCK).view(T, groups, FP8_BLOCK)
        scale = _scale_of(p.amax(dim=2))
        q = _cast_fp8(v / scale.repeat_interleave(FP8_BLOCK, dim=1)[:, :K])
    return q.contiguous(), scale.contiguous()


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype=torch.float32) -> torch.Tensor:
    check_quant(fmt)
    v, s = q.to(dtype), scale.to(dtype)
    if fmt in ("fp8_tensor", "fp8_channel"):
        return v * s
    if fmt == "fp8_block":
        return v * s.repeat_interleave(FP8_BLOCK, dim=1)[:, : q.shape[1]]
    raise ValueError(f"quant: dequantize_activation needs an fp8 format, got {fmt!r}")


def fake_quantize_activation(a: torch.Tensor, fmt, dtype=torch.float64) -> torch.Tensor:
    """``dequantize(quantize(a))`` — what a W8A8 kernel effectively multiplies; identity for bf16."""
    if fmt is None:
        return a.to(dtype)
    q, s = quantize_activation(a, fmt)
    return dequantize_activation(q, s, fmt, dtype)

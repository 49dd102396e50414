"""The quantization formats of the contract — one registry — and their torch reference.

:data:`FORMATS` is the one table of formats: bf16 and three FP8 (E4M3FN) scale granularities.
Everything that differs between formats is a field of its :class:`QuantFormat` (weight dtype, which
values share a scale, the tolerance against the oracle, the kernels' mode number); every
validator, oracle, kernel launcher and report reads it from here, so a new format is one more row.

Every FP8 format stores ``q = saturate(round_to_nearest_even(v / s))`` in float8_e4m3fn with an fp32
scale ``s = max(amax, 1e-12) / 448`` (448 = :data:`FP8_MAX`), and reads a value back as ``q · s``.
The formats differ only in the groups of values that share one scale:

==============  ==================================  ==========================================
format          weight [E, N_out, K_in]: scale      activation [T, K]: scale (dynamic)
==============  ==================================  ==========================================
fp8_tensor      [E]        (one per expert matrix)  [1]              (whole tensor)
fp8_channel     [E, N_out] (one per output row)     [T, 1]           (one per token)
fp8_block       [E, ⌈N_out/128⌉, ⌈K_in/128⌉]         [T, ⌈K/128⌉]     (1×128 groups along K)
==============  ==================================  ==========================================

A kernel's GEMM then computes Σ_k (qa·sa)(qw·sw); when neither scale changes along K (the first
two formats) both factor out of the K sum and are applied once after the loop; for ``fp8_block``
they change every 128 of K and are applied per K step.

Amax is computed in fp32 on the values as given (a bf16 activation is exact in fp32).

Static activation scales (``fp8_tensor`` only). Instead of the batch's amax, a caller may give the
two activation scales — x's (``a1_scale``) and the intermediate's (``a2_scale``) — calibrated
beforehand, as vLLM's ``activation_scheme="static"`` checkpoints do (:func:`quantize_activation_static`:
``q = e4m3(clamp(a / s, ±448))`` with the given s). Then a token's quantization no longer depends on
the other tokens of its batch. Values beyond ±448·s, which a calibration that saw smaller amaxes
lets through, saturate to ±448 — a bounded clipping error, not an inf.

NaN and overflow. A NaN anywhere in a group makes the group's amax NaN, hence its scale NaN, hence
every value of the group NaN after dequantization (``q · s``); an inf makes the scale inf, and the
group dequantizes to NaN as well (``0 · inf``). Nothing is dropped: a scale group is the blast
radius of a non-finite value. Finite values beyond ±448·s cannot occur (s is taken from the
group's own amax); the saturating cast only guards rounding at the edge — except under a static
scale, where they saturate (above). A NaN stays NaN under a static scale, but only in its own value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite E4M3FN value. Quantization saturates to ±FP8_MAX.
FP8_MAX = 448.0
#: Edge of a weight block / activation group in ``fp8_block``.
FP8_BLOCK = 128
#: Smallest amax a scale is computed from, so an all-zero group gets a finite, non-zero scale.
AMAX_FLOOR = 1e-12

#: In a scale group, "the whole extent of this dimension".
WHOLE = None


@dataclass(frozen=True)
class QuantFormat:
    """One quantization format of the backend contract.

    ``weight_group`` / ``activation_group`` say which values share one scale: ``(rows, cols)`` of
    an expert weight W[e] [N_out, K_in] / of an activation [T, K]; :data:`WHOLE` spans the
    dimension. ``None`` for bf16, which has no scales.
    """

    name: str | None  # the contract's spelling: None (bf16) or "fp8_…"
    label: str  # display and table name ("bf16" for None)
    mode: int  # the number kernels branch on (a compile-time constant): 0 bf16, 1, 2, 3 …
    weight_dtype: torch.dtype
    weight_group: tuple | None
    activation_group: tuple | None
    tolerance: float  # rel L2 a backend's output may be from the fp64 oracle on its own inputs
    summary: str

    @property
    def quantized(self) -> bool:
        return self.weight_group is not None

    @property
    def scales_along_k(self) -> bool:
        """True when a scale changes along the reduction (K) dimension, so a GEMM must apply the
        scales every K step instead of once after the loop."""
        return self.quantized and (self.weight_group[1] is not WHOLE or self.activation_group[1] is not WHOLE)

    def weight_scale_shape(self, E: int, n_out: int, k_in: int) -> tuple | None:
        """Shape of the fp32 scale of a [E, n_out, k_in] weight: one entry per group; a dimension
        that one scale spans whole does not appear. None for bf16."""
        if not self.quantized:
            return None
        counts = _group_counts((n_out, k_in), self.weight_group)
        return (E,) + tuple(c for c, g in zip(counts, self.weight_group) if g is not WHOLE)

    def activation_scale_shape(self, T: int, K: int) -> tuple:
        """Shape of the fp32 scale of a [T, K] activation: [rows, cols] of groups (broadcasts
        against the activation), or [1] when one scale covers the whole tensor."""
        self._need_scales("activation_scale_shape")
        if self.activation_group == (WHOLE, WHOLE):
            return (1,)
        return _group_counts((T, K), self.activation_group)

    def _need_scales(self, what: str) -> None:
        if not self.quantized:
            raise ValueError(f"quant: {what} needs an fp8 format, got {self.name!r}")


#: The registry, in contract order; keys are the contract's spellings of ``quant``.
FORMATS: dict = {
    f.name: f
    for f in (
        #           name           label          mode  weight dtype     weight_group / activation_group  tolerance
        QuantFormat(
            None,
            "bf16",
            0,
            torch.bfloat16,
            None,
            None,
            1e-2,
            "bf16 weights and activations, fp32 accumulation; no scales",
        ),
        QuantFormat(
            "fp8_tensor",
            "fp8_tensor",
            1,
            FP8_DTYPE,
            (WHOLE, WHOLE),
            (WHOLE, WHOLE),
            1e-2,
            "one fp32 scale per expert weight matrix; one dynamic scale for a whole activation",
        ),
        QuantFormat(
            "fp8_channel",
            "fp8_channel",
            2,
            FP8_DTYPE,
            (1, WHOLE),
            (1, WHOLE),
            1e-2,
            "one scale per output channel (weight row); one dynamic scale per token (row)",
        ),
        QuantFormat(
            "fp8_block",
            "fp8_block",
            3,
            FP8_DTYPE,
            (FP8_BLOCK, FP8_BLOCK),
            (1, FP8_BLOCK),
            1e-2,
            "one scale per 128×128 weight block; one dynamic scale per 1×128 activation group (DeepSeek-V3 style)",
        ),
    )
}

#: The contract's ``quant`` values, in order. ``None`` is plain bf16.
QUANT_FORMATS = tuple(FORMATS)


def get_format(quant) -> QuantFormat:
    """The :class:`QuantFormat` of a contract ``quant`` value; ValueError naming ``quant`` if unknown."""
    try:
        return FORMATS[quant]
    except (KeyError, TypeError):  # TypeError: an unhashable value
        known = ", ".join(map(repr, FORMATS))
        raise ValueError(f"quant: expected one of {known}, got {quant!r}") from None


def check_quant(quant) -> str | None:
    """Return ``quant`` if it names a format of :data:`FORMATS`, else raise ValueError."""
    return get_format(quant).name


# --- scale groups -----------------------------------------------------------------------------


def _group_counts(extents: tuple, group: tuple) -> tuple:
    """Groups per dimension: ⌈n / g⌉, or 1 for a WHOLE dimension."""
    return tuple(1 if g is WHOLE else math.ceil(n / g) for n, g in zip(extents, group))


def _group_amax(v: torch.Tensor, group: tuple) -> torch.Tensor:
    """Amax of |v| [..., R, C] over (rows, cols) groups → [..., ⌈R/r⌉, ⌈C/c⌉] (1 for WHOLE).

    Zero padding of partial groups does not change an amax of |v|; torch's amax propagates NaN,
    so a group with a NaN gets a NaN amax. An empty group's amax is 0.
    """
    *lead, R, C = v.shape
    nr, nc = _group_counts((R, C), group)
    r, c = (max(n, 1) if g is WHOLE else g for n, g in zip((R, C), group))
    a = v.abs()
    if a.numel() == 0:
        return a.new_zeros(*lead, nr, nc)
    a = torch.nn.functional.pad(a, (0, nc * c - C, 0, nr * r - R))
    return a.reshape(*lead, nr, r, nc, c).amax(dim=(-3, -1))


def _expand_groups(s: torch.Tensor, group: tuple, R: int, C: int) -> torch.Tensor:
    """[..., nr, nc] group scales → scales that broadcast against [..., R, C] values."""
    for dim, n, g in ((-2, R, group[0]), (-1, C, group[1])):
        if g is not WHOLE and g > 1:
            s = s.repeat_interleave(g, dim=dim).narrow(dim, 0, n)
    return s


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, 1e-12) / 448`` as an IEEE division on every device (NaN stays NaN).

    The divisor is a tensor on purpose: PyTorch's CUDA kernel divides by a Python scalar as a
    multiplication by its reciprocal, which is one ulp off for some amax values (the CPU divides
    exactly). One ulp in a scale decides the rounding of values that sit exactly on a midpoint of
    the e4m3 grid — frequent for bf16 inputs — and the re-quantized intermediate amplifies such a
    flip to ~1 % of the output (measured on the H200: GPU vs CPU oracle 8.5e-3 rel L2 with the
    scalar division).
    """
    amax = amax.float().clamp_min(AMAX_FLOOR)
    return amax / torch.full_like(amax, FP8_MAX)


def _cast_fp8(v: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of fp32 ``v`` to E4M3FN (NaN → NaN)."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _quantize(v: torch.Tensor, group: tuple):
    """fp32 ``v`` [..., R, C] → (q E4M3 [..., R, C], group scales [..., nr, nc])."""
    R, C = v.shape[-2:]
    scale = _scale_of(_group_amax(v, group))
    return _cast_fp8(v / _expand_groups(scale, group, R, C)), scale


# --- weights ------------------------------------------------------------------------------------


def weight_scale_shape(fmt, E: int, n_out: int, k_in: int) -> tuple:
    """The shape of the fp32 scale tensor of a [E, n_out, k_in] weight in format ``fmt``."""
    f = get_format(fmt)
    f._need_scales("weight_scale_shape")
    return f.weight_scale_shape(E, n_out, k_in)


def quantize_weight(w: torch.Tensor, fmt):
    """Quantize expert weights ``w`` [E, N_out, K_in] to ``(q float8_e4m3fn, scale float32)``."""
    f = get_format(fmt)
    f._need_scales("quantize_weight")
    if w.dim() != 3:
        raise ValueError(f"w: expected [E, N_out, K_in], got shape {tuple(w.shape)}")
    q, scale = _quantize(w.float(), f.weight_group)
    return q.contiguous(), scale.reshape(f.weight_scale_shape(*w.shape)).contiguous()


def dequantize_weight(q: torch.Tensor, scale, fmt, dtype=torch.float32) -> torch.Tensor:
    """``q · scale`` broadcast per ``fmt``, in ``dtype`` (fp32 by default; the oracle uses fp64).
    For bf16 (``fmt`` None, ``scale`` None) the weights themselves, in ``dtype``."""
    f = get_format(fmt)
    if not f.quantized:
        return q.to(dtype)
    E, N, K = q.shape
    s = scale.to(dtype).reshape(E, *_group_counts((N, K), f.weight_group))
    return q.to(dtype) * _expand_groups(s, f.weight_group, N, K)


# --- activations (quantized dynamically, inside the backend) --------------------------------------


def activation_scale_shape(fmt, T: int, K: int) -> tuple:
    """The shape of the fp32 dynamic scale of a [T, K] activation in format ``fmt``."""
    return get_format(fmt).activation_scale_shape(T, K)


def quantize_activation(a: torch.Tensor, fmt):
    """Dynamic quantization of activations ``a`` [T, K] → ``(q float8_e4m3fn, scale float32)``."""
    f = get_format(fmt)
    f._need_scales("quantize_activation")
    if a.dim() != 2:
        raise ValueError(f"a: expected [T, K], got shape {tuple(a.shape)}")
    q, scale = _quantize(a.float(), f.activation_group)
    return q.contiguous(), scale.reshape(f.activation_scale_shape(*a.shape)).contiguous()


def quantize_activation_static(a: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor quantization of ``a`` [T, K] with a given fp32 scale (shape [] or [1]):
    ``e4m3(clamp(a / scale, ±448))``, an IEEE division by the scale as given (no floor); values
    beyond ±448·scale saturate. Returns q float8_e4m3fn [T, K]; its scale is ``scale`` itself."""
    if a.dim() != 2:
        raise ValueError(f"a: expected [T, K], got shape {tuple(a.shape)}")
    if not (isinstance(scale, torch.Tensor) and scale.numel() == 1):
        raise ValueError(f"scale: expected a one-element tensor, got {scale!r}")
    return _cast_fp8(a.float() / scale.float().reshape(1).to(a.device)).contiguous()


def static_scale_of(amax) -> torch.Tensor:
    """The static scale a calibration stores for an activation amax it observed (fp32 [1]):
    ``max(amax, 1e-12) / 448``, the dynamic scale of a tensor with that amax."""
    return _scale_of(torch.as_tensor(amax, dtype=torch.float32).reshape(1))


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, fmt, dtype=torch.float32) -> torch.Tensor:
    """``q · scale`` broadcast per ``fmt``, in ``dtype``."""
    f = get_format(fmt)
    f._need_scales("dequantize_activation")
    T, K = q.shape
    s = scale.to(dtype).reshape(_group_counts((T, K), f.activation_group))
    return q.to(dtype) * _expand_groups(s, f.activation_group, T, K)


def fake_quantize_activation(a: torch.Tensor, fmt, dtype=torch.float64, scale=None) -> torch.Tensor:
    """``dequantize(quantize(a))`` — what a W8A8 kernel effectively multiplies; identity for bf16.
    ``scale``: a static per-tensor scale (fp8_tensor) instead of the dynamic one."""
    if not get_format(fmt).quantized:
        return a.to(dtype)
    if scale is not None:
        if fmt != "fp8_tensor":
            raise ValueError(f"scale: a static activation scale needs fmt='fp8_tensor', got {fmt!r}")
        return quantize_activation_static(a, scale).to(dtype) * scale.to(dtype=dtype, device=a.device).reshape(1)
    q, s = quantize_activation(a, fmt)
    return dequantize_activation(q, s, fmt, dtype)

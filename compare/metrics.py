"""Numerics: how far a kernel's output is from the truth, and whether that is far enough to worry.

The truth is the fp64 oracle (``moe_spec.oracle``) evaluated on the *kernel's own inputs*: for an FP8
run that means the quantized weights and the W8A8 model of the activations, so the error measured
here is the kernel's arithmetic alone. What quantization itself costs is a separate question,
answered by comparing the quantized problem with the unquantized bf16 problem
(the ``quant_error`` column of the report and the per-expert table of ``compare.numerics``).

Four numbers describe one output ``y`` against a reference ``r`` (both [T, K]):

* relative L2 error      ‖y − r‖₂ / ‖r‖₂ — the headline: an average over every element;
* max abs error          max |y − r| — in the units of the output;
* max error in bf16 ULPs max |y − r| / ulp(r) — the worst element in units of the spacing of bf16
  numbers at the reference value. bf16 keeps 8 significant bits, so ulp(r) = 2^(⌊log₂|r|⌋ − 7):
  rounding the exact answer to bf16 costs at most 0.5 ULP. An output is a sum of thousands of
  products and may cancel to nearly zero, where its own ULP is tiny; the kernel's absolute error
  (from its bf16 intermediate) does not shrink with the output, so such an element would read as
  hundreds of ULPs while the layer is fine. The magnitude is therefore floored at rms(r): an
  element smaller than the typical output is measured in the ULP of the typical output;
* cosine similarity      ⟨y, r⟩ / (‖y‖ ‖r‖) — blind to a global scale error, sharp on direction.

The tolerance policy (:data:`TOLERANCES`) is written down with its reasoning in
``notes/numerics.md``; this module is its executable form.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from moe_spec.oracle import rel_l2  # noqa: F401  (one definition, re-exported as a metric)
from moe_spec.quant import FORMATS, QuantFormat, get_format

ULP_FLOOR = 1.0  # |ref| is floored at ULP_FLOOR · rms(ref) before taking its ULP
BF16_MANTISSA_BITS = 7  # stored bits; 8 significant bits with the implicit one
BF16_MIN_NORMAL_EXP = -126


# --- the four error measures -------------------------------------------------------------------


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (float64): 2^(⌊log₂|x|⌋ − 7), subnormal spacing below 2^-126."""
    mag = x.double().abs()
    exponent = torch.floor(torch.log2(mag.clamp_min(2.0**BF16_MIN_NORMAL_EXP)))
    return torch.exp2(exponent - BF16_MANTISSA_BITS)


@dataclass(frozen=True)
class Errors:
    """The four error measures of one output against its reference."""

    rel_l2: float
    max_abs: float
    max_ulp: float
    cosine: float

    def as_dict(self) -> dict:
        return asdict(self)


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))


def max_abs(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.numel() == 0:
        return 0.0
    return float((out.double() - ref.double()).abs().max())


def max_ulp(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst element error in bf16 ULPs of the reference, magnitude floored at ULP_FLOOR·rms(ref)."""
    if out.numel() == 0:
        return 0.0
    ref64 = ref.double()
    rms = _norm(ref64) / math.sqrt(ref64.numel())
    magnitude = ref64.abs().clamp_min(ULP_FLOOR * rms)
    if rms == 0.0:  # an all-zero reference: any nonzero output is infinitely wrong
        return 0.0 if bool((out == 0).all()) else math.inf
    return float(((out.double() - ref64).abs() / bf16_ulp(magnitude)).max())


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1 when both are zero)."""
    a, b = out.double().flatten(), ref.double().flatten()
    na, nb = _norm(a), _norm(b)
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.dot(a, b)) / (na * nb)


def errors(out: torch.Tensor, ref: torch.Tensor) -> Errors:
    """All four measures of ``out`` against ``ref`` (shapes must match)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    return Errors(rel_l2(out, ref), max_abs(out, ref), max_ulp(out, ref), cosine(out, ref))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Determinism check: same shape, dtype and bits (NaNs compare by bits too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return bool(torch.equal(a, b))


# --- the tolerance policy ------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """Bounds a kernel's output must meet against the oracle on its own inputs.

    ``max_ulp`` is None where the worst element is not a meaningful gate (FP8: one re-quantized
    intermediate that lands on the other side of an fp8 rounding boundary moves an output by a
    large fraction of its value; that is the format, not the kernel).
    """

    rel_l2: float
    cosine: float
    max_ulp: float | None
    quant_error: float | None  # sanity bound on the quantized problem vs the bf16 problem


#: The parts of the policy that are the same for every format of its kind; each format's rel L2
#: bound is its ``tolerance`` in the registry (:data:`moe_spec.quant.FORMATS`).
COSINE_BOUND = 0.9999  # 1 − cos ≈ rel²/2: consistent with a 1e-2 rel L2 bound
BF16_MAX_ULP = 16.0  # unquantized formats only: one re-quantized FP8 value can move an output far
QUANT_ERROR_BOUND = 0.12  # quantized formats: the quantized problem vs the bf16 problem (sanity)


def _policy(fmt: QuantFormat) -> Tolerance:
    return Tolerance(
        rel_l2=fmt.tolerance,
        cosine=COSINE_BOUND,
        max_ulp=None if fmt.quantized else BF16_MAX_ULP,
        quant_error=QUANT_ERROR_BOUND if fmt.quantized else None,
    )


# Reasoning in notes/numerics.md. Keys are the formats' labels ("bf16" stands for quant=None), in
# the registry's order.
TOLERANCES: dict[str, Tolerance] = {fmt.label: _policy(fmt) for fmt in FORMATS.values()}


def quant_name(quant: str | None) -> str:
    """The display/table name of a quantization format (its registry label): None is "bf16"."""
    return get_format(quant).label


def tolerance_for(quant: str | None) -> Tolerance:
    try:
        return TOLERANCES[quant_name(quant)]
    except ValueError:
        raise ValueError(f"quant: no tolerance policy for {quant!r}; known: {list(TOLERANCES)}") from None


def check(err: Errors, quant: str | None) -> tuple[bool, str]:
    """Apply the policy: (passed, reason). The reason names every bound that failed, or "ok"."""
    tol = tolerance_for(quant)
    failed = []
    if not err.rel_l2 <= tol.rel_l2:  # written so that NaN fails
        failed.append(f"rel_l2 {err.rel_l2:.2e} > {tol.rel_l2:.0e}")
    if not err.cosine >= tol.cosine:
        failed.append(f"cosine {err.cosine:.6f} < {tol.cosine}")
    if tol.max_ulp is not None and not err.max_ulp <= tol.max_ulp:
        failed.append(f"max_ulp {err.max_ulp:.1f} > {tol.max_ulp:g}")
    return (not failed, "ok" if not failed else "; ".join(failed))


def cross_backend_tolerance(quant: str | None) -> float:
    """Two backends that each pass may differ by up to twice the bound (triangle inequality)."""
    return 2.0 * tolerance_for(quant).rel_l2


# --- per-expert attribution ---------------------------------------------------------------------


def token_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token squared error and squared reference norm (float64, [T] each)."""
    diff = out.double() - ref.double()
    return diff.pow(2).sum(-1), ref.double().pow(2).sum(-1)


def kernel_error_by_expert(
    out: torch.Tensor, ref: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> list[float | None]:
    """Attribute the kernel's error to experts through the tokens routed to them.

    The kernel's output sums k experts per token, so its error cannot be split exactly; but a bug
    confined to one expert (a wrong offset, a dropped tile) corrupts every token routed there and
    no other. For expert e this is the relative L2 error over the tokens that visit e.
    """
    err2, ref2 = token_errors(out, ref)
    ids = topk_ids.long()
    result: list[float | None] = []
    for e in range(num_experts):
        visits = (ids == e).any(-1)
        if not bool(visits.any()):
            result.append(None)
            continue
        num, den = float(err2[visits].sum()), float(ref2[visits].sum())
        result.append(math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf))
    return result


def flag_outliers(values: list[float | None], *, factor: float, bound: float | None) -> list[str]:
    """Mark values that stand out: above ``factor`` × the median of the others, or above ``bound``.

    The relative test finds one bad expert among good ones; the absolute bound finds the opposite
    FP8 failure, where most experts collapse under a scale that one outlier expert dictates.
    """
    present = sorted(v for v in values if v is not None)
    median = present[len(present) // 2] if present else 0.0
    flags = []
    for v in values:
        reasons = []
        if v is not None and len(present) >= 3 and median > 0 and v > factor * median:
            reasons.append(f"{v / median:.1f}x median")
        if v is not None and bound is not None and v > bound:
            reasons.append(f"> {bound:g}")
        flags.append(", ".join(reasons))
    return flags

"""The fp64 oracle: the exact function of what a kernel was given.

For ``quant=None`` the oracle evaluates the MoE layer (see :mod:`moe_spec.problem`) in float64 on
the bf16 inputs. For an fp8 format it models a W8A8 kernel step by step, still in float64:

1. the weights are dequantized (``q · scale``) — exactly the values the kernel multiplies;
2. x is quantized dynamically with :func:`moe_spec.quant.quantize_activation` and dequantized;
3. GEMM1 and SiLU(gate)·up;
4. the intermediate (all T·top_k rows together — per-tensor scales see the whole tensor) is
   quantized again in the same format, as the kernel must do before GEMM2;
5. GEMM2, then the routing weights and the sum over the top-k slots.

With static activation scales (``a1_scale``, ``a2_scale``: fp8_tensor only, see
:mod:`moe_spec.contract`) steps 2 and 4 use the given scales instead of the tensors' amaxes
(:func:`moe_spec.quant.quantize_activation_static`: values beyond ±448·s saturate), and a token's
output no longer depends on the rest of its batch. :func:`calibrate_static_scales` gives the scales
the dynamic pipeline would use on a batch — what a calibration run records (its maximum over the
batches it sees).

So the gap between a kernel and the oracle is the kernel's own arithmetic (accumulation order,
bf16 intermediates, a rounding at a quantization boundary), not the quantization error, which
:mod:`compare` reports separately against the unquantized problem.

The oracle loops over the experts that received tokens, dequantizing one expert at a time, so it
runs on the GPU for the catalog shapes (fp64 matmul) and on the CPU for small ones.

NaN and inf follow IEEE arithmetic in fp64, and the FP8 quantizations of :mod:`moe_spec.quant`
spread them over their scale groups. Step 4 quantizes the intermediate from fp32 (the kernels keep
it in fp32), so an intermediate beyond fp32's range is inf there, as in a kernel; in bf16 the
oracle has no such step and stays finite where a kernel overflows (see :mod:`moe_spec.contract`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_spec.quant import _group_amax, dequantize_weight, fake_quantize_activation, static_scale_of
from moe_spec.validate import validate_moe_args

F64 = torch.float64


@dataclass
class OracleResult:
    """The oracle's output with its per-expert breakdown.

    ``out``          [T, K]         Σ_j w[t, j] · y[t, j]
    ``pair_output``  [T, top_k, K]  y[t, j]: the output of expert ``topk_ids[t, j]`` for token t,
                                    before the routing weight
    ``topk_ids``     [T, top_k]     int64 copy of the routing
    ``term_scale``   [T, K]         with ``term_scales=True``: √(Σ_j Σ_i (w[t, j]·a[t, j, i]·W2[e_j, k, i])²),
                                    the root-sum-square of the products that GEMM2 and the routing sum
                                    add up to ``out[t, k]`` (a = the intermediate GEMM2 reads):
                                    what :func:`rel_l2_terms` judges an error against
    """

    out: torch.Tensor
    pair_output: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    term_scale: torch.Tensor | None = None  # [T, K]: the root-sum-square of out's terms (``term_scales=True``)

    def experts(self) -> list[int]:
        return sorted(int(e) for e in self.topk_ids.unique())

    def expert_tokens(self, e: int) -> torch.Tensor:
        """The tokens routed to expert ``e`` (ascending)."""
        return (self.topk_ids == e).any(dim=1).nonzero().squeeze(1)

    def expert_contribution(self, e: int) -> torch.Tensor:
        """[T, K]: expert ``e``'s weighted share of ``out`` (zero rows for tokens it did not get)."""
        mask = (self.topk_ids == e).to(F64) * self.topk_weights.to(F64)
        return (self.pair_output * mask[..., None]).sum(dim=1)


def _expert_weight(w, scale, quant, e):
    """Expert e's weight in fp64: the bf16 values, or ``q · scale`` (identity for bf16)."""
    return dequantize_weight(w[e : e + 1], None if scale is None else scale[e : e + 1], quant, F64)[0]


def _intermediate(x, w1, topk_ids, quant, w1_scale, a1_scale, I):  # noqa: E741
    """Steps 2–3: SiLU(gate)·up of every pair p = t·top_k + j in fp64 [T·top_k, I], and the pairs of each expert."""
    k = topk_ids.shape[1]
    flat = topk_ids.long().reshape(-1)
    xa = fake_quantize_activation(x, quant, scale=a1_scale)  # [T, K] fp64
    pairs_of = {int(e): (flat == e).nonzero().squeeze(1) for e in flat.unique()}
    inter = torch.zeros(flat.numel(), I, dtype=F64, device=x.device)
    for e, pairs in pairs_of.items():
        h = xa[pairs // k] @ _expert_weight(w1, w1_scale, quant, e).T
        inter[pairs] = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    return inter, pairs_of


def oracle_breakdown(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    *,
    quant=None,
    w1_scale=None,
    w2_scale=None,
    a1_scale=None,
    a2_scale=None,
    term_scales: bool = False,
) -> OracleResult:
    """Evaluate the MoE layer in float64 and keep every (token, slot) output; with ``term_scales``
    also the root-sum-square of each output's terms (one more GEMM per expert)."""
    d = validate_moe_args(
        x,
        w1,
        w2,
        topk_weights,
        topk_ids,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        data_checks="sync",
    )  # it indexes with the ids
    T, K, I, k = d.T, d.K, d.I, d.top_k
    ids = topk_ids.long()
    inter, pairs_of = _intermediate(x, w1, topk_ids, quant, w1_scale, a1_scale, I)
    inter = fake_quantize_activation(inter, quant, scale=a2_scale)  # identity for bf16

    y = torch.zeros(T * k, K, dtype=F64, device=x.device)
    squares = torch.zeros(T * k, K, dtype=F64, device=x.device) if term_scales else None
    for e, pairs in pairs_of.items():
        w = _expert_weight(w2, w2_scale, quant, e)
        y[pairs] = inter[pairs] @ w.T
        if term_scales:  # Σ_i (a_i·W2[k, i])² of each pair
            squares[pairs] = inter[pairs].square() @ w.square().T
    y = y.view(T, k, K)
    out = (y * topk_weights.to(F64)[..., None]).sum(dim=1)
    scale = (
        None
        if squares is None
        else (squares.view(T, k, K) * topk_weights.to(F64).square()[..., None]).sum(dim=1).sqrt()
    )
    return OracleResult(out=out, pair_output=y, topk_ids=ids, topk_weights=topk_weights, term_scale=scale)


def oracle(
    x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None
) -> torch.Tensor:
    """The MoE layer in float64: [T, K]."""
    return oracle_breakdown(
        x,
        w1,
        w2,
        topk_weights,
        topk_ids,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
    ).out


def calibrate_static_scales(
    x, w1, w2, topk_weights, topk_ids, *, quant="fp8_tensor", w1_scale=None, w2_scale=None
) -> tuple:
    """``(a1_scale, a2_scale)``, fp32 [1] each: the per-tensor scales the dynamic fp8_tensor layer
    uses on this batch — x's and the intermediate's (from the fp64 intermediate rounded to fp32,
    as step 4 quantizes it). A calibration takes the maximum of each over its batches."""
    d = validate_moe_args(
        x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, data_checks="sync"
    )
    if quant != "fp8_tensor":
        raise ValueError(f"quant: static activation scales are calibrated for 'fp8_tensor', got {quant!r}")
    inter, _ = _intermediate(x, w1, topk_ids, quant, w1_scale, None, d.I)
    whole = (None, None)
    return static_scale_of(_group_amax(x.float(), whole)), static_scale_of(_group_amax(inter.float(), whole))


def rel_l2_terms(a: torch.Tensor, result: OracleResult) -> float:
    """‖a − out‖₂ / max(‖out‖₂, ‖term_scale‖₂) in float64: the error judged against the size of the
    terms that add up to the output (:attr:`OracleResult.term_scale`, ``term_scales=True``), where
    they are larger than the output — the contract's metric (:mod:`moe_spec.contract`).

    Why: a kernel rounds the terms it adds (the intermediate to bf16 or FP8, each pair's output to
    bf16), so its error is a fraction of the terms' size, whatever their sum. Where the terms cancel —
    two experts' contributions of opposite sign, GEMM2's products over I at small K — the output is
    smaller than its terms and :func:`rel_l2` grows by that factor with no fault of the kernel. The
    root-sum-square is the size of a sum of terms of random sign, so on data without cancellation
    ‖term_scale‖ ≈ ‖out‖ and the two metrics agree (a sum of magnitudes would be √I times the
    output there, and forgive √I times the error); this one is never larger than :func:`rel_l2`.
    Conventions as :func:`rel_l2`: 0 for empty tensors, inf for a non-finite ``a``.
    """
    if result.term_scale is None:
        raise ValueError("result: expected an OracleResult with term scales (oracle_breakdown(..., term_scales=True))")
    a = a.to(F64)
    if result.out.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    den = max(float(torch.linalg.vector_norm(result.out)), float(torch.linalg.vector_norm(result.term_scale)))
    num = float(torch.linalg.vector_norm(a - result.out))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖₂ / ‖ref‖₂ in float64 — the headline error of every comparison in this project.

    0 for empty tensors and for two zero tensors; inf when ``a`` holds a NaN or inf, or when only
    the reference is zero (so a bound written ``err <= tol`` fails them all).
    """
    a, ref = a.to(F64), ref.to(F64)
    if ref.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    den = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(a - ref))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den

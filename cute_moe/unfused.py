"""What the layer fuses, and the unfused pipeline: ``fused_moe(..., fusion="separate")``.

The bf16 fused pipeline folds two passes into its GEMM1 (:data:`GATED_GEMM1`,
:data:`GATHER_IN_PRODUCER`: switches the plan reads); each has its unfused twin, which
``fusion="separate"`` always runs and which a switch falls back to.  Explicit ``configs`` are taken
as given.

A CUTLASS-style FP8 MoE runs scaling, the GEMM and the expert aggregation as separate passes over
HBM; the fused layer (the default, ``fusion="fused"``) does all three in the GEMM's registers.
Both compute the same W8A8 function; ``separate`` pays for the extra passes::

    fused (default)                           separate
    GEMM1: H = acc · s_x·s_w   (fp32)         GEMM1: raw acc (fp32)  →  scale pass: H = raw · s_x·s_w
    SiLU·up, quantize                         SiLU·up, quantize                        (the same)
    GEMM2: y = acc · s_a·s_w · w_route (bf16) GEMM2: raw acc (bf16)  →  scale pass: y = raw · s_a·s_w
    combine: out[t] = Σ_j y                   weighted combine: out[t] = Σ_j w_route · y

Only the per-tensor and per-channel scales can leave the GEMM: ``fp8_block``'s change every 128 of K,
so they stay in its main loop (promotion) in both pipelines, and its ``separate`` pipeline differs
by the routing-weight pass only — as does bf16's.  The scale pass multiplies by the epilogue's
product in the epilogue's order, so GEMM1's fp32 H is bit for bit the fused one; GEMM2's raw bf16
output is rounded once more than the fused one.
"""

from __future__ import annotations

import torch

from moe_spec.align import Alignment
from moe_spec.hopper import sm_count

from .config import GemmConfig
from .limits import check_fusion
from .rowops import compile_unfused_kernels

GATED_GEMM1 = True
"""SiLU·up in GEMM1's epilogue (``GemmConfig.gated``): the ``[M_pad, 2I]`` pre-activation never
reaches memory and the SiLU·mul row kernel does not run.  False: a plain GEMM1, then the row kernel."""

GATHER_IN_PRODUCER = True
"""GEMM1's producer reads its token rows by index straight from x (``GemmConfig.gather_rows``): the
sorted copy ``X_sorted [M_pad, K]`` is never written and the gather row kernel does not run; taken
when K is a multiple of the config's ``tile_k``.  False: the gather row kernel writes ``X_sorted``
and GEMM1 loads it by TMA."""

_EPILOGUE_SCALED = ("fp8_tensor", "fp8_channel")


def separate_configs(cfg1: GemmConfig, cfg2: GemmConfig) -> tuple[GemmConfig, GemmConfig]:
    """The fused layer's (GEMM1, GEMM2) configs turned into the unfused pipeline's: scales left to
    the scale pass where they can leave the GEMM, no routing weight in GEMM2's epilogue."""
    off = {"epilogue_scales": False} if cfg1.quant in _EPILOGUE_SCALED else {}
    return cfg1.replace(**off).validate(), cfg2.replace(row_scale=False, **off).validate()


def scale_rows(
    y: torch.Tensor, alignment: Alignment, x_scale: torch.Tensor, w_scale: torch.Tensor, quant
) -> torch.Tensor:
    """The scale pass, in place: ``y[r, c] ·= s_x · s_w`` for per-tensor / per-channel FP8 (x_scale
    in the GEMM's row order: [1] or [M_pad]) on the used rows (``alignment.num_padded``), each row
    reading its expert's weight scale (``expert_of_block``, one expert per ``alignment.tile``
    rows); nothing to do for bf16 and fp8_block."""
    if quant not in _EPILOGUE_SCALED:
        return y
    name = {torch.float32: "scale_f32", torch.bfloat16: "scale_bf16"}[y.dtype]
    kernel = compile_unfused_kernels(quant, sm_count(y.device))[name]
    row_expert = alignment.expert_of_block.repeat_interleave(alignment.tile)  # −1 past the used rows: never read
    kernel(y, row_expert, x_scale, w_scale, alignment.num_padded)
    return y


def weighted_combine(y: torch.Tensor, row_of_pair: torch.Tensor, topk_weights: torch.Tensor, quant) -> torch.Tensor:
    """The aggregation pass: ``out[t] = Σ_j topk_weights[t, j] · y[row_of_pair[t·top_k + j]]``, fp32
    sum → bf16 [T, K]."""
    T = topk_weights.shape[0]
    out = torch.empty(T, y.shape[1], dtype=y.dtype, device=y.device)
    weights = topk_weights.reshape(-1).to(torch.float32)
    compile_unfused_kernels(quant, sm_count(y.device))["weighted_combine"](y, out, row_of_pair, weights)
    return out


def gated_gemm1() -> bool:
    """Whether the fused bf16 plan's GEMM1 carries SiLU·up in its epilogue (:data:`GATED_GEMM1`)."""
    return GATED_GEMM1


def hbm_bytes(T: int, K: int, I: int, top_k: int, experts_hit: int, quant, fusion: str) -> dict:
    """Analytic HBM bytes of each pass of the layer (``quant`` FP8: the W8A8 pipeline; bf16: the
    plain one), from the shapes alone: M = T·top_k rows (padding ignored), the weights of the
    ``experts_hit`` experts read once per GEMM, scales and alignment data left out (they are small
    and the same in both pipelines). ``fusion="separate"`` adds what the unfused pipeline moves:
    the scale passes (per-tensor / per-channel FP8: read and write GEMM1's fp32 [M, 2I] and GEMM2's
    bf16 [M, K] once more) and the routing weights read by the weighted combine. The fused bf16
    layer's gated GEMM1 writes [M, I] and has no SiLU·up pass; gathering in its producer, it has no
    gather pass (:data:`GATHER_IN_PRODUCER`). The FP8 layer is modelled with the plain GEMM1 (fp32
    [M, 2I] written, one SiLU·up + quantize pass): the plan's gated FP8 GEMM1 (``plan.GATED_FP8_GEMM1``,
    whose path this model does not know) moves less — A [M, I] written, read once or twice. Returns
    {pass: bytes}; ``sum(...values())`` is the layer's total."""
    check_fusion(fusion)
    M, wb = T * top_k, 1 if quant else 2  # token rows; bytes per weight / activation element
    p = {}
    if quant:
        p["quantize x"] = T * K * 2 + T * K
    if quant or fusion == "separate" or not GATHER_IN_PRODUCER:  # else GEMM1 reads x's rows itself
        p["gather"] = 2 * M * K * wb
    h_bytes = 4 if quant else 2  # GEMM1 writes fp32 H for the FP8 layer, bf16 for bf16
    if not quant and fusion == "fused" and gated_gemm1():  # SiLU·up in GEMM1's epilogue: [M, I] out
        p["GEMM1 + SiLU·up"] = experts_hit * 2 * I * K * wb + M * K * wb + M * I * 2
    else:
        p["GEMM1"] = experts_hit * 2 * I * K * wb + M * K * wb + M * 2 * I * h_bytes
    scaled = fusion == "separate" and quant in _EPILOGUE_SCALED
    if scaled:
        p["scale pass 1"] = 2 * M * 2 * I * h_bytes
    if "GEMM1" in p:
        p["SiLU·up" + (", quantize" if quant else "")] = M * 2 * I * h_bytes + M * I * wb
    p["GEMM2"] = experts_hit * K * I * wb + M * I * wb + M * K * 2
    if scaled:
        p["scale pass 2"] = 2 * M * K * 2
    p["combine"] = M * K * 2 + T * K * 2 + (M * 4 if fusion == "separate" else 0)
    return p

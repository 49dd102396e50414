"""triton_moe: the fused MoE expert computation written in Triton.

``fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None,
config=None, swap_ab=None)`` implements the backend contract of :mod:`moe_spec.contract`;
``fused_experts`` is the same function in vLLM's spelling. Both go through the torch operator
``torch.ops.triton_moe.fused_moe`` (:mod:`~triton_moe.ops`) when torch.compile or another tracer is
at work; an eager call runs :func:`triton_moe.moe.fused_moe` directly.

``plan(dims, quant, config=None, swap_ab=None)`` is the call's decisions (tile, path, instruction),
``plans_for(...)`` every plan a layer can get (:mod:`moe_spec.plan` describes both);
``warmup(E, K, I, top_k, quant, max_tokens)`` compiles every kernel of those plans
(:mod:`moe_spec.warmup`).

Read in this order: :mod:`~triton_moe.align` (sorting pairs by expert), :mod:`~triton_moe.kernels`
(the grouped GEMM with swap-AB and in-register FP8; :mod:`~triton_moe.kernels_tma` its persistent
TMA variant, :mod:`~triton_moe.kernels_rows` quantization and the combine), :mod:`~triton_moe.moe`
(the pipeline), :mod:`~triton_moe.config` (the tile, GEMM2's own tile, the swap-AB rule),
:mod:`~triton_moe.heuristic` (tuned tables, the default rule), :mod:`~triton_moe.plan` (the
decisions of one call), :mod:`~triton_moe.jit` (launches and the compile counter),
:mod:`~triton_moe.warmup`. The benchmarks, studies and the autotuner are in :mod:`triton_moe.lab`.
"""

from moe_spec.contract import make_fused_experts
from triton_moe.config import Gemm2Tile, TritonConfig, choose_swap_ab
from triton_moe.heuristic import get_config
from triton_moe.ops import fused_moe
from triton_moe.plan import LayerPlan, plan, plans_for
from triton_moe.warmup import warmup

fused_experts = make_fused_experts(fused_moe)

__all__ = [
    "fused_moe",
    "fused_experts",
    "Gemm2Tile",
    "LayerPlan",
    "TritonConfig",
    "choose_swap_ab",
    "get_config",
    "plan",
    "plans_for",
    "warmup",
]

"""``torch.ops.cute_moe.fused_moe``: this backend's ``fused_moe`` as a torch operator.

The op (:mod:`moe_spec.ops`: the contract's schema, a CPU and a CUDA kernel, a fake
implementation) lets ``torch.compile(model, fullgraph=True)`` take a model whose MoE layers run
these kernels without a graph break, and ``mode="reduce-overhead"`` capture them in its CUDA graphs.
Its fake implementation runs the checks of :func:`cute_moe.moe.fused_moe` that read only metadata,
in its order — the arguments (static activation scales ``a1_scale`` / ``a2_scale`` included: the
contract's host checks), the plan with the default options (:func:`cute_moe.plan.plan`), the device
rule (a CUDA device) — and returns an empty bf16 [T, K];
so a model traces on fake CUDA tensors on a machine without a GPU.

:func:`fused_moe` is the package's public function (``cute_moe.fused_moe``): the op while a tracer
is at work, :func:`cute_moe.moe.fused_moe` itself for an eager call (no dispatcher on the way;
:func:`moe_spec.ops.entry`). The backend options ``swap_ab``, ``configs`` and ``fusion`` are not in
the schema: a call that gives one is a direct Python call.
"""

from __future__ import annotations

from moe_spec.ops import define_fused_moe_op, entry

from .moe import LIMITS
from .moe import fused_moe as backend_fused_moe
from .plan import plan

#: ``torch.ops.cute_moe.fused_moe.default``
OP = define_fused_moe_op("cute_moe", backend_fused_moe, limits=LIMITS, plan=plan)

fused_moe = entry(OP, backend_fused_moe, {"swap_ab": None, "configs": None, "fusion": "fused"})

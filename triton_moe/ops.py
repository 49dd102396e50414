"""``torch.ops.triton_moe.fused_moe``: this backend's ``fused_moe`` as a torch operator.

The op (:mod:`moe_spec.ops`: the contract's schema, a CPU and a CUDA kernel, a fake
implementation) lets ``torch.compile(model, fullgraph=True)`` take a model whose MoE layers run
these kernels without a graph break, and ``mode="reduce-overhead"`` capture them in its CUDA graphs.
Its fake implementation runs the checks of :func:`triton_moe.moe.fused_moe` that read only
metadata — the arguments, the plan with the default options (:func:`triton_moe.plan.plan`), the
device rule — and returns an empty bf16 [T, K].

:func:`fused_moe` is the package's public function (``triton_moe.fused_moe``): the op while a
tracer is at work, :func:`triton_moe.moe.fused_moe` itself for an eager call (no dispatcher on the
way; :func:`moe_spec.ops.entry`). The backend options ``config`` and ``swap_ab`` are not in the
schema: a call that gives one is a direct Python call, which torch.compile traces into.
"""

from __future__ import annotations

from moe_spec.ops import define_fused_moe_op, entry
from triton_moe.decode_host import counter_block, counter_words
from triton_moe.moe import LIMITS
from triton_moe.moe import fused_moe as backend_fused_moe
from triton_moe.plan import plan


def decode_counters(device, dims, quant) -> None:
    """The decode kernel's counters (:func:`~triton_moe.decode_host.counter_block`), made while the graph is
    traced where an eager call of these sizes takes that kernel: under ``mode="reduce-overhead"`` the
    compiled graph's first run is a CUDA-graph tree's warm-up — eager, so the decode kernel
    (:func:`triton_moe.plan.uses_decode`) — and a block first made there would live in the graph's pool."""
    eager = plan(dims, quant, eager=True)
    if eager.path == "decode":
        counter_block(device, counter_words(dims.K, eager.config))


#: ``torch.ops.triton_moe.fused_moe.default``
OP = define_fused_moe_op("triton_moe", backend_fused_moe, limits=LIMITS, plan=plan, device_state=decode_counters)

fused_moe = entry(OP, backend_fused_moe, {"config": None, "swap_ab": None})

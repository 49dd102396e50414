"""An eager call that a CUDA graph would capture on another path: that path's kernels loaded first.

The path rule sends an eager call of a few pairs to the one-launch decode kernel, and the same call
captured into a CUDA graph to the grouped pipeline (:func:`triton_moe.plan.uses_decode`). A Triton
kernel's first launch loads its binary (``cuModuleLoadData``), which the driver refuses while a stream
is being captured ("operation not permitted when stream is capturing"). The usual way to capture —
a few eager calls, then the capture — would meet the grouped pipeline's kernels first inside the
capture. So the first eager call of each signature that takes the decode kernel also runs once the
way a capture would (:func:`prime`): one more layer call per signature and process, its output
dropped. After :func:`triton_moe.warmup`, which runs every plan of the layer, it only costs that call.
"""

from __future__ import annotations

from triton_moe.plan import plan, uses_decode

#: (call signature, topk_ids dtype) already primed in this process; :func:`forget` clears it.
_primed: set = set()


def prime(fused_moe, dims, call, args: tuple, kwargs: dict) -> None:
    """Run ``fused_moe(*args, **kwargs)`` once with the config a CUDA graph capturing it would take, the
    first time the eager call ``call`` (its cached plan, for sizes ``dims``) takes the decode kernel;
    nothing when the captured call takes the decode kernel too."""
    key = (call, args[4].dtype)  # the ids dtype is part of every kernel's specialization
    if key in _primed:
        return
    quant = kwargs.get("quant")
    if not uses_decode(dims.T, dims.top_k, quant):
        fused_moe(*args, **kwargs, config=plan(dims, quant).config)
    _primed.add(key)


def forget() -> None:
    """Forget which calls were primed (with the cached plans: ``triton_moe.moe.forget_plans``)."""
    _primed.clear()

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

#: The signatures already primed in this process; :func:`forget` clears it.
_primed: set = set()


def prime(fused_moe, dims, args: tuple, kwargs: dict) -> None:
    """Run ``fused_moe(*args, **kwargs)`` once with the config a CUDA graph capturing it would take, the
    first time an eager call of its signature (sizes ``dims``) takes the decode kernel; nothing when the
    captured call takes the decode kernel too. The signature holds what Triton specializes a kernel on
    beyond the sizes: each tensor's dtype and whether its address is 16-byte aligned."""
    tensors = (*args, *(v for v in kwargs.values() if v is not None and not isinstance(v, str)))
    quant = kwargs.get("quant")
    key = (dims, quant, args[0].device, *((t.dtype, t.data_ptr() % 16 == 0) for t in tensors))
    if key in _primed:
        return
    if not uses_decode(dims.T, dims.top_k, quant):
        fused_moe(*args, **kwargs, config=plan(dims, quant).config)
    _primed.add(key)


def forget() -> None:
    """Forget which calls were primed (with the cached plans: ``triton_moe.moe.forget_plans``)."""
    _primed.clear()

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


def prime(fused_moe, dims, call, args: tuple, kwargs: dict) -> None:
    """Run ``fused_moe(*args, **kwargs)`` once with the config a CUDA graph capturing it would take, the
    first time an eager call of its signature takes the decode kernel; nothing when the captured call
    takes the decode kernel too. ``call`` is the cached plan of the sizes ``dims``, format, device and
    options (``triton_moe.moe._call_of``); its ``primed`` set holds the rest of the signature, what
    Triton specializes a kernel on beyond those: the ids dtype and each tensor's 16-byte alignment."""
    quant = kwargs["quant"]
    if uses_decode(dims.T, dims.top_k, quant):  # a capture takes the decode kernel too: nothing to load
        return
    x, w1, w2, weights, ids = args
    scales = tuple(kwargs[k] for k in ("w1_scale", "w2_scale", "a1_scale", "a2_scale"))
    key = (ids.dtype, x.data_ptr() % 16, w1.data_ptr() % 16, w2.data_ptr() % 16, weights.data_ptr() % 16)
    key += (ids.data_ptr() % 16, *(s.data_ptr() % 16 for s in scales if s is not None))
    if key not in call.primed:
        fused_moe(*args, **kwargs, config=plan(dims, quant).config)
        call.primed.add(key)

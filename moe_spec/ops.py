"""The backend contract as a torch operator: ``torch.ops.<backend>.fused_moe``, which torch.compile takes whole.

torch.compile traces Python until it meets code it cannot see through; a backend's ``fused_moe``
(host-side plan, caches, Triton or CuTe launches) is such code — a graph break at best, a failed
``fullgraph=True`` compile at worst. Registered as an operator with a schema and a fake
implementation, the call is one node of the graph: the tracer runs the fake (shapes and dtypes only,
on fake tensors), the compiled graph calls the real kernel, and a CUDA graph
(``mode="reduce-overhead"``) captures the kernel's launches like any other op's.

:func:`define_fused_moe_op` defines ``<namespace>::fused_moe`` with :data:`SCHEMA` — the contract's
arguments (:mod:`moe_spec.contract`) without the backend options — and registers:

* the CPU and CUDA kernels: the backend's ``fused_moe`` itself, so a call through the op checks,
  plans and launches exactly as a direct call, and raises the same errors;
* the fake implementation: the backend's checks that read only metadata (``check``; default
  :func:`metadata_checks`) on the fake tensors, then an empty bf16 [T, K] — what the kernels
  return. Under dynamic shapes a symbolic size is checked at its hint (no guard is added); the
  real kernel checks the actual sizes when it runs.

The schema declares no mutated argument (``mutates_args=()`` in ``custom_op``'s words) and it is
functional as far as the graph can see: the output is a new tensor. Two buffers outside the
arguments are written: the device's error word (:func:`moe_spec.validate.error_word`), into which
the kernels OR the bits of failed data checks (made, for a CUDA device, by the fake implementation
while the graph is traced: :func:`make_device_state`), and the backend's workspace — its cached
buffers on the device's default stream, fresh ones for a call through the op on any other stream
(:func:`through_op`: a CUDA-graph tree's), freed when it returns; no graph input or output aliases them.

:func:`entry` is a backend's public ``fused_moe`` around the op: while torch.compile or another
tracer (``make_fx``, a ``FakeTensorMode``, functionalization) is at work, or a tensor is not a plain
tensor (a FakeTensor, a subclass), it calls the op; otherwise — an eager call, the common case, or
one under a dispatch mode that only watches the aten ops — it calls the backend's function
directly, the one the op's kernel would call, so an eager call does not pay the dispatcher
(``notes/results/host_cost_triton_cpu_2026-12-04.md`` measures both). Backend options (a config,
swap-AB, the unfused pipeline, …) are not in the schema: a call that gives one is always a direct
Python call, which torch.compile traces into as before.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

from moe_spec.validate import Limits, check_runs_on, error_word, validate_moe_args

#: The operator's schema, without its name's namespace: the contract's arguments, in its order.
SCHEMA = (
    "fused_moe(Tensor x, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, str? quant=None, "
    "Tensor? w1_scale=None, Tensor? w2_scale=None, Tensor? a1_scale=None, Tensor? a2_scale=None) -> Tensor"
)
#: The dtype of the output ([T, K]) of every backend (moe_spec.contract).
OUT_DTYPE = torch.bfloat16

_op_call = threading.local()  # .depth: how many op kernels this thread is inside
_libraries: dict = {}  # namespace -> (torch.library.Library, the op, the backend function), kept for the process


def through_op() -> bool:
    """Whether this thread is running an op's kernel — a compiled graph's call — rather than an eager call.

    A backend then takes fresh buffers instead of its cached workspace unless the call runs on the
    device's default stream (:class:`moe_spec.workspace.Workspaces`): a CUDA-graph tree
    (``mode="reduce-overhead"``) runs its warm-up on a stream of its own with every allocation routed
    into the graph's private memory pool, and a cached buffer left alive there is a tensor the tree
    does not track (it refuses to replay). Fresh buffers are freed when the call returns, as an
    inductor buffer is."""
    return getattr(_op_call, "depth", 0) > 0


def metadata_checks(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    quant=None,
    w1_scale=None,
    w2_scale=None,
    a1_scale=None,
    a2_scale=None,
    *,
    limits: Limits | None = None,
    plan: Callable | None = None,
):
    """What a backend's ``fused_moe`` checks from metadata alone (no data read), in its order:
    :func:`moe_spec.validate.validate_moe_args` in the ``"device"`` mode (the data checks belong to
    the kernels), the backend's ``plan(dims, quant)`` with its default options (it refuses what the
    backend cannot run), then the device rule of ``limits``. Returns the sizes
    (:class:`moe_spec.validate.MoEDims`)."""
    dims = validate_moe_args(
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
        limits=limits,
        data_checks="device",
    )
    if plan is not None:
        plan(dims, quant)
    check_runs_on(x.device, limits)
    return dims


def make_device_state(device, backend_state: Callable | None = None) -> None:
    """Make the buffers a backend keeps for the process on a CUDA ``device`` — the error word and
    its bit constants (:func:`moe_spec.validate.error_word`), and ``backend_state(device)``'s — now,
    outside every dispatch mode.

    The fake implementation calls it while the graph is traced, before the compiled graph first
    runs: under ``mode="reduce-overhead"`` that first run is a CUDA-graph tree's warm-up, whose
    allocations all land in the graph's private pool, and a buffer first made there and kept for the
    process is one the tree does not track (it refuses to record)."""
    if device.type != "cuda" or not torch.cuda.is_available():  # a trace on fake CUDA tensors of a CPU machine
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        error_word(device)
        if backend_state is not None:
            backend_state(device)


def _hint(size) -> int:
    """A concrete value of a (possibly symbolic) size, without a guard: the hint the tracer has."""
    if type(size) is int:
        return size
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None)
    if hint is not None:
        return hint(size, fallback=1)
    return size.node.hint if size.node.hint is not None else 1  # older torch


def _concrete(t):
    """``t`` itself when its sizes and strides are plain ints, else a fake tensor of the same dtype
    and device at the hints of its sizes (checked in place of the symbolic one)."""
    if not isinstance(t, torch.Tensor):
        return t
    shape, stride = t.shape, t.stride()
    if all(type(s) is int for s in (*shape, *stride)):
        return t
    return torch.empty_strided([_hint(s) for s in shape], [_hint(s) for s in stride], dtype=t.dtype, device=t.device)


def define_fused_moe_op(
    namespace: str,
    impl: Callable,
    *,
    limits: Limits | None = None,
    plan: Callable | None = None,
    check: Callable | None = None,
    device_state: Callable | None = None,
) -> torch._ops.OpOverload:
    """Define ``torch.ops.<namespace>.fused_moe`` (:data:`SCHEMA`) running ``impl`` — a backend's
    ``fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant, w1_scale, w2_scale, a1_scale, a2_scale)``
    — on CPU and CUDA tensors, with a fake implementation that runs ``check`` (same arguments,
    metadata only; default :func:`metadata_checks` with ``limits`` and ``plan``) and returns an empty
    bf16 [T, K]. ``device_state(device, dims, quant)``, if given, makes the backend's own buffers kept
    for the process that a call of those sizes would first make, when :func:`make_device_state` makes
    the error word (at trace time, outside every dispatch mode; ``dims`` is what ``check`` returns).
    Returns the op's overload (``torch.ops.<namespace>.fused_moe.default``). A namespace is defined
    once per process: a second call returns the first op when ``impl`` is the same function, and
    raises otherwise."""
    known = _libraries.get(namespace)
    if known is not None:
        if known[2] is impl:
            return known[1]
        raise RuntimeError(
            f"namespace: {namespace}::fused_moe is defined already (by {known[2].__module__}."
            f"{known[2].__qualname__}); an op is defined once per process"
        )
    if check is None:
        check = functools.partial(metadata_checks, limits=limits, plan=plan)

    def kernel(
        x, w1, w2, topk_weights, topk_ids, quant=None, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None
    ):
        _op_call.depth = getattr(_op_call, "depth", 0) + 1
        try:
            return impl(
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
            )
        finally:
            _op_call.depth -= 1

    def fake(x, w1, w2, topk_weights, topk_ids, quant=None, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None):
        args = [_concrete(t) for t in (x, w1, w2, topk_weights, topk_ids)]
        dims = check(*args, quant, *(_concrete(t) for t in (w1_scale, w2_scale, a1_scale, a2_scale)))
        make_device_state(x.device, None if device_state is None else lambda d: device_state(d, dims, quant))
        return x.new_empty((x.shape[0], x.shape[1]), dtype=OUT_DTYPE)

    kernel.__name__ = fake.__name__ = "fused_moe"
    kernel.__qualname__ = f"{namespace}.fused_moe"
    fake.__qualname__ = f"{namespace}.fused_moe_fake"
    lib = torch.library.Library(namespace, "DEF")
    lib.define(SCHEMA)
    for key in ("CPU", "CUDA"):
        lib.impl("fused_moe", kernel, key)
    torch.library.register_fake(f"{namespace}::fused_moe", fake, lib=lib)
    op = getattr(torch.ops, namespace).fused_moe.default
    _libraries[namespace] = (lib, op, impl)
    return op


def _plain(t) -> bool:
    return t is None or type(t) is torch.Tensor or type(t) is torch.nn.Parameter


_TRACING_MODES: tuple = ()


def _tracing_mode() -> bool:
    """Whether a tracing dispatch mode is active: fake tensors, ``make_fx``'s proxies, functionalization."""
    global _TRACING_MODES
    if not _TRACING_MODES:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch._subclasses.functional_tensor import FunctionalTensorMode
        from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

        _TRACING_MODES = (FakeTensorMode, ProxyTorchDispatchMode, FunctionalTensorMode)
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, _TRACING_MODES) for m in _get_current_dispatch_mode_stack())


def tracing(*tensors) -> bool:
    """Whether a call with these arguments must go through the op: torch.compile is tracing, a
    tracing dispatch mode is active (a FakeTensorMode, ``make_fx``'s proxy mode, functionalization),
    or an argument is a tensor subclass (a FakeTensor, a functional wrapper). Another dispatch mode
    (one that counts or logs the aten ops) sees the backend's own ops, as before the op existed."""
    if torch.compiler.is_compiling():
        return True
    if torch._C._len_torch_dispatch_stack() and _tracing_mode():
        return True
    return not all(map(_plain, tensors))


def entry(op: torch._ops.OpOverload, impl: Callable, options: dict) -> Callable:
    """A backend's public ``fused_moe``: ``impl``'s signature and doc, calling ``op`` when
    :func:`tracing` (and no backend option differs from its default in ``options``, name → default),
    else ``impl`` directly. Arguments the schema cannot take (a list for a tensor, a number for
    ``quant``) go to ``impl`` even while tracing, which names them as a direct call does."""

    def given(kwargs: dict) -> bool:
        for name, value in kwargs.items():
            default = options.get(name, given)  # an unknown name: impl raises its TypeError
            if value is not default and not (type(value) is type(default) and value == default):
                return True
        return False

    @functools.wraps(impl)
    def fused_moe(
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
        **backend_options,
    ):
        if (
            tracing(x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, a1_scale, a2_scale)
            and not (backend_options and given(backend_options))
            and _schema_types(x, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale, a1_scale, a2_scale)
        ):
            return op(x, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale, a1_scale, a2_scale)
        return impl(
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
            **backend_options,
        )

    fused_moe.op = op
    fused_moe.impl = impl
    return fused_moe


def _schema_types(x, w1, w2, topk_weights, topk_ids, quant, *scales) -> bool:
    """Whether the arguments have the types :data:`SCHEMA` takes."""
    return (
        all(isinstance(t, torch.Tensor) for t in (x, w1, w2, topk_weights, topk_ids))
        and (quant is None or type(quant) is str)
        and all(s is None or isinstance(s, torch.Tensor) for s in scales)
    )

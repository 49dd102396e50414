"""The contenders, loaded lazily and described uniformly.

============== ===========================================================================
name           what it is
============== ===========================================================================
cute_moe       this project's CuTe DSL kernel (WGMMA grouped GEMM, swap-AB for decode)
triton_moe     this project's Triton kernel (grouped GEMM, swap-AB, FP8 in registers)
torch_grouped  ``torch._grouped_mm`` / ``torch._scaled_grouped_mm``: what a user already has
torch_loop     one ``torch.matmul`` per expert: the plain baseline
hf_triton_moe  transformers' experts module with ``experts_implementation="triton_moe"``
hf_cute_moe    ... with ``"cute_moe"``
hf_grouped_mm  ... with transformers' default, ``"grouped_mm"`` (``torch._grouped_mm``)
============== ===========================================================================

The first four are the default run; the ``hf_`` three (:data:`HF_BACKENDS`, ``--backends all``)
need transformers (the ``hf`` extra) and run :func:`compare.hf_experts.experts_fused_moe`: the
numbers a user sees inside a model, against the same oracle. The contract's arguments carry no
model name, so each runs one experts class for every shape — ``MixtralExperts`` (bf16) or
transformers' ``FP8Experts`` with a Mixtral config (fp8_block) — and says so in its config column;
the experts classes of the catalog's models compute the same function from the same weights
(tests/test_compare_hf.py checks it). A format transformers has no counterpart for is declined
("not implemented"). They are timed eagerly, not from a CUDA graph (transformers' forwards read
routing data on the host). With ``--hf-compiled`` each also gets the compiled columns: the same
call with the experts module's forward under ``torch.compile(fullgraph=True)``
(:attr:`Backend.compiled`, :func:`compare.timed.compile_fullgraph`), beside its eager µs.

A backend that fails to import, or refuses a (shape, quant, device), is never dropped: the suite
turns it into a row that says "not available: <why>". Each :class:`Backend` also knows its plan
for a case (the two kernels' own ``plan``: config, alignment tile, path, instruction — see
:mod:`moe_spec.plan`), names it in the config column, runs its alignment/permutation step alone
(timed separately from the GEMM path, at the plan's alignment tile), as far as the backend exposes
those; what it does not expose is reported as missing, not guessed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_spec.validate import MoEDims, validate_moe_args

#: hf backend -> the transformers experts implementation it runs
HF_BACKENDS = {"hf_triton_moe": "triton_moe", "hf_cute_moe": "cute_moe", "hf_grouped_mm": "grouped_mm"}
#: every backend :func:`load_backend` knows (the default run: compare.cases.DEFAULT_BACKENDS)
BACKEND_NAMES = ("cute_moe", "triton_moe", "torch_grouped", "torch_loop") + tuple(HF_BACKENDS)
KERNELS = ("cute_moe", "triton_moe")  # the two implementations that must agree with each other
#: the backends whose numerics are this project's kernels' (a FAIL is this project's problem)
OUR_KERNELS = KERNELS + tuple(b for b, impl in HF_BACKENDS.items() if impl in KERNELS)
BASELINE = "torch_grouped"  # speedups are quoted against what a torch user already has ...
FALLBACK_BASELINE = "torch_loop"  # ... or, where torch_grouped was not timed, the plain loop


@dataclass
class Backend:
    """One contender. ``missing`` is set (and ``fused_moe`` None) when it could not be imported."""

    name: str
    fused_moe: Callable | None = None
    missing: str | None = None
    needs_cuda: bool = False
    capturable: bool = True  # a call can be captured in a CUDA graph (no host sync)
    describe: Callable[[MoEDims, str | None], str] = field(default=lambda dims, quant: "")
    # (dims, quant) -> the backend's plan (moe_spec.plan.LayerPlan); None where it has none
    plan: Callable | None = None
    # (inputs, dims) -> zero-argument callable running the alignment/permutation step alone
    prepare: Callable | None = None
    # the same layer with scaling and aggregation as separate passes over HBM (cute_moe's
    # fusion="separate"), timed beside the fused layer on FP8 rows; None where there is none
    separate: Callable | None = None
    # (T, K, I, top_k, experts_hit, quant, fusion) -> {pass: HBM bytes}: the analytic traffic of
    # the fused and separate pipelines
    pass_bytes: Callable | None = None
    # (quant, device) -> why it cannot run here beyond needs_cuda (None: try it)
    check: Callable[[str | None, str], str | None] | None = None
    # compile -> the same call with its torch module's forward compiled by ``compile`` (the hf
    # backends: transformers' experts module, as a compiled model runs it); None where there is none
    compiled: Callable[[Callable], Callable] | None = None

    def unavailable(self, quant: str | None, device: str) -> str | None:
        """Why this backend cannot run here before trying (None: try it; refusals are caught later)."""
        if self.missing:
            return self.missing
        if self.needs_cuda and device != "cuda":
            return "needs a Hopper GPU (the CPU report shows its configs and PTX instead)"
        return self.check(quant, device) if self.check else None


def _import_error(name: str, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"import {name} failed: {type(exc).__name__}: {first}"[:200]


# --- the adapters -------------------------------------------------------------------------------


def _describe_plan(plan: Callable) -> Callable[[MoEDims, str | None], str]:
    """The config column: the plan a CUDA graph captures (what the graph timing runs) and, for a backend
    whose plan weighs eager calls (an ``eager`` keyword), the eager call's plan where it differs (what
    the eager column runs; only where CUDA is present: off the GPU no call is planned eagerly)."""
    import torch

    weighs_eager = "eager" in inspect.signature(plan).parameters

    def describe(dims, quant):
        try:
            captured = plan(dims, quant)
            eager = plan(dims, quant, eager=True) if weighs_eager and torch.cuda.is_available() else captured
        except NotImplementedError:
            return ""  # a format the backend does not build: its status says so
        return captured.describe() + ("" if eager == captured else f" (eager: {eager.describe()})")

    return describe


def _load_cute() -> Backend:
    mod = importlib.import_module("cute_moe")
    b = Backend("cute_moe", fused_moe=mod.fused_moe, needs_cuda=True)
    if hasattr(mod, "plan"):
        b.plan = mod.plan
        b.describe = _describe_plan(mod.plan)
        sort_rows = getattr(mod, "sort_rows", None)
        if sort_rows is not None:

            def prepare(inputs, dims):
                tile = mod.plan(dims, inputs.quant).align_tile
                return lambda: sort_rows(inputs.topk_ids, inputs.topk_weights, dims.E, tile)

            b.prepare = prepare
    unfused = importlib.import_module("cute_moe.unfused")
    b.separate = functools.partial(mod.fused_moe, fusion="separate")
    b.pass_bytes = unfused.hbm_bytes
    return b


def _load_triton() -> Backend:
    mod = importlib.import_module("triton_moe")
    b = Backend("triton_moe", fused_moe=mod.fused_moe)
    if hasattr(mod, "plan"):
        b.plan = mod.plan
        b.describe = _describe_plan(mod.plan)
        try:
            align = importlib.import_module("triton_moe.align").align_block_size

            def prepare(inputs, dims):
                tile = mod.plan(dims, inputs.quant).align_tile
                return lambda: align(inputs.topk_ids, dims.E, tile)

            b.prepare = prepare
        except (ImportError, AttributeError):
            pass
    return b


def _load_torch_grouped() -> Backend:
    import torch

    import compare.baselines as baselines

    if not hasattr(torch, "_grouped_mm"):
        raise ImportError(f"torch {torch.__version__} has no torch._grouped_mm")
    b = Backend("torch_grouped", fused_moe=baselines.grouped_fused_moe)
    b.describe = lambda dims, quant: (
        ("torch._grouped_mm" if quant is None else "torch._scaled_grouped_mm rowwise")
        + f", groups padded to {baselines.GROUP_ALIGN}"
    )
    b.prepare = lambda inputs, dims: lambda: baselines.prepare_grouped(inputs.topk_ids, dims.E)
    return b


def _load_torch_loop() -> Backend:
    import compare.baselines as baselines

    b = Backend("torch_loop", fused_moe=baselines.loop_fused_moe, capturable=False)
    b.describe = lambda dims, quant: (
        "per-expert torch.matmul" + ("" if quant is None else " (W8A8 model in fp32; numerics reference, not timed)")
    )
    return b


def _load_hf(name: str) -> Backend:
    """transformers' experts module through one experts implementation (see the module docstring)."""
    implementation = HF_BACKENDS[name]
    hf = importlib.import_module("compare.hf_experts")  # ImportError without transformers: a "missing" row
    kernel = None
    if implementation in hf.IMPLEMENTATIONS:
        kernel = load_backend(implementation)
        if kernel.missing:
            raise ImportError(f"{implementation}: {kernel.missing}")
        hf.register(implementation)

    def through(run):
        def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
            if quant not in hf.QUANTS:
                validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)
                raise NotImplementedError(hf.no_counterpart(quant))
            return run(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)

        fused_moe.__name__ = run.__name__
        fused_moe.__doc__ = run.__doc__
        return fused_moe

    fused_moe = through(hf.experts_fused_moe(implementation, hf.HARNESS_MODEL_TYPE))

    def describe(dims, quant):
        if quant not in hf.QUANTS:
            return ""  # declined: its status says why
        where = hf.experts_module_name(hf.HARNESS_MODEL_TYPE, quant)
        inner = kernel.describe(dims, quant) if kernel is not None else hf.own_forward(implementation, quant)
        return f"transformers {where} → {implementation}" + (f": {inner}" if inner else "")

    return Backend(
        name,
        fused_moe=fused_moe,
        needs_cuda=kernel is not None and kernel.needs_cuda,
        capturable=False,
        describe=describe,
        check=lambda quant, device: hf.cannot_run(implementation, quant),
        compiled=lambda compile: through(hf.experts_fused_moe(implementation, hf.HARNESS_MODEL_TYPE, compile)),
    )


_LOADERS = {
    "cute_moe": _load_cute,
    "triton_moe": _load_triton,
    "torch_grouped": _load_torch_grouped,
    "torch_loop": _load_torch_loop,
    **{name: (lambda n: lambda: _load_hf(n))(name) for name in HF_BACKENDS},
}
_loaded: dict[str, Backend] = {}


def load_backend(name: str) -> Backend:
    """The backend called ``name``; an import failure gives a Backend with ``missing`` set."""
    if name not in _LOADERS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    if name not in _loaded:
        try:
            _loaded[name] = _LOADERS[name]()
        except Exception as exc:  # noqa: BLE001 - any import failure becomes an explicit row
            _loaded[name] = Backend(name, missing=_import_error(name, exc))
    return _loaded[name]

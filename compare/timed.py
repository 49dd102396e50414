"""One case's backends against the clock: median time, roofline position, alignment step, speedup.

The clock is a parameter (:class:`Clock`): on a GPU, :data:`GPU_CLOCK` — the CUDA-graph timer over
rotated input sets (cold L2) and the ceilings measured at the start of the run, both from
:mod:`moe_spec.timing`. A test passes a stand-in clock and exercises every line of this module on
a CPU; only the numbers differ.

Each backend whose numerics ran (ok or FAIL) is timed; its row gets the median and spread, the
weight bandwidth it reached, its place on this run's roofline (:func:`moe_spec.timing.roofline`), its
alignment/permutation step timed alone, and its speedup against the torch baseline of the case.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compare.backends import BASELINE, FALLBACK_BASELINE, Backend
from compare.cases import Budget, Case
from moe_spec.problem import MoEInputs
from moe_spec.quant import weight_scale_shape
from moe_spec.timing import (
    Ceilings,
    measure_ceilings,
    moe_traffic,
    roofline,
    sets_for_cold_l2,
    time_cuda_graph,
    wall_us,
)
from moe_spec.validate import MoEDims


@dataclass(frozen=True)
class Clock:
    """How the suite measures: ``time(make_call, n_sets, use_graph=..., **options) -> Timing`` (the
    signature of :func:`moe_spec.timing.time_cuda_graph`), ``ceilings() -> Ceilings``, ``sync()`` after
    a failed call, and the device's name for the report."""

    time: Callable
    ceilings: Callable[[], Ceilings]
    sync: Callable[[], None]
    device: Callable[[], str]
    # ``eager(make_call, n_sets, quick=...) -> µs per call`` of plain calls (:func:`eager_sets_us`);
    # None: no eager column
    eager: Callable | None = None
    # ``compile(module) -> module`` for the compiled columns of a backend that has them
    # (Backend.compiled: the hf backends), timed by ``eager``; None: no compiled columns
    compile: Callable | None = None


def eager_sets_us(make_call, n_sets: int, *, quick: bool = False, calls: int = 50, repeats: int = 5) -> float:
    """The eager column: what a call costs when it is simply called, not replayed from a CUDA graph (the
    argument checks, the planning, every launch, any read that makes the host wait). ``make_call(i)``
    is set ``i``'s call; ``calls`` back-to-back calls go round the sets, one ``torch.cuda.synchronize()``
    ending each of ``repeats`` repeats; the median per call (:func:`moe_spec.timing.wall_us`).
    ``quick``: 20 calls, 3 repeats. When it costs as much as the graph replay, the host keeps up."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "eager_sets_us: needs a CUDA device (moe_spec.timing.host_us measures the host side on a CPU)"
        )
    if quick:
        calls, repeats = 20, 3
    return wall_us([make_call(i) for i in range(n_sets)], calls=calls, repeats=repeats, sync=torch.cuda.synchronize)


def compile_fullgraph(module, backend: str = "inductor"):
    """``torch.compile(module, fullgraph=True, dynamic=False)``: the compiled columns' compilation, as a
    model compiled whole (``compare.studies.hf_bench --compiled``) compiles its experts."""
    return torch.compile(module, fullgraph=True, dynamic=False, backend=backend)


GPU_CLOCK = Clock(
    time=time_cuda_graph,
    ceilings=measure_ceilings,
    sync=torch.cuda.synchronize,
    device=torch.cuda.get_device_name,
    eager=eager_sets_us,
)


def clone_inputs(inputs: MoEInputs) -> MoEInputs:
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return MoEInputs(
        c(inputs.x),
        c(inputs.w1),
        c(inputs.w2),
        c(inputs.topk_weights),
        c(inputs.topk_ids),
        inputs.quant,
        c(inputs.w1_scale),
        c(inputs.w2_scale),
    )


def _options(quick: bool) -> dict:
    return dict(replays=6, min_calls=4, warmup=1) if quick else dict(replays=20, min_calls=10, warmup=2)


def time_calls(clock: Clock, make_call, n_sets: int, capturable: bool, quick: bool):
    """(Timing, note). A graph capture that fails falls back to eager timing, and says so."""
    if capturable:
        try:
            return clock.time(make_call, n_sets, use_graph=True, **_options(quick)), "graph"
        except Exception as exc:  # noqa: BLE001
            clock.sync()
            note = f"eager (graph capture failed: {type(exc).__name__})"
    else:
        note = "eager (host-synchronizing loop)"
    return clock.time(make_call, n_sets, use_graph=False, **_options(quick)), note


def _scale_bytes(quant, dims: MoEDims) -> int:
    """fp32 scale bytes of one expert's W1 and W2 (shapes from moe_spec.quant)."""
    if quant is None:
        return 0
    w1 = math.prod(weight_scale_shape(quant, 1, 2 * dims.I, dims.K))
    w2 = math.prod(weight_scale_shape(quant, 1, dims.K, dims.I))
    return 4 * (w1 + w2)


def time_backend(
    clock: Clock, backend: Backend, sets: list, dims: MoEDims, quant, ceilings: Ceilings, quick: bool
) -> dict:
    """The timing columns of one backend's row."""
    make_call = lambda i: lambda: backend.fused_moe(**sets[i].kwargs())  # noqa: E731
    t, note = time_calls(clock, make_call, len(sets), backend.capturable, quick)
    hit = int(torch.unique(sets[0].topk_ids).numel())
    weight_bytes = 1 if quant else 2
    nbytes, flops = moe_traffic(dims.T, dims.K, dims.I, dims.top_k, hit, weight_bytes, _scale_bytes(quant, dims))
    roof = roofline(nbytes, flops, ceilings, "fp8" if quant else "bf16", t.median_us)
    row = {
        "us": t.median_us,
        "p10_us": t.p10_us,
        "p90_us": t.p90_us,
        "timing": note,
        "weight_tbps": hit * 3 * dims.I * dims.K * weight_bytes / (t.median_us * 1e-6) / 1e12,
        "tflops": roof["tflops"],
        "pct_floor": roof["pct_of_floor"],
        "floor_us": roof["floor_us"],
        "bound": roof["bound"],
        "experts_hit": hit,
    }
    if backend.prepare is not None:
        try:
            prep, _ = time_calls(clock, lambda i: backend.prepare(sets[i], dims), len(sets), True, quick)
            row["prep_us"] = prep.median_us
        except Exception as exc:  # noqa: BLE001
            row["prep_us"] = None
            row["timing"] += f"; prep not timed ({type(exc).__name__})"
    if clock.eager is not None:
        row["eager_us"] = clock.eager(make_call, len(sets), quick=quick)
        row["eager_ratio"] = row["eager_us"] / t.median_us
    if quant is not None and backend.separate is not None:
        row.update(_separate(clock, backend, sets, dims, quant, hit, t.median_us, quick))
    if clock.compile is not None and clock.eager is not None and backend.compiled is not None:
        row.update(_compiled(clock, backend, sets, quant, row["eager_us"], quick))
    return row


def _compiled(clock: Clock, backend: Backend, sets: list, quant, eager_us: float, quick: bool) -> dict:
    """The compiled columns: the backend's call with its module compiled by ``clock.compile``, its first
    call (the compilation) untimed, then timed as the eager column is. Dynamo's caches are reset first:
    every case compiles a new module of one class, whose forward dynamo would count as a recompile
    of the last case's, up to its limit. The output on the first set is compared with the eager
    call's (``compiled_rel_l2``); beyond the format's tolerance there is no number, only the note.
    A call that does not compile or run gives ``compiled_us`` None and the reason in ``compiled_note``."""
    from compare.metrics import tolerance_for
    from moe_spec.oracle import rel_l2

    torch._dynamo.reset()
    call = backend.compiled(clock.compile)
    kwargs = sets[0].kwargs()
    try:
        out = call(**kwargs)
        clock.sync()
        us = clock.eager(lambda i: lambda: call(**sets[i].kwargs()), len(sets), quick=quick)
    except Exception as exc:  # noqa: BLE001 - a call that does not compile is a note, not the end of the row
        clock.sync()
        text = str(exc).strip().splitlines()
        return {"compiled_us": None, "compiled_note": f"not compiled: {type(exc).__name__}: {text[0] if text else ''}"}
    err, bound = rel_l2(out, backend.fused_moe(**kwargs)), tolerance_for(quant).rel_l2
    if not err <= bound:  # NaN included
        note = f"differs from eager: rel L2 {err:.1e} from the eager call's output, over the bound {bound:.0e}"
        return {"compiled_us": None, "compiled_rel_l2": err, "compiled_note": note}
    return {"compiled_us": us, "compiled_ratio": us / eager_us, "compiled_rel_l2": err}


def _separate(
    clock: Clock, backend: Backend, sets: list, dims: MoEDims, quant, hit: int, fused_us: float, quick: bool
) -> dict:
    """The unfused pipeline on the same inputs: µs, the bytes both pipelines move, fused's speedup."""
    t, _ = time_calls(
        clock, lambda i: lambda: backend.separate(**sets[i].kwargs()), len(sets), backend.capturable, quick
    )
    fused, separate = (
        sum(backend.pass_bytes(dims.T, dims.K, dims.I, dims.top_k, hit, quant, f).values())
        for f in ("fused", "separate")
    )
    return {
        "separate_us": t.median_us,
        "fusion_speedup": t.median_us / fused_us,
        "fused_bytes": fused,
        "separate_bytes": separate,
    }


def time_case(
    clock: Clock,
    case: Case,
    rows: dict,
    backends: dict,
    ceilings: Ceilings,
    quick: bool,
    budget: Budget,
    progress=lambda text: None,
) -> None:
    """Time every backend of the case that ran; fill its row. The budget is checked between backends
    (a CUDA graph capture is not interrupted halfway)."""
    set_bytes = sum(t.numel() * t.element_size() for t in (case.inputs.w1, case.inputs.w2))
    n_sets = 2 if quick else sets_for_cold_l2(set_bytes)
    sets = [case.inputs] + [clone_inputs(case.inputs) for _ in range(n_sets - 1)]
    for name, row in rows.items():
        if row.get("status") not in ("ok", "FAIL"):
            row["timing"] = "skipped: " + row.get("status", "not run")
            continue
        if name == "torch_loop" and case.quant is not None:
            row["timing"] = "not timed: the FP8 loop is the W8A8 model in fp32 matmuls, a numerics reference"
            continue
        if budget.spent():
            row["timing"] = f"skipped: {budget.text} spent"
            continue
        progress(f"time {case.title} {name}")
        try:
            row.update(time_backend(clock, backends[name], sets, case.dims, case.quant, ceilings, quick))
        except Exception as exc:  # noqa: BLE001
            clock.sync()
            row["timing"] = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
    base = next((b for b in (BASELINE, FALLBACK_BASELINE) if rows.get(b, {}).get("us")), None)
    for row in rows.values():
        if base and row.get("us"):
            row["speedup"] = rows[base]["us"] / row["us"]
            row["speedup_vs"] = base
    del sets

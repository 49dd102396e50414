"""Eager against graph timing, and the host's cost alone: ``python -m compare.studies.eager``.

:func:`moe_spec.timing.time_cuda_graph` measures the kernels alone: a graph replay launches them
with no Python in between. A serving stack that does not capture calls pays the host too — the
argument checks, the planning, every launch, and any read of device data that makes the host
wait. :func:`eager_us` measures that: ``calls`` back-to-back calls with one synchronization at
the end, so the host runs ahead of the GPU unless something in the call waits for it; the median
of a few repeats (:func:`compare.timed.eager_sets_us`, the main job's eager column, on one input set).
When an eager call costs as much as its graph replay, the host keeps up.

:func:`host_us` (:func:`moe_spec.timing.host_us`: the loop of :func:`eager_us`,
:func:`moe_spec.timing.wall_us`, without the synchronization) is the host side alone (no GPU
needed): µs per call of the Python that runs, with the launches made by the caller's stand-in
(for triton_moe, run it inside ``triton_moe.jit.count_compilations(dry_run=True)``, which binds
every launch's arguments as Triton does but launches nothing).

    python -m compare.studies.eager --shape qwen3-30b-a3b --tokens 1 8 --quant bf16     # on a GPU

prints eager and graph µs per call side by side, both on one input set (warm L2: the comparison
is of host cost, not of the cold-L2 kernel times the compare report states). With ``--profile N``
each cell is also run N times under cProfile and its first rows by own time are printed: where
the host's microseconds go (:func:`profile_rows`; the profiler inflates every time it shows).

    python -m compare.studies.eager --host --shape qwen3-30b-a3b --tokens 1 64 --quant bf16   # any machine

prints triton_moe's host µs per call and its launches (the shape's E and top_k with K = 256,
I = 128: the host work does not depend on K and I), launched through Triton's launch path into a
stand-in driver that runs nothing (``triton_moe.lab.hostcost``, which also compares Triton's own
``JITFunction.run`` with the direct path).
"""

from __future__ import annotations

from compare.timed import eager_sets_us
from moe_spec.cli import ArgumentParser, needs_cuda
from moe_spec.timing import host_us


def eager_us(fn, kwargs: dict, calls: int = 50, repeats: int = 5) -> float:
    """Median over ``repeats`` of the wall time of ``calls`` back-to-back ``fn(**kwargs)``, one
    ``torch.cuda.synchronize()`` at the end of each repeat, in µs per call (after a warm-up call)."""
    return eager_sets_us(lambda i: lambda: fn(**kwargs), 1, calls=calls, repeats=repeats)


def profile_rows(fn, kwargs: dict, calls: int, rows: int = 15) -> list[str]:
    """cProfile of ``calls`` eager ``fn(**kwargs)``: the first ``rows`` functions by own time, as
    pstats prints them (ncalls, tottime, percall, cumtime, percall, where)."""
    import cProfile
    import io
    import pstats

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn(**kwargs)
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn(**kwargs)
    prof.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return lines[start : start + rows + 1]


def main(argv=None) -> None:
    from compare.backends import load_backend
    from moe_spec.problem import draw_weights, get_shape, make_inputs
    from moe_spec.quant import FORMATS
    from moe_spec.timing import time_cuda_graph

    p = ArgumentParser(prog="python -m compare.studies.eager", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--quant", default="bf16", choices=[f.label for f in FORMATS.values()])
    p.add_argument("--backend", nargs="+", default=["triton_moe", "cute_moe"])
    p.add_argument("--host", action="store_true", help="triton_moe's host cost per call, no GPU needed")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="also cProfile N eager calls per cell [0: no]")
    a = p.parse_args(argv)
    if a.profile < 0:
        p.error(f"--profile: expected a number of calls ≥ 0, got {a.profile}")
    shape = get_shape(a.shape)
    quant = next(f.name for f in FORMATS.values() if f.label == a.quant)
    if a.host:
        return _host_table(shape, quant, a.tokens)
    needs_cuda(p.prog, "--host measures triton_moe's host cost per call on a CPU")
    weights = draw_weights(shape, 0, device="cuda")
    print("| backend | shape | quant | T | eager µs | graph µs |\n|---|---|---|---|---|---|")
    profiles = []
    for T in a.tokens:
        kw = make_inputs(shape, T, quant, weights_bf16=weights).to("cuda").kwargs()
        for name in a.backend:
            fn = load_backend(name).fused_moe
            if fn is None:
                continue
            try:
                eager = eager_us(fn, kw)
                graph = time_cuda_graph(lambda i: lambda: fn(**kw), 1).median_us
            except NotImplementedError:
                continue
            print(f"| {name} | {shape.label} | {a.quant} | {T} | {eager:.1f} | {graph:.1f} |", flush=True)
            if a.profile:
                profiles.append((f"{name} {shape.label} {a.quant} T={T}", profile_rows(fn, kw, a.profile)))
    for cell, rows in profiles:
        print("", f"cProfile of {a.profile} eager calls, {cell}, by own time:", "```", *rows, "```", sep="\n")


def _host_table(shape, quant, tokens) -> None:
    """triton_moe's host µs per call on a machine without a GPU: its launches go through Triton's own
    launch path to a stand-in sm_90 driver that runs nothing (:func:`triton_moe.lab.hostcost.stand_in_driver`)."""
    from moe_spec.problem import MoEShape, make_inputs
    from moe_spec.quant import get_format
    from triton_moe import fused_moe
    from triton_moe.jit import count_compilations
    from triton_moe.lab.hostcost import stand_in_driver

    stand_in = MoEShape(shape.label, shape.num_experts, shape.top_k, 256, 128, "host-cost stand-in")
    print("| backend | shape (E, top_k; K=256, I=128) | quant | T | host µs | launches |\n|---|---|---|---|---|---|")
    for T in tokens:
        kw = make_inputs(stand_in, T, quant).kwargs()
        with stand_in_driver():
            fused_moe(**kw)
            with count_compilations() as counter:
                fused_moe(**kw)
            launches = len(counter.launches)
            us = host_us(fused_moe, kw)
        print(f"| triton_moe | {shape.label} | {get_format(quant).label} | {T} | {us:.1f} | {launches} |", flush=True)


if __name__ == "__main__":
    main()

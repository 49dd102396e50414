"""What an eager ``cute_moe.fused_moe`` call costs the host, step by step (GPU).

    python -m cute_moe.lab.hostcost --out DIR [--shape qwen3-30b-a3b] [--tokens 1 8 64]
                                    [--quant bf16 fp8_tensor] [--calls 200] [--deadline-s 240] [--commit C]

For each (T, format) of the shape (default Qwen3-30B-A3B, T = 1, 8, 64, bf16 and fp8_tensor), on one
input set, after a warm-up call (compiles, binds the launches, makes the workspace):

* ``eager µs``: ``--calls`` back-to-back calls, one ``torch.cuda.synchronize()`` at the end, median
  of five repeats (:func:`moe_spec.timing.wall_us`): what a serving loop without CUDA graphs pays;
* ``graph µs``: the same call replayed from a CUDA graph (:func:`moe_spec.timing.time_cuda_graph`,
  warm L2: the comparison is of host cost), and ``eager / graph``;
* the split: the same ``--calls`` calls with ``time.perf_counter_ns`` around each step of
  :func:`cute_moe.moe.fused_moe`, the GPU work queued and never waited for inside the loop —
  ``validate`` (:func:`moe_spec.validate.validate_moe_args`, its cached verdict), ``plan lookup``
  (``moe._call_of``: the plan and the bound launches of the call signature), ``device checks``
  (``check_runs_on``, ``surface_errors``), ``workspace`` (``moe._workspace``: the stream's
  buffers), ``gemm args`` (``launch_args``: the weight and output views a GEMM takes), ``x scales
  sorted`` (FP8 per-token and 1×128 scales: x's scales in the sorted order), one column per launch
  (the TVM-FFI function's call: DLPack of each tensor, the argument checks, ``cuLaunchKernel``) and
  ``rest`` (the timed call less its parts: the output allocations and the Python between steps).
  Each step is timed by wrapping the very function ``fused_moe`` calls (module globals of
  :mod:`cute_moe.moe` and :mod:`cute_moe.moe_fp8`, :data:`WRAPPED`, and the call's bound launches), so the
  split follows the product's code (``tests/test_cute_hostcost.py`` checks each wrapped global is there);
  the wrappers' own cost shows as ``timed call µs`` against ``eager µs``.

Writes ``hostcost.md`` and ``hostcost.json`` (date, device, commit, command) into ``--out``, a new or
empty directory, rewritten after every cell.  On a machine without CUDA it refuses in one line:
without the device there is no TVM-FFI call to time (the host Python up to the launches, with the
launches stubbed, is ``python -m cute_moe.lab.bench_align --host``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from moe_spec import studyout

FILES = ("hostcost.md", "hostcost.json")
TOKENS = (1, 8, 64)
QUANTS = ("bf16", "fp8_tensor")
#: The steps of fused_moe timed by wrapping a module global: (column, module of cute_moe, global).
WRAPPED = (
    ("validate", "moe", "validate_moe_args"),
    ("plan lookup", "moe", "_call_of"),
    ("device checks", "moe", "check_runs_on"),
    ("device checks", "moe", "surface_errors"),
    ("workspace", "moe", "_workspace"),
    ("gemm args", "moe", "launch_args"),
    ("gemm args", "moe_fp8", "launch_args"),
    ("x scales sorted", "moe_fp8", "sorted_token_scales"),
)
#: A cell starts only when this much time is left before the deadline.
CELL_S = 20.0


class _Timers:
    """ns per column, summed over the timed calls."""

    def __init__(self):
        self.ns: dict = {}

    def wrap(self, column: str, fn):
        perf, ns = time.perf_counter_ns, self.ns
        ns.setdefault(column, 0)

        def timed(*args, **kwargs):
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[column] += perf() - t0

        return timed


def wrapped_modules() -> dict:
    """The modules :data:`WRAPPED` names, by their name in the package."""
    from cute_moe import moe, moe_fp8

    return {"moe": moe, "moe_fp8": moe_fp8}


def split(fused_moe, kwargs: dict, calls: int) -> tuple[dict, float]:
    """({column: µs per call}, µs per timed call) over ``calls`` calls of ``fused_moe(**kwargs)``
    with every step of :data:`WRAPPED` and every launch of the call timed; one sync, at the end."""
    import torch

    from cute_moe import moe

    names = ("x", "w1", "w2", "topk_weights", "topk_ids", "quant", "w1_scale", "w2_scale")
    args = {k: kwargs.get(k) for k in names}
    dims = moe.validate_moe_args(**args, limits=moe.LIMITS)
    # the call's own _Call (fused_moe's key: default options), whose bound launches are timed
    call = moe._call_of(dims, args["quant"], None, None, "fused", args["x"].device, args["topk_ids"].dtype, False)
    timers = _Timers()
    modules = wrapped_modules()
    saved_globals = {(mod, name): getattr(modules[mod], name) for _, mod, name in WRAPPED}
    saved_launches = call.launches
    try:
        for column, mod, name in WRAPPED:
            setattr(modules[mod], name, timers.wrap(column, saved_globals[mod, name]))
        call.launches = {name: timers.wrap(f"launch {name}", fn) for name, fn in saved_launches.items()}
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            fused_moe(**kwargs)
        total = time.perf_counter_ns() - start  # the host's time: the GPU may still be running
        torch.cuda.synchronize()
    finally:
        for (mod, name), fn in saved_globals.items():
            setattr(modules[mod], name, fn)
        call.launches = saved_launches
    per_call = {k: v / calls / 1e3 for k, v in timers.ns.items() if v}
    total_us = total / calls / 1e3
    per_call["rest"] = total_us - sum(per_call.values())
    return per_call, total_us


def _cell(shape, weights, T: int, quant_label: str, calls: int) -> dict:
    import torch

    from cute_moe.moe import fused_moe
    from moe_spec.problem import make_inputs
    from moe_spec.quant import FORMATS
    from moe_spec.timing import time_cuda_graph, wall_us

    quant = next(f.name for f in FORMATS.values() if f.label == quant_label)
    kw = make_inputs(shape, T, quant, weights_bf16=weights).to("cuda").kwargs()
    fused_moe(**kw)  # warm: compiles, binds the launches, makes the workspace, CUDA loads the modules
    torch.cuda.synchronize()
    eager = wall_us([lambda: fused_moe(**kw)], calls=calls, repeats=5, sync=torch.cuda.synchronize)
    graph = time_cuda_graph(lambda i: lambda: fused_moe(**kw), 1).median_us
    steps, timed = split(fused_moe, kw, calls)
    return {
        "eager_us": eager,
        "graph_us": graph,
        "eager_over_graph": eager / graph,
        "timed_call_us": timed,
        "steps_us": steps,
    }


def _write(out: Path, results: dict) -> None:
    columns = list(dict.fromkeys(c for r in results["rows"] for c in r.get("steps_us", {})))
    lines = [
        f"# cute_moe: the host cost of an eager call, step by step, on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        f"{results['shape']}, one input set, {results['calls']} back-to-back calls. eager: one sync at the end "
        "(median of 5); graph: CUDA-graph replay of the same call (warm L2). The split: µs per call of each "
        "step of `fused_moe` (perf_counter_ns around the function it calls, no sync inside), `rest` = the "
        "timed call less its parts; `timed call` includes the timers' own cost.",
        "",
        "| T | quant | eager µs | graph µs | eager / graph | timed call µs | " + " | ".join(columns) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(columns),
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['T']} | {r['quant']} | error: {r['error']} |")
            continue
        steps = " | ".join(f"{r['steps_us'].get(c, 0.0):.1f}" for c in columns)
        lines.append(
            f"| {r['T']} | {r['quant']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} | "
            f"{r['eager_over_graph']:.2f} | {r['timed_call_us']:.1f} | {steps} |"
        )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    studyout.write_files(
        out, dict(zip(FILES, ("\n".join(lines) + "\n", json.dumps(results, indent=1, default=str) + "\n")))
    )


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m cute_moe.lab.hostcost"
    p = studyout.gpu_study_parser(prog, __doc__, FILES, 240.0)
    p.add_argument("--shape", default="qwen3-30b-a3b", help="catalog shape (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="batch sizes (default: 1 8 64)")
    p.add_argument(
        "--quant", nargs="+", default=list(QUANTS), choices=["bf16", "fp8_tensor", "fp8_channel", "fp8_block"]
    )
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per measurement (default: 200)")
    a, out, run = studyout.start_gpu_study(prog, p, argv, FILES)
    if any(t < 1 for t in a.tokens) or a.calls < 1:
        print(f"{prog}: error: --tokens and --calls: every value must be at least 1", file=sys.stderr)
        raise SystemExit(2)
    import torch

    from moe_spec.problem import draw_weights, get_shape

    shape = get_shape(a.shape)
    weights = draw_weights(shape, 0, device="cuda")
    start = time.time()
    results = {**run, "shape": shape.label, "calls": a.calls, "rows": [], "cut": []}
    _write(out, results)
    for T in a.tokens:
        for q in a.quant:
            if time.time() - start > a.deadline_s - CELL_S:
                results["cut"].append(f"T={T} {q}")
                continue
            row = {"T": T, "quant": q}
            try:
                row.update(_cell(shape, weights, T, q, a.calls))
            except Exception as exc:  # noqa: BLE001 — one failing cell is a row, not the end of the run
                row["error"] = repr(exc)[:300]
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            _write(out, results)
    torch.cuda.synchronize()
    print(f"\n{(out / FILES[0]).read_text()}")
    return results


if __name__ == "__main__":
    main()

"""The one-launch decode kernel's timeline, measured: where a launch's time goes, task by task.

    python -m cute_moe.lab.trace_decode --out DIR [--deadline-s 120] [--shapes ...] [--tokens 1,8]
        [--quant bf16,fp8_tensor] [--stages N] [--ctas-per-sm M] [--fp8-overlap on|off]

Each cell (format, catalog shape, T with T·top_k within the kernel's pairs) launches the kernel's instrumented
twin (``cute_moe.decode.compile_decode(..., trace=True)``: the same kernel, with every task's SM and four
``%globaltimer`` stamps, :mod:`cute_moe.decode_trace`) on one input set, L2 flushed before each launch, three
times, and keeps the last.  From the trace (:func:`summarize`), per phase (Q1, A, Q2, B, C): the tasks, when
the first was taken and the last finished (µs from the first claim), the mean time the consumers spent on a
task, the mean producer wait (claim to operands ready, for tasks that wait on a counter) and the mean time a
task sat claimed before the consumers took it; and for the launch: its span and the SMs' busy fraction (the
consumers' task time over the span).  The stamps cost a few instructions per task: a traced launch is the
kernel's schedule, not its exact time (``bench_decode`` times the plain kernel).

Writes ``trace.md`` and ``trace.json`` (with every task's row) into ``--out`` (new or empty).
"""

from __future__ import annotations

import json
import sys

from moe_spec import studyout

from .bench_decode import add_variant_options, apply_variant

FILES = ("trace.md", "trace.json")
SHAPES = ("qwen3-30b-a3b", "deepseek-v3:tp8")
TOKENS = (1, 8)
QUANTS = ("bf16", "fp8_tensor")
FORMATS = ("bf16", "fp8_tensor", "fp8_channel", "fp8_block")
PHASES = ("Q1", "A", "Q2", "B", "C")
CELL_S = 20.0
FLUSH_BYTES = 512 << 20  # more than the H100's and H200's 50 / 60 MB L2


def phase_bounds(ids: list[int], E: int, T: int, K: int, I: int, fp8: bool) -> tuple:  # noqa: E741
    """(A0, Q0, B0, C0, END) of a launch, as the kernel numbers its tasks (bf16: no Q phases, A0 = 0, Q0 = B0)."""
    from ..decode_parts import fp8_phase_starts, leader_tables, phase_starts, tile_counts

    n_leaders = leader_tables(ids, E)["n_leaders"]
    nt1, nk, ntb = tile_counts(T, K, I)
    if fp8:
        return fp8_phase_starts(n_leaders, nt1, nk, ntb)
    b0, c0, end = phase_starts(n_leaders, nt1, nk, ntb)
    return 0, b0, b0, c0, end


def phase_of(task: int, bounds: tuple) -> str:
    """The phase of task number ``task`` under ``bounds`` (:func:`phase_bounds`)."""
    a0, q0, b0, c0, _ = bounds
    for name, below in zip(PHASES, (a0, q0, b0, c0)):
        if task < below:
            return name
    return "C"


def summarize(rows: list[list[int]], bounds: tuple) -> dict:
    """The launch's summary from its trace ``rows`` ([sm, claim, ready, take, done] per task, ns; ready 0 where
    the producer waited on nothing), task numbers being row indices below ``bounds``' END."""
    end = bounds[-1]
    rows = rows[:end]
    t0 = min(r[1] for r in rows)
    us = lambda ns: (ns - t0) / 1000.0  # noqa: E731
    phases = {}
    for name in PHASES:
        mine = [r for t, r in enumerate(rows) if phase_of(t, bounds) == name]
        if not mine:
            continue
        waits = [(r[2] - r[1]) / 1000.0 for r in mine if r[2]]
        phases[name] = {
            "tasks": len(mine),
            "first_take_us": round(min(us(r[3]) for r in mine), 2),
            "last_done_us": round(max(us(r[4]) for r in mine), 2),
            "mean_busy_us": round(sum(r[4] - r[3] for r in mine) / len(mine) / 1000.0, 2),
            "mean_producer_wait_us": round(sum(waits) / len(waits), 2) if waits else None,
            "mean_queued_us": round(sum(r[3] - r[1] for r in mine) / len(mine) / 1000.0, 2),
        }
    span = max(us(r[4]) for r in rows)
    sms = {r[0] for r in rows}
    busy = sum(r[4] - r[3] for r in rows) / 1000.0
    return {"span_us": round(span, 2), "sms": len(sms), "busy_fraction": round(busy / (span * len(sms)), 3)} | {
        "phases": phases
    }


def _cell(shape, T: int, fmt: str) -> dict:
    import torch

    from moe_spec.problem import make_inputs
    from moe_spec.validate import validate_moe_args

    from ..decode import compile_decode, launch, launch_grid
    from ..decode_parts import max_tasks
    from ..decode_trace import TRACE_WORDS
    from ..limits import LIMITS
    from ..runtime import ffi_function

    quant = None if fmt == "bf16" else fmt
    kw = make_inputs(shape, T, quant, seed=0, device="cuda").to("cuda").kwargs()
    w_scales = {n: kw[n] for n in ("w1_scale", "w2_scale")}
    scales = w_scales | {"a1_scale": None, "a2_scale": None}
    args = (kw["x"], kw["w1"], kw["w2"], kw["topk_weights"], kw["topk_ids"])
    dims = validate_moe_args(*args, quant=quant, limits=LIMITS, **w_scales)
    kernel = ffi_function(compile_decode("int32", quant, trace=True))
    ids = kw["topk_ids"].to(torch.int32)
    tasks = max_tasks(T, dims.top_k, dims.E, dims.K, dims.I, quant is not None)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        trace = torch.zeros((tasks, TRACE_WORDS), dtype=torch.int64, device="cuda")
        flush.zero_()  # the weights out of L2, as a decode step finds them
        launch(kernel, *args[:4], ids, dims, quant=quant, scales=scales, trace=trace)
        torch.cuda.synchronize()
    rows = trace.cpu().tolist()
    bounds = phase_bounds(ids.flatten().tolist(), dims.E, T, dims.K, dims.I, quant is not None)
    grid = launch_grid(dims, kw["x"].device, quant)
    return summarize(rows, bounds) | {"grid": grid, "bounds": list(bounds), "tasks": rows[: bounds[-1]]}


def _write(out, results: dict) -> None:
    lines = [
        f"# The one-launch decode kernel's measured timeline on {results['device']}",
        "",
        *studyout.header_lines(results),
        f"- one launch: {results.get('variant')}",
        "",
        "The instrumented twin of `cute_moe.decode`'s kernel (`compile_decode(..., trace=True)`), L2 flushed before "
        "the launch. Times in µs from the first claim. busy: the consumers' time on a task (take → end, after its "
        "signal); wait: the producer's claim → operands ready, for tasks that wait on a counter; queued: claim → "
        "take. busy fraction: consumer task time over span × SMs.",
        "",
        "| format | shape | T | span µs | SMs | busy | phase | tasks | first take | last end | mean busy "
        "| mean wait | mean queued |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        head = f"| {r['quant']} | {r['shape']} | {r['T']}"
        if "error" in r:
            lines.append(f"{head} | error: {r['error']} |")
            continue
        for i, (name, p) in enumerate(r["phases"].items()):
            lead = f"{head} | {r['span_us']:.1f} | {r['sms']} | {r['busy_fraction']:.2f}" if i == 0 else "| | | | | |"
            wait = "-" if p["mean_producer_wait_us"] is None else f"{p['mean_producer_wait_us']:.2f}"
            lines.append(
                f"{lead} | {name} | {p['tasks']} | {p['first_take_us']:.2f} | {p['last_done_us']:.2f} "
                f"| {p['mean_busy_us']:.2f} | {wait} | {p['mean_queued_us']:.2f} |"
            )
    if results["cut"]:
        lines += ["", f"Not run (deadline or over the kernel's pairs): {', '.join(results['cut'])}"]
    text = json.dumps(results, default=str) + "\n"
    studyout.write_files(out, dict(zip(FILES, ("\n".join(lines) + "\n", text))))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m cute_moe.lab.trace_decode"
    parser = studyout.gpu_study_parser(prog, __doc__, FILES, 120.0)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="catalog shapes, comma separated")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, comma separated")
    parser.add_argument("--quant", default=",".join(QUANTS), help=f"formats, comma separated, of {FORMATS}")
    add_variant_options(parser)
    a, out, run = studyout.start_gpu_study(prog, parser, argv, FILES)
    try:
        shapes = studyout.split_list("--shapes", a.shapes)
        tokens = studyout.positive_ints("--tokens", a.tokens)
        quants = studyout.split_list("--quant", a.quant)
        bad = [q for q in quants if q not in FORMATS]
        if bad:
            raise studyout.UsageError(f"--quant: {', '.join(bad)} not among {', '.join(FORMATS)}")
        variant = apply_variant(a)
    except studyout.UsageError as exc:
        parser.error(str(exc))
    import torch

    from moe_spec.problem import get_shape

    from ..decode_parts import PAIR_LANES

    results = {**run, "variant": variant, "rows": [], "cut": []}
    _write(out, results)
    took = studyout.run_cells(
        results,
        [{"quant": q, "shape": spec, "T": T} for q in quants for spec in shapes for T in tokens],
        lambda cell: _cell(get_shape(cell["shape"]), cell["T"], cell["quant"]),
        lambda r: _write(out, r),
        deadline_s=a.deadline_s,
        cell_s=CELL_S,
        skip=lambda cell: cell["T"] * get_shape(cell["shape"]).top_k > PAIR_LANES,
        after=lambda i: torch.cuda.empty_cache(),
    )
    print(f"\n{(out / 'trace.md').read_text()}")
    print(f"trace_decode done in {took:.0f} s")


if __name__ == "__main__":
    main()

"""Where a layer's time goes, per kernel: ``python -m compare.studies.profile --out DIR``.

A **cell** is (backend, catalog shape, T, format); by default the speed targets (:data:`TARGETS`),
``--backends/--shapes/--quants/--tokens`` keep some, ``--grid`` runs every combination of those
lists, ``--quick`` the first few. Two phases, so that no CUDA graph is captured after the profiler
first ran (CUPTI and CUDA graphs have a history of crashes when mixed):

1. **time**, per cell: the problem built as the suite builds it (weights drawn on the device, input
   sets for a cold L2), a warm-up, the suite's CUDA-graph clock and its eager fallback
   (:mod:`compare.timed`), then the wall time of ``--calls`` back-to-back eager calls;
2. **profile**, per cell that ran: rebuilt, warmed up, ``torch.profiler`` (CUDA activity only)
   around ``--calls`` eager calls — graph replays are not profiled. :func:`aggregate` (pure, over
   ``(name, device µs)`` records in launch order; :func:`torch_profile` is the adapter) gives per
   kernel its stage (:data:`STAGE_RULES`), launches and µs per layer call (split per launch where a
   name runs twice in a call, e.g. Triton's GEMM1 and GEMM2) and share of the device-busy time.

A failing cell (a format the backend does not build, out of memory, a missing backend) is a row
saying so. ``--time-budget`` stops cleanly (phase 1 leaves :data:`PROFILE_RESERVE_S` per cell to
phase 2; cells not reached say "skipped"). Bad options and an ``--out`` that is not a new or empty
directory are refused before any work; ``profile.json`` and ``profile.md`` (with date, device,
commit, command) are rewritten after every cell, so a crash keeps what was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from compare import timed
from compare.backends import load_backend
from compare.cases import Budget
from compare.status import TARGETS  # the speed targets (one table: the status tables read it too)
from moe_spec import runinfo, studyout
from moe_spec.problem import draw_weights, get_shape, make_inputs
from moe_spec.quant import FORMATS
from moe_spec.studyout import UsageError
from moe_spec.timing import sets_for_cold_l2

PROG = "python -m compare.studies.profile"
FILES = ("profile.json", "profile.md")
BACKENDS = ("cute_moe", "triton_moe")
QUANT_NAMES = {f.label: f.name for f in FORMATS.values()}  # label ("bf16", "fp8_tensor", ...) -> contract value
PROFILE_CALLS = 20  # eager calls timed and profiled per cell
WARMUP_CALLS = 3
QUICK_CELLS = 4
PROFILE_RESERVE_S = 3.0  # of --time-budget, per cell, kept for phase 2 (rebuild, warm-up, profile)
NAME_WIDTH = 60

#: Kernel name -> stage: the first rule with a word in the name's core (:func:`stage_of`, lower
#: case) wins, else "other". The core drops the mangled arguments of a CuTe DSL name and a C++
#: name's templates, so argument text ("…gmemalign16…") never decides. "torch" is torch's own
#: kernels around the backend's (the routing data checks, fills, copies, index ops); memcpy and
#: memset events are their own stages and do not count as kernel launches.
STAGE_RULES = (
    ("torch", ("at::", "at_cuda_detail")),
    ("alignment", ("align", "count", "place", "sort")),
    ("gemm", ("gemm", "wgmma", "matmul")),
    ("quantize", ("quant", "amax", "scalerows")),
    ("combine", ("combine", "reduce", "sum")),
    ("activation", ("silu",)),
    ("gather", ("gather",)),
)
STAGES = tuple(s for s, _ in STAGE_RULES) + ("other", "memcpy", "memset")  # the last two are not kernel launches


def display_name(name: str) -> str:
    """The name without ``void``, CuTe DSL's ``kernel_cutlass_`` prefix and ``_object_at_…`` arguments."""
    s = name.strip().removeprefix("void ").removeprefix("kernel_cutlass_")
    return s.split("_object_at_")[0]


def short(name: str, width: int = NAME_WIDTH) -> str:  # the markdown's kernel column
    s = display_name(name)
    return s if len(s) <= width else s[: width - 1] + "…"


def stage_of(name: str) -> str:
    """ "memcpy"/"memset" (the profiler's names for copies and fills), else the stage of
    :data:`STAGE_RULES` read from the name's core: :func:`display_name` without C++ templates and arguments."""
    low = name.strip().lower()
    if low.startswith(("memcpy", "memset")):
        return low[:6]
    core = display_name(name).split("<")[0].split("(")[0].lower()
    return next((stage for stage, words in STAGE_RULES if any(w in core for w in words)), "other")


def aggregate(records: Iterable[tuple[str, float]], calls: int) -> dict:
    """Device events ``(name, µs)`` of ``calls`` layer calls, in launch order, grouped by name: per
    kernel its stage, launches and µs per layer call, share of the busy time (largest first) and,
    where every call launched the same sequence, ``launch_us``: its µs per launch in call order;
    per layer call the kernel launches, copies, fills, busy µs (all events) and µs per stage."""
    if not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls: expected a positive int, got {calls!r}")
    records = [(name, float(us)) for name, us in records]
    count, total = defaultdict(int), defaultdict(float)
    for name, us in records:
        count[name] += 1
        total[name] += us
    n = len(records) // calls
    seqs = [records[i * n : (i + 1) * n] for i in range(calls)]
    regular = n * calls == len(records) and all([r[0] for r in q] == [r[0] for r in seqs[0]] for q in seqs)
    busy = sum(total.values())
    kernels = [
        {
            "name": k,
            "display": display_name(k),
            "stage": stage_of(k),
            "count": count[k],
            "calls_per_call": count[k] / calls,
            "us_per_call": total[k] / calls,
            "share": total[k] / busy if busy else 0.0,
            "launch_us": [sum(q[j][1] for q in seqs) / calls for j in range(n) if seqs[0][j][0] == k]
            if regular
            else None,
        }
        for k in sorted(total, key=lambda k: (-total[k], k))
    ]
    of = lambda stages, key: sum(k[key] for k in kernels if k["stage"] in stages)  # noqa: E731
    return {
        "calls": calls,
        "launches_per_call": of(STAGES[:-2], "calls_per_call"),
        "memcpy_per_call": of(("memcpy",), "calls_per_call"),
        "memset_per_call": of(("memset",), "calls_per_call"),
        "busy_us": busy / calls,
        "kernels": kernels,
        "stages": {s: of((s,), "us_per_call") for s in STAGES if any(k["stage"] == s for k in kernels)},
    }


def _device_us(event) -> float:
    """``device_time_total`` (torch ≥ 2.4) or ``cuda_time_total``; where 0 (no device set) the time range."""
    value = next((getattr(event, a) for a in ("device_time_total", "cuda_time_total") if hasattr(type(event), a)), 0)
    return float(value or event.time_range.elapsed_us())


def device_records(events) -> list[tuple[str, float]]:
    """``(name, µs)`` of the CUDA device events (kernels, copies, fills) of ``prof.events()``."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, _device_us(e)) for e in sorted(events, key=lambda e: e.time_range.start) if e.device_type == cuda]


def torch_profile(run: Callable[[], None]) -> list[tuple[str, float]]:
    """Run ``run`` (which synchronizes at its end) under ``torch.profiler`` with the CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    return device_records(prof.events())


@dataclass(frozen=True)
class Cell:
    backend: str
    shape: str  # catalog label, e.g. "deepseek-v3:tp8"
    T: int
    quant: str  # format label: "bf16", "fp8_tensor", ...
    target_us: float | None = None

    @property
    def title(self) -> str:
        return f"{self.backend} {self.shape} {self.quant} T={self.T}"

    def record(self) -> dict:
        return {"cell": self.title, **asdict(self), "status": "not run"}


TARGET_CELLS = tuple(
    Cell(backend, shape, T, quant, float(us))
    for (quant, backend, shape), by_T in TARGETS.items()
    for T, us in by_T.items()
)


def parse_names(option: str, text: str, known) -> tuple:
    names = list(known) if text.strip().lower() == "all" else [n.lower() for n in studyout.split_list(option, text)]
    for n in names:
        if n not in known:
            raise UsageError(f"{option}: unknown name {n!r}; known: {', '.join(known)} (or 'all')")
    return tuple(dict.fromkeys(names))


def select_cells(backends=None, shapes=None, quants=None, tokens=None, *, grid=False, quick=False) -> list[Cell]:
    """The target cells matching every list given (None: any); with ``grid`` every combination (tokens
    required; backends, shapes, quants default to both, the targets' and bf16)."""
    targets = TARGET_CELLS
    if grid:
        if not tokens:
            raise UsageError("--grid: needs --tokens (the token counts of the combinations)")
        known = {(c.backend, c.shape, c.T, c.quant): c for c in targets}
        lists = (
            backends or BACKENDS,
            shapes or tuple(dict.fromkeys(c.shape for c in targets)),
            tokens,
            quants or ("bf16",),
        )
        cells = [known.get(key, Cell(*key)) for key in itertools.product(*lists)]
    else:
        keep = lambda value, allowed: allowed is None or value in allowed  # noqa: E731
        cells = [
            c
            for c in targets
            if keep(c.backend, backends) and keep(c.shape, shapes) and keep(c.T, tokens) and keep(c.quant, quants)
        ]
        if not cells:
            raise UsageError(
                "no target cell matches --backends/--shapes/--quants/--tokens (--grid runs any combination of them)"
            )
    return cells[:QUICK_CELLS] if quick else cells


@dataclass
class Env:
    """What a run measures with (a CPU test passes stand-ins): clock, profiler, device, shape and backend lookup."""

    clock: timed.Clock = field(default_factory=lambda: timed.GPU_CLOCK)
    profile: Callable = torch_profile
    device: str = "cuda"
    shape_of: Callable = get_shape
    load: Callable = load_backend


def status_of(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    kind = (
        "not implemented"
        if isinstance(exc, NotImplementedError)
        else "out of memory"
        if isinstance(exc, torch.OutOfMemoryError)
        else "error"
    )
    return f"{kind}: {type(exc).__name__}: {first}"


def build_sets(cell: Cell, env: Env, seed: int) -> list:
    """The cell's problem as the suite builds it, plus copies: enough sets for a cold L2."""
    shape = env.shape_of(cell.shape)
    inputs = make_inputs(
        shape,
        cell.T,
        QUANT_NAMES[cell.quant],
        seed=seed,
        device=env.device,
        weights_bf16=draw_weights(shape, seed, env.device),
    )
    n = sets_for_cold_l2(sum(t.numel() * t.element_size() for t in (inputs.w1, inputs.w2)))
    return [inputs] + [timed.clone_inputs(inputs) for _ in range(n - 1)]


def _on_cell(cell: Cell, env: Env, seed: int, key: str, measure: Callable) -> dict:
    """Build the cell's sets, warm up, then ``measure(backend, sets, run)`` (``run(n)``: n eager calls
    rotating the sets, then a synchronize). Any failure becomes ``{key: status}``."""
    backend = env.load(cell.backend)
    if backend.missing:
        return {key: f"not available: {backend.missing}"}
    try:
        sets = build_sets(cell, env, seed)

        def run(n: int) -> None:
            for i in range(n):
                backend.fused_moe(**sets[i % len(sets)].kwargs())
            env.clock.sync()

        run(WARMUP_CALLS)
        return {key: "ok", **measure(backend, sets, run)}
    except Exception as exc:  # noqa: BLE001 - a failed cell is a row; the run goes on
        with contextlib.suppress(Exception):  # a sticky device error raises here again: it is in the row already
            env.clock.sync()
        return {key: status_of(exc)}


def time_cell(cell: Cell, env: Env, calls: int, seed: int) -> dict:
    """Phase 1 of one cell: status, graph µs (median, p10, p90, how it was timed), eager µs, met."""

    def measure(backend, sets, run):
        make_call = lambda i: lambda: backend.fused_moe(**sets[i].kwargs())  # noqa: E731
        t, note = timed.time_calls(env.clock, make_call, len(sets), backend.capturable, False)
        env.clock.sync()
        start = time.perf_counter()
        run(calls)
        met = None if cell.target_us is None else t.median_us <= cell.target_us
        return {
            "graph_us": t.median_us,
            "graph_p10_us": t.p10_us,
            "graph_p90_us": t.p90_us,
            "timing": note,
            "input_sets": len(sets),
            "eager_us": (time.perf_counter() - start) / calls * 1e6,
            "met": met,
        }

    return _on_cell(cell, env, seed, "status", measure)


def profile_cell(cell: Cell, env: Env, calls: int, seed: int) -> dict:
    """Phase 2 of one cell: the aggregated device events of ``calls`` eager calls."""

    def measure(backend, sets, run):
        return {"profile": aggregate(env.profile(lambda: run(calls)), calls)}

    row = _on_cell(cell, env, seed, "profile_status", measure)
    if row.get("profile") is not None and not row["profile"]["kernels"]:
        row["profile_status"] = "no device events recorded (is CUPTI available here?)"
    return row


def run_profile(
    cells: list,
    *,
    env: Env | None = None,
    calls: int = PROFILE_CALLS,
    time_budget_s: float | None = None,
    seed: int = 0,
    command: str = "run_profile(...)",
    commit: str | None = None,
    write: Callable = lambda result: None,
    say: Callable = lambda text: None,
) -> dict:
    """Both phases over ``cells``; ``write(result)`` after every cell. Returns {"meta", "cells"}."""
    env = env or Env()
    budget = Budget(time_budget_s)
    reserve = PROFILE_RESERVE_S * len(cells) if time_budget_s is not None else 0.0
    meta = runinfo.run_info(command, cuda=env.device == "cuda", commit=commit, device=env.clock.device())
    meta.update(
        calls=calls,
        warmup_calls=WARMUP_CALLS,
        seed=seed,
        time_budget_s=time_budget_s,
        stage_rules={s: list(words) for s, words in STAGE_RULES},
    )
    result = {"meta": meta, "cells": [c.record() for c in cells]}
    for phase, step in (("time", time_cell), ("profile", profile_cell)):
        if phase == "profile" and any(r["status"] == "ok" for r in result["cells"]):
            with contextlib.suppress(Exception):  # the first session starts CUPTI (a second or so): outside any cell
                env.profile(env.clock.sync)
        for i, (cell, row) in enumerate(zip(cells, result["cells"])):
            if phase == "profile" and row["status"] != "ok":
                row["profile_status"] = "not profiled: the cell did not run"
            elif phase == "time" and budget.left() <= reserve:
                row["status"] = f"skipped: {budget.text}: the rest was kept to profile the cells timed"
            elif budget.spent():
                row["profile_status"] = f"skipped: {budget.text} spent"
            else:
                say(f"[{i + 1}/{len(cells)}] {phase} {cell.title}")
                row.update(step(cell, env, calls, seed))
                if env.device == "cuda":
                    torch.cuda.empty_cache()  # the cell's sets are freed: the next cell starts with an empty pool
                write(result)
    write(result)
    return result


MET = {True: "yes", False: "**no**", None: "—"}  # graph µs ≤ target µs; "—": not timed or no target


def _us(v, fmt="{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def summary_table(result: dict) -> list[str]:
    stages = [s for s in STAGES if any(s in (r.get("profile") or {}).get("stages", {}) for r in result["cells"])]
    lines = [
        "| cell | target µs | graph µs | met | eager µs | launches/call | busy µs | "
        + "".join(f"{s} µs | " for s in stages)
        + "status |",
        "|---" * (8 + len(stages)) + "|",
    ]
    for r in result["cells"]:
        p = r.get("profile") or {}
        status = (
            r["status"]
            if r["status"] != "ok"
            else r.get("profile_status", "ok")
            + ("" if r.get("timing", "graph") == "graph" else f"; graph µs timed {r['timing']}")
        )
        lines.append(
            f"| {r['cell']} | {_us(r['target_us'])} | {_us(r.get('graph_us'))} | {MET[r.get('met')]} "
            f"| {_us(r.get('eager_us'))} | {_us(p.get('launches_per_call'), '{:.3g}')} | {_us(p.get('busy_us'))} | "
            + "".join(f"{_us(p['stages'].get(s)) if p else '—'} | " for s in stages)
            + f"{status.replace('|', '/')} |"
        )
    return lines


def _launch_split(kernel: dict) -> str:
    """`` (a + b)``: the µs of each launch of a kernel launched more than once per call; else empty."""
    launches = kernel.get("launch_us") or ()
    return " (" + " + ".join(f"{us:.1f}" for us in launches) + ")" if len(launches) > 1 else ""


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        "# Where the layer's time goes, per kernel",
        "",
        f"- date: {m['date']}",
        f"- device: {m['device']}",
        f"- commit: `{m['commit']}`",
        f"- command: `{m['command']}`",
        f"- graph µs: the suite's CUDA-graph clock (median, rotated input sets, cold L2); eager µs: wall time of "
        f"{m['calls']} back-to-back calls / {m['calls']}; kernels: torch.profiler (CUDA activity) over "
        f"{m['calls']} eager calls after {m['warmup_calls']} warm-up calls, per layer call; busy µs: the sum of "
        f"all device events per call",
        "- stages: the first of "
        + "; ".join(f"{s} ({', '.join(w)})" for s, w in m["stage_rules"].items())
        + " found in the kernel name, else other",
        "",
    ]
    lines += summary_table(result)
    for r in result["cells"]:
        p = r.get("profile")
        if not p:
            continue
        target = f"target {_us(r['target_us'])} µs, met: {MET[r.get('met')]}; " if r["target_us"] is not None else ""
        lines += [
            "",
            f"## {r['cell']}: graph {_us(r.get('graph_us'))} µs ({target}busy {_us(p['busy_us'])} µs, "
            f"{_us(p['launches_per_call'], '{:.3g}')} launches/call)",
            "",
            "| kernel | stage | calls/call | µs/call | share |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| `{short(k['name']).replace('|', '/')}` | {k['stage']} | {_us(k['calls_per_call'], '{:.3g}')} "
            f"| {_us(k['us_per_call'])}{_launch_split(k)} | {k['share'] * 100:.0f} % |"
            for k in p["kernels"]
        ]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out: Path) -> None:
    """profile.json and profile.md, each written whole (rewritten after every cell)."""
    studyout.write_files(out, dict(zip(FILES, (json.dumps(result, indent=1) + "\n", to_markdown(result)))))


def build_parser() -> argparse.ArgumentParser:
    p = studyout.Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Cells: the speed targets (--list prints them), or with --grid any combination.",
    )
    p.add_argument("--out", help="a new or empty directory for profile.json and profile.md (required to run)")
    p.add_argument("--backends", help=f"keep cells of these backends: {', '.join(BACKENDS)} or 'all'")
    p.add_argument("--shapes", help="keep cells of these catalog shapes, e.g. qwen3-30b-a3b,deepseek-v3:tp8")
    p.add_argument("--quants", help=f"keep cells of these formats: {', '.join(QUANT_NAMES)} or 'all'")
    p.add_argument("--tokens", help="keep cells of these token counts T, e.g. 1,4096")
    p.add_argument(
        "--grid",
        action="store_true",
        help="every combination of the lists instead of the target cells (--tokens required; quants default bf16)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--cells-all", dest="quick", action="store_false", default=False, help="all selected cells")
    which.add_argument("--quick", action="store_true", help=f"only the first {QUICK_CELLS} selected cells")
    p.add_argument(
        "--calls", type=int, default=PROFILE_CALLS, help="eager calls timed and profiled per cell [%(default)s]"
    )
    p.add_argument(
        "--time-budget",
        default="450",
        metavar="S",
        help="stop after S seconds; cells not reached are 'skipped' rows [%(default)s]",
    )
    p.add_argument("--commit", default=None, help="commit to record [git rev-parse of this checkout]")
    p.add_argument("--list", action="store_true", help="print the selected cells and exit (no GPU needed)")
    return p


def parse_args(argv: list) -> argparse.Namespace:
    """Every option checked (UsageError naming it otherwise) and the cells selected; nothing run."""
    args = build_parser().parse_args(argv)
    lists = dict(
        backends=parse_names("--backends", args.backends, BACKENDS) if args.backends else None,
        shapes=studyout.shape_labels("--shapes", args.shapes) if args.shapes else None,
        quants=parse_names("--quants", args.quants, QUANT_NAMES) if args.quants else None,
        tokens=studyout.positive_ints("--tokens", args.tokens) if args.tokens else None,
    )
    if args.calls < 1:
        raise UsageError(f"--calls: expected a positive integer, got {args.calls}")
    args.time_budget = studyout.number(
        "--time-budget", args.time_budget, lowest=0.0, allow_lowest=False, what="a finite number of seconds > 0"
    )
    args.cells = select_cells(**lists, grid=args.grid, quick=args.quick)
    if not args.list:
        args.out = studyout.check_out(args.out, FILES)
    return args


def _run(args: argparse.Namespace, argv: list) -> int:
    if args.list:
        print(
            "\n".join(c.title + (f"  target {c.target_us:g} µs" if c.target_us else "  no target") for c in args.cells)
        )
        return 0
    runinfo.require_cuda(PROG)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before any backend imports cutlass, as the suite does
    result = run_profile(
        args.cells,
        calls=args.calls,
        time_budget_s=args.time_budget,
        command=runinfo.command_line(PROG, argv),
        commit=args.commit,
        write=lambda r: write_outputs(r, args.out),
        say=studyout.progress(PROG),
    )
    print("\n".join(summary_table(result)))
    print(f"wrote {args.out / 'profile.md'} and {args.out / 'profile.json'}")
    return 0


def main(argv=None) -> int:
    return studyout.run_command(PROG, argv, parse_args, _run, interrupted="the cells finished so far are in {out}")


if __name__ == "__main__":
    sys.exit(main())

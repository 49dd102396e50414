"""The main job: every (shape, quant, T) case, every backend — numerics first, then time.

:func:`run_suite` walks the cases of a :class:`~compare.cases.SuiteSpec` in the order given (shapes,
then formats, then token counts). For one case it

1. builds the problem and its fp64 oracle(s) (:class:`compare.cases.Case`);
2. asks each backend whether it implements the format and can run here, then measures it against
   the oracle, reruns it (determinism) and reruns a few tokens alone (batch invariance)
   (:mod:`compare.numerics`); compares the two kernels with each other; attributes the error to
   experts. A kernel from outside this project (yours, a peer's: :mod:`compare.userkernel`) is also
   checked for writes into its inputs and compared with our kernels' output;
3. with a clock (a GPU), times each backend that ran, places it on this run's roofline and quotes
   its speedup (:mod:`compare.timed`).

After the first shape's cases come the JIT study — the fresh-cache warm-up study of
:mod:`compare.warm_study` on that shape, each backend and format in a new process with empty Triton
and CuTe caches: its ``warmup`` call, then a sweep of T up to 16384 that must compile nothing — and
the CuTe PTX listing (:mod:`compare.compilation`) and the ``do_not_specialize`` demo
(:mod:`compare.jitdemo`).

``spec.time_budget_s`` bounds the whole run: the case running when it is spent is stopped and says
so in its rows, every later case becomes an explicit "skipped" row, and the report is written.

Everything lands in one plain dict, which :mod:`compare.report` renders and :mod:`compare.router`
turns into a routing table.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compare import userkernel
from compare.backends import KERNELS
from compare.cases import (
    DEFAULT_TOKENS_GPU,
    REDUCED_LABEL,
    Budget,
    Case,
    OutOfTime,
    SuiteSpec,
    draw_weights,
    reduce_shape,
)
from compare.compilation import cute_ptx_summary
from compare.metrics import quant_name
from compare.numerics import case_record, cross_check, describe, measure, unavailable
from compare.timed import GPU_CLOCK, Clock, compile_fullgraph, time_case
from moe_spec.problem import get_shape
from moe_spec.runinfo import run_info
from moe_spec.timing import Ceilings


def _meta(spec: SuiteSpec, clock: Clock | None) -> dict:
    info = run_info(
        spec.command, cuda=spec.device == "cuda", commit=spec.commit or None, device=clock.device() if clock else None
    )
    return {
        **info,
        "mode": REDUCED_LABEL if spec.reduced else "gpu",
        "timed": clock is not None,
        "shapes": list(spec.shapes),
        "tokens": list(spec.tokens),
        "quants": [quant_name(q) for q in spec.quants],
        "backends": list(spec.backends),
        "seed": spec.seed,
        "quick": spec.quick,
        "outlier_expert": spec.outlier_expert,
        "time_budget_s": spec.time_budget_s,
    }


class _Steps:
    """Progress without a terminal (a log file, a pipe, CI): one line per step on ``stream``, never a
    bar redrawn with carriage returns; with ``stream`` None, nothing."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream

    def update(self, n: int = 1) -> None:
        self.done += n

    def set_description_str(self, s: str) -> None:
        if self.stream is not None:
            print(f"[{self.done}/{self.total} done] {s}", file=self.stream, flush=True)

    def close(self) -> None: ...


def _progress(total: int, enabled: bool, stream=None):
    """A tqdm bar on a terminal's stderr; one line per step when stderr is not a terminal; nothing when
    not ``enabled``."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        return _Steps(total)
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return _Steps(total, stream)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a declared dependency; degrade to lines rather than fail
        return _Steps(total, stream)
    return tqdm(total=total, file=stream, unit="run", dynamic_ncols=True, leave=False)


@dataclass
class _Runner:
    """What every case of one run shares."""

    spec: SuiteSpec
    backends: dict
    budget: Budget
    clock: Clock | None
    ceilings: Ceilings | None
    say: Callable[[str], None]

    def skipped(self, case: Case, status: str) -> list[dict]:
        """One explicit row per backend for a case that did not run."""
        return [case.row(name, config="", status=status, timing=status) for name in self.backends]

    def stopped(self, case: Case, rows: dict, current: str | None) -> list[dict]:
        """The rows of a case the budget stopped: finished backends keep their numerics."""
        spent = f"{self.budget.text} spent"
        where = f"during {current}'s numerics" if current else "while building the problem and its oracle"
        out = []
        for name in self.backends:
            row = rows.get(name) or case.row(name, config="")
            row.pop("expert_errors", None)
            if name not in rows:
                row["status"] = f"stopped: {spent} {where}" if name == current or not current else f"skipped: {spent}"
            row["timing"] = f"skipped: {spent}"
            out.append(row)
        return out

    def run(self, case: Case, weights) -> tuple[list[dict], dict | None]:
        """(rows, case record) of one case; the record is None when the case did not finish."""
        spec, rows, outputs, current = self.spec, {}, {}, None
        try:
            with self.budget.armed():
                try:
                    case.build(weights, spec.seed, spec.device)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory: reported, the run goes on
                    if spec.device == "cuda":
                        torch.cuda.empty_cache()
                    return self.skipped(
                        case,
                        f"error: building the problem or its oracle failed: {type(exc).__name__}: {exc}".splitlines()[
                            0
                        ],
                    ), None
                for name, backend in self.backends.items():
                    current = name
                    self.say(f"{case.title} {name}")
                    row = case.row(name, config=describe(backend, case.dims, case.quant))
                    declined = unavailable(backend, case.inputs, spec.device)
                    if declined:
                        row["status"] = declined
                    else:
                        external = userkernel.is_external(backend)  # checked for writes into its inputs
                        fields, out = (userkernel.measure if external else measure)(backend, case)
                        row.update(fields)
                        if out is not None and (name in KERNELS or external):
                            outputs[name] = out
                    rows[name] = row
                current = None
                cross_check(rows, outputs, case.quant)
                userkernel.compare_with_ours(rows, outputs, case.quant, self.backends)
                record = case_record(case, rows)
        except OutOfTime:
            return self.stopped(case, rows, current), None
        if self.clock is not None:
            time_case(self.clock, case, rows, self.backends, self.ceilings, spec.quick, self.budget, self.say)
        else:
            for row in rows.values():
                row["timing"] = "skipped: no GPU"
        return list(rows.values()), record

    def guarded(self, what: str, work: Callable[[], dict], **fields) -> dict:
        """``work()`` under the budget; a stopped or skipped entry instead when the budget is spent."""
        if self.budget.spent():
            return {**fields, "status": f"skipped: {self.budget.text} spent"}
        self.say(what)
        try:
            with self.budget.armed():
                return work()
        except OutOfTime:
            return {**fields, "status": f"stopped: {self.budget.text} spent during it"}


#: The JIT study's sweep: (max T, spacing of the odd values) — on a GPU the warm study's own 247 values
#: up to 16384 (72 with --quick); on the CPU (reduced shapes, Triton dry run) up to 512.
JIT_SWEEP = {
    ("cuda", False): (16384, 1.03),
    ("cuda", True): (16384, 1.25),
    ("cpu", False): (512, 1.25),
    ("cpu", True): (512, 1.25),
}


def _jit(spec: SuiteSpec, shape, kernels: list, runner: _Runner) -> list:
    """One warm-study case per (kernel, format) on ``shape``, each in a fresh process with empty
    caches; the entries keep the summary and the warm-up's steps, not the per-T rows."""
    from compare.warm_study import run_warm_study, sweep_tokens

    if not kernels:
        return []
    tokens = sweep_tokens(*JIT_SWEEP[(spec.device, spec.quick)])

    def study():
        return run_warm_study(
            [shape],
            list(spec.quants),
            kernels,
            tokens=tokens,
            device=spec.device,
            command=spec.command,
            commit=spec.commit or None,
        )

    done = runner.guarded("JIT: warm-up study (fresh caches)", study)
    if "cases" not in done:  # stopped or skipped by the time budget
        return [
            {"backend": k, "shape": shape.label, "quant": quant_name(q), "status": done["status"]}
            for k in kernels
            for q in spec.quants
        ]
    return [
        {**{k: v for k, v in c.items() if k != "per_T"}, "sweep_T": [tokens[0], tokens[-1], len(tokens)]}
        for c in done["cases"]
    ]


def run_suite(spec: SuiteSpec, progress: bool = True, clock: Clock | None = None) -> dict:
    """Run every case of ``spec``; return the results dict (meta, ceilings, rows, cases, jit, ptx).

    ``clock`` measures time (default: :data:`compare.timed.GPU_CLOCK` on "cuda", none on the CPU,
    where nothing is timed); its compiled columns only where ``spec.hf_compiled`` asks for them (a
    compilation per case and hf backend), with :func:`compare.timed.compile_fullgraph` unless the
    clock brings its own compile.
    """
    if clock is None and spec.device == "cuda":
        clock = GPU_CLOCK
    if clock is not None:
        clock = dataclasses.replace(clock, compile=(clock.compile or compile_fullgraph) if spec.hf_compiled else None)
    budget = Budget(spec.time_budget_s)
    result: dict = {
        "meta": _meta(spec, clock),
        "ceilings": None,
        "rows": [],
        "cases": [],
        "jit": [],
        "jit_demo": None,
        "cute_ptx": None,
    }
    ceilings = clock.ceilings() if clock else None
    result["ceilings"] = ceilings.as_dict() if ceilings else None
    backends = {name: userkernel.load(name) for name in spec.backends}
    bar = _progress(len(spec.shapes) * len(spec.tokens) * len(spec.quants) * len(backends), progress)
    runner = _Runner(spec, backends, budget, clock, ceilings, bar.set_description_str)
    try:
        for position, shape_spec in enumerate(spec.shapes):
            full = get_shape(shape_spec)
            shape = reduce_shape(full) if spec.reduced else full
            weights = None
            for quant in spec.quants:
                for T in spec.tokens:
                    case = Case(full, shape, quant, T, spec.reduced)
                    if budget.spent():
                        rows, record = runner.skipped(case, f"skipped: {budget.text} spent"), None
                    else:
                        if weights is None:
                            weights = draw_weights(shape, spec.seed + position, spec.device, spec.outlier_expert)
                        rows, record = runner.run(case, weights)
                    case.release()
                    result["rows"] += rows
                    if record:
                        result["cases"].append(record)
                    bar.update(len(backends))
            if spec.jit and position == 0:  # the JIT study on the first shape
                result["jit"] = _jit(spec, shape, [k for k in KERNELS if k in backends], runner)
            weights = None  # this shape's weights: freed before the next shape's are drawn
            if spec.device == "cuda":
                torch.cuda.empty_cache()
    finally:
        bar.close()
    if spec.jit:
        from compare.jitdemo import run_demo  # imports triton: only once the CLI has chosen the interpreter or not

        result["jit_demo"] = runner.guarded("JIT demo", run_demo)
    if spec.reduced and spec.ptx and "cute_moe" in spec.backends:
        result["cute_ptx"] = runner.guarded(
            "CuTe PTX", lambda: cute_ptx_summary(spec.shapes, DEFAULT_TOKENS_GPU, spec.quants)
        )
    return result

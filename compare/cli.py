"""``python -m compare``: prove the CuTe and Triton kernels compute the same function, then time them.

On a GPU it runs the suite (default: Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 TP8 at
T ∈ {1, 8, 32, 128, 1024, 4096}, bf16 and fp8_tensor) for every backend, prints what the run did
and a summary per shape and format (best backend, µs, speedup, % of floor, status; 120 columns at
most), and writes the full tables into ``results.json``, ``results.csv``, ``report.md``, with PNG
plots, into ``--out``. Without a GPU it still exits 0: numerics through the Triton interpreter on reduced
shapes, the CuTe configs it would run with their PTX WGMMA lines, no timing — and its first lines
say so.

Examples::

    python -m compare                                   # the full suite (GPU) / the CPU report
    python -m compare --quick --tokens 8,1024           # a fast GPU smoke run
    python -m compare --shapes mixtral-8x7b --quant bf16,fp8_channel --backends triton_moe,torch_loop
    python -m compare --out out/ --write-router compare/data/router_h200.json
    python -m compare --merge a/results.json b/results.json --out merged/
    python -m compare --backends cute_moe,triton_moe,path/to/your_kernel.py:fused_moe --strict   # yours beside ours

Lists are normalized: names are case-insensitive, a shape with ``:tp1`` is the shape itself, token
counts are read as integers (``08`` is 8), and repeats are dropped, first one kept. Bad input (an
unknown name, a bad number, an output path that cannot be written, a file that is not a results
record) is one line on stderr and exit status 2, before any work. Ctrl-C is one line and exit
status 130; the output directory is then left as it was (:mod:`compare.outputs`).
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap

from compare import report, results, userkernel
from compare.backends import BACKEND_NAMES, HF_BACKENDS
from compare.cases import (
    CPU_MAX_TOKENS,
    DEFAULT_BACKENDS,
    DEFAULT_SHAPES,
    DEFAULT_TOKENS_CPU,
    DEFAULT_TOKENS_GPU,
    SuiteSpec,
)
from compare.outputs import OutputError, Outputs
from compare.peers import PEERS
from compare.report import OUTPUT_FILES
from compare.results import ResultsError
from compare.suite import run_suite
from compare.tables import banner, wrap
from moe_spec.problem import CATALOG
from moe_spec.quant import QUANT_FORMATS
from moe_spec.runinfo import command_line
from moe_spec.studyout import Parser, UsageError, number, positive_ints, run_command, shape_labels, split_list

PROG = "python -m compare"
QUANT_CHOICES = ("bf16",) + tuple(q for q in QUANT_FORMATS if q is not None)
SEED_LIMIT = 2**32
HELP_WIDTH = 100  # the epilog is printed as written (RawDescriptionHelpFormatter), so it is wrapped here


def parse_quants(text: str) -> tuple:
    names = list(QUANT_CHOICES) if text.strip().lower() == "all" else [q.lower() for q in split_list("--quant", text)]
    for q in names:
        if q not in QUANT_CHOICES:
            raise UsageError(f"--quant: unknown quant format {q!r}; known: {', '.join(QUANT_CHOICES)} (or 'all')")
    return tuple(None if q == "bf16" else q for q in dict.fromkeys(names))


def parse_backends(text: str) -> tuple:
    """Backend and peer names (case-insensitive), and kernel specs (``target:function[@sig]``, kept as
    typed and checked for their form here; imported by :func:`compare.userkernel.check_all` in ``_run``)."""
    if text.strip().lower() == "all":
        return BACKEND_NAMES
    names = []
    for b in split_list("--backends", text):
        if userkernel.known_name(b):
            names.append(b.lower())
        elif userkernel.looks_like_kernel(b):
            try:
                names.append(userkernel.parse_spec(b).text)
            except userkernel.SpecError as exc:
                raise UsageError(str(exc)) from None
        else:
            raise UsageError(
                f"--backends: unknown backend {b.lower()!r}; known: {', '.join(BACKEND_NAMES)}, the peers "
                f"{', '.join(PEERS)} (or 'all'), or a kernel of yours as module.path:function or "
                "path/to/file.py:function"
            )
    return tuple(dict.fromkeys(names))


def parse_seed(text: str) -> int:
    s = text.strip()
    if not s.isdigit() or int(s) >= SEED_LIMIT:
        raise UsageError(f"--seed: expected an integer in [0, 2**32), got {text!r}")
    return int(s)


def build_parser() -> argparse.ArgumentParser:
    epilog = (
        "Shapes: " + ", ".join(CATALOG) + " (append :tpN for a tensor-parallel shard). Numerics tolerance "
        "policy: notes/numerics.md."
    )
    p = Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(textwrap.wrap(epilog, HELP_WIDTH)),
    )
    p.add_argument(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help="comma list of catalog shapes, case-insensitive; repeats dropped [%(default)s]",
    )
    p.add_argument(
        "--tokens",
        default=None,
        help=f"comma list of token counts T, repeats dropped [GPU: {','.join(map(str, DEFAULT_TOKENS_GPU))};"
        f" CPU: {','.join(map(str, DEFAULT_TOKENS_CPU))}; the CPU path takes T ≤ {CPU_MAX_TOKENS}]",
    )
    p.add_argument(
        "--quant",
        default="bf16,fp8_tensor",
        help=f"comma list of formats from {', '.join(QUANT_CHOICES)}, or 'all' [%(default)s]",
    )
    p.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"comma list from {', '.join(BACKEND_NAMES)}, or 'all' (the {', '.join(HF_BACKENDS)} rows "
        f"run transformers' experts module and need transformers); the peers {', '.join(PEERS)} "
        "(a row 'not installed' where they are not); your own kernel as module.path:function or "
        "path/to/file.py:function, with the contract's signature or vLLM's fused_experts one "
        "(read from its parameters; force with @ours / @vllm; notes/check_your_kernel.md) "
        "[%(default)s]",
    )
    p.add_argument(
        "--out",
        default="compare-out",
        help="output directory; its earlier report files are replaced, others kept [%(default)s]",
    )
    p.add_argument(
        "--quick", action="store_true", help="fast GPU smoke run: fewer timing replays, 2 input sets, a short JIT sweep"
    )
    p.add_argument("--cpu", action="store_true", help="the CPU path (interpreter, reduced shapes) even with a GPU")
    p.add_argument("--seed", default="0", help="seed of the random problems, in [0, 2**32) [%(default)s]")
    p.add_argument("--no-jit", dest="jit", action="store_false", help="skip the JIT study and demo")
    p.add_argument(
        "--hf-compiled",
        action="store_true",
        help="the hf backends also with their experts module under torch.compile(fullgraph=True): "
        "compiled µs beside eager µs (one compilation per case and backend)",
    )
    p.add_argument("--no-ptx", dest="ptx", action="store_false", help="CPU: skip compiling the CuTe configs")
    p.add_argument(
        "--outlier-expert",
        default="0",
        metavar="F",
        help="scale expert 0's W1 by F > 0: shows how one expert's range collapses the others under a "
        "shared per-tensor FP8 scale (see the per-expert table) [0: off]",
    )
    p.add_argument(
        "--time-budget",
        default=None,
        metavar="S",
        help="stop after S > 0 seconds: the case running then is stopped and says so, the rest become "
        "explicit 'skipped' rows, the report is written (and --strict fails)",
    )
    p.add_argument("--commit", default="", help="commit to record in the report [git rev-parse of this checkout]")
    p.add_argument("--write-router", metavar="PATH", help="write the routing table measured by this run to PATH")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="do not run: merge these results.json files and render them into --out",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a row fails its tolerance, the kernels disagree, a rerun differs, a T sweep "
        "recompiles, or the time budget stopped the run",
    )
    p.add_argument(
        "--no-plots",
        dest="plots",
        action="store_false",
        help="no PNG files (for a report committed to git, which keeps no binaries)",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress report (a bar on a terminal, else a line per step on stderr)",
    )
    return p


def _parse(argv: list) -> argparse.Namespace:
    """Every option checked and normalized (UsageError otherwise); nothing imported or run yet."""
    args = build_parser().parse_args(argv)
    args.shapes = shape_labels("--shapes", args.shapes)
    args.quant = parse_quants(args.quant)
    args.backends = parse_backends(args.backends)
    args.tokens = positive_ints("--tokens", args.tokens) if args.tokens is not None else None
    args.seed = parse_seed(args.seed)
    args.outlier_expert = number(
        "--outlier-expert",
        args.outlier_expert,
        lowest=0.0,
        allow_lowest=True,
        what="a finite factor > 0 (or 0: no outlier)",
    )
    if args.hf_compiled and not set(args.backends) & set(HF_BACKENDS):
        raise UsageError(
            f"--hf-compiled: compiles the hf backends' experts module, and --backends has none of "
            f"{', '.join(HF_BACKENDS)}"
        )
    if args.time_budget is not None:
        args.time_budget = number(
            "--time-budget",
            args.time_budget,
            lowest=0.0,
            allow_lowest=False,
            what="a finite number of seconds > 0 (leave it out for no budget)",
        )
    return args


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _router_table(result: dict, path: str) -> tuple:
    """(JSON text or None, the line to print)."""
    from compare.router import build_table

    table = build_table(result["rows"], result["meta"])
    if not table["entries"]:
        return None, f"router table NOT written to {path}: no timed, correct rows in this run (timing needs a GPU)"
    return json.dumps(table, indent=1) + "\n", f"router table ({len(table['entries'])} cases) written to {path}"


def _run(args, argv: list) -> int:
    """The run or the merge, staged beside ``--out`` and moved into place; a run stopped early leaves no
    staging directory behind."""
    try:
        return _run_staged(args, argv, args.outputs)
    finally:
        args.outputs.discard()


def _run_staged(args, argv: list, outputs: Outputs) -> int:
    if args.merge:
        result = results.merge([results.load(path) for path in args.merge])
        outputs.stage()
    else:
        on_gpu = _has_cuda() and not args.cpu
        too_many = [T for T in args.tokens or () if T > CPU_MAX_TOKENS]
        if not on_gpu and too_many:
            raise UsageError(
                f"--tokens: {too_many[0]} is more than the CPU path can finish: without a GPU a case "
                f"takes at most T = {CPU_MAX_TOKENS} (the Triton interpreter on reduced shapes)"
            )
        if args.hf_compiled and not on_gpu:
            raise UsageError("--hf-compiled: the compiled columns are timings, and the CPU path times nothing")
        if not on_gpu:  # before any backend imports triton: Triton runs through its interpreter
            os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before any backend imports cutlass
        try:  # your kernels imported and checked before any work
            userkernel.check_all(args.backends)
        except userkernel.SpecError as exc:
            raise UsageError(str(exc)) from None
        outputs.stage()
        tokens = args.tokens or (DEFAULT_TOKENS_GPU if on_gpu else DEFAULT_TOKENS_CPU)
        spec = SuiteSpec(
            shapes=args.shapes,
            tokens=tokens,
            quants=args.quant,
            backends=args.backends,
            device="cuda" if on_gpu else "cpu",
            seed=args.seed,
            quick=args.quick,
            jit=args.jit,
            ptx=args.ptx,
            outlier_expert=args.outlier_expert,
            time_budget_s=args.time_budget,
            hf_compiled=args.hf_compiled,
            commit=args.commit,
            command=command_line(PROG, argv),
        )
        result = run_suite(spec, progress=args.progress)

    written = report.write_all(result, outputs.staging, with_plots=args.plots)
    router_json, router_line = _router_table(result, args.write_router) if args.write_router else (None, None)
    outputs.commit(router_json)
    report_md = outputs.out / "report.md"
    say = [part for line in banner(result, str(report_md)) for part in wrap(line)] + [""]
    say += [report.compact_table(result), ""]
    say += wrap(f"wrote into {outputs.out}: " + ", ".join(p.name for p in written))
    say += wrap(router_line) if router_line else []
    found = report.problems(result)
    if found:
        say += ["", f"{len(found)} problem(s):"] + [part for p in found for part in wrap(f"  {p}", indent="    ")]
    print("\n".join(say))
    return 1 if (found and args.strict) else 0


def _start(argv: list) -> argparse.Namespace:
    """The options (:func:`_parse`) and the output targets checked (``args.outputs``), before any work."""
    args = _parse(argv)
    args.outputs = Outputs(args.out, OUTPUT_FILES, args.write_router).check()
    return args


def _interrupted(args: argparse.Namespace) -> str:
    if args.outputs.committed:
        return f"the report was already written to {args.outputs.out}"
    return "nothing written, the output directory is as it was"


def main(argv=None) -> int:
    return run_command(PROG, argv, _start, _run, interrupted=_interrupted, errors=(OutputError, ResultsError))

"""``python -m compare``: prove the CuTe and Triton kernels compute the same function, then time them.

On a GPU it runs the suite (default: Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 TP8 at
T ∈ {1, 8, 32, 128, 1024, 4096}, bf16 and fp8_tensor) for every backend, prints a compact table and
writes ``results.json``, ``results.csv``, ``report.md`` and PNG plots into ``--out``. Without a GPU
it still exits 0: numerics through the Triton interpreter on reduced shapes, the CuTe configs it
would run with their PTX WGMMA lines, and timing marked "skipped: no GPU".

Examples::

    python -m compare                                   # the full suite (GPU) / the CPU report
    python -m compare --quick --tokens 8,1024           # a fast GPU smoke run
    python -m compare --shapes mixtral-8x7b --quant bf16,fp8_channel --backends triton_moe,torch_loop
    python -m compare --out out/ --write-router compare/data/router_h200.json
    python -m compare --merge a/results.json b/results.json --out merged/

Bad input (unknown shape, format or backend, a bad token list) is one line on stderr and exit
status 2.
"""

from __future__ import annotations

from moe_spec.problem import CATALOG

import argparse
import json
import os
import shlex
import sys

from compare.backends import BACKEND_NAMES
from moe_spec.problem import get_shape
from moe_spec.quant import QUANT_FORMATS

QUANT_CHOICES = ("bf16",) + tuple(q for q in QUANT_FORMATS if q is not None)


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; we want one line, no traceback
        raise UsageError(message)


def _split(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise UsageError(f"empty item in list {text!r}")
    return list(dict.fromkeys(items))  # drop repeats, keep order


def parse_shapes(text: str) -> tuple:
    shapes = _split(text)
    for s in shapes:
        try:
            get_shape(s)
        except ValueError as exc:
            raise UsageError(str(exc).removeprefix("shape: ")) from None
    return tuple(shapes)


def parse_tokens(text: str) -> tuple:
    tokens = []
    for s in _split(text):
        if not s.isdigit() or int(s) < 1:
            raise UsageError(f"bad token count {s!r} in --tokens {text!r}: expected positive integers, e.g. 1,8,32")
        tokens.append(int(s))
    return tuple(tokens)


def parse_quants(text: str) -> tuple:
    names = list(QUANT_CHOICES) if text.strip() == "all" else _split(text)
    for q in names:
        if q not in QUANT_CHOICES:
            raise UsageError(f"unknown quant format {q!r}; known: {', '.join(QUANT_CHOICES)} (or 'all')")
    return tuple(None if q == "bf16" else q for q in names)


def parse_backends(text: str) -> tuple:
    names = list(BACKEND_NAMES) if text.strip() == "all" else _split(text)
    for b in names:
        if b not in BACKEND_NAMES:
            raise UsageError(f"unknown backend {b!r}; known: {', '.join(BACKEND_NAMES)} (or 'all')")
    return tuple(names)


def build_parser() -> argparse.ArgumentParser:
    from compare.suite import DEFAULT_SHAPES, DEFAULT_TOKENS_CPU, DEFAULT_TOKENS_GPU

    p = _Parser(prog="python -m compare", description=__doc__.split("\n\n")[0].replace("``", ""),
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Shapes: " + ", ".join(CATALOG)
                + " (append :tpN for a tensor-parallel shard). Numerics tolerance policy: notes/numerics.md.")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma list of catalog shapes [%(default)s]")
    p.add_argument("--tokens", default=None,
                   help=f"comma list of token counts T [GPU: {','.join(map(str, DEFAULT_TOKENS_GPU))}; "
                        f"CPU: {','.join(map(str, DEFAULT_TOKENS_CPU))}]")
    p.add_argument("--quant", default="bf16,fp8_tensor",
                   help=f"comma list of formats from {', '.join(QUANT_CHOICES)}, or 'all' [%(default)s]")
    p.add_argument("--backends", default="all", help=f"comma list from {', '.join(BACKEND_NAMES)}, or 'all' [all]")
    p.add_argument("--out", default="compare-out", help="output directory [%(default)s]")
    p.add_argument("--quick", action="store_true",
                   help="fast GPU smoke run: fewer timing replays, 2 input sets, a short JIT sweep")
    p.add_argument("--cpu", action="store_true", help="the CPU path (interpreter, reduced shapes) even with a GPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the random problems [%(default)s]")
    p.add_argument("--no-jit", dest="jit", action="store_false", help="skip the JIT study and demo")
    p.add_argument("--no-ptx", dest="ptx", action="store_false", help="CPU: skip compiling the CuTe configs")
    p.add_argument("--outlier-expert", type=float, default=0.0, metavar="F",
                   help="scale expert 0's W1 by F: shows how one expert's range collapses the others under a "
                        "shared per-tensor FP8 scale (see the per-expert table)")
    p.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                   help="stop starting new cases after S seconds; the rest become explicit 'skipped' rows "
                        "(so a run under a wall-clock limit still writes its report)")
    p.add_argument("--commit", default="", help="commit to record in the report [git rev-parse of this checkout]")
    p.add_argument("--write-router", metavar="PATH", help="write the routing table measured by this run to PATH")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="do not run: merge these results.json files and render them into --out")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a row fails its tolerance, the kernels disagree, a rerun differs, or a "
                        "T sweep recompiles")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="no PNG files (for a report committed to git, which keeps no binaries)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _write_router(result: dict, path: str) -> str:
    from compare.router import build_table

    table = build_table(result["rows"], result["meta"])
    if not table["entries"]:
        return f"router table NOT written to {path}: no timed, correct rows in this run (timing needs a GPU)"
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return f"router table ({len(table['entries'])} cases) written to {path}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        shapes = parse_shapes(args.shapes)
        quants = parse_quants(args.quant)
        backends = parse_backends(args.backends)
        tokens = parse_tokens(args.tokens) if args.tokens is not None else None
        merge_inputs = []
        for path in args.merge or []:
            try:
                with open(path) as f:
                    merge_inputs.append(json.load(f))
            except (OSError, json.JSONDecodeError) as exc:
                raise UsageError(f"cannot read results file {path!r}: {exc}") from None
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2

    import compare.report as report

    if merge_inputs:
        result = report.merge(merge_inputs)
    else:
        on_gpu = _has_cuda() and not args.cpu
        if not on_gpu:  # before any backend imports triton: Triton runs through its interpreter
            os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before any backend imports cutlass
        from compare.suite import DEFAULT_TOKENS_CPU, DEFAULT_TOKENS_GPU, SuiteSpec, run_suite

        spec = SuiteSpec(shapes=shapes, tokens=tokens or (DEFAULT_TOKENS_GPU if on_gpu else DEFAULT_TOKENS_CPU),
                         quants=quants, backends=backends, device="cuda" if on_gpu else "cpu", seed=args.seed,
                         quick=args.quick, jit=args.jit, ptx=args.ptx, outlier_expert=args.outlier_expert,
                         time_budget_s=args.time_budget, commit=args.commit,
                         command="python -m compare " + shlex.join(argv))
        result = run_suite(spec, progress=args.progress)

    print(report.compact_table(result))
    written = report.write_all(result, args.out, with_plots=args.plots)
    print("\nwrote " + ", ".join(str(p) for p in written))
    if args.write_router:
        print(_write_router(result, args.write_router))
    found = report.problems(result)
    if found:
        print(f"\n{len(found)} problem(s):\n  " + "\n  ".join(found))
    return 1 if (found and args.strict) else 0

"""Autotune: measure candidate configs on the GPU and write a tuned table for a shape.

    python -m triton_moe.lab.autotune --shape mixtral-8x7b --quant bf16 --tokens 1 8 32 128 1024 4096

For every token count the candidates of its regime (decode: tokens per expert ≤ 32, 16/32-row
tiles; prefill: 64/128-row tiles) are timed with :func:`moe_spec.timing.time_cuda_graph` over the
expert computation (alignment excluded, cold L2), the fastest kept, and the table written as
``configs/E=…,N=…,K=…,dtype=…,device=….json`` (see :mod:`triton_moe.heuristic`). A tqdm bar shows
progress; ``--budget-s`` stops early and keeps what was measured (the heuristic covers the rest).

The candidates vary the tile, the pipeline depth and the warps, never the swap-AB path: each
carries ``swap_ab=None``, so the rule (:func:`~triton_moe.config.choose_swap_ab`) decides it from
the tile, and the table stores ``null`` for it. Forcing the path is a comparison, not a tuning
choice: ``python -m triton_moe.lab.bench`` (its swap-AB sweep) times the same tile both ways.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from moe_spec.cli import ArgumentParser
from moe_spec.plan import tokens_per_expert
from moe_spec.quant import FORMATS, get_format
from moe_spec.runinfo import command_line
from triton_moe.config import TritonConfig
from triton_moe.heuristic import current_device_name, default_config, table_path


def candidates(T: int, E: int, top_k: int, quant) -> list[TritonConfig]:
    """A small, regime-specific search space (the heuristic's pick comes first); every candidate
    leaves swap-AB to the rule (``swap_ab=None``, see the module docstring)."""
    fp8 = get_format(quant).quantized
    bk = 128 // get_format(quant).weight_dtype.itemsize  # one 128-byte row of operand
    m = tokens_per_expert(T, E, top_k)
    if m <= 32:
        bm = 16 if m <= 16 else 32
        cands = [
            TritonConfig(bm, 64, bk, 1, 4, 4),
            TritonConfig(bm, 128, bk, 1, 4, 3),
            TritonConfig(bm, 64, 2 * bk, 1, 4, 3),
            TritonConfig(bm, 64, bk, 1, 4, 5),
            TritonConfig(bm, 32, bk, 1, 4, 4),  # BLOCK_N < 64: the rule does not swap
        ]
    elif m <= 96:
        cands = [
            TritonConfig(64, 64, bk, 8, 4, 4),
            TritonConfig(64, 128, bk, 8, 4, 3),
            TritonConfig(32, 64, bk, 1, 4, 4),
            TritonConfig(64, 128, bk, 8, 8, 4),
        ]
    else:
        cands = [
            TritonConfig(128, 128, bk, 8, 8, 3),
            TritonConfig(128, 128, bk, 8, 8, 4),
            TritonConfig(64, 128, bk, 8, 4, 4),
            TritonConfig(128, 64, bk, 8, 4, 4),
            TritonConfig(64, 128, bk, 8, 8, 4),  # 8 warps: fp8_block's GEMM1 without spills (notes/triton_moe.md)
            TritonConfig(128, 64, bk, 8, 8, 4),
            TritonConfig(128, 128, 128 if not fp8 else 64, 8, 8, 3),
        ]
    first = replace(default_config(T, E, top_k, quant), swap_ab=None)
    out = [first] + [c for c in cands if c != first]
    return [c for c in out if c.fits(quant)]


def tune(spec: str, quant, tokens, *, budget_s: float = 1e9, progress=True, log=print) -> dict:
    """{T: (best config, µs, every candidate's µs)} for shape ``spec``; stops at ``budget_s``."""
    from tqdm import tqdm

    from moe_spec.problem import get_shape
    from triton_moe.lab.workload import Problem

    shape = get_shape(spec)
    jobs = [(T, c) for T in tokens for c in candidates(T, shape.num_experts, shape.top_k, quant)]
    start = time.time()
    results: dict = {}
    problems: dict = {}
    bar = tqdm(jobs, desc=f"tune {spec} {get_format(quant).label}", disable=not progress)
    for T, cfg in bar:
        if time.time() - start > budget_s:
            log(f"autotune: budget of {budget_s:.0f} s spent; {len(results)} token counts tuned")
            break
        if T not in problems:
            problems.clear()
            problems[T] = Problem(shape, T, quant)
        try:
            us = problems[T].time(cfg)
        except Exception as exc:  # a candidate that fails to compile or run is skipped, not fatal
            log(f"autotune: T={T} {cfg} failed: {type(exc).__name__}: {exc}")
            continue
        entry = results.setdefault(T, [None, float("inf"), []])
        entry[2].append((cfg.as_dict(), us))
        if us < entry[1]:
            entry[0], entry[1] = cfg, us
        bar.set_postfix(T=T, best_us=f"{entry[1]:.1f}")
    return results


def write_table(spec: str, quant, results: dict, out_dir=None, *, command: str = "", commit: str = "") -> Path:
    """Write the table (the measured candidates' µs included) with the command line and commit that
    made it, so a reader can rerun it."""
    from moe_spec.problem import get_shape
    from moe_spec.runinfo import git_commit

    shape = get_shape(spec)
    path = table_path(shape.num_experts, shape.intermediate, shape.hidden, quant, current_device_name())
    if out_dir is not None:
        path = Path(out_dir) / path.name
    body = {
        "shape": spec,
        "dtype": get_format(quant).label,
        "device": current_device_name(),
        "tuned": time.strftime("%Y-%m-%d"),
        "command": command,
        "commit": commit or git_commit(),
        "method": "CUDA-graph replays of the expert computation (alignment excluded), cold L2; "
        "moe_spec.timing.time_cuda_graph",
        "configs": {str(T): r[0].as_dict() for T, r in sorted(results.items()) if r[0] is not None},
        "measured_us": {str(T): r[1] for T, r in sorted(results.items())},
        "candidates_us": {str(T): [[c, round(us, 2)] for c, us in r[2]] for T, r in sorted(results.items())},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="catalog name, optionally :tpN (e.g. deepseek-v3:tp8)")
    p.add_argument("--quant", default="bf16", choices=[f.label for f in FORMATS.values()])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 1024, 4096])
    p.add_argument("--budget-s", type=float, default=1e9, help="stop after this many seconds")
    p.add_argument("--out-dir", default=None, help="where to write the table (default: the package's configs/)")
    p.add_argument("--commit", default="", help="commit to record in the table [git rev-parse of this checkout]")
    a = p.parse_args(argv)
    quant = next(f.name for f in FORMATS.values() if f.label == a.quant)
    results = tune(a.shape, quant, a.tokens, budget_s=a.budget_s)
    command = command_line("python -m triton_moe.lab.autotune", sys.argv[1:] if argv is None else argv)
    print(f"wrote {write_table(a.shape, quant, results, a.out_dir, command=command, commit=a.commit)}")


if __name__ == "__main__":
    main()

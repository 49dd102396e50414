"""Benchmark of the Triton backend on the GPU: target table, swap-AB sweep, alignment, tuning.

    python -m triton_moe.lab.bench --out notes/results [--deadline-s 240] [--tune] [--no-swap]

What is timed is the full expert computation — amax, GEMM1 + SiLU·up, GEMM2 × routing weight,
combine — with the alignment excluded (timed on its own), CUDA-graph replayed over rotated input
sets so that every call starts with its weights out of L2 (:func:`moe_spec.timing.time_cuda_graph`).
Each row also gives the roofline floor of :func:`moe_spec.timing.roofline` for the same bytes and
FLOPs, measured against this run's ceilings. Sections run in priority order and the JSON and
Markdown files are rewritten after each, so a deadline cuts the tail, never the whole run. The FP8
accumulation study is ``python -m triton_moe.lab.promotion``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from moe_spec.cli import ArgumentParser
from moe_spec.plan import tokens_per_expert
from moe_spec.problem import get_shape
from moe_spec.quant import get_format
from moe_spec.runinfo import command_line, require_cuda, run_info
from moe_spec.timing import measure_ceilings
from triton_moe.lab.workload import Problem, drop_weights

#: (shape, quant, T, target µs) — the project's performance targets (the README's results table).
TARGETS = [
    ("mixtral-8x7b", None, 8, 560),
    ("mixtral-8x7b", None, 4096, 4700),
    ("mixtral-8x7b", "fp8_tensor", 8, 330),
    ("mixtral-8x7b", "fp8_tensor", 4096, 2800),
    ("qwen3-30b-a3b", None, 1, 32),
    ("qwen3-30b-a3b", None, 4096, 650),
    ("deepseek-v3:tp8", None, 1, 40),
    ("deepseek-v3:tp8", None, 4096, 900),
    ("deepseek-v3:tp8", "fp8_tensor", 4096, 800),
]
#: swap-AB sweep: tokens per expert 1 … 32 (and 64, past the rule's edge) on three (shape, dtype)s.
SWAP_SWEEP = [("mixtral-8x7b", None), ("mixtral-8x7b", "fp8_tensor"), ("deepseek-v3:tp8", None)]
SWAP_TPE = [1, 2, 4, 8, 16, 32, 64]


def _write(out: Path, results: dict):
    out.mkdir(parents=True, exist_ok=True)
    (out / "triton_bench.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    lines = [
        f"# Triton backend on {results['device']}",
        "",
        f"date {results['date']}, commit {results['commit']}, command `{results['command']}`",
        "",
        "Expert computation (alignment excluded), CUDA-graph replay, cold L2. µs = median.",
        "",
        "| shape | dtype | T | config | µs | target µs | floor µs | % of floor | align µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["targets"]:
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['config']} | {r['us']:.1f} | {r['target_us']} "
            f"| {r['roofline']['floor_us']:.1f} | {r['roofline']['pct_of_floor']:.0f} | {r['align_us']:.1f} |"
        )
    if results["swap"]:
        lines += [
            "",
            "Swap-AB: the same tile with swap on and off (speedup = off / on).",
            "",
            "| shape | dtype | T | tokens/expert | tile | swap µs | no-swap µs | speedup |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results["swap"]:
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['tokens_per_expert']:g} | {r['tile']} "
                f"| {r['swap_us']:.1f} | {r['noswap_us']:.1f} | {r['speedup']:.2f} |"
            )
    if results["tuned"]:
        lines += [
            "",
            "Tuning (best candidate per token count):",
            "",
            "| shape | dtype | T | best config | µs | heuristic µs |",
            "|---|---|---|---|---|---|",
        ]
        for r in results["tuned"]:
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['config']} | {r['us']:.1f} | {r['heuristic_us']:.1f} |"
            )
    (out / "triton_bench.md").write_text("\n".join(lines) + "\n")


def _tile(cfg) -> str:
    return (
        f"{cfg.BLOCK_M}x{cfg.BLOCK_N}x{cfg.BLOCK_K}/w{cfg.num_warps}s{cfg.num_stages}{'/swap' if cfg.swap_ab else ''}"
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m triton_moe.lab.bench"
    p = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="notes/results")
    p.add_argument("--deadline-s", type=float, default=1e9)
    p.add_argument("--tune", action="store_true", help="also tune the target shapes (tables to --out)")
    p.add_argument("--no-swap", action="store_true", help="skip the swap-AB sweep")
    p.add_argument("--commit", default=None, help="git commit to record (when the checkout has no .git)")
    a = p.parse_args(argv)
    require_cuda(prog)
    start = time.time()
    left = lambda: a.deadline_s - (time.time() - start)  # noqa: E731
    out = Path(a.out)
    ceilings = measure_ceilings()
    results = {
        **run_info(command_line(prog, argv), cuda=True, commit=a.commit),
        "ceilings": ceilings.as_dict(),
        "targets": [],
        "swap": [],
        "tuned": [],
    }

    for spec, quant, T, target in TARGETS:
        if left() < 0:
            break
        prob = Problem(get_shape(spec), T, quant)
        cfg = prob.config()
        us = prob.time(cfg)
        results["targets"].append(
            {
                "shape": spec,
                "dtype": get_format(quant).label,
                "T": T,
                "config": _tile(cfg),
                "us": us,
                "target_us": target,
                "align_us": prob.time_align(cfg.BLOCK_M),
                "roofline": prob.roofline(us, ceilings),
            }
        )
        print(
            f"{spec:16s} {get_format(quant).label:10s} T={T:5d} {_tile(cfg):24s} {us:9.1f} µs (target {target})",
            flush=True,
        )
        _write(out, results)
    drop_weights()

    for spec, quant in [] if a.no_swap else SWAP_SWEEP:
        shape = get_shape(spec)
        for tpe in SWAP_TPE:
            if left() < 0:
                break
            T = max(1, round(tpe * shape.num_experts / shape.top_k))
            prob = Problem(shape, T, quant)
            base = replace(prob.config(), BLOCK_M=16 if tpe <= 16 else 32, BLOCK_N=64, GROUP_M=1, gemm2=None)
            on, off = prob.time(replace(base, swap_ab=True)), prob.time(replace(base, swap_ab=False))
            results["swap"].append(
                {
                    "shape": spec,
                    "dtype": get_format(quant).label,
                    "T": T,
                    "tokens_per_expert": tokens_per_expert(T, shape.num_experts, shape.top_k),
                    "tile": _tile(replace(base, swap_ab=None)),
                    "swap_us": on,
                    "noswap_us": off,
                    "speedup": off / on,
                }
            )
            print(f"swap {spec:16s} {get_format(quant).label:10s} T={T:5d} on {on:8.1f} off {off:8.1f}", flush=True)
            _write(out, results)
        drop_weights()

    if a.tune:
        from triton_moe.lab.autotune import tune, write_table

        for spec, quant in dict.fromkeys((s, q) for s, q, _, _ in TARGETS):
            if left() < 20:
                break
            tokens = [1, 8, 32, 128, 1024, 4096]
            res = tune(spec, quant, tokens, budget_s=max(0.0, left() / 2), progress=False)
            write_table(spec, quant, res, out)
            heur = {
                r["T"]: r["us"]
                for r in results["targets"]
                if r["shape"] == spec and r["dtype"] == (get_format(quant).label)
            }
            for T, (cfg, us, all_) in sorted(res.items()):
                if cfg is None:
                    continue
                results["tuned"].append(
                    {
                        "shape": spec,
                        "dtype": get_format(quant).label,
                        "T": T,
                        "config": _tile(cfg.resolved()),
                        "us": us,
                        "heuristic_us": all_[0][1],
                        "target_row_us": heur.get(T),
                        "candidates": all_,
                    }
                )
            _write(out, results)
            drop_weights()
    print(f"bench done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

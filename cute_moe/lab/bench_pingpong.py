"""Ping-pong and cluster multicast against cooperative: ``python -m cute_moe.lab.bench_pingpong --out DIR``
(GPU, well under 90 s).

For each catalog shape (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 TP8) at T = 4096 tokens — the
prefill the bf16 layer plans with the normal path's 128-token tiles — each GEMM of the bf16 layer
is run as the layer runs it:

* GEMM1: gated (SiLU·up in the epilogue) and gathering (token rows read by index from x), ``x [T, K]``
  by ``W1 [E, 2I, K]`` → ``[M_pad, I]``;
* GEMM2: ``[M_pad, I]`` (GEMM1's output) by ``W2 [E, K, I]`` → ``[M_pad, K]``, the routing weight
  of every row applied in the epilogue;

with these configurations: ``cooperative`` — the plan's cooperative tile (:func:`cute_moe.plan.choose_config`
as the plan calls it: 128 tokens per tile over two consumer warpgroups; the plan then runs DeepSeek-V3
TP8's short GEMM2 ping-pong, :func:`cute_moe.gemm_rules.short_k_gemm2`), ``pingpong`` — its ping-pong twin
(:func:`cute_moe.gemm_rules.pingpong_config`: each warpgroup a whole 64-token tile of its own, the same
WGMMA sequence per output element, so its output must be the cooperative one bit for bit), and
with ``--alt`` also ``pingpong-128`` — a ping-pong tile of 128 tokens per warpgroup (GEMM1
128×64 gated, GEMM2 128×128; two WGMMAs along M per K slice), and with ``--cluster`` also
``cluster-2`` — the cooperative tile on clusters of two CTAs that multicast a shared weight tile
(:mod:`cute_moe.gemm_parts`; the same output bit for bit).  The routing is the softmax top-k of
random logits (``moe_spec.problem.make_inputs``), sorted once for every token tile
(``cute_moe.moe.sort_rows``).

Each GEMM call is timed by CUDA-graph replay (:func:`moe_spec.timing.time_cuda_graph`; one input
set: at these sizes a call moves far more than the L2 holds and is compute-bound), the median µs
per call; TFLOP/s counts the routed rows only (``2 · T · top_k · N · K``, N = 2I for GEMM1: gate
and up), not the padding.  ``equal``: torch.equal of the variant's output and the cooperative
one's on every row both write.  Writes ``bench_pingpong.md`` and ``bench_pingpong.json`` (date,
device, commit, command) to ``--out``, a new or empty directory checked before any GPU work.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch

from moe_spec import runinfo, studyout
from moe_spec.cli import ArgumentParser
from moe_spec.problem import draw_weights, get_shape, make_inputs
from moe_spec.timing import time_cuda_graph
from moe_spec.validate import MoEDims

from ..config import GemmConfig, max_stages
from ..gemm_rules import pingpong_config

PROG = "python -m cute_moe.lab.bench_pingpong"
SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
TOKENS = 4096
FILES = ("bench_pingpong.md", "bench_pingpong.json")
TIMING = dict(replays=10, min_calls=4, warmup=1)


def _fitted(cfg: GemmConfig) -> GemmConfig:
    return cfg.replace(stages=max_stages(cfg.replace(stages=2)))


def variants(gemm: GemmConfig, alt: bool, cluster: bool = False) -> dict[str, GemmConfig]:
    """{name: config} timed for one of the layer's GEMMs (``gemm``: the plan's, cooperative)."""
    out = {"cooperative": gemm, "pingpong": pingpong_config(gemm)}
    if cluster:
        out["cluster-2"] = gemm.replace(cluster=2)
    if alt:  # 128 tokens per warpgroup: 128 registers of accumulators (gated: 64 features, gate and up)
        wide = dict(tokens_tile=128, weights_tile=64 if gemm.gated else 128, schedule="pingpong", stages=2)
        out["pingpong-128"] = _fitted(gemm.replace(**wide))
    return out


def tile_text(cfg: GemmConfig) -> str:
    return f"T{cfg.tokens_tile}xW{cfg.weights_tile} s{cfg.stages}"


def bench_shape(spec: str, alt: bool, cluster: bool = False) -> list[dict]:
    from moe_spec.plan import tokens_per_expert

    from ..moe import grouped_gemm, sort_rows
    from ..plan import choose_config, plan

    shape = get_shape(spec)
    E, K, I, top_k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k  # noqa: E741
    w1, w2 = draw_weights(shape, 1, device="cuda")
    inp = make_inputs(shape, TOKENS, seed=7, device="cuda", weights_bf16=(w1, w2))
    p = plan(MoEDims(T=TOKENS, E=E, K=K, I=I, top_k=top_k))
    gemm2 = choose_config(tokens_per_expert(TOKENS, E, top_k), K, I, row_scale=True, layer=(K, I))  # cooperative
    gemm1 = p.gemm1.replace(cluster=1)  # the plan's tile on single CTAs (the plan may cluster it: gemm_rules.py)
    gemms = {"gemm1": variants(gemm1, alt, cluster), "gemm2": variants(gemm2, alt, cluster)}
    tiles = sorted({c.tokens_tile for v in gemms.values() for c in v.values()})
    rows = sort_rows(inp.topk_ids, inp.topk_weights, E, math.lcm(*tiles), tuple(tiles))
    used = int(rows.alignment.num_padded)
    pairs = TOKENS * top_k
    # GEMM2's input: GEMM1's output (the cooperative kernel's; every variant computes the same values)
    a = grouped_gemm(inp.x, w1, rows, p.gemm1)
    problems = {
        "gemm1": dict(x=inp.x, w=w1, n=I, flops=2 * pairs * 2 * I * K, scale=None),
        "gemm2": dict(x=a, w=w2, n=K, flops=2 * pairs * K * I, scale=rows.weight_of_row),
    }
    out_rows = []
    for gemm, configs in gemms.items():
        prob = problems[gemm]
        outs = {}
        for name, cfg in configs.items():
            out = torch.empty(rows.rows, prob["n"], dtype=torch.bfloat16, device="cuda")
            call = lambda cfg=cfg, out=out: grouped_gemm(  # noqa: E731 (bound per config)
                prob["x"],
                prob["w"],
                rows,
                cfg,  # noqa: E731
                row_scale=prob["scale"],
                out=out,
            )
            t0 = time.perf_counter()
            call()  # compiles (first use of the config in this process)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            t = time_cuda_graph(lambda i, call=call: call, 1, **TIMING)
            outs[name] = out
            row = {
                "shape": spec,
                "T": TOKENS,
                "gemm": gemm,
                "variant": name,
                "schedule": cfg.schedule,
                "tile": tile_text(cfg),
                "config": cfg.as_dict(),
                "us": round(t.median_us, 1),
                "p10_us": round(t.p10_us, 1),
                "p90_us": round(t.p90_us, 1),
                "tflops": round(prob["flops"] / t.median_us / 1e6, 1),
                "first_call_s": round(first_s, 2),
                "equal": bool(torch.equal(out[:used].view(torch.int16), outs["cooperative"][:used].view(torch.int16))),
            }
            print({k: v for k, v in row.items() if k != "config"}, flush=True)
            out_rows.append(row)
        for name in configs:
            if name != "cooperative":
                row = next(r for r in out_rows if r["shape"] == spec and r["gemm"] == gemm and r["variant"] == name)
                coop = next(
                    r for r in out_rows if r["shape"] == spec and r["gemm"] == gemm and r["variant"] == "cooperative"
                )
                row["speedup"] = round(coop["us"] / row["us"], 3)
    del w1, w2, inp, a
    torch.cuda.empty_cache()
    return out_rows


def markdown(result: dict) -> str:
    lines = [
        "# Ping-pong and cluster multicast against cooperative: the bf16 layer's GEMMs at T = 4096",
        "",
        *studyout.header_lines(result),
        "",
        "CUDA-graph replay, median µs per GEMM call (p10–p90 in the JSON); TFLOP/s over the routed rows "
        "(2·T·top_k·N·K, N = 2I for GEMM1); speedup = cooperative µs / variant µs; `equal`: torch.equal "
        "with the cooperative output on every row both write. GEMM1 is gated and gathering, GEMM2 applies "
        "the routing weights.",
        "",
        "| shape | GEMM | variant | tile | µs | TFLOP/s | speedup | equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cells"]:
        lines.append(
            f"| {r['shape']} | {r['gemm']} | {r['variant']} | {r['tile']} | {r['us']} | {r['tflops']} | "
            f"{r.get('speedup', '—')} | {r['equal']} |"
        )
    lines += ["", f"Wall time of the run: {result['wall_s']} s (compiles included)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=False, help="a new or empty directory for bench_pingpong.md and .json")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of catalog shapes [%(default)s]")
    ap.add_argument("--alt", action="store_true", help="also a ping-pong tile of 128 tokens per warpgroup")
    ap.add_argument("--cluster", action="store_true", help="also the cooperative tile on clusters of two (multicast)")
    ap.add_argument("--commit", default=None, help="commit to record [git rev-parse of this checkout]")
    args = ap.parse_args(argv)
    out = studyout.out_or_exit(PROG, args.out, FILES)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        try:
            get_shape(s)
        except (KeyError, ValueError) as exc:
            print(f"{PROG}: error: --shapes: {exc}", file=sys.stderr)
            return 2
    runinfo.require_cuda(PROG)
    command = runinfo.command_line(PROG, sys.argv[1:] if argv is None else argv)
    result = {**runinfo.run_info(command, cuda=True, commit=args.commit), "T": TOKENS, "cells": []}
    start = time.perf_counter()
    for spec in shapes:
        result["cells"] += bench_shape(spec, args.alt, args.cluster)
        result["wall_s"] = round(time.perf_counter() - start, 1)
        studyout.write_files(out, {FILES[0]: markdown(result), FILES[1]: json.dumps(result, indent=1) + "\n"})
    print(markdown(result))
    return 0 if all(r["equal"] for r in result["cells"] if r["variant"] in ("pingpong", "cluster-2")) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the CuTe MoE kernel on the GPU: layer cells, GEMM-level swap-AB vs normal, compile time.

    python -m cute_moe.lab.bench [--quick | --breakdown | --sweep] [--json FILE] [--commit SHA]

Every time is a CUDA-graph replay over rotated weight sets (cold L2) through
``moe_spec.timing.time_cuda_graph``; the median is reported.  Three tables:

* ``layer``: ``fused_moe`` end to end (align, gather, GEMM1, SiLU·mul, GEMM2, combine).
* ``gemm``: GEMM1 alone (``grouped_gemm``) at a given tokens per expert, normal vs swap-AB,
  with the weight bandwidth it reached (bytes of the experts' W1 that received tokens / time).
* ``compile``: seconds of the first compile of each config the run used (0 if it was cached).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from moe_spec.cli import ArgumentParser
from moe_spec.problem import draw_weights, get_shape, make_inputs
from moe_spec.runinfo import command_line, require_cuda, run_info
from moe_spec.timing import time_cuda_graph

from ..cache import compile_count
from ..config import GemmConfig
from ..moe import fused_moe, gather_rows, grouped_gemm, sort_rows
from ..plan import choose_config


def _weights(shape, n_sets, seed=0, device="cuda"):
    """``n_sets`` independent (w1, w2) sets (moe_spec.problem.draw_weights), rotated for a cold L2."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [draw_weights(shape, g) for _ in range(n_sets)]


def bench_layer(spec: str, Ts, n_sets=2, swap_ab=None) -> list[dict]:
    shape = get_shape(spec)
    sets = _weights(shape, n_sets)
    rows = []
    for T in Ts:
        inputs = [make_inputs(shape, T, seed=i, device="cuda", weights_bf16=sets[i]) for i in range(n_sets)]
        t = time_cuda_graph(lambda i: lambda: fused_moe(**inputs[i].kwargs(), swap_ab=swap_ab), n_sets)
        hit = int(torch.unique(inputs[0].topk_ids).numel())
        weight_bytes = hit * shape.weight_elements() * torch.bfloat16.itemsize
        rows.append(
            {
                "shape": spec,
                "T": T,
                "swap_ab": swap_ab,
                "median_us": round(t.median_us, 1),
                "p10_us": round(t.p10_us, 1),
                "p90_us": round(t.p90_us, 1),
                "tflops": round(shape.flops(T) / t.median_us / 1e6, 1),
                "weight_tbps": round(weight_bytes / t.median_us / 1e6, 3),
            }
        )
        print(rows[-1], flush=True)
    sets.clear()  # the weight sets go before empty_cache (the lambdas above hold the list)
    torch.cuda.empty_cache()
    return rows


def bench_gemm1(spec: str, tokens_per_expert_list, n_sets=2) -> list[dict]:
    """GEMM1 alone, swap-AB vs normal, every expert receiving the same number of tokens."""
    shape = get_shape(spec)
    E, K, I = shape.num_experts, shape.hidden, shape.intermediate
    sets = _weights(shape, n_sets, seed=1)
    w1_bytes = sets[0][0].nbytes  # every expert's W1: each one receives tokens here
    rows = []
    for tpe in tokens_per_expert_list:
        T = tpe * E  # top_k = 1 here: exactly tpe tokens per expert
        ids = torch.arange(T, device="cuda", dtype=torch.int32).remainder(E).view(T, 1)
        w = torch.ones(T, 1, device="cuda")
        x = torch.randn(T, K, device="cuda").bfloat16()
        row = {"shape": spec, "tokens_per_expert": tpe}
        for swap in (False, True):
            cfg = choose_config(tpe, 2 * I, K, swap_ab=swap)
            al = sort_rows(ids, w, E, cfg.tokens_tile)
            xs = gather_rows(x, al)
            out = torch.empty(al.rows, 2 * I, device="cuda", dtype=torch.bfloat16)
            t = time_cuda_graph(lambda i: lambda: grouped_gemm(xs, sets[i][0], al, cfg, out=out), n_sets)
            key = "swap" if swap else "normal"
            row[key + "_us"] = round(t.median_us, 1)
            row[key + "_tile"] = f"{cfg.tile_m}x{cfg.tile_n}"
            row[key + "_weight_tbps"] = round(w1_bytes / t.median_us / 1e6, 3)
            row[key + "_tflops"] = round(2 * T * 2 * I * K / t.median_us / 1e6, 1)
        row["swap_speedup"] = round(row["normal_us"] / row["swap_us"], 2)
        rows.append(row)
        print(row, flush=True)
    sets.clear()  # the weight sets go before empty_cache (the lambdas above hold the list)
    torch.cuda.empty_cache()
    return rows


def bench_breakdown(spec: str, T: int, n_sets: int = 2) -> dict:
    """Median µs of every stage of fused_moe (each timed alone, weights rotated) at one cell."""
    from ..moe import combine, silu_mul
    from ..plan import layer_configs

    shape = get_shape(spec)
    E, K, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
    sets = _weights(shape, n_sets)
    inp = make_inputs(shape, T, seed=0, device="cuda", weights_bf16=sets[0])
    cfg1, cfg2 = layer_configs(T, E, K, I, k)
    al = sort_rows(inp.topk_ids, inp.topk_weights, E, cfg1.tokens_tile)
    xs = gather_rows(inp.x, al)
    h = grouped_gemm(xs, sets[0][0], al, cfg1)
    a = silu_mul(h, al)
    y = grouped_gemm(a, sets[0][1], al, cfg2, row_scale=al.weight_of_row)
    pairs = T * k
    stages = {
        "align": lambda i: lambda: sort_rows(inp.topk_ids, inp.topk_weights, E, cfg1.tokens_tile),
        "gather": lambda i: lambda: gather_rows(inp.x, al),
        "gemm1": lambda i: lambda: grouped_gemm(xs, sets[i][0], al, cfg1, out=h),
        "silu_mul": lambda i: lambda: silu_mul(h, al),
        "gemm2": lambda i: lambda: grouped_gemm(a, sets[i][1], al, cfg2, row_scale=al.weight_of_row, out=y),
        "combine": lambda i: lambda: combine(y, al, T, k),
    }
    row = {
        "shape": spec,
        "T": T,
        "gemm1": f"{cfg1.tile_m}x{cfg1.tile_n}{' swap' if cfg1.swap_ab else ''}",
        "rows_alloc": al.rows,
        "rows_used": int(al.alignment.num_padded),
        "pairs": pairs,
    }
    for name, make in stages.items():
        row[name + "_us"] = round(time_cuda_graph(make, n_sets).median_us, 1)
    row["gemm1_tflops"] = round(2 * pairs * 2 * I * K / row["gemm1_us"] / 1e6, 1)
    row["gemm2_tflops"] = round(2 * pairs * K * I / row["gemm2_us"] / 1e6, 1)
    print(row, flush=True)
    sets.clear()  # the weight sets go before empty_cache (the lambdas above hold the list)
    torch.cuda.empty_cache()
    return row


def bench_gemm_configs(spec: str, T: int, configs: list[GemmConfig], n_sets: int = 2) -> list[dict]:
    """GEMM1 of one layer cell under several normal-path configs (tile / rasterization sweep)."""
    shape = get_shape(spec)
    E, K, I = shape.num_experts, shape.hidden, shape.intermediate
    sets = _weights(shape, n_sets, seed=2)
    inp = make_inputs(shape, T, seed=0, device="cuda", weights_bf16=sets[0])
    rows = []
    for cfg in configs:
        al = sort_rows(inp.topk_ids, inp.topk_weights, E, cfg.tokens_tile)
        xs = gather_rows(inp.x, al)
        out = torch.empty(al.rows, 2 * I, device="cuda", dtype=torch.bfloat16)
        t = time_cuda_graph(lambda i: lambda: grouped_gemm(xs, sets[i][0], al, cfg, out=out), n_sets)
        rows.append(
            {
                "shape": spec,
                "T": T,
                "tile": f"{cfg.tile_m}x{cfg.tile_n}",
                "stages": cfg.stages,
                "group_tokens": cfg.group_tokens,
                "us": round(t.median_us, 1),
                "tflops": round(2 * T * shape.top_k * 2 * I * K / t.median_us / 1e6, 1),
            }
        )
        print(rows[-1], flush=True)
    sets.clear()  # the weight sets go before empty_cache (the lambdas above hold the list)
    torch.cuda.empty_cache()
    return rows


def bench_compile() -> dict:
    """Seconds for a first compile of a config not compiled yet in this process."""
    from ..ptx import compile_gemm

    cfg = GemmConfig(swap_ab=True, tokens_tile=32, weights_tile=64, consumer_warpgroups=1, stages=5, epi_stages=3)
    start, n0 = time.perf_counter(), compile_count()
    compile_gemm(cfg, torch.cuda.get_device_properties(0).multi_processor_count)
    return {"config": cfg.as_dict(), "seconds": round(time.perf_counter() - start, 2), "compiled": compile_count() - n0}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m cute_moe.lab.bench"
    ap = ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer cells")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--breakdown", action="store_true", help="only the per-stage breakdown of fused_moe")
    ap.add_argument("--sweep", action="store_true", help="only a GEMM1 tile / rasterization sweep at T = 4096")
    ap.add_argument("--commit", default=None, help="git commit to record (when the checkout has no .git)")
    args = ap.parse_args(argv)
    require_cuda(prog)
    result = {**run_info(command_line(prog, argv), cuda=True, commit=args.commit), "compile": bench_compile()}
    print(result["compile"], flush=True)
    if args.breakdown:
        result["breakdown"] = [
            bench_breakdown(spec, T) for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8") for T in (8, 4096)
        ]
    if args.sweep:
        base = GemmConfig(tokens_tile=128, weights_tile=256, stages=4)
        sweep = [
            base,
            base.replace(group_tokens=1),
            base.replace(group_tokens=16),
            base.replace(epi_stages=1, stages=4),
            GemmConfig(tokens_tile=128, weights_tile=128, stages=6),
            GemmConfig(tokens_tile=128, weights_tile=192, stages=5),
            GemmConfig(tokens_tile=64, weights_tile=256, consumer_warpgroups=1, stages=5),
        ]
        result["gemm1_configs"] = bench_gemm_configs("mixtral-8x7b", 4096, sweep) + bench_gemm_configs(
            "qwen3-30b-a3b", 4096, sweep[:1] + sweep[4:]
        )
    if args.breakdown or args.sweep:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return result
    Ts = (8, 4096) if args.quick else (1, 8, 32, 128, 1024, 4096)
    shapes = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
    result["layer"] = [r for spec in shapes for r in bench_layer(spec, Ts)]
    tpes = (2, 8, 32, 128) if args.quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    result["gemm1"] = [r for spec in ("mixtral-8x7b", "deepseek-v3:tp8") for r in bench_gemm1(spec, tpes)]
    result["compiles_total"] = compile_count()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

"""Persistent TMA GEMM vs the grouped GEMM, on the GPU: the same tile, the whole layer timed.

    python -m triton_moe.lab.bench_tma --out DIR [--fp8-block] [--flatten] [--deadline-s 130] [--commit C]

For the three catalog prefill shapes (mixtral-8x7b, qwen3-30b-a3b, deepseek-v3:tp8) at T = 4096
and 1024, in bf16 and fp8_tensor (``--fp8-block`` adds fp8_block): the config the shipped table
(or the heuristic) gives, once as it is (``moe_gemm_kernel``) and once with ``persistent_tma=True``
(``triton_moe.kernels_tma``; ``--flatten`` adds a third column with ``tma_flatten=True``). A tile
that resolves to swap-AB is listed and skipped: the persistent kernel is the non-swap path.

What is timed is :meth:`triton_moe.lab.workload.Problem.time` — the expert computation (alignment
excluded), CUDA-graph replayed over rotated input sets (cold L2), median µs — as in
``python -m triton_moe.lab.bench``. Each row also checks the persistent output against the grouped one
on the same inputs (relative L2, bit-identical or not), and a small shape is checked against the
fp64 oracle in every format first. TFLOP/s counts the two GEMMs' multiply-adds over the pairs
(:func:`moe_spec.timing.moe_traffic`).

Writes ``tma_bench.json`` and ``tma_bench.md`` (date, device, commit, command) into ``--out``,
which must be new or empty; both are rewritten after every row, so the deadline (``--deadline-s``:
no row starts after it) cuts the tail, never the whole run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from moe_spec import studyout
from moe_spec.cli import ArgumentParser

FILES = ("tma_bench.md", "tma_bench.json")
SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
TOKENS = (4096, 1024)
#: A row starts only when this much time is left before the deadline (compiling four kernels and
#: timing two variants of the largest shape takes about that long).
ROW_S = 20.0


def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def _write(out: Path, results: dict) -> None:
    flatten = results["flatten"]
    lines = [
        f"# Persistent TMA GEMM vs grouped GEMM on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Expert computation (alignment excluded), CUDA-graph replay, cold L2, median µs; the same tile in "
        "both columns. TFLOP/s: the two GEMMs' FLOPs over the layer's time. rel L2 and bit-identical: the "
        "persistent output against the grouped one on the same inputs.",
        "",
        "| shape | dtype | T | tile | grouped µs | persistent µs |"
        + (" flatten µs |" if flatten else "")
        + " speedup | grouped TFLOP/s | persistent TFLOP/s | rel L2 | bit-identical |",
        "|---|---|---|---|---|---|" + ("---|" if flatten else "") + "---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if r.get("skipped"):
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['tile']} | skipped: {r['skipped']} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['tile']} | {r['grouped_us']:.1f} "
            f"| {r['persistent_us']:.1f} |"
            + (f" {_fmt(r.get('flatten_us'), '.1f')} |" if flatten else "")
            + f" {r['speedup']:.3f} | {r['grouped_tflops']:.0f} | {r['persistent_tflops']:.0f} "
            f"| {r['rel_l2']:.1e} | {r['bit_identical']} |"
        )
    lines += [
        "",
        "Small shape (E = 8, top_k = 2, K = 160, I = 80, T = 300) against the fp64 oracle (rel L2):",
        "",
        "| dtype | tile | grouped | persistent | bit-identical |",
        "|---|---|---|---|---|",
    ]
    for r in results["oracle"]:
        lines.append(
            f"| {r['dtype']} | {r.get('tile', '–')} | {r['grouped_rel_l2']:.2e} | {r['persistent_rel_l2']:.2e} "
            f"| {r['bit_identical']} |"
        )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    studyout.write_files(
        out, dict(zip(FILES, ("\n".join(lines) + "\n", json.dumps(results, indent=1, default=str) + "\n")))
    )


def _oracle_rows(quants) -> list:
    import torch

    from moe_spec.oracle import oracle, rel_l2
    from moe_spec.problem import MoEShape, get_shape, make_inputs
    from moe_spec.quant import get_format
    from triton_moe import fused_moe
    from triton_moe.heuristic import get_config

    # Mixtral-8x7B's E and top_k, and its T = 4096 config: the binaries compiled here are the ones
    # its rows run (N, K and E only specialize on divisibility by 16, equal here)
    mixtral = get_shape(SHAPES[0])
    shape = MoEShape(
        "small", mixtral.num_experts, mixtral.top_k, 160, 80, "bench check: K, I not multiples of the tile"
    )
    rows = []
    for quant in quants:
        inp = make_inputs(shape, 300, quant, seed=1, device="cuda")
        cfg = get_config(
            TOKENS[0], mixtral.num_experts, mixtral.top_k, mixtral.intermediate, mixtral.hidden, quant
        ).replace_both(swap_ab=False)
        base = fused_moe(**inp.kwargs(), config=cfg)
        out = fused_moe(**inp.kwargs(), config=cfg.replace_both(persistent_tma=True))
        ref = oracle(**inp.kwargs())
        rows.append(
            {
                "dtype": get_format(quant).label,
                "grouped_rel_l2": rel_l2(base, ref),
                "persistent_rel_l2": rel_l2(out, ref),
                "bit_identical": bool(torch.equal(out, base)),
                "tile": cfg.tile_label(),
            }
        )
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m triton_moe.lab.bench_tma"
    p = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a new or empty directory for tma_bench.{md,json}")
    p.add_argument("--fp8-block", action="store_true", help="also time fp8_block")
    p.add_argument("--flatten", action="store_true", help="also time persistent_tma with tma_flatten=True")
    p.add_argument("--deadline-s", type=float, default=130.0, help="no row starts after this many seconds")
    p.add_argument("--commit", default=None, help="git commit to record (when the checkout has no .git)")
    a = p.parse_args(argv)
    out = studyout.out_or_exit(prog, a.out, FILES)

    from moe_spec.runinfo import command_line, require_cuda, run_info

    require_cuda(prog)
    import torch

    from moe_spec.oracle import rel_l2
    from moe_spec.problem import get_shape
    from moe_spec.quant import get_format
    from moe_spec.timing import moe_traffic
    from triton_moe import fused_moe
    from triton_moe.lab.workload import Problem, drop_weights

    start = time.time()
    quants = [None, "fp8_tensor"] + (["fp8_block"] if a.fp8_block else [])
    results = {
        **run_info(command_line(prog, argv), cuda=True, commit=a.commit),
        "flatten": a.flatten,
        "oracle": [],
        "rows": [],
        "cut": [],
    }
    results["oracle"] = _oracle_rows(quants)
    _write(out, results)

    for T in TOKENS:  # T = 4096 first: the deadline cuts the smaller batch
        for spec, quant in [(spec, quant) for spec in SHAPES for quant in quants]:
            shape, label = get_shape(spec), get_format(quant).label
            if time.time() - start > a.deadline_s - ROW_S:
                results["cut"].append(f"{spec} {label} T={T}")
                continue
            prob = Problem(shape, T, quant)
            cfg = prob.config()
            row = {"shape": spec, "dtype": label, "T": T, "tile": cfg.tile_label(), "config": cfg.as_dict()}
            if cfg.swap_ab:
                row["skipped"] = "the table's tile is swap-AB"
                results["rows"].append(row)
                continue
            tma = cfg.replace_both(persistent_tma=True)
            st = prob.sets[0]
            base_out, tma_out = fused_moe(**st, config=cfg), fused_moe(**st, config=tma)
            torch.cuda.synchronize()
            grouped_us, persistent_us = prob.time(cfg), prob.time(tma)
            flops = moe_traffic(
                T,
                shape.hidden,
                shape.intermediate,
                shape.top_k,
                prob.experts_hit,
                get_format(quant).weight_dtype.itemsize,
            )[1]
            row.update(
                grouped_us=grouped_us,
                persistent_us=persistent_us,
                speedup=grouped_us / persistent_us,
                grouped_tflops=flops / grouped_us * 1e-6,
                persistent_tflops=flops / persistent_us * 1e-6,
                rel_l2=rel_l2(tma_out, base_out.double()),
                bit_identical=bool(torch.equal(tma_out, base_out)),
            )
            if a.flatten:  # None where the flattened pipeline does not fit in shared memory
                flat = tma.replace_both(tma_flatten=True)
                row["flatten_us"] = prob.time(flat) if flat.fits(quant) else None
            results["rows"].append(row)
            print(
                f"{spec:16s} {label:10s} T={T:5d} {row['tile']:20s} grouped {grouped_us:9.1f} µs "
                f"persistent {persistent_us:9.1f} µs ({row['speedup']:.3f}×, "
                f"{row['persistent_tflops']:.0f} TFLOP/s) rel L2 {row['rel_l2']:.1e} "
                f"bit-identical {row['bit_identical']}",
                flush=True,
            )
            _write(out, results)
        drop_weights()
    _write(out, results)
    print(f"\n{(out / 'tma_bench.md').read_text()}")
    print(f"bench_tma done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

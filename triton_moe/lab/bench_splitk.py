"""Split-K for GEMM1 on the GPU: the shipped tile at split_k 1, 2, 4, 8, the expert computation timed.

    python -m triton_moe.lab.bench_splitk --out DIR [--deadline-s 150] [--commit C]

A decode layer of few tokens and a narrow intermediate (DeepSeek-V3 under TP8: I = 256) gives
GEMM1 too few programs to keep 132 SMs streaming weights: at T = 1 the top_k = 8 pairs land in
8 blocks, and 8 × I / BLOCK_N 64 = 32 programs (each a gate tile and its up tile) walk all of
K = 7168. ``split_k = S`` cuts K into S ranges and launches S times the programs; each writes its
fp32 partial tile, the last one to finish sums them in a fixed order and runs the epilogue
(:func:`triton_moe.kernels._split_k_sum`), so the output does not depend on which finished first.

For each cell below, the tile the shipped table (or the heuristic) gives, with ``split_k``
replaced: :meth:`triton_moe.lab.workload.Problem.time` (expert computation, alignment excluded,
CUDA-graph replay over rotated input sets — cold L2 —, median µs) and
:meth:`~triton_moe.lab.workload.Problem.check` (rel L2 against the fp64 oracle, a rerun bit-identical,
a CUDA-graph replay equal to the eager call). The cells are the decode cells where the question is
open (DeepSeek-V3 TP8 at T = 1 in all four formats and at T = 8, Qwen3-30B-A3B at T = 1) and three
cells at split_k = 1 that show the kernel's other paths did not move.

Writes ``splitk.json`` and ``splitk.md`` (date, device, commit, command) into ``--out``, which must
be new or empty; both are rewritten after every row, so the deadline (``--deadline-s``: no cell
starts after it) cuts the tail, never the whole run.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from moe_spec import studyout

FILES = ("splitk.md", "splitk.json")
#: (shape, quant, T, the split_k values timed)
CELLS = (
    ("deepseek-v3:tp8", None, 1, (1, 2, 4, 8)),
    ("deepseek-v3:tp8", "fp8_tensor", 1, (1, 2, 4, 8)),
    ("deepseek-v3:tp8", "fp8_channel", 1, (1, 2, 4)),
    ("deepseek-v3:tp8", "fp8_block", 1, (1, 2, 4)),
    ("deepseek-v3:tp8", None, 8, (1, 2, 4)),
    ("deepseek-v3:tp8", "fp8_tensor", 8, (1, 2, 4)),
    ("qwen3-30b-a3b", None, 1, (1, 2, 4)),
    ("deepseek-v3:tp8", None, 4096, (1,)),
    ("mixtral-8x7b", None, 4096, (1,)),
    ("mixtral-8x7b", None, 128, (1,)),
)
#: A cell starts only when this much time is left before the deadline.
CELL_S = 15.0


def _write(out: Path, results: dict) -> None:
    lines = [
        f"# Split-K for GEMM1 on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Expert computation (alignment excluded), CUDA-graph replay, cold L2, median µs. Each cell keeps the "
        "shipped tile and replaces split_k. rel L2: against the fp64 oracle; bit-identical: a second call; "
        "graph = eager: a CUDA-graph replay against the eager call. Best: the fastest split_k of the cell.",
        "",
        "| shape | dtype | T | tile | split_k | µs | vs split 1 | rel L2 | bit-identical | graph = eager |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {}
    for r in results["rows"]:
        key = (r["shape"], r["dtype"], r["T"])
        if "error" in r:
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['tile']} | {r['split_k']} | error: {r['error']} |"
            )
            continue
        base.setdefault(key, r["us"] if r["split_k"] == 1 else None)
        ratio = f"{r['us'] / base[key]:.3f}" if base.get(key) else "–"
        best = min(o["us"] for o in results["rows"] if "us" in o and (o["shape"], o["dtype"], o["T"]) == key)
        mark = (
            " (best)"
            if r["us"] == best and sum(1 for o in results["rows"] if (o["shape"], o["dtype"], o["T"]) == key) > 1
            else ""
        )
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['tile']} | {r['split_k']}{mark} | {r['us']:.1f} "
            f"| {ratio} | {r['rel_l2']:.1e} | {r['bit_identical']} | {r['graph_equal']} |"
        )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    studyout.write_files(
        out, dict(zip(FILES, ("\n".join(lines) + "\n", json.dumps(results, indent=1, default=str) + "\n")))
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m triton_moe.lab.bench_splitk"
    parser = studyout.gpu_study_parser(prog, __doc__, FILES, 150.0)
    a, out, run = studyout.start_gpu_study(prog, parser, argv, FILES)
    import torch

    from moe_spec.problem import get_shape
    from moe_spec.quant import get_format
    from triton_moe.lab.workload import Problem, drop_weights

    start = time.time()
    results = {**run, "rows": [], "cut": []}
    _write(out, results)
    for spec, quant, T, splits in CELLS:
        label = get_format(quant).label
        if time.time() - start > a.deadline_s - CELL_S:
            results["cut"].append(f"{spec} {label} T={T}")
            continue
        prob = Problem(get_shape(spec), T, quant)
        shipped = prob.config()
        for s in splits:
            cfg = replace(shipped, split_k=s)
            row = {
                "shape": spec,
                "dtype": label,
                "T": T,
                "tile": cfg.tile_label(),
                "split_k": s,
                "config": cfg.as_dict(),
                "shipped_split_k": shipped.split_k,
            }
            try:
                row.update(prob.check(cfg), us=prob.time(cfg))
            except Exception as exc:  # noqa: BLE001 — a config the kernel refuses is a row, not the end of the run
                row["error"] = repr(exc)[:300]
            results["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
            _write(out, results)
        del prob
        drop_weights()
        torch.cuda.empty_cache()
    _write(out, results)
    print(f"\n{(out / 'splitk.md').read_text()}")
    print(f"bench_splitk done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

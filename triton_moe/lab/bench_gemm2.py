"""GEMM2's own tile on the GPU: the down projection timed alone, the shared tile against candidates.

    python -m triton_moe.lab.bench_gemm2 --out DIR [--deadline-s 120] [--tables] [--shapes S ...] [--dtypes D ...]
                                     [--margin 0.03] [--commit C]

GEMM2 multiplies the intermediate [P, I] by W2ᵀ (W2 [E, K, I]): half of GEMM1's FLOPs, but its
reduction is only I long (256 at DeepSeek-V3 under TP8: 2–4 K steps per 64/128-deep tile) and it
keeps one accumulator where GEMM1 keeps two, so the tile the shipped table chose for both GEMMs
(BLOCK_M is the alignment tile and stays shared) need not be GEMM2's best. For each cell below the
study takes the shipped config (:func:`triton_moe.heuristic.get_config` on this device), runs the
layer once per input set to get GEMM2's real operand (the intermediate, quantized under FP8, for
the layer's routing: :class:`triton_moe.lab.workload.Problem`), and times
:func:`triton_moe.moe.gemm2` alone — CUDA-graph replay over the rotated input sets (cold L2),
median µs — for the shared tile and for each candidate :class:`~triton_moe.config.Gemm2Tile`
(:func:`candidates`: wider BLOCK_N, BLOCK_K covering more of the short K, stages, warps, GROUP_M,
the persistent TMA kernel; only tiles that :meth:`~triton_moe.config.TritonConfig.check` accepts).

Each candidate's output y [P, K] is compared with the shared tile's: rel L2, and ``torch.equal``
(expected where the K order is the same, i.e. the same BLOCK_K, and for bf16 then bit-identical).
The fastest candidate of a cell that is at least ``--margin`` faster than the shared tile is then
checked as a whole layer (:meth:`~triton_moe.lab.workload.Problem.check`: rel L2 against the fp64
oracle, a rerun bit-identical, a CUDA-graph replay equal to the eager call) and the layer timed with
and without it (:meth:`~triton_moe.lab.workload.Problem.time`).

Cells, in this order (the deadline cuts the tail; ``--shapes`` / ``--dtypes`` select): DeepSeek-V3
TP8 at T = 4096, Qwen3-30B-A3B at T = 4096, DeepSeek-V3 TP8 at T = 1024, Mixtral-8x7B at T = 4096,
each in bf16 then fp8_tensor; then the same four in fp8_channel then fp8_block. Writes
``gemm2.json`` and ``gemm2.md`` (date, device, commit, command) into ``--out``, which must be new
or empty, after every row; with ``--tables`` also ``tables/<table>.json``: each shipped
table with the winners that passed the layer check written into its entries' ``gemm2`` (to be
copied over ``triton_moe/configs/``), and the JSON snippet printed.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from moe_spec import studyout
from triton_moe.config import Gemm2Tile, TritonConfig

FILES = ("gemm2.md", "gemm2.json")
#: (shape, quant, T), in the order they run
CELLS = tuple(
    (spec, quant, T)
    for quants in ((None, "fp8_tensor"), ("fp8_channel", "fp8_block"))
    for spec, T in (
        ("deepseek-v3:tp8", 4096),
        ("qwen3-30b-a3b", 4096),
        ("deepseek-v3:tp8", 1024),
        ("mixtral-8x7b", 4096),
    )
    for quant in quants
)
#: A cell starts only when this much time is left before the deadline.
CELL_S = 15.0
#: rel L2 of a candidate's y against the shared tile's that counts as the same result.
SAME = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_channel": 1e-2, "fp8_block": 1e-2}
#: The layer's rel L2 against the fp64 oracle a written winner must keep (tests/test_triton_gpu.py's).
LAYER_TOL = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_channel": 1e-2, "fp8_block": 1e-2}


def candidates(shipped: TritonConfig, quant, I: int) -> list[Gemm2Tile]:  # noqa: E741
    """GEMM2 tiles to try with the shipped config's BLOCK_M, those its format and shared memory
    accept. One list per regime (BLOCK_M ≥ 64: the token tile is WGMMA's M; below: swap-AB, the
    weight tile is) and per operand width, not per shape, so a tile compiled for one shape serves
    the next (Triton's key holds E, N, K only through their divisibility by 16). BLOCK_K = 2 × the
    128-byte row (128 bf16, 256 fp8) only where GEMM2's K (= I) holds one such step."""
    from moe_spec.quant import get_format

    bk = 128 // get_format(quant).weight_dtype.itemsize  # one 128-byte row of operand
    deep = 2 * bk if I >= 2 * bk else None
    if shipped.BLOCK_M >= 64:
        tiles = [
            Gemm2Tile(256, bk, 8, 8, 3),
            Gemm2Tile(256, bk, 8, 8, 4),
            Gemm2Tile(128, bk, 8, 8, 4),
            Gemm2Tile(128, bk, 8, 4, 4),
            Gemm2Tile(256, bk, 1, 8, 3),
            Gemm2Tile(256, bk, 8, 8, 3, swap_ab=False, persistent_tma=True),
        ]
        if deep:
            tiles += [Gemm2Tile(256, deep, 8, 8, 2), Gemm2Tile(128, deep, 8, 8, 3)]
    else:
        tiles = [
            Gemm2Tile(256, bk, 1, 4, 3),
            Gemm2Tile(256, bk, 1, 8, 3),
            Gemm2Tile(128, bk, 1, 4, 4),
            Gemm2Tile(64, bk, 1, 4, 4),
            Gemm2Tile(128, bk, 8, 4, 3),
        ]
        if deep:
            tiles += [Gemm2Tile(128, deep, 1, 4, 3), Gemm2Tile(256, deep, 1, 8, 2)]
    base = shipped.gemm2_config()
    out = []
    for t in tiles:
        cfg = replace(shipped, gemm2=t)
        if cfg.fits(quant) and cfg.resolved().gemm2_config() != base and t not in out:
            out.append(t)
    return out


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _write(out: Path, results: dict) -> None:
    lines = [
        f"# GEMM2's own tile on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "GEMM2 alone (`triton_moe.moe.gemm2`: the down projection × routing weight, into y [P, K]), "
        "CUDA-graph replay, cold L2, median µs, on the intermediate of the layer's own run with the shipped "
        "config. `shared`: GEMM2 on the shipped tile (GEMM1's). vs shared: µs / shared µs. rel L2 and equal: y "
        "against the shared tile's y (equal expected with the same BLOCK_K). TFLOP/s: 2·P·I·K / µs.",
        "",
        "| shape | dtype | T | GEMM2 tile | µs | vs shared | TFLOP/s | rel L2 | equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        head = f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['tile']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error']} |")
            continue
        best = " (best)" if r.get("best") else ""
        lines.append(
            f"{head} {r['us']:.1f}{best} | {_fmt(r.get('vs_shared'), '.3f')} | {r['tflops']:.0f} | "
            f"{_fmt(r.get('rel_l2'), '.1e')} | {r.get('equal', '–')}"
            f"{'' if r.get('same_k_order', True) or 'equal' not in r else ' (other BLOCK_K)'} |"
        )
    if results["cells"]:
        lines += [
            "",
            "Per cell: the best GEMM2 tile, checked as a whole layer (rel L2 against the fp64 oracle, a "
            "rerun bit-identical, a CUDA-graph replay equal to eager) and the expert computation timed with the "
            "shared tile and with it (µs). Written: whether `--tables` puts it into the table.",
            "",
            "| shape | dtype | T | shipped tile | best GEMM2 tile | GEMM2 µs shared → best | layer µs shared → best "
            "| layer rel L2 | bit-identical | graph = eager | written |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in results["cells"]:
            lines.append(
                f"| {c['shape']} | {c['dtype']} | {c['T']} | {c['shipped']} | {c['best'] or '(shared)'} | "
                f"{c['shared_us']:.1f} → {_fmt(c.get('best_us'), '.1f')} | {_fmt(c.get('layer_shared_us'), '.1f')} "
                f"→ {_fmt(c.get('layer_best_us'), '.1f')} | {_fmt(c.get('layer_rel_l2'), '.1e')} | "
                f"{c.get('bit_identical', '–')} | {c.get('graph_equal', '–')} | {c['written']} |"
            )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    studyout.write_files(
        out, dict(zip(FILES, ("\n".join(lines) + "\n", json.dumps(results, indent=1, default=str) + "\n")))
    )


def _cell(spec, quant, T, results, out, deadline, margin) -> None:
    """Time GEMM2 alone for the shared tile and every candidate of one cell; check the best."""
    import torch

    from moe_spec.oracle import rel_l2
    from moe_spec.problem import get_shape
    from moe_spec.quant import get_format
    from moe_spec.timing import time_cuda_graph
    from triton_moe import moe
    from triton_moe.align import align_block_size
    from triton_moe.lab.workload import Problem

    shape = get_shape(spec)
    label = get_format(quant).label
    E, K, I, top_k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k  # noqa: E741
    prob = Problem(shape, T, quant)
    shipped = prob.config()
    shared = replace(shipped, gemm2=None)
    P = T * top_k
    ops = []  # per input set: GEMM2's operands, from one layer run with the shipped config
    for st in prob.sets:
        routing = align_block_size(st["topk_ids"], E, shipped.BLOCK_M)
        ws = moe._buffers(T, top_k, E, K, I, quant, shipped.BLOCK_M, st["x"].device, moe._split(shipped))
        moe.expert_computation(
            st["x"],
            st["w1"],
            st["w2"],
            st["topk_weights"],
            st["topk_ids"],
            routing,
            quant=quant,
            w1_scale=st["w1_scale"],
            w2_scale=st["w2_scale"],
            config=shared,
            workspace=ws,
        )
        a2, s2 = (ws["aq"], ws["act_scale"]) if get_format(quant).quantized else (ws["act"], None)
        ops.append(
            dict(
                a2=a2,
                s2=s2,
                w2=st["w2"],
                w2_scale=st["w2_scale"],
                topk_weights=st["topk_weights"],
                topk_ids=st["topk_ids"],
                routing=routing,
                y=torch.empty((P, K), dtype=torch.bfloat16, device=st["x"].device),
            )
        )
    torch.cuda.synchronize()

    def run(cfg, i, y=None):
        o = ops[i]
        moe.gemm2(
            o["a2"],
            o["s2"],
            o["w2"],
            o["w2_scale"],
            o["y"] if y is None else y,
            o["topk_weights"],
            o["topk_ids"],
            o["routing"],
            cfg,
            quant=quant,
        )

    flops = 2 * P * I * K
    base_y = None
    rows = []
    configs = [(shared, None)] + [
        (replace(shipped, gemm2=t).resolved().check(quant), t) for t in candidates(shipped, quant, I)
    ]
    if shipped.gemm2 is not None and shipped.gemm2 not in [t for _, t in configs]:
        configs.append((shipped, shipped.gemm2))  # the table's own GEMM2 tile, if it has one
    for cfg, tile in configs:
        if time.time() > deadline and tile is not None:
            results["cut"].append(f"{spec} {label} T={T} G2 {tile.label()}")
            continue
        row = {
            "shape": spec,
            "dtype": label,
            "T": T,
            "tile": "shared " + shared.tile_label() if tile is None else tile.label(),
            "gemm2": None if tile is None else tile.as_dict(),
            "same_k_order": tile is None or cfg.gemm2_config().BLOCK_K == shared.BLOCK_K,
        }
        try:
            y = torch.empty_like(ops[0]["y"])
            run(cfg, 0, y)
            torch.cuda.synchronize()
            if base_y is None:
                base_y = y
            else:
                row.update(rel_l2=rel_l2(y, base_y.double()), equal=bool(torch.equal(y, base_y)))
            us = time_cuda_graph(lambda i, cfg=cfg: lambda: run(cfg, i), len(ops), replays=15, min_calls=10).median_us
            row.update(us=us, tflops=flops / us * 1e-6)
        except Exception as exc:  # noqa: BLE001 — a tile that fails to compile or run is a row, not the end
            row["error"] = repr(exc)[:300]
        rows.append(row)
        if "us" in rows[0]:
            row["vs_shared"] = row["us"] / rows[0]["us"] if "us" in row else None
        results["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "gemm2"}), flush=True)
        _write(out, results)

    if not rows or "us" not in rows[0]:
        return
    # Under FP8 a BLOCK_K other than GEMM1's changes how the K sum is cut into promoted partial sums,
    # so a token's bits would differ between the T = 1 entry and this one (tests/test_batch_invariance_gpu.py):
    # such a tile is timed and shown, never chosen.
    ok = [
        r
        for r, (_, t) in zip(rows, configs)
        if "us" in r
        and (t is None or (r.get("rel_l2", 1.0) <= SAME[quant] and (quant is None or r.get("same_k_order", True))))
    ]
    best_row = min(ok, key=lambda r: r["us"])
    best_row["best"] = True
    best = next(t for r, (_, t) in zip(rows, configs) if r is best_row)
    cell = {
        "shape": spec,
        "dtype": label,
        "T": T,
        "shipped": shipped.tile_label(),
        "shared_us": rows[0]["us"],
        "best": None if best is None else best.label(),
        "best_us": best_row["us"],
        "gemm2": None if best is None else best.as_dict(),
        "written": False,
    }
    if best is not None and best_row["us"] <= (1 - margin) * rows[0]["us"]:
        cfg = replace(shipped, gemm2=best)
        try:
            check = prob.check(cfg)
            cell.update(
                layer_rel_l2=check["rel_l2"],
                bit_identical=check["bit_identical"],
                graph_equal=check["graph_equal"],
                layer_shared_us=prob.time(shared),
                layer_best_us=prob.time(cfg),
            )
            cell["written"] = bool(
                cell["layer_rel_l2"] <= LAYER_TOL[quant]
                and cell["bit_identical"]
                and cell["graph_equal"]
                and cell["layer_best_us"] < cell["layer_shared_us"]
            )
        except Exception as exc:  # noqa: BLE001
            cell["error"] = repr(exc)[:300]
    results["cells"].append(cell)
    _write(out, results)


def write_tables(results: dict, out: Path) -> dict:
    """The shipped tables with the cells' written winners in their entries' ``gemm2``, as files under
    ``out/tables/`` ({file name: JSON body}); the measurement and command beside them."""
    from moe_spec.problem import get_shape
    from moe_spec.quant import FORMATS
    from triton_moe.heuristic import current_device_name, table_path

    bodies = {}
    for c in results["cells"]:
        if not c["written"]:
            continue
        s = get_shape(c["shape"])
        quant = next(f.name for f in FORMATS.values() if f.label == c["dtype"])
        path = table_path(s.num_experts, s.intermediate, s.hidden, quant, current_device_name())
        body = bodies.setdefault(path.name, json.loads(path.read_text()))
        body["configs"][str(c["T"])]["gemm2"] = c["gemm2"]
        note = body.setdefault(
            "gemm2_measured",
            {
                "source": f"{results['command']} (commit {results['commit']}, {results['date']}, {results['device']}): "
                "GEMM2 alone µs, shared tile → own tile; expert computation µs, the same"
            },
        )
        note[str(c["T"])] = {
            "gemm2_us": [round(c["shared_us"], 1), round(c["best_us"], 1)],
            "layer_us": [round(c["layer_shared_us"], 1), round(c["layer_best_us"], 1)],
        }
    files = {name: json.dumps(body, indent=1) + "\n" for name, body in bodies.items()}
    if files:
        studyout.write_files(out / "tables", files)
    return bodies


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m triton_moe.lab.bench_gemm2"
    p = studyout.gpu_study_parser(prog, __doc__, FILES, 120.0, "no cell or candidate starts after this many seconds")
    p.add_argument(
        "--margin",
        type=float,
        default=0.03,
        help="a winner must be this fraction faster than the shared tile to be checked and written",
    )
    p.add_argument("--tables", action="store_true", help="also write the tables with the winners under --out/tables")
    p.add_argument("--shapes", nargs="+", default=None, help="only these shapes' cells (e.g. deepseek-v3:tp8)")
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        choices=["bf16", "fp8_tensor", "fp8_channel", "fp8_block"],
        help="only these formats' cells",
    )
    a, out, run = studyout.start_gpu_study(prog, p, argv, FILES)
    import torch

    from moe_spec.quant import get_format
    from triton_moe.lab.workload import drop_weights

    start = time.time()
    deadline = start + a.deadline_s
    results = {**run, "rows": [], "cells": [], "cut": []}
    _write(out, results)
    for spec, quant, T in CELLS:
        if (a.shapes and spec not in a.shapes) or (a.dtypes and get_format(quant).label not in a.dtypes):
            continue
        if time.time() > deadline - CELL_S:
            results["cut"].append(f"{spec} {get_format(quant).label} T={T}")
            continue
        try:
            _cell(spec, quant, T, results, out, deadline, a.margin)
        except Exception as exc:  # noqa: BLE001 — a cell that cannot run (memory, a layer error) is recorded
            results["cut"].append(f"{spec} {get_format(quant).label} T={T} (error: {repr(exc)[:200]})")
            _write(out, results)
        drop_weights()
        torch.cuda.empty_cache()
    _write(out, results)
    if a.tables:
        bodies = write_tables(results, out)
        print(
            json.dumps(
                {
                    name: {T: e.get("gemm2") for T, e in body["configs"].items() if e.get("gemm2")}
                    for name, body in bodies.items()
                },
                indent=1,
            )
        )
    print(f"\n{(out / 'gemm2.md').read_text()}")
    print(f"bench_gemm2 done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

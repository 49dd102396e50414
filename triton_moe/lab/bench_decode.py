"""The one-launch decode kernel against the grouped pipeline on the GPU, and a sweep of its tile.

    python -m triton_moe.lab.bench_decode --out DIR [--deadline-s 540] [--shapes ...] [--quants ...]
        [--tokens 1,8,32] [--eager] [--sweep [--sweep-tokens 1,8]] [--commit C]
    python -m triton_moe.lab.bench_decode --sanitize     # one call each, no timing: for compute-sanitizer

Every cell is a whole ``fused_moe`` call (what ``python -m compare`` times: the grouped pipeline's
alignment included), CUDA-graph replayed over rotated input sets (cold L2,
:func:`moe_spec.timing.time_cuda_graph`), median µs: the decode path (``config=DecodeConfig()``,
the plan's tile) and the grouped pipeline (the config its rule gives at that T), for the catalog
shapes (compare's defaults) × bf16 and fp8_tensor × T = 1, 8, 32 by default (about 100 s of GPU
time; ``--quants`` and ``--tokens`` take the other formats and counts). A T whose T·top_k exceeds the
decode kernel's pair lanes has a grouped row only. Each decode row is checked against the grouped
pipeline's output (rel L2) and against a rerun (bit-identical); % floor is the roofline's.
``--eager`` adds each path's eager µs (back-to-back calls without a graph, :func:`moe_spec.timing.wall_us`):
what a model run eagerly pays, host path and launches included.

``--sweep`` also times the decode kernel over a few tiles (BLOCK_N, BLOCK_K, warps, stages, GEMM1's
SPLIT and GEMM2's BLOCK_N2: :data:`CANDIDATES`) at ``--sweep-tokens``; each new tile compiles
once per format and top_k, so the sweep is the run's longest part (a few minutes).

Writes ``decode.json`` and ``decode.md`` into ``--out`` (new or empty), rewritten after every cell;
no cell starts after ``--deadline-s``.
"""

from __future__ import annotations

import json
import sys
import time

from moe_spec import studyout

FILES = ("decode.md", "decode.json")
#: The catalog shapes compare times by default (compare.cases.DEFAULT_SHAPES; the lab does not import compare).
SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
QUANTS = ("bf16", "fp8_tensor")
TOKENS = (1, 8, 32)
SWEEP_TOKENS = (1, 8)
#: The decode tiles the sweep times: DecodeConfig fields over its defaults (64x128x16/w4s4).
CANDIDATES = (
    {},
    dict(num_stages=3),
    dict(num_stages=5),
    dict(BLOCK_K=64),
    dict(BLOCK_K=256, num_stages=3),
    dict(num_warps=8),
    dict(BLOCK_N=128, BLOCK_K=64),
    dict(BLOCK_N=32),  # twice the GEMM1 tasks, as a narrower M (no longer one WGMMA's 64 rows)
    dict(SPLIT=2),  # gate and up in separate tasks: twice the GEMM1 tasks, the same bits
    dict(SPLIT=4),  # … and K in two slices
    dict(SPLIT=8),
    dict(SPLIT=16),
    dict(BLOCK_N2=128),  # GEMM2 and combine tasks of 128 rows: half as many, twice as long
    dict(SPLIT=4, BLOCK_N2=128),
    dict(SPLIT=8, BLOCK_N2=128),
    dict(SPLIT=8, BLOCK_N2=256, num_stages=3),
)
#: A cell starts only when this much time is left before the deadline.
CELL_S = 10.0
#: Back-to-back eager calls per timed repeat (--eager).
EAGER_CALLS = 100


def _time(prob, cfg) -> float:
    """Median µs of whole ``fused_moe`` calls with ``cfg``, CUDA-graph replay over the problem's sets."""
    from moe_spec.timing import time_cuda_graph
    from triton_moe.moe import fused_moe

    def make_call(i):
        st = prob.sets[i]
        return lambda: fused_moe(**st, config=cfg)

    return time_cuda_graph(make_call, prob.n_sets, replays=15, min_calls=10).median_us


def _eager(prob, cfg) -> float:
    """Median wall µs per whole ``fused_moe`` call with ``cfg`` called back to back, without a graph
    (what a model run eagerly pays: the host path and every launch), going round the problem's sets."""
    import torch

    from moe_spec.timing import wall_us
    from triton_moe.moe import fused_moe

    runs = [lambda st=st: fused_moe(**st, config=cfg) for st in prob.sets]
    return round(wall_us(runs, calls=EAGER_CALLS, repeats=5, sync=torch.cuda.synchronize), 1)


def _row(prob, cfg, grouped_out, ceilings, eager: bool = False) -> dict:
    import torch

    from moe_spec.oracle import rel_l2
    from triton_moe.moe import fused_moe

    st = prob.sets[0]
    out, again = fused_moe(**st, config=cfg), fused_moe(**st, config=cfg)
    us = _time(prob, cfg)
    torch.cuda.synchronize()
    return {
        "us": us,
        **({"eager_us": _eager(prob, cfg)} if eager else {}),
        "pct_floor": prob.roofline(us, ceilings)["pct_of_floor"],
        "rel_l2_vs_grouped": rel_l2(out, grouped_out.double()),
        "bit_identical": bool(torch.equal(out, again)),
    }


def _write(out, results: dict) -> None:
    lines = [
        f"# The one-launch decode kernel on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Whole fused_moe calls, CUDA-graph replay, cold L2, median µs; % floor: the roofline's. decode: the "
        "plan's DecodeConfig; grouped: the rule's TritonConfig (alignment included). rel L2: the decode output "
        "against the grouped pipeline's; bit-identical: a rerun.",
        "",
        "| shape | dtype | T | grouped µs | decode µs | decode / grouped | % floor (decode) | rel L2 | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    eager = results.get("eager")
    if eager:
        lines[-2] += " grouped eager µs | decode eager µs | eager decode / grouped |"
        lines[-4] += " eager: back-to-back calls without a graph, wall µs per call (host path and launches included)."
        lines[-1] += "---|---|---|"
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['T']} | error: {r['error']} |")
            continue
        d = r.get("decode")
        dec = (
            f"{d['us']:.1f} | {d['us'] / r['grouped_us']:.2f} | {d['pct_floor']:.0f} | {d['rel_l2_vs_grouped']:.1e} "
            f"| {d['bit_identical']}"
            if d
            else "– | – | – | – | –"
        )
        if eager:
            ge, de = r.get("grouped_eager_us"), (d or {}).get("eager_us")
            dec += f" | {ge:.1f} | " + (f"{de:.1f} | {de / ge:.2f}" if de else "– | –")
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['grouped_us']:.1f} | {dec} |")
    if results["sweep"]:
        lines += [
            "",
            "## The decode tile (BLOCK_NxBLOCK_KxBLOCK_T/warps,stages)",
            "",
            "| shape | dtype | T | tile | µs | % floor | rel L2 vs grouped |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in results["sweep"]:
            if "error" in r:
                lines.append(f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['tile']} | error: {r['error']} |")
                continue
            best = min(
                o["us"]
                for o in results["sweep"]
                if "us" in o and (o["shape"], o["dtype"], o["T"]) == (r["shape"], r["dtype"], r["T"])
            )
            mark = " (best)" if r["us"] == best else ""
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['tile']}{mark} | {r['us']:.1f} | {r['pct_floor']:.0f} "
                f"| {r['rel_l2_vs_grouped']:.1e} |"
            )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    studyout.write_files(
        out, dict(zip(FILES, ("\n".join(lines) + "\n", json.dumps(results, indent=1, default=str) + "\n")))
    )


def sanitize() -> None:
    """One bf16 and one fp8_block decode call at Qwen3-30B-A3B's shape, T = 1 and 8, no timing: the
    run for ``compute-sanitizer --tool memcheck|racecheck|synccheck``."""
    import torch

    from moe_spec.problem import get_shape
    from moe_spec.validate import check
    from triton_moe.config import DecodeConfig
    from triton_moe.lab.workload import Problem, drop_weights
    from triton_moe.moe import fused_moe

    shape = get_shape("qwen3-30b-a3b")
    for quant in (None, "fp8_block"):
        for T in (1, 8):
            st = Problem(shape, T, quant, n_sets=1).sets[0]
            out = fused_moe(**st, config=DecodeConfig())
            torch.cuda.synchronize()
            check()
            print(f"decode {quant or 'bf16'} T={T}: out {tuple(out.shape)}, finite {bool(out.isfinite().all())}")
        drop_weights()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m triton_moe.lab.bench_decode"
    if argv == ["--sanitize"]:
        from moe_spec.cli import needs_cuda

        needs_cuda(prog)
        sanitize()
        return
    parser = studyout.gpu_study_parser(prog, __doc__, FILES, 540.0)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="catalog shapes, comma separated")
    parser.add_argument("--quants", default=",".join(QUANTS), help="formats, comma separated (bf16, fp8_…)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts of the comparison")
    parser.add_argument("--sweep-tokens", default=",".join(map(str, SWEEP_TOKENS)), help="token counts of the sweep")
    parser.add_argument("--sweep", action="store_true", help="also the tile sweep (minutes of GPU time)")
    parser.add_argument("--no-sweep", action="store_true", help="only the comparison (the default)")
    parser.add_argument("--sanitize", action="store_true", help="alone: one call each for compute-sanitizer")
    parser.add_argument(
        "--eager", action="store_true", help="also each path's eager µs: back-to-back calls, no graph (host included)"
    )
    a, out, run = studyout.start_gpu_study(prog, parser, argv, FILES)
    try:
        shapes = studyout.split_list("--shapes", a.shapes)
        quants = studyout.split_list("--quants", a.quants)
        tokens = studyout.positive_ints("--tokens", a.tokens)
        sweep_tokens = () if a.no_sweep or not a.sweep else studyout.positive_ints("--sweep-tokens", a.sweep_tokens)
    except studyout.UsageError as exc:
        parser.error(str(exc))
    import torch

    from moe_spec.problem import get_shape
    from moe_spec.timing import measure_ceilings
    from triton_moe.config import DecodeConfig
    from triton_moe.decode import PAIR_LANES
    from triton_moe.lab.workload import Problem, drop_weights
    from triton_moe.moe import fused_moe

    start = time.time()
    ceilings = measure_ceilings()
    results = {**run, "ceilings": ceilings.as_dict(), "eager": a.eager, "rows": [], "sweep": [], "cut": []}
    _write(out, results)
    for spec in shapes:
        shape = get_shape(spec)
        for label in quants:
            quant = None if label == "bf16" else label
            for T in sorted(set(tokens) | set(sweep_tokens)):
                if time.time() - start > a.deadline_s - CELL_S:
                    results["cut"].append(f"{spec} {label} T={T}")
                    continue
                row = {"shape": spec, "dtype": label, "T": T}
                try:
                    prob = Problem(shape, T, quant)
                    grouped = prob.config()
                    grouped_out = fused_moe(**prob.sets[0], config=grouped)
                    row.update(grouped_tile=grouped.tile_label(), grouped_us=_time(prob, grouped))
                    if a.eager and T in tokens:
                        row["grouped_eager_us"] = _eager(prob, grouped)
                    decodes = T * shape.top_k <= PAIR_LANES
                    if decodes and T in tokens:
                        cfg = DecodeConfig().check(quant)
                        row.update(decode_tile=cfg.label(), decode=_row(prob, cfg, grouped_out, ceilings, a.eager))
                        row["decode_over_grouped"] = round(row["decode"]["us"] / row["grouped_us"], 3)
                    for fields in CANDIDATES if decodes and T in sweep_tokens else ():
                        cell = {"shape": spec, "dtype": label, "T": T, "tile": repr(fields)}
                        try:
                            cfg = DecodeConfig(**fields).check(quant)
                            cell["tile"] = cfg.label()
                            cell.update(_row(prob, cfg, grouped_out, ceilings))
                        except Exception as exc:  # noqa: BLE001 — a tile the format refuses is a row
                            cell["error"] = repr(exc)[:200]
                        results["sweep"].append(cell)
                    del prob
                except Exception as exc:  # noqa: BLE001 — one failing cell is a row, not the end of the run
                    row["error"] = repr(exc)[:300]
                if T in tokens:
                    results["rows"].append(row)
                print(json.dumps(row, default=str), flush=True)
                _write(out, results)
            drop_weights()
            torch.cuda.empty_cache()
    _write(out, results)
    print(f"\n{(out / 'decode.md').read_text()}")
    print(f"bench_decode done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

"""What static activation scales cost or save: fp8_tensor with the batch's own (dynamic) scales
against calibrated static ones, the whole layer timed on the GPU.

    python -m triton_moe.lab.bench_static --out DIR [--deadline-s 120] [--commit C]

``fused_moe(..., quant="fp8_tensor")`` finds each activation's scale on the device: an
``amax_kernel`` pass over x, a ``tl.atomic_max`` per GEMM1 program into the intermediate's amax,
and a zeroed amax buffer. ``a1_scale`` / ``a2_scale`` (static, calibrated outside the layer) drop
all three and make every token's output row independent of its batch. This study times both on
the same inputs: for each cell, the static scales are those :func:`moe_spec.oracle.calibrate_static_scales`
computes for that batch (what the dynamic layer would use, up to the intermediate's fp32 rounding),
so the two runs quantize alike and differ only in where the scale comes from.

Timed: :func:`triton_moe.fused_moe` — the whole layer, alignment included — CUDA-graph replay over
rotated input sets (cold L2), median µs (:func:`moe_spec.timing.time_cuda_graph`). Checked: rel L2
of each against the fp64 oracle with the same scales (dynamic: the batch's; static: the given ones),
and of static against dynamic.

Writes ``static.json`` and ``static.md`` (date, device, commit, command) into ``--out``, which must
be new or empty; both are rewritten after every row, so the deadline (``--deadline-s``: no cell
starts after it) cuts the tail, never the whole run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moe_spec import studyout

FILES = ("static.md", "static.json")
CELLS = tuple((spec, T) for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8") for T in (1, 128, 4096))
#: A cell starts only when this much time is left before the deadline.
CELL_S = 12.0


def _write(out: Path, results: dict) -> None:
    lines = [
        f"# Static against dynamic activation scales (fp8_tensor) on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Whole layer (`fused_moe`, alignment included), CUDA-graph replay, cold L2, median µs. Static: "
        "`a1_scale`, `a2_scale` calibrated on the same batch. rel L2 against the fp64 oracle with the same "
        "scales; static vs dynamic: rel L2 between the two outputs.",
        "",
        "| shape | T | dynamic µs | static µs | static / dynamic | rel L2 dynamic | rel L2 static "
        "| static vs dynamic |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['T']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['T']} | {r['dynamic_us']:.1f} | {r['static_us']:.1f} | "
            f"{r['static_us'] / r['dynamic_us']:.3f} | {r['rel_l2_dynamic']:.1e} | {r['rel_l2_static']:.1e} | "
            f"{r['static_vs_dynamic']:.1e} |"
        )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    studyout.write_files(
        out, dict(zip(FILES, ("\n".join(lines) + "\n", json.dumps(results, indent=1, default=str) + "\n")))
    )


def _cell(spec: str, T: int) -> dict:
    from moe_spec.oracle import calibrate_static_scales, oracle, rel_l2
    from moe_spec.problem import get_shape
    from moe_spec.timing import time_cuda_graph
    from triton_moe.lab.workload import Problem
    from triton_moe.moe import fused_moe

    prob = Problem(get_shape(spec), T, "fp8_tensor")
    scales = [calibrate_static_scales(**st) for st in prob.sets]

    def timed(static: bool) -> float:
        def make_call(i):
            kw = dict(a1_scale=scales[i][0], a2_scale=scales[i][1]) if static else {}
            return lambda: fused_moe(**prob.sets[i], **kw)

        return time_cuda_graph(make_call, prob.n_sets, replays=15, min_calls=10).median_us

    st = prob.sets[0]
    dyn = fused_moe(**st)
    sta = fused_moe(**st, a1_scale=scales[0][0], a2_scale=scales[0][1])
    row = {
        "rel_l2_dynamic": rel_l2(dyn, oracle(**st)),
        "rel_l2_static": rel_l2(sta, oracle(**st, a1_scale=scales[0][0], a2_scale=scales[0][1])),
        "static_vs_dynamic": rel_l2(sta, dyn),
        "config": prob.config().as_dict(),
    }
    # alternate the two, twice, and keep each one's best: the order must not favour either
    dyn_us, sta_us = [], []
    for _ in range(2):
        dyn_us.append(timed(False))
        sta_us.append(timed(True))
    row.update(dynamic_us=min(dyn_us), static_us=min(sta_us), dynamic_runs=dyn_us, static_runs=sta_us)
    return row


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m triton_moe.lab.bench_static"
    a, out, run = studyout.start_gpu_study(prog, studyout.gpu_study_parser(prog, __doc__, FILES, 120.0), argv, FILES)
    import torch

    from triton_moe.lab.workload import drop_weights

    def after(i: int) -> None:
        if i + 1 == len(CELLS) or CELLS[i + 1][0] != CELLS[i][0]:  # the next cell's weights are another shape's
            drop_weights()
            torch.cuda.empty_cache()

    results = {**run, "rows": [], "cut": []}
    _write(out, results)
    took = studyout.run_cells(
        results,
        [{"shape": spec, "T": T} for spec, T in CELLS],
        lambda cell: _cell(cell["shape"], cell["T"]),
        lambda r: _write(out, r),
        deadline_s=a.deadline_s,
        cell_s=CELL_S,
        after=after,
        shown=lambda row: {k: v for k, v in row.items() if k != "config"},
    )
    print(f"\n{(out / 'static.md').read_text()}")
    print(f"bench_static done in {took:.0f} s")


if __name__ == "__main__":
    main()

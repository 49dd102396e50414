"""What quantizing x in GEMM1's A load is worth: the whole layer with GEMM1 reading bf16 x and
quantizing it itself (``triton_moe.plan.x_quant_in_gemm1``) against the separate path (x's own
``quantize_kernel`` launch, :func:`triton_moe.moe.separate_x_quant`), timed on the GPU.

    python -m triton_moe.lab.bench_x_quant --out DIR [--deadline-s 120] [--commit C]

Cells: Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 TP8 at T = 1, 8, 64 (the rule holds for tiles of
at most 32 rows: decode sizes) for fp8_block, fp8_channel and fp8_tensor with static scales
(calibrated on the batch), each with the plan's own tile. A cell where the rule does not apply is
listed, not timed.

Timed as ``bench_epilogue_quant`` times: :func:`triton_moe.fused_moe`, the whole layer, CUDA-graph
replay over rotated input sets (cold L2), median µs, the two paths alternated twice and each one's
best kept. Checked: the two outputs equal bit for bit, and rel L2 against the fp64 oracle.

Writes ``x_quant.json`` and ``x_quant.md`` into ``--out`` (new or empty), rewritten after every row.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from moe_spec import studyout

FILES = ("x_quant.md", "x_quant.json")
FORMATS = ("fp8_block", "fp8_channel", "fp8_tensor static")
CELLS = tuple(
    (spec, T, fmt)
    for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
    for fmt in FORMATS
    for T in (1, 8, 64)
)
#: A cell starts only when this much time is left before the deadline.
CELL_S = 12.0


def _write(out: Path, results: dict) -> None:
    lines = [
        f"# x quantized in GEMM1's A load against its own quantize launch, on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Whole layer (`fused_moe`, alignment included), CUDA-graph replay, cold L2, median µs. Separate: "
        "`triton_moe.moe.separate_x_quant()` (x → `quantize_kernel` → E4M3 x). Equal: the two outputs bit "
        "for bit. rel L2 against the fp64 oracle.",
        "",
        "| shape | format | T | GEMM1 tile | separate µs | in GEMM1 µs | in GEMM1 / separate | equal | rel L2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        head = f"| {r['shape']} | {r['format']} | {r['T']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error']} |")
        elif not r["applies"]:
            lines.append(f"{head} {r['tile']} | the rule does not apply: not timed |")
        else:
            lines.append(
                f"{head} {r['tile']} | {r['separate_us']:.1f} | {r['in_gemm1_us']:.1f} | "
                f"{r['in_gemm1_us'] / r['separate_us']:.3f} | {'yes' if r['equal'] else 'NO'} | {r['rel_l2']:.1e} |"
            )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    studyout.write_files(
        out, dict(zip(FILES, ("\n".join(lines) + "\n", json.dumps(results, indent=1, default=str) + "\n")))
    )


def _cell(spec: str, T: int, fmt: str) -> dict:
    import torch

    from moe_spec.oracle import calibrate_static_scales, oracle, rel_l2
    from moe_spec.problem import get_shape
    from moe_spec.timing import time_cuda_graph
    from moe_spec.validate import MoEDims
    from triton_moe.lab.workload import Problem
    from triton_moe.moe import fused_moe, separate_x_quant
    from triton_moe.plan import plan

    shape = get_shape(spec)
    quant, static = fmt.split()[0], fmt.endswith("static")
    dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
    p = plan(dims, quant)
    g = p.gemm1
    tile = f"{'swap ' if g.swap_ab else ''}{g.BLOCK_M}x{g.BLOCK_N}x{g.BLOCK_K}" + (
        f" split{g.split_k}" * (g.split_k > 1)
    )
    row = {"tile": tile, "path": p.path, "applies": p.x_quant_in_gemm1(static)}
    if not row["applies"]:
        return row
    prob = Problem(shape, T, quant)
    scales = [calibrate_static_scales(**st) if static else (None, None) for st in prob.sets]

    def call(i):
        a1, a2 = scales[i]
        return fused_moe(**prob.sets[i], **(dict(a1_scale=a1, a2_scale=a2) if static else {}))

    def timed() -> float:
        return time_cuda_graph(lambda i: lambda: call(i), prob.n_sets, replays=15, min_calls=10).median_us

    out = call(0)
    with separate_x_quant():
        ref = call(0)
    a1, a2 = scales[0]
    row.update(
        equal=bool(torch.equal(out.view(torch.int16), ref.view(torch.int16))),
        rel_l2=rel_l2(out, oracle(**prob.sets[0], **(dict(a1_scale=a1, a2_scale=a2) if static else {}))),
    )
    sep_us, in_us = [], []
    for _ in range(2):  # alternate, keep each one's best: the order must not favour either
        with separate_x_quant():
            sep_us.append(timed())
        in_us.append(timed())
    row.update(separate_us=min(sep_us), in_gemm1_us=min(in_us), separate_runs=sep_us, in_gemm1_runs=in_us)
    return row


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m triton_moe.lab.bench_x_quant"
    a, out, run = studyout.start_gpu_study(prog, studyout.gpu_study_parser(prog, __doc__, FILES, 120.0), argv, FILES)
    import torch

    from triton_moe.lab.workload import drop_weights

    start = time.time()
    results = {**run, "rows": [], "cut": []}
    _write(out, results)
    for i, (spec, T, fmt) in enumerate(CELLS):
        if time.time() - start > a.deadline_s - CELL_S:
            results["cut"].append(f"{spec} {fmt} T={T}")
            continue
        row = {"shape": spec, "format": fmt, "T": T}
        try:
            row.update(_cell(spec, T, fmt))
        except Exception as exc:  # noqa: BLE001 — one failing cell is a row, not the end of the run
            row["error"] = repr(exc)[:300]
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        _write(out, results)
        if i + 1 == len(CELLS) or (CELLS[i + 1][0], CELLS[i + 1][2]) != (spec, fmt):  # other weights next
            drop_weights()
            torch.cuda.empty_cache()
    _write(out, results)
    print(f"\n{(out / FILES[0]).read_text()}")
    print(f"bench_x_quant done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

"""What quantizing the FP8 intermediate in GEMM1's epilogue is worth: the whole layer with GEMM1
writing E4M3 (``triton_moe.plan.epilogue_quant``) against the separate path (fp32 intermediate →
``quantize_kernel``, :func:`triton_moe.moe.separate_act_quant`), timed on the GPU.

    python -m triton_moe.lab.bench_epilogue_quant --out DIR [--deadline-s 120] [--commit C]

Cells: Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 TP8 at T = 1, 128, 4096, for fp8_block (the
plan's own tile: the rule applies where GEMM1's BLOCK_N is a multiple of 128) and for fp8_tensor
with static scales (calibrated on the batch by :func:`moe_spec.oracle.calibrate_static_scales`; the
rule applies at every tile). A cell where the rule does not apply is listed, not timed.

Timed: :func:`triton_moe.fused_moe` — the whole layer, alignment included — CUDA-graph replay over
rotated input sets (cold L2), median µs (:func:`moe_spec.timing.time_cuda_graph`), the two paths
alternated twice and each one's best kept. Checked: the two outputs are equal bit for bit (the
epilogue quantizes with ``quantize_kernel``'s helpers), and rel L2 against the fp64 oracle.

Writes ``epilogue_quant.json`` and ``epilogue_quant.md`` (date, device, commit, command) into
``--out``, which must be new or empty; both are rewritten after every row, so the deadline
(``--deadline-s``: no cell starts after it) cuts the tail, never the whole run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from moe_spec import studyout

FILES = ("epilogue_quant.md", "epilogue_quant.json")
FORMATS = ("fp8_block", "fp8_tensor static")
CELLS = tuple(
    (spec, T, fmt)
    for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
    for fmt in FORMATS
    for T in (1, 128, 4096)
)
#: A cell starts only when this much time is left before the deadline.
CELL_S = 12.0


@dataclass(frozen=True)
class Study:
    """One fused-against-separate study of an FP8 quantization: its files, cells and report words, the
    plan's rule (a :class:`~triton_moe.plan.LayerPlan` method taking ``static``) and the
    :mod:`triton_moe.moe` context manager that turns the fused path off.  ``bench_x_quant`` is the other."""

    prog: str
    files: tuple
    cells: tuple
    title: str
    separate: str  # what the separate path is, for the report
    label: str  # the fused path's column name
    key: str  # its key in the rows: "<key>_us", "<key>_runs"
    rule: str  # the LayerPlan method
    switch: str  # the triton_moe.plan constant that turns the fused path on and off (moe.rule_set)


EPILOGUE = Study(
    "python -m triton_moe.lab.bench_epilogue_quant",
    FILES,
    CELLS,
    "The FP8 intermediate quantized in GEMM1's epilogue against a separate pass",
    "`triton_moe.moe.separate_act_quant()` (fp32 intermediate → `quantize_kernel`)",
    "epilogue",
    "epilogue",
    "epilogue_quant",
    "EPILOGUE_QUANT",
)


def _write(out: Path, results: dict, study: Study = EPILOGUE) -> None:
    label, key = study.label, study.key
    lines = [
        f"# {study.title}, on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Whole layer (`fused_moe`, alignment included), CUDA-graph replay, cold L2, median µs. Separate: "
        f"{study.separate}. Equal: the two outputs bit for bit. rel L2 against the fp64 oracle.",
        "",
        f"| shape | format | T | GEMM1 tile | separate µs | {label} µs | {label} / separate | equal | rel L2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        head = f"| {r['shape']} | {r['format']} | {r['T']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error']} |")
        elif not r["applies"]:
            lines.append(f"{head} {r['tile']} | the rule does not apply: not timed |")
        else:
            fused = r[f"{key}_us"]
            lines.append(
                f"{head} {r['tile']} | {r['separate_us']:.1f} | {fused:.1f} | "
                f"{fused / r['separate_us']:.3f} | {'yes' if r['equal'] else 'NO'} | {r['rel_l2']:.1e} |"
            )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    studyout.write_files(
        out, dict(zip(study.files, ("\n".join(lines) + "\n", json.dumps(results, indent=1, default=str) + "\n")))
    )


def _tile(g) -> str:
    split = f" split{g.split_k}" if g.split_k > 1 else ""
    return f"{'swap ' if g.swap_ab else ''}{g.BLOCK_M}x{g.BLOCK_N}x{g.BLOCK_K}{split}"


def _cell(spec: str, T: int, fmt: str, study: Study = EPILOGUE) -> dict:
    from moe_spec.problem import get_shape
    from triton_moe import moe

    quant, static = fmt.split()[0], fmt.endswith("static")
    with moe.rule_set(study.switch, True):  # the fused path where its rule's conditions hold
        return _timed_cell(get_shape(spec), T, quant, static, study)


def _timed_cell(shape, T: int, quant: str, static: bool, study: Study) -> dict:
    import torch

    from moe_spec.oracle import calibrate_static_scales, oracle, rel_l2
    from moe_spec.timing import time_cuda_graph
    from moe_spec.validate import MoEDims
    from triton_moe import moe
    from triton_moe.lab.workload import Problem
    from triton_moe.plan import plan

    dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
    p = plan(dims, quant)
    row = {"tile": _tile(p.gemm1), "path": p.path, "applies": getattr(p, study.rule)(static)}
    if not row["applies"]:
        return row

    def separate():
        return moe.rule_set(study.switch, False)

    prob = Problem(shape, T, quant)
    scales = [calibrate_static_scales(**st) if static else (None, None) for st in prob.sets]

    def call(i):
        a1, a2 = scales[i]
        return moe.fused_moe(**prob.sets[i], **(dict(a1_scale=a1, a2_scale=a2) if static else {}))

    def timed() -> float:
        return time_cuda_graph(lambda i: lambda: call(i), prob.n_sets, replays=15, min_calls=10).median_us

    out = call(0)
    with separate():
        ref = call(0)
    a1, a2 = scales[0]
    row.update(
        equal=bool(torch.equal(out.view(torch.int16), ref.view(torch.int16))),
        rel_l2=rel_l2(out, oracle(**prob.sets[0], **(dict(a1_scale=a1, a2_scale=a2) if static else {}))),
    )
    sep_us, fused_us = [], []
    for _ in range(2):  # alternate, keep each one's best: the order must not favour either
        with separate():
            sep_us.append(timed())
        fused_us.append(timed())
    row.update(separate_us=min(sep_us), separate_runs=sep_us)
    row.update({f"{study.key}_us": min(fused_us), f"{study.key}_runs": fused_us})
    return row


def run(argv, study: Study, doc: str) -> None:
    """The study's command: every cell until the deadline, the report rewritten after each row."""
    a, out, info = studyout.start_gpu_study(
        study.prog, studyout.gpu_study_parser(study.prog, doc, study.files, 120.0), argv, study.files
    )
    import torch

    from triton_moe.lab.workload import drop_weights

    cells = study.cells

    def after(i: int) -> None:
        (spec, _, fmt), later = cells[i], cells[i + 1 :]
        if not later or (later[0][0], later[0][2]) != (spec, fmt):  # the next cell's weights are others
            drop_weights()
            torch.cuda.empty_cache()

    results = {**info, "rows": [], "cut": []}
    _write(out, results, study)
    took = studyout.run_cells(
        results,
        [{"shape": spec, "format": fmt, "T": T} for spec, T, fmt in cells],
        lambda cell: _cell(cell["shape"], cell["T"], cell["format"], study),
        lambda r: _write(out, r, study),
        deadline_s=a.deadline_s,
        cell_s=CELL_S,
        after=after,
    )
    print(f"\n{(out / study.files[0]).read_text()}")
    print(f"{study.prog.rsplit('.', 1)[1]} done in {took:.0f} s")


def main(argv=None):
    run(sys.argv[1:] if argv is None else list(argv), EPILOGUE, __doc__)


if __name__ == "__main__":
    main()

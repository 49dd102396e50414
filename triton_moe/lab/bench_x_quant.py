"""What quantizing x in GEMM1's A load is worth: the whole layer with GEMM1 reading bf16 x and
quantizing it itself (``triton_moe.plan.x_quant_in_gemm1``, its switch turned on for the study: the
product leaves it off) against the separate path (x's own ``quantize_kernel`` launch), timed on the GPU.

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

import sys

from triton_moe.lab.bench_epilogue_quant import Study, run

FILES = ("x_quant.md", "x_quant.json")
FORMATS = ("fp8_block", "fp8_channel", "fp8_tensor static")
CELLS = tuple(
    (spec, T, fmt)
    for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
    for fmt in FORMATS
    for T in (1, 8, 64)
)
X_QUANT = Study(
    "python -m triton_moe.lab.bench_x_quant",
    FILES,
    CELLS,
    "x quantized in GEMM1's A load against its own quantize launch",
    "`triton_moe.moe.separate_x_quant()` (x → `quantize_kernel` → E4M3 x)",
    "in GEMM1",
    "in_gemm1",
    "x_quant_in_gemm1",
    "X_QUANT_IN_GEMM1",
)


def main(argv=None):
    run(sys.argv[1:] if argv is None else list(argv), X_QUANT, __doc__)


if __name__ == "__main__":
    main()

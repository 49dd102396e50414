"""The Triton backend's lab: the benchmarks, studies and the autotuner around the product.

Nothing here is part of a ``fused_moe`` call: the product (``triton_moe``'s top level: the kernels, the
layer, its plan and config, the alignment, the launch path, the warm-up) never imports this package.
Each module is a command that measures something on a GPU and writes a report, or the tables the
product reads (``python -m triton_moe.lab.autotune`` writes ``triton_moe/configs/*.json``):

==========================  ==================================================================================
``bench``                   the target table, the swap-AB sweep and the alignment, on the catalog shapes
``bench_align``             the alignment alone, with and without its small chunks
``bench_gemm2``             GEMM2's own tile (:class:`~triton_moe.config.Gemm2Tile`) against GEMM1's
``bench_splitk``            split-K of GEMM1 at decode
``bench_static``            static against dynamic FP8 activation scales
``bench_epilogue_quant``    the FP8 intermediate quantized in GEMM1's epilogue against a separate pass
``bench_x_quant``           x quantized in GEMM1's A load against its own quantize launch
``bench_tma``               the persistent TMA kernel against the grouped one
``promotion``               FP8 accumulator promotion, accuracy against cost (its own GEMM kernel)
``hostcost``                the host's time per call, Triton's launch path against the direct one
``autotune``                the tuned tables (console script ``moe-triton-autotune``)
``workload``                what the benches share: one problem's inputs, timing and check
==========================  ==================================================================================

Their results are in ``notes/results/`` (each report names its command).
"""

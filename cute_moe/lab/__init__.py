"""The CuTe backend's lab: the benchmarks, studies, the layout explorer and its figures.

Nothing here is part of a ``fused_moe`` call: the product (``cute_moe``'s top level: the kernels, the
layer, its plan and config, the alignment, the compile cache, the warm-up) never imports this package.
Each module is a command that measures or draws something (``python -m cute_moe.lab.X``):

===================  ==================================================================================
``bench``            layer cells, GEMM-level swap-AB against normal, compile time (GPU)
``bench_align``      the token alignment's launches against torch's ops (GPU), and the layer's host cost
``bench_decode``     the one-launch decode kernel against the grouped pipeline, bf16 (GPU)
``bench_gated``      the gated FP8 GEMM1 (SiLU·up, quantization in its epilogue) against the plain one (GPU)
``bench_pingpong``   ping-pong and cluster multicast against cooperative consumers (GPU)
``bench_schedule``   the whole layer, any format, with the plan's GEMMs against their ping-pong twins (GPU)
``crossover``        where swap-AB stops paying, per catalog shape (GPU)
``explore``          the layout explorer: one config's layouts, PTX and pictures, or a layer call's plan (CPU)
``figures``          which pictures are drawn for which config (``notes/figures/``)
``fig_decode``       the one-launch decode kernel's tasks as a modelled timeline
``fig_memory``       shared-memory banks and TMA boxes
``fig_pipeline``     the pipeline of one config as a timeline
``fig_tiles``        accumulator fragments and swap-AB's two tilings
``hostcost``         an eager call's host cost, step by step, against its graph replay (GPU)
``promotion``        the FP8 GEMM without promotion, the variant the promotion study compares against
``sanitize_decode``  calls of the one-launch decode kernel for compute-sanitizer (GPU)
``svg``              the small SVG writer the pictures use
===================  ==================================================================================

Their results are in ``notes/results/`` (each report names its command).
"""

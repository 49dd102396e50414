"""moe_spec — the specification of the MoE problem, shared by both backends and the harness.

This is the lowest layer of the project. It imports nothing of ours; ``cute_moe`` and
``triton_moe`` import only this package (never each other), and ``compare`` imports all three.

- :mod:`moe_spec.quant`    the registry of FP8 formats and the quantize / dequantize reference
- :mod:`moe_spec.problem`  the MoE layer's sizes, the catalog of model shapes, routing, random inputs
- :mod:`moe_spec.validate` the argument checks both backends run before any launch (errors name the argument)
- :mod:`moe_spec.sizes`    the one check of a layer's sizes and device that every surface runs (backend ``Limits``)
- :mod:`moe_spec.errorword` the data checks' device error word, and how it reaches the caller without a sync
- :mod:`moe_spec.oracle`   the float64 oracle with a per-expert breakdown
- :mod:`moe_spec.contract` the backend contract and its vLLM ``fused_experts`` spelling
- :mod:`moe_spec.timing`   CUDA-graph timing with a cold L2, host wall-clock loops, ceilings, rooflines
- :mod:`moe_spec.align`    the one alignment: (token, expert) pairs sorted by expert, each run padded to the tile
- :mod:`moe_spec.plan`     the interface of a backend's plan (its decisions for one call) and the empty-batch rule
- :mod:`moe_spec.hopper`   the Hopper facts both backends' configs read (shared memory, WGMMA shapes, SM count)
- :mod:`moe_spec.runinfo`  what every result file names: date, device, commit, command
- :mod:`moe_spec.studyout` where a study command writes: ``--out`` new or empty, files written whole, the run's header
"""

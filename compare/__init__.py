"""compare — the hub of the lab: the shared problem definition and the proof that both backends agree.

Leaf modules (the backends import these and nothing else from here; they never import each other):

- :mod:`compare.problem`  the MoE problem, FP8 constants, the catalog of model shapes, routing, random inputs
- :mod:`compare.quant`    the FP8 formats (quantize / dequantize), the reference both backends reproduce
- :mod:`compare.validate` argument checks shared by both backends (errors name the argument)
- :mod:`compare.oracle`   the float64 oracle with a per-expert breakdown
- :mod:`compare.contract` the backend contract and its vLLM ``fused_experts`` spelling
- :mod:`compare.timing`   CUDA-graph timing with a cold L2, ceilings, rooflines

The main job (``python -m compare``) and its reports live in the other modules of this package.
"""

from compare.oracle import oracle, oracle_breakdown, rel_l2
from compare.problem import CATALOG, QUANT_FORMATS, MoEInputs, MoEShape, get_shape, make_inputs, route
from compare.validate import MoEDims, validate_moe_args



def __getattr__(name):
    # ``compare.fused_moe(..., backend="auto")``: the router, imported on first use so that the
    # backends, which import the leaf modules above, never pull the main job in with them.
    if name == "fused_moe":
        from compare.router import fused_moe

        return fused_moe
    raise AttributeError(f"module 'compare' has no attribute {name!r}")


__all__ = [
    "CATALOG", "QUANT_FORMATS", "MoEInputs", "MoEShape", "MoEDims", "get_shape", "make_inputs", "route",
    "oracle", "oracle_breakdown", "rel_l2", "validate_moe_args", "fused_moe",
]

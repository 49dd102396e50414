"""cute_moe: a warp-specialized WGMMA grouped GEMM for Mixture-of-Experts, in the CuTe DSL.

Reading order, the product (this folder):

* ``config.py`` — what one GEMM kernel is (:class:`GemmConfig`: tiles, stages, schedule); its
  limits in ``limits.py``.
* ``plan.py`` — every decision of one layer call: the path rule, the two GEMM configs, the pipeline.
* ``gemm.py`` — the kernel, one tile's life (``gemm_parts.py``, ``gemm_plan.py``, ``gemm_rules.py``
  beside it; FP8 scales and promotion in ``fp8_gemm.py``).
* ``rowops.py`` — gather, SiLU·mul, combine; ``quantops.py`` — FP8 activation quantization;
  ``alignops.py`` / ``alignsteps.py`` / ``rowmaps.py`` — the routing alignment and row maps.
* ``moe.py`` — the MoE layer (``moe_fp8.py``: the W8A8 host side; ``unfused.py``: what is fused and
  the ``fusion="separate"`` pipeline; ``ops.py``: the torch operator).
* ``cache.py`` — the one compile cache every kernel compiles through; ``runtime.py`` — torch tensors
  as kernel arguments and their symbolic twins; ``ptx.py`` — a config's PTX on the CPU;
  ``layouts.py`` — the kernel's layouts as plain data; ``warmup.py`` — compile all a layer can use.

The lab (``cute_moe/lab/``: benchmarks, studies, the layout explorer and figures) reads the product
and is never imported by it.
"""

from moe_spec.contract import make_fused_experts

from . import arch  # noqa: F401  (first: sets CUTE_DSL_ARCH before any module below imports cutlass)
from .cache import compile_count
from .config import GemmConfig
from .gemm_plan import compile_gemm
from .layouts import describe, describe_json
from .moe import combine, gather_rows, grouped_gemm, silu_mul, sort_rows
from .ops import fused_moe
from .plan import LayerPlan, choose_config, layer_configs, plan, plans_for
from .ptx import compile_ptx, mma_instruction
from .quantops import compile_quant_kernels
from .rowops import compile_row_kernels
from .warmup import compile_plan, warmup

fused_experts = make_fused_experts(fused_moe)

__all__ = [
    "GemmConfig",
    "LayerPlan",
    "choose_config",
    "combine",
    "compile_count",
    "compile_gemm",
    "compile_plan",
    "compile_ptx",
    "compile_quant_kernels",
    "compile_row_kernels",
    "describe",
    "describe_json",
    "fused_experts",
    "fused_moe",
    "gather_rows",
    "grouped_gemm",
    "layer_configs",
    "mma_instruction",
    "plan",
    "plans_for",
    "silu_mul",
    "sort_rows",
    "warmup",
]

"""cute_moe: a warp-specialized WGMMA grouped GEMM for Mixture-of-Experts, in the CuTe DSL.

Reading order: ``config.py`` (what a kernel is: tiles, stages, the path rule) → ``plan.py`` (the
decisions of one layer call) → ``gemm.py`` (the kernel) → ``rowops.py`` (gather, SiLU·mul,
combine) → ``moe.py`` (routing alignment and the MoE layer) → ``layouts.py`` (the kernel's layouts
as plain data) → ``ptx.py`` (compile on the CPU, the compile cache) → ``warmup.py`` (compile every
kernel a layer can use, before serving) → ``bench.py``.
FP8: ``fp8_gemm.py`` (scales in registers, two-level accumulation) → ``quantops.py`` (activation
quantization kernels) → ``moe_fp8.py`` (the W8A8 layer's host side); ``unfused.py`` (the unfused
pipeline, ``fusion="separate"``); ``runtime.py`` converts torch tensors into kernel arguments for
every host wrapper.
"""

from moe_spec.contract import make_fused_experts

from . import arch  # noqa: F401  (first: sets CUTE_DSL_ARCH before any module below imports cutlass)
from .config import GemmConfig
from .layouts import describe, describe_json
from .moe import combine, gather_rows, grouped_gemm, silu_mul, sort_rows
from .ops import fused_moe
from .plan import LayerPlan, choose_config, layer_configs, plan, plans_for
from .ptx import compile_gemm, compile_ptx, mma_instruction
from .quantops import compile_quant_kernels
from .rowops import compile_row_kernels
from .warmup import compile_plan, warmup
from .cache import compile_count

fused_experts = make_fused_experts(fused_moe)

__all__ = ["GemmConfig", "LayerPlan", "choose_config", "combine", "compile_count", "compile_gemm", "compile_plan",
           "compile_ptx", "compile_quant_kernels", "compile_row_kernels", "describe", "describe_json", "fused_experts",
           "fused_moe", "gather_rows", "grouped_gemm", "layer_configs", "mma_instruction", "plan", "plans_for",
           "silu_mul", "sort_rows", "warmup"]

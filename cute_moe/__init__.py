"""cute_moe: a warp-specialized WGMMA grouped GEMM for Mixture-of-Experts, in the CuTe DSL.

Reading order: ``config.py`` (what a kernel is: tiles, stages, the swap-AB rule) → ``gemm.py``
(the kernel) → ``moe.py`` (routing alignment and the MoE layer) → ``layouts.py`` (the kernel's
layouts as plain data) → ``ptx.py`` (compile on the CPU, the compile cache).
"""

from .config import GemmConfig, choose_config
from .ptx import compile_count, compile_gemm, compile_ptx

__all__ = ["GemmConfig", "choose_config", "compile_count", "compile_gemm", "compile_ptx"]

"""The CPU PTX listing: compile a GEMM configuration without a GPU and read what it compiles to.

:func:`cute_moe.gemm_plan.compile_gemm` builds the kernel from *fake* tensors; the same compiled
object serves the CPU (to read its PTX, here) and the GPU (to launch it).

``compile_ptx(cfg)`` returns the PTX text: the teaching view of what WGMMA, TMA, ``setmaxnreg``
and ``stmatrix`` instructions the config produced, and the CPU test hook.  ``mma_instruction(cfg)``
names the WGMMA the config compiles to, read from the kernel's own tiled MMA.

"""

from __future__ import annotations

import functools

import cutlass.cute as cute

from .config import GemmConfig
from .gemm_plan import KernelPlan, compile_gemm

PTX_TYPES = {"Float32": "f32", "BFloat16": "bf16", "Float16": "f16", "Float8E4M3FN": "e4m3"}
"""DSL element type → the type suffix PTX spells in ``wgmma.mma_async`` (accumulator, A, B)."""


def compile_ptx(cfg: GemmConfig, num_ctas: int | None = None) -> str:
    """PTX of the kernel for ``cfg``, compiled on the CPU (no GPU needed)."""
    return compile_gemm(cfg, num_ctas, keep_ptx=True).__ptx__


@functools.cache
def mma_instruction(cfg: GemmConfig) -> str:
    """The ``wgmma.mma_async`` instruction ``cfg`` compiles to, as PTX spells it.

    Read from the kernel's own tiled MMA (:class:`~cute_moe.gemm_plan.KernelPlan`, built in a jit
    context without compiling the kernel): the atom's instruction shape and operand types.
    """
    found = {}

    @cute.jit
    def probe():
        op = KernelPlan(cfg).tiled_mma.op
        found["mnk"] = tuple(int(v) for v in op.shape_mnk)
        found["types"] = tuple(PTX_TYPES[str(t)] for t in (op.acc_dtype, op.a_dtype, op.b_dtype))

    probe()
    return "wgmma.mma_async.sync.aligned.m{}n{}k{}.".format(*found["mnk"]) + ".".join(found["types"])

"""The layer's activation, one definition for every kernel that applies it: the row kernels (:mod:`cute_moe.rowops`),
the gated GEMM1's epilogue (:mod:`cute_moe.gemm`), the quantize kernels (:mod:`cute_moe.quantops`) and the one
launch (:mod:`cute_moe.decode_steps`, :mod:`cute_moe.decode_quant`).  This module imports nothing of the package.
"""

import cutlass
import cutlass.cute as cute


def silu_mul(gate, up):
    """``SiLU(gate) · up = gate / (1 + e^(−gate)) · up`` in fp32, on register vectors of any dtype.

    The one definition of the layer's activation: ``SiluMul`` rounds it to bf16, the FP8 layer's
    ``quantops.RowAmax`` keeps it in fp32 for quantization.
    """
    g, u = gate.to(cutlass.Float32), up.to(cutlass.Float32)
    return g / (1.0 + cute.math.exp(-g, fastmath=True)) * u

"""The FP8 quantization's device arithmetic, one definition for the quantize kernels (:mod:`cute_moe.quantops`)
and the gated GEMM1's epilogue (:mod:`cute_moe.epilogue_quant`), so both compute the same bits.

Every maximum is PTX ``max.NaN.f32`` (NaN in, NaN out: ``torch.amax``'s semantics); the amax atomic is an
integer max on the bits of non-negative values, where NaN ranks above +inf; the scale is
``max(amax, 1e-12) / 448`` by IEEE division (``div.rn.f32``), as :mod:`moe_spec.quant` computes it.  This
module imports nothing of the package.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from moe_spec.quant import AMAX_FLOOR, FP8_MAX


@cute.jit
def max_nan(a, b):
    """IEEE 754 ``maximum``: NaN if either operand is NaN (PTX ``max.NaN.f32``)."""
    return cute.arch.fmax(a, b, nan=True)


@cute.jit
def bfly_max_nan(v, offsets: tuple):
    """The maximum of ``v`` over the lanes ``lane ^ x`` for every XOR combination of ``offsets``, in each
    of them, NaN-propagating: one butterfly shuffle per offset."""
    for x in cutlass.range_constexpr(len(offsets)):
        v = max_nan(v, cute.arch.shuffle_sync_bfly(v, offset=offsets[x]))
    return v


@cute.jit
def atomic_amax(ptr, v):
    """``*ptr = max(*ptr, v)`` for non-negative ``v``: an integer max on the bits (NaN above +inf)."""
    cute.arch.atomic_fmax(ptr, v, sign_bit=False)


@cute.jit
def scale_of(amax):
    """The E4M3 scale of an amax: ``max(amax, 1e-12) / 448``, an IEEE division as moe_spec.quant computes it."""
    return cutlass.max(amax, cutlass.Float32(AMAX_FLOOR)) / cutlass.Float32(FP8_MAX)


@cute.jit
def flag_bad_scale(s, word: cute.Tensor, bad_bit: int):
    """OR ``bad_bit`` into the error word when the static scale ``s`` is not finite and positive (NaN fails
    both compares, −0.0 the first); the scale is used as given all the same."""
    if (s > cutlass.Float32(0.0)) & (s < cutlass.Float32(float("inf"))):
        pass
    else:
        cute.arch.atomic_or(word.iterator, cutlass.Int32(bad_bit))

"""Which argument classes Triton 3.6 still puts in the cache key (notes/triton_moe.md, "Recompilation").

The key is computed by Triton's own binder (``triton_moe.jit.specialization_key``), the lookup a
GPU launch performs. ``amax_kernel(x_ptr, amax_ptr, num_rows, K, BLOCK)`` has ``num_rows`` in
``do_not_specialize`` and ``K`` specialized.
"""

import torch

from triton_moe.jit import specialization_key
from triton_moe.kernels_rows import amax_kernel

X, AMAX = torch.empty(4, 4), torch.empty(1)


def _key(num_rows, K=17):
    return specialization_key(amax_kernel, (X, AMAX, num_rows, K), dict(BLOCK=128))


def test_do_not_specialize_keeps_the_integer_type_in_the_key():
    # no value class (== 1, divisible by 16) for num_rows, but its type: i32 up to 2**31 − 1, then i64
    assert len({_key(n) for n in (1, 16, 17, 1000, 2**31 - 1)}) == 1
    assert "('i32', None)" in _key(2**31 - 1) and "('i64', None)" in _key(2**31)
    assert _key(2**31) != _key(2**31 - 1)


def test_specialized_integers_carry_their_value_class():
    # an integer equal to 1 becomes a constant; one divisible by 16 carries the divisibility mark 'D'
    assert "('constexpr', 1)" in _key(5, K=1)
    assert "('i32', 'D')" in _key(5, K=16) and "('i32', '')" in _key(5, K=17)
    assert len({_key(5, K) for K in (1, 16, 17)}) == 3

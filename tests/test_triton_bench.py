"""triton_moe.lab.workload helpers that do not need a GPU: the weights it times are compare's weights."""

import pytest
import torch

from moe_spec.problem import MoEShape, draw_weights, get_shape
from moe_spec.quant import quantize_weight
from triton_moe.lab import workload as bench

SHAPE = MoEShape("bench-tiny", 4, 2, 64, 48, "test shape")


@pytest.mark.parametrize("quant", [None, "fp8_channel", "fp8_block"], ids=lambda q: q or "bf16")
def test_make_weights_are_draw_weights(quant):
    w1, w2, s1, s2 = bench.make_weights(SHAPE, quant, 3, device="cpu")
    r1, r2 = draw_weights(SHAPE, 3)
    if quant is None:
        assert s1 is None and s2 is None
        assert torch.equal(w1, r1) and torch.equal(w2, r2)
    else:
        (q1, t1), (q2, t2) = quantize_weight(r1, quant), quantize_weight(r2, quant)
        assert torch.equal(w1.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s1, t1)
        assert torch.equal(w2.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s2, t2)


def test_weight_bytes():
    mixtral = get_shape("mixtral-8x7b")
    assert bench.weight_bytes(mixtral, None) == 8 * 3 * 14336 * 4096 * 2  # 2.8 GB: W1 [2I, K] + W2 [K, I]
    assert bench.weight_bytes(mixtral, "fp8_tensor") == 8 * 3 * 14336 * 4096

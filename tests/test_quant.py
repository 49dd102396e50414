"""The FP8 formats: scale shapes, saturation, round trip error, and the E4M3 grid."""

import pytest
import torch

from moe_spec.quant import FP8_MAX
from moe_spec.quant import (activation_scale_shape, dequantize_activation, dequantize_weight,
                           quantize_activation, quantize_weight, weight_scale_shape)

FMTS = ["fp8_tensor", "fp8_channel", "fp8_block"]


@pytest.mark.parametrize("fmt", FMTS)
def test_weight_round_trip(fmt):
    w = torch.randn(3, 200, 300) * torch.logspace(-4, 1, 200)[None, :, None]
    q, s = quantize_weight(w, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == weight_scale_shape(fmt, 3, 200, 300)
    back = dequantize_weight(q, s, fmt)
    # Every group's amax maps to exactly ±448, so the max element reconstructs to within 1 ulp (2^-3 rel at 448).
    assert q.float().abs().max() == FP8_MAX
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < 0.04  # E4M3: 3 mantissa bits → ≤ 2^-4 relative per element, rms ~ 2^-4/√3
    if fmt != "fp8_tensor":  # finer scales keep small rows out of the subnormal range
        coarse = dequantize_weight(*quantize_weight(w, "fp8_tensor"), "fp8_tensor")
        row_err = lambda v: ((v - w).norm(dim=2) / w.norm(dim=2)).max().item()  # noqa: E731
        assert row_err(back) < 0.05 < row_err(coarse)


@pytest.mark.parametrize("fmt", FMTS)
def test_activation_round_trip_and_shapes(fmt):
    a = torch.randn(7, 260).bfloat16()
    q, s = quantize_activation(a, fmt)
    assert tuple(s.shape) == activation_scale_shape(fmt, 7, 260)
    back = dequantize_activation(q, s, fmt)
    assert ((back - a.float()).norm() / a.float().norm()).item() < 0.04


def test_values_on_the_grid_survive_exactly():
    # With scale 1 (amax exactly 448) every E4M3 value is representable and must come back bit-exact.
    grid = torch.tensor([448.0, 1.0, 0.5, -3.25, 0.015625, 0.0, -448.0])
    q, s = quantize_activation(grid[None], "fp8_tensor")
    assert s.item() == 1.0
    assert torch.equal(dequantize_activation(q, s, "fp8_tensor")[0], grid)


def test_block_scales_follow_their_block():
    w = torch.ones(1, 256, 256)
    w[0, 128:, 128:] = 100.0  # one hot block
    q, s = quantize_weight(w, "fp8_block")
    assert torch.allclose(s[0], torch.tensor([[1.0, 1.0], [1.0, 100.0]]) / FP8_MAX)


def test_zero_group_gets_finite_scale():
    q, s = quantize_activation(torch.zeros(2, 130).bfloat16(), "fp8_block")
    assert torch.isfinite(s).all() and (s > 0).all() and torch.all(q.float() == 0)

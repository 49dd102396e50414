"""The format registry and the FP8 reference: scale shapes, saturation, round trip error, the E4M3
grid, and what a NaN or inf does to its scale group."""

import dataclasses

import pytest
import torch

from moe_spec.quant import (
    FORMATS,
    FP8_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    QUANT_FORMATS,
    QuantFormat,
    activation_scale_shape,
    check_quant,
    dequantize_activation,
    dequantize_weight,
    get_format,
    quantize_activation,
    quantize_weight,
    weight_scale_shape,
)

FMTS = [q for q in QUANT_FORMATS if get_format(q).quantized]


def test_the_registry_is_the_contract():
    assert list(FORMATS) == [None, "fp8_tensor", "fp8_channel", "fp8_block"] == list(QUANT_FORMATS)
    assert FMTS == ["fp8_tensor", "fp8_channel", "fp8_block"]
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, QuantFormat) and fmt.name == name and get_format(name) is fmt
        assert check_quant(name) == name
        assert fmt.label == ("bf16" if name is None else name)
        assert fmt.weight_dtype == (torch.bfloat16 if name is None else FP8_DTYPE)
        assert fmt.quantized == (name is not None)
    assert len({f.mode for f in FORMATS.values()}) == len(FORMATS) and FORMATS[None].mode == 0
    assert [f.scales_along_k for f in FORMATS.values()] == [False, False, False, True]
    with pytest.raises(dataclasses.FrozenInstanceError):
        FORMATS[None].tolerance = 1.0  # frozen


@pytest.mark.parametrize("bad", ["fp8", "FP8_TENSOR", "bf16", 0, ["fp8_block"]])
def test_unknown_formats_are_named(bad):
    for call in (get_format, check_quant, lambda q: weight_scale_shape(q, 1, 2, 3)):
        with pytest.raises(ValueError, match="^quant: expected one of None, 'fp8_tensor'"):
            call(bad)


def test_bf16_has_no_scales():
    bf16 = get_format(None)
    assert bf16.weight_scale_shape(4, 8, 16) is None
    for call in (
        lambda: weight_scale_shape(None, 4, 8, 16),
        lambda: activation_scale_shape(None, 2, 16),
        lambda: quantize_weight(torch.ones(1, 2, 2), None),
        lambda: quantize_activation(torch.ones(2, 2), None),
    ):
        with pytest.raises(ValueError, match="^quant: .* needs an fp8 format"):
            call()
    w = torch.randn(2, 3, 4).bfloat16()
    assert torch.equal(dequantize_weight(w, None, None, torch.float64), w.double())


@pytest.mark.parametrize(
    "fmt, E, N, K, shape",
    [
        ("fp8_tensor", 3, 200, 300, (3,)),
        ("fp8_channel", 3, 200, 300, (3, 200)),
        ("fp8_block", 3, 200, 300, (3, 2, 3)),
        ("fp8_block", 1, 128, 256, (1, 1, 2)),
    ],
)
def test_weight_scale_shapes(fmt, E, N, K, shape):
    assert weight_scale_shape(fmt, E, N, K) == get_format(fmt).weight_scale_shape(E, N, K) == shape


@pytest.mark.parametrize("fmt, shape", [("fp8_tensor", (1,)), ("fp8_channel", (7, 1)), ("fp8_block", (7, 3))])
def test_activation_scale_shapes(fmt, shape):
    assert activation_scale_shape(fmt, 7, 260) == shape


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


# --- NaN and inf: a scale group is the blast radius of a non-finite value --------------------------


def _weight_group_mask(fmt, E, N, K, e, n, k):
    """[E, N, K] bool: the values that share a scale with w[e, n, k], by direct indexing."""
    m = torch.zeros(E, N, K, dtype=torch.bool)
    if fmt == "fp8_tensor":
        m[e] = True
    elif fmt == "fp8_channel":
        m[e, n] = True
    else:
        b = FP8_BLOCK
        m[e, n // b * b : (n // b + 1) * b, k // b * b : (k // b + 1) * b] = True
    return m


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("fmt", FMTS)
def test_a_non_finite_weight_poisons_exactly_its_scale_group(fmt, value):
    E, N, K = 2, 260, 300
    w = torch.randn(E, N, K)
    w[1, 200, 140] = value
    back = dequantize_weight(*quantize_weight(w, fmt), fmt)
    assert torch.equal(back.isnan(), _weight_group_mask(fmt, E, N, K, 1, 200, 140))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("fmt", FMTS)
def test_a_non_finite_activation_poisons_exactly_its_scale_group(fmt, value):
    a = torch.randn(5, 300).bfloat16()
    a[3, 150] = value
    q, s = quantize_activation(a, fmt)
    back = dequantize_activation(q, s, fmt)
    expected = torch.zeros(5, 300, dtype=torch.bool)
    rows = slice(None) if fmt == "fp8_tensor" else 3
    cols = slice(128, 256) if fmt == "fp8_block" else slice(None)
    expected[rows, cols] = True
    assert torch.equal(back.isnan(), expected)
    assert int((~torch.isfinite(s)).sum()) == 1  # the one scale of that group (NaN, or inf)

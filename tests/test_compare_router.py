"""compare.router on a synthetic table: nearest T, ties, unknown layers, formats, and the table builder."""

import pytest
import torch

from compare import router
from compare.baselines import loop_fused_moe
from moe_spec.problem import MoEShape, get_shape, make_inputs

MIX = get_shape("mixtral-8x7b")


def _entry(shape, quant, T, backend):
    return {
        "shape": shape.label,
        "E": shape.num_experts,
        "K": shape.hidden,
        "I": shape.intermediate,
        "top_k": shape.top_k,
        "quant": quant,
        "T": T,
        "backend": backend,
        "us": {backend: 1.0},
    }


TABLE = {
    "entries": [
        _entry(MIX, "bf16", 1, "cute_moe"),
        _entry(MIX, "bf16", 32, "cute_moe"),
        _entry(MIX, "bf16", 1024, "triton_moe"),
        _entry(MIX, "fp8_tensor", 1, "triton_moe"),
        _entry(MIX, "fp8_tensor", 4096, "torch_grouped"),
        _entry(get_shape("deepseek-v3:tp8"), "bf16", 8, "torch_grouped"),
        _entry(get_shape("qwen3-30b-a3b"), "bf16", 8, "torch_grouped"),
    ]
}


@pytest.mark.parametrize(
    "T, expected",
    [
        (1, "cute_moe"),
        (4, "cute_moe"),
        (40, "cute_moe"),
        (170, "cute_moe"),
        (200, "triton_moe"),
        (100000, "triton_moe"),
    ],
)
def test_nearest_T_in_log_space(T, expected):
    # log2 distance: 181 is the geometric midpoint of 32 and 1024; a tie goes to the smaller T
    assert router.choose_backend(MIX, None, T, TABLE) == expected


def test_exact_log_tie_goes_to_the_smaller_T():
    table = {"entries": [_entry(MIX, "bf16", 8, "a"), _entry(MIX, "bf16", 32, "b")]}
    assert router.choose_backend(MIX, None, 16, table) == "a"


def test_format_and_shape_spellings():
    assert router.choose_backend("mixtral-8x7b", "fp8_tensor", 2, TABLE) == "triton_moe"
    assert router.choose_backend(MIX, "fp8_tensor", 3000, TABLE) == "torch_grouped"
    assert router.choose_backend(MIX, "fp8_block", 8, TABLE) == router.FALLBACK  # format never measured
    assert router.choose_backend(MIX, None, 8, {"entries": []}) == router.FALLBACK


def test_unmeasured_layer_takes_the_majority_at_the_nearest_T():
    other = MoEShape("other", 64, 4, 1024, 512, "test")
    assert router.choose_backend(other, None, 8, TABLE) == "torch_grouped"  # 2 of the 2 entries at T = 8


def test_build_table_keeps_only_correct_timed_rows():
    base = {"shape": "mixtral-8x7b", "E": 8, "K": 4096, "I": 14336, "top_k": 2, "quant": "bf16", "T": 8}
    rows = [
        {**base, "backend": "fast_but_wrong", "status": "FAIL", "us": 1.0},
        {**base, "backend": "disagrees", "status": "ok", "us": 2.0, "xdiff_ok": False},
        {**base, "backend": "untimed", "status": "ok"},
        {**base, "backend": "slow", "status": "ok", "us": 9.0},
        {**base, "backend": "good", "status": "ok", "us": 5.0},
        {**base, "backend": "refused", "status": "not available: no"},
    ]
    table = router.build_table(rows, {"device": "test"})
    assert [e["backend"] for e in table["entries"]] == ["good"]
    assert table["entries"][0]["us"] == {"slow": 9.0, "good": 5.0}
    assert router.choose_backend(MIX, None, 8, table) == "good"


def test_shipped_table_is_the_measured_h200_one():
    table = router.load_table()
    assert table["placeholder"] is False and table["device"] == "NVIDIA H200" and table["commit"]
    for e in table["entries"]:
        assert {"E", "K", "I", "top_k", "quant", "T", "backend"} <= set(e)
        assert e["backend"] == min(e["us"], key=e["us"].get)  # the fastest correct one was recorded
    cases = {(e["shape"], e["quant"]) for e in table["entries"]}
    for shape in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"):
        assert {(shape, "bf16"), (shape, "fp8_tensor")} <= cases
    # the table's own entries route to themselves
    for e in table["entries"]:
        assert router.choose_backend(e["shape"], None if e["quant"] == "bf16" else e["quant"], e["T"]) == e["backend"]


def test_auto_routing_validates_before_reading_shapes():
    inputs = make_inputs(MoEShape("s", 8, 2, 256, 128, "test"), 4, None, seed=0)
    with pytest.raises(TypeError, match="^w1:"):
        router.fused_moe(**{**inputs.kwargs(), "w1": [[1.0]]}, backend="auto")


def test_auto_fused_moe_on_cpu_routes_to_the_cpu_backend():
    inputs = make_inputs(MoEShape("s", 8, 2, 256, 128, "test"), 4, None, seed=0)
    out = router.fused_moe(**inputs.kwargs(), backend="auto")
    assert torch.equal(out, loop_fused_moe(**inputs.kwargs()))
    with pytest.raises(ValueError, match="unknown backend"):
        router.fused_moe(**inputs.kwargs(), backend="nope")

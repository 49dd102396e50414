"""compare.metrics: known answers for every measure, and the tolerance policy on real (CPU) runs."""

import math

import pytest
import torch

from compare import metrics
from compare.baselines import loop_fused_moe
from compare.cases import draw_weights
from compare.numerics import expert_table as _expert_table
from moe_spec.oracle import oracle, oracle_breakdown
from moe_spec.problem import MoEShape, make_inputs

SMALL = MoEShape("small", num_experts=8, top_k=2, hidden=256, intermediate=128, source="test")


@pytest.mark.parametrize(
    "value, ulp",
    [
        (1.0, 2.0**-7),
        (1.5, 2.0**-7),
        (2.0, 2.0**-6),
        (0.75, 2.0**-8),
        (-3.0, 2.0**-6),
        (0.0, 2.0**-133),
        (1e-40, 2.0**-133),
    ],
)
def test_bf16_ulp_known_values(value, ulp):
    assert float(metrics.bf16_ulp(torch.tensor([value]))[0]) == ulp


def test_bf16_ulp_is_the_spacing_of_bf16():
    x = torch.tensor([1.0, 3.0, 100.0, 0.01, 7e-39], dtype=torch.bfloat16)  # the last one is subnormal
    nxt = (x.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 up (positive x)
    assert torch.equal(nxt.double() - x.double(), metrics.bf16_ulp(x))


def test_errors_known_answers():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    out = ref * (1 + 1e-3)
    e = metrics.errors(out, ref)
    assert e.rel_l2 == pytest.approx(1e-3)
    assert e.max_abs == pytest.approx(4e-3)
    assert e.cosine == pytest.approx(1.0)
    assert metrics.cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == 0.0
    assert metrics.cosine(torch.tensor([1.0, 1.0]), torch.tensor([-1.0, -1.0])) == pytest.approx(-1.0)
    assert metrics.rel_l2(torch.zeros(3), torch.zeros(3)) == 0.0
    assert math.isinf(metrics.rel_l2(torch.ones(3), torch.zeros(3)))
    with pytest.raises(ValueError, match="shape"):
        metrics.errors(torch.zeros(2, 3), torch.zeros(3, 2))


def test_max_ulp_counts_ulps_with_the_rms_floor():
    ref = torch.ones(4, 8, dtype=torch.float64)
    assert metrics.max_ulp(ref + 2.0**-7, ref) == pytest.approx(1.0)
    assert metrics.max_ulp(ref + 3 * 2.0**-7, ref) == pytest.approx(3.0)
    # an element that cancels to ~0 is measured in the ULP of the typical output (rms ≈ 1.5 here)
    ref = ref * 1.5
    ref[0, 0] = 1e-6
    out = ref.clone()
    out[0, 0] += 2.0**-7
    assert metrics.max_ulp(out, ref) == pytest.approx(1.0, rel=1e-3)
    assert metrics.max_ulp(torch.empty(0), torch.empty(0)) == 0.0


def test_bitwise_equal_compares_bits():
    a = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    assert metrics.bitwise_equal(a, a.clone())
    assert not metrics.bitwise_equal(a, -a)  # -0.0 == 0.0 numerically, not bitwise
    assert not metrics.bitwise_equal(a, a.float())
    nan = torch.tensor([float("nan")])
    assert metrics.bitwise_equal(nan, nan.clone())


def test_check_names_every_failed_bound_and_fails_nan():
    good = metrics.Errors(rel_l2=1e-3, max_abs=1e-3, max_ulp=2.0, cosine=0.999999)
    assert metrics.check(good, None) == (True, "ok")
    bad = metrics.Errors(rel_l2=0.2, max_abs=1.0, max_ulp=100.0, cosine=0.9)
    ok, why = metrics.check(bad, None)
    assert not ok and "rel_l2" in why and "cosine" in why and "max_ulp" in why
    ok, why = metrics.check(bad, "fp8_tensor")
    assert not ok and "max_ulp" not in why  # FP8 does not gate the worst element
    nan = metrics.Errors(float("nan"), float("nan"), float("nan"), float("nan"))
    assert not metrics.check(nan, "fp8_block")[0]
    with pytest.raises(ValueError, match="tolerance"):
        metrics.tolerance_for("int4")
    assert metrics.cross_backend_tolerance(None) == 2 * metrics.TOLERANCES["bf16"].rel_l2


def test_policy_is_read_from_the_format_registry():
    from moe_spec.quant import FORMATS

    assert list(metrics.TOLERANCES) == [f.label for f in FORMATS.values()]
    for quant, fmt in FORMATS.items():
        tol = metrics.tolerance_for(quant)
        assert metrics.quant_name(quant) == fmt.label and tol is metrics.TOLERANCES[fmt.label]
        assert tol.rel_l2 == fmt.tolerance and metrics.cross_backend_tolerance(quant) == 2 * fmt.tolerance
        # the policy of notes/numerics.md: ULPs gate bf16 only, the quantization error FP8 only
        assert (tol.cosine, tol.max_ulp, tol.quant_error) == (
            (0.9999, None, 0.12) if fmt.quantized else (0.9999, 16.0, None)
        )
    assert metrics.quant_name(None) == "bf16"
    with pytest.raises(ValueError, match="^quant: no tolerance policy for 'int4'"):
        metrics.tolerance_for("int4")
    with pytest.raises(ValueError, match="^quant:"):
        metrics.quant_name("int4")


# --- the policy against real implementations: correct ones pass, broken ones fail --------------


@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_channel", "fp8_block"])
@pytest.mark.parametrize("T", [1, 32])
def test_policy_passes_the_plain_torch_loop(quant, T):
    for seed in range(3):
        inputs = make_inputs(SMALL, T, quant, seed=seed)
        err = metrics.errors(loop_fused_moe(**inputs.kwargs()), oracle(**inputs.kwargs()))
        assert metrics.check(err, quant) == (True, "ok"), (seed, err)


def _broken_runs(quant):
    inputs = make_inputs(SMALL, 16, quant, seed=1)
    kw = inputs.kwargs()
    yield "wrong expert", loop_fused_moe(**{**kw, "topk_ids": (inputs.topk_ids + 1) % SMALL.num_experts})
    yield "routing weight ignored", loop_fused_moe(**{**kw, "topk_weights": torch.full_like(inputs.topk_weights, 0.5)})
    if quant is not None:
        yield "scale 15 % off", loop_fused_moe(**{**kw, "w1_scale": inputs.w1_scale * 1.15})
    out = loop_fused_moe(**kw).clone()
    out[3] = 0
    yield "one token dropped", out


@pytest.mark.parametrize("quant", [None, "fp8_tensor"])
def test_policy_fails_broken_implementations(quant):
    inputs = make_inputs(SMALL, 16, quant, seed=1)
    ref = oracle(**inputs.kwargs())
    for what, out in _broken_runs(quant):
        ok, why = metrics.check(metrics.errors(out, ref), quant)
        assert not ok, f"{what} passed the {quant} policy"


# --- per-expert attribution ----------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2])
def test_kernel_error_is_attributed_to_the_broken_expert(top_k):
    shape = MoEShape("k", num_experts=8, top_k=top_k, hidden=256, intermediate=128, source="test")
    inputs = make_inputs(shape, 64, None, seed=2)
    ref = oracle(**inputs.kwargs())
    out = loop_fused_moe(**inputs.kwargs()).clone()
    bad = (inputs.topk_ids == 3).any(-1)
    out[bad] = (out[bad].float() * 1.2).to(out.dtype)  # expert 3's tokens are 20 % off
    per_expert = metrics.kernel_error_by_expert(out, ref, inputs.topk_ids, shape.num_experts)
    flags = metrics.flag_outliers(per_expert, factor=4.0, bound=metrics.TOLERANCES["bf16"].rel_l2)
    assert max(range(8), key=lambda e: per_expert[e]) == 3 and flags[3]
    if top_k == 1:  # every token belongs to one expert: the attribution is exact
        assert "median" in flags[3] and [e for e in range(8) if flags[e]] == [3]


def test_flag_outliers_relative_and_absolute():
    assert metrics.flag_outliers([1.0, 1.1, 0.9, 10.0], factor=4, bound=None) == ["", "", "", "9.1x median"]
    flags = metrics.flag_outliers([0.5, 0.5, 0.5, None], factor=3, bound=0.12)
    assert flags[:3] == ["> 0.12"] * 3 and flags[3] == ""
    assert metrics.flag_outliers([1.0, 5.0], factor=2, bound=None) == ["", ""]  # too few to judge


@pytest.mark.parametrize("quant, collapses", [("fp8_tensor", True), ("fp8_channel", False)])
def test_shared_scale_collapse_is_flagged_per_expert(quant, collapses):
    """One loud expert (W1 × 100) under a per-tensor intermediate scale drowns the others."""
    weights = draw_weights(SMALL, seed=0, device="cpu", outlier=100.0)
    inputs = make_inputs(SMALL, 32, quant, seed=0, weights_bf16=weights)
    plain = make_inputs(SMALL, 32, None, seed=0, weights_bf16=weights)
    ref, ref_bf16 = oracle_breakdown(**inputs.kwargs()), oracle_breakdown(**plain.kwargs())
    table = _expert_table(ref, ref_bf16, {}, quant, SMALL.num_experts)
    flagged = [e["expert"] for e in table if "quant" in e["flags"]]
    if collapses:
        assert len(flagged) >= SMALL.num_experts - 2 and 0 not in flagged
    else:
        assert flagged == []

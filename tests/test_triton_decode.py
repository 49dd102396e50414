"""The one-launch decode kernel (triton_moe.decode) on the CPU (Triton interpreter), and on the GPU (``-m gpu``).

Under the interpreter programs run one after another, so program 0 claims every task in order and
finds each counter it waits on complete: these tests run the kernel itself, its task numbering,
counters and their reset. Shapes are small (K = 256, I = 128 or 256) so that the file runs in a
few minutes.
"""

import importlib

import pytest
import torch

import triton_moe
from moe_spec.oracle import calibrate_static_scales, oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.validate import (
    BAD_A2_SCALE,
    BAD_ID,
    BAD_W2_SCALE,
    BAD_WEIGHT,
    REPEATED_ID,
    MoEDims,
    check,
)
from triton_moe import decode, decode_host
from triton_moe.config import DecodeConfig, TritonConfig
from triton_moe.jit import count_compilations
from triton_moe.plan import plan, plans_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array:DeprecationWarning",
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning",
)

QUANTS = [None, "fp8_tensor", "fp8_channel", "fp8_block"]
ALL_FORMATS = ("bf16", "fp8_tensor", "fp8_channel", "fp8_block")
TOL = 1e-2
CFG = DecodeConfig(BLOCK_N=64, BLOCK_K=64, BLOCK_T=16, num_warps=4, num_stages=2)

# (E, top_k, K, I, T): one token; an expert chosen by several tokens; every expert of E = 16 at T = 8
CASES = [(8, 2, 256, 128, 1), (8, 2, 256, 128, 5), (16, 8, 256, 128, 8), (12, 4, 256, 256, 2)]


#: The formats the shipped rule sends to the decode kernel (triton_moe.plan.DECODE_FORMATS); these
#: tests run the kernel in every format on the default path (the ``every_format_decodes`` fixture).
_PLAN = importlib.import_module("triton_moe.plan")  # the module (triton_moe.plan is also the function)
SHIPPED_RULE = (_PLAN.DECODE_FORMATS, _PLAN.DECODE_MAX_PAIRS)
#: The rule these tests run under: every format, up to the kernel's pair lanes.
KERNEL_RULE = (ALL_FORMATS, 64)


@pytest.fixture(autouse=True)
def every_format_decodes(monkeypatch):
    """The decode path for every format up to 64 pairs by default (the kernel's whole reach), cached
    plans dropped before and after."""
    from triton_moe.moe import forget_plans

    forget_plans()
    monkeypatch.setattr(_PLAN, "DECODE_FORMATS", KERNEL_RULE[0])
    monkeypatch.setattr(_PLAN, "DECODE_MAX_PAIRS", KERNEL_RULE[1])
    yield
    forget_plans()


def test_the_shipped_rule_is_where_the_h200_measured_the_kernel_faster():
    """bf16 at T·top_k ≤ 2 (notes/results/decode_h200_2026-12-04_first.md: Mixtral-8x7B T = 1 0.96×
    the grouped pipeline, every other bf16 cell 1.02–1.21×; FP8 not yet measured since its rewrite)."""
    assert SHIPPED_RULE == (("bf16",), 2)
    assert decode.PAIR_LANES >= KERNEL_RULE[1]


def _inputs(E, top_k, K, I, T, quant, seed=1):  # noqa: E741
    return make_inputs(MoEShape("decode", E, top_k, K, I, "test"), T, quant, seed=seed)


def _counters_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in decode_host._counter_blocks.values())


@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}k{}K{}I{}T{}".format(*c))
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_matches_the_oracle(quant, case):
    inp = _inputs(*case, quant)
    out = decode.decode_fused_moe(**inp.kwargs(), config=CFG)
    assert out.dtype == torch.bfloat16 and out.shape == inp.x.shape
    assert rel_l2(out, oracle(**inp.kwargs())) <= TOL
    assert _counters_zero()  # the last program out reset every counter


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_more_pairs_of_one_expert_than_a_token_tile(quant):
    """18 tokens all choosing expert 3 in their first slot: 18 > BLOCK_T pairs of one expert, served
    in two chunks by its leader's tasks; the default path at T·top_k = 36 is this kernel."""
    inp = _inputs(8, 2, 256, 128, 18, quant, seed=4)
    inp.topk_ids[:, 0] = 3
    inp.topk_ids[:, 1] = torch.arange(18) % 7 + (torch.arange(18) % 7 >= 3).long()  # never 3
    with count_compilations() as counter:
        out = triton_moe.fused_moe(**inp.kwargs())
    assert counter.launches == ["decode_moe_kernel"]  # the whole layer: one launch
    assert rel_l2(out, oracle(**inp.kwargs())) <= TOL


def test_static_scales():
    inp = _inputs(8, 4, 256, 128, 5, "fp8_tensor", seed=5)
    a1, a2 = calibrate_static_scales(**inp.kwargs())
    out = decode.decode_fused_moe(**inp.kwargs(), a1_scale=a1, a2_scale=a2, config=CFG)
    assert rel_l2(out, oracle(**inp.kwargs(), a1_scale=a1, a2_scale=a2)) <= TOL


@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
def test_reruns_are_bitwise_equal_and_leave_the_counters_zero(quant):
    inp = _inputs(8, 2, 256, 128, 5, quant, seed=6)
    outs = [triton_moe.fused_moe(**inp.kwargs()) for _ in range(3)]
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    assert decode_host._counter_blocks and _counters_zero()


@pytest.mark.parametrize("quant", [None, "fp8_block"], ids=lambda q: q or "bf16")
def test_agrees_with_the_grouped_pipeline(quant):
    inp = _inputs(8, 2, 256, 128, 5, quant, seed=7)
    one = triton_moe.fused_moe(**inp.kwargs())
    grouped = triton_moe.fused_moe(**inp.kwargs(), config=TritonConfig(16, 64, 64, 1, 4, 2, True))
    assert rel_l2(one, grouped.double()) <= 5e-3


# ---- the data checks: the alignment's and GEMMs' bits, from the one kernel ----------------------


@pytest.mark.parametrize("quant", [None, "fp8_channel"], ids=lambda q: q or "bf16")
def test_a_bad_id_gives_a_nan_row_and_the_flag(quant, word):
    inp = _inputs(8, 2, 256, 128, 4, quant, seed=8)
    clean = triton_moe.fused_moe(**inp.kwargs())
    assert int(word) == 0
    inp.topk_ids[2, 1] = 8
    out = triton_moe.fused_moe(**inp.kwargs())
    assert bool(out[2].isnan().all())
    rest = torch.arange(4) != 2
    assert torch.equal(out[rest], clean[rest])
    assert int(word) == BAD_ID
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E\)"):
        check("cpu")


def test_repeated_ids_weights_and_scales_set_their_bits(word):
    inp = _inputs(8, 2, 256, 128, 4, "fp8_tensor", seed=9)
    inp.topk_ids[1, 1] = inp.topk_ids[1, 0]
    triton_moe.fused_moe(**inp.kwargs())
    assert int(word) == REPEATED_ID
    word.zero_()
    inp = _inputs(8, 2, 256, 128, 4, "fp8_tensor", seed=9)
    a1, a2 = calibrate_static_scales(**inp.kwargs())
    inp.topk_weights[3, 0] = float("inf")
    inp.w2_scale[int(inp.topk_ids[0, 0])] = 0.0
    triton_moe.fused_moe(**inp.kwargs(), a1_scale=a1, a2_scale=-a2)
    assert int(word) == BAD_WEIGHT | BAD_W2_SCALE | BAD_A2_SCALE


# ---- the plan's rule, the options, the warm-up -----------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_the_plan_picks_decode_up_to_the_threshold(top_k):
    assert _PLAN.DECODE_MAX_PAIRS <= decode.PAIR_LANES  # the rule stays within the kernel's pair lanes
    last = _PLAN.DECODE_MAX_PAIRS // top_k
    at = plan(MoEDims(T=last, E=16, K=256, I=128, top_k=top_k))
    past = plan(MoEDims(T=last + 1, E=16, K=256, I=128, top_k=top_k))
    assert (at.path, past.path) == ("decode", "grouped")
    assert at.describe().startswith("decode 1-launch") and not past.describe().startswith("decode")
    listed = plans_for(16, 256, 128, top_k, max_tokens=4 * last)
    assert listed[0] == at and all(p.path == "grouped" for p in listed[1:]) and past in listed
    forced = [plan(MoEDims(T=1, E=16, K=256, I=128, top_k=top_k), config=TritonConfig(16, 64, 64))]
    forced.append(plan(MoEDims(T=1, E=16, K=256, I=128, top_k=top_k), swap_ab=True))
    assert all(p.path == "grouped" for p in forced)
    big = plan(MoEDims(T=4 * last, E=16, K=256, I=128, top_k=top_k), config=DecodeConfig())
    assert big.path == "decode"


def test_a_format_outside_the_rule_keeps_the_grouped_pipeline(monkeypatch):
    """DECODE_FORMATS names the formats the rule sends to the decode kernel; another format plans
    the grouped pipeline at every T (a DecodeConfig still forces the kernel)."""
    monkeypatch.setattr(importlib.import_module("triton_moe.plan"), "DECODE_FORMATS", ("bf16",))
    dims = MoEDims(T=1, E=16, K=256, I=128, top_k=2)
    assert plan(dims).path == "decode" and plan(dims, "fp8_tensor").path == "grouped"
    assert all(p.path == "grouped" for p in plans_for(16, 256, 128, 2, "fp8_tensor", max_tokens=64))
    assert plan(dims, "fp8_tensor", config=DecodeConfig()).path == "decode"


def test_a_forced_grouped_config_runs_the_grouped_pipeline():
    inp = _inputs(8, 2, 256, 128, 2, None, seed=10)
    with count_compilations(dry_run=True) as counter:
        triton_moe.fused_moe(**inp.kwargs(), config=TritonConfig(16, 64, 64))
    assert "decode_moe_kernel" not in counter.launches and "moe_gemm_kernel" in counter.launches


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"config": DecodeConfig(BLOCK_K=256)}, ValueError, "^config: fp8_block needs BLOCK_K to divide 128"),
        ({"config": DecodeConfig(), "swap_ab": False}, ValueError, "^swap_ab: the decode kernel"),
    ],
)
def test_bad_decode_options_are_refused_before_any_launch(options, error, match):
    inp = _inputs(8, 2, 256, 128, 2, "fp8_block")
    with count_compilations(dry_run=True) as counter, pytest.raises(error, match=match):
        triton_moe.fused_moe(**inp.kwargs(), **options)
    assert counter.launches == []


def test_too_many_pairs_for_a_forced_decode_config_are_refused():
    inp = _inputs(8, 2, 256, 128, decode.PAIR_LANES, None)
    with count_compilations(dry_run=True) as counter, pytest.raises(ValueError, match="^config: the decode kernel"):
        triton_moe.fused_moe(**inp.kwargs(), config=DecodeConfig())
    assert counter.launches == []


def test_decode_config_fields_are_checked():
    with pytest.raises(ValueError, match="^BLOCK_T=8"):
        DecodeConfig(BLOCK_T=8)
    with pytest.raises(TypeError, match="^num_warps"):
        DecodeConfig(num_warps=4.0)


@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
def test_the_warmup_compiles_the_decode_kernel_and_a_sweep_compiles_nothing(quant):
    E, top_k, K, I = 8, 2, 64, 32  # noqa: E741
    with count_compilations(dry_run=True) as counter:
        report = triton_moe.warmup(E, K, I, top_k, quant, max_tokens=64, device="cpu")
        assert "decode_moe_kernel" in report.compiled
        counter.mark()
        for T in range(1, _PLAN.DECODE_MAX_PAIRS // top_k + 3):  # across the threshold
            inp = make_inputs(MoEShape("w", E, top_k, K, I, "test"), T, quant, seed=T)
            if T % 2:
                inp.topk_ids = inp.topk_ids.long()
            triton_moe.fused_moe(**inp.kwargs())
        assert counter.new_keys == {}


# ---- the GPU lane ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
@pytest.mark.parametrize("spec", ["qwen3-30b-a3b", "deepseek-v3:tp8", "mixtral-8x7b"])
def test_gpu_decode_matches_the_oracle_and_the_grouped_pipeline(spec, quant):
    from moe_spec.problem import get_shape
    from moe_spec.validate import check as check_word

    shape = get_shape(spec)
    for T in (1, 2, 5, _PLAN.DECODE_MAX_PAIRS // shape.top_k):
        inp = make_inputs(shape, T, quant, seed=T).to("cuda")
        outs = [triton_moe.fused_moe(**inp.kwargs()) for _ in range(3)]
        dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
        assert plan(dims, quant).path == "decode"
        cfg = triton_moe.get_config(T, dims.E, dims.top_k, dims.I, dims.K, quant)
        grouped = triton_moe.fused_moe(**inp.kwargs(), config=cfg)
        torch.cuda.synchronize()
        check_word()
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), (spec, quant, T)
        assert rel_l2(outs[0], oracle(**inp.kwargs())) <= TOL, (spec, quant, T)
        assert rel_l2(outs[0], grouped.double()) <= TOL, (spec, quant, T)
        assert all(int(b.abs().sum()) == 0 for b in decode_host._counter_blocks.values())


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_bit_for_bit_with_the_grouped_pipeline(quant):
    """The Q1 / Q2 tasks quantize x and h once with the grouped pipeline's scales and rounding, so
    the E4M3 operands — and every output bit — are the grouped pipeline's (interpreter)."""
    inp = _inputs(8, 2, 256, 128, 5, quant, seed=7)
    one = triton_moe.fused_moe(**inp.kwargs())
    grouped = triton_moe.fused_moe(**inp.kwargs(), config=TritonConfig(16, 64, 64, 1, 4, 2, True))
    assert torch.equal(one.view(torch.int16), grouped.view(torch.int16))

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
    BAD_W1_SCALE,
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


# ---- the tile knobs: SPLIT (GEMM1 parts per tile) and BLOCK_N2 (W2 rows per GEMM2 / combine task) ----


def _knobs(**changes) -> DecodeConfig:
    """CFG with ``changes``."""
    return DecodeConfig(**{**CFG.as_dict(), **changes})


def _bits(out):
    return out.view(torch.int16)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_split_2_gives_the_bits_of_one_task_per_tile(quant):
    """SPLIT = 2: a gate part and an up part, each over all of K (one slice) with today's loop and
    dequantization, summed by the finisher from the fp32 workspace: the bits of SPLIT = 1."""
    inp = _inputs(12, 4, 256, 256, 2, quant, seed=11)
    one = decode.decode_fused_moe(**inp.kwargs(), config=CFG)
    two = decode.decode_fused_moe(**inp.kwargs(), config=_knobs(SPLIT=2))
    assert torch.equal(_bits(two), _bits(one))
    assert _counters_zero()


# (quant, SPLIT, K, T): BLOCK_K = 64, so K = 256 gives SPLIT / 2 slices of 512 / SPLIT; K = 192 at SPLIT = 8
# four slices of 64, the last empty; K = 320 at SPLIT = 16 eight slices of 64, the last three empty.
# T = 18: 18 pairs of expert 3, two chunks of BLOCK_T per part and in the finisher
SPLITS = [
    (None, 4, 256, 18),
    ("fp8_tensor", 4, 256, 5),
    ("fp8_channel", 8, 256, 5),
    ("fp8_block", 8, 192, 5),
    (None, 8, 192, 5),
    ("fp8_tensor", 16, 320, 3),
]


@pytest.mark.parametrize("quant, split, K, T", SPLITS, ids=lambda v: str(v or "bf16"))
def test_split_k_slices_match_the_oracle_and_rerun_bitwise(quant, split, K, T):
    """The K slices' partials summed in a fixed order: within the tolerances of the oracle and of
    the one-task path, the same bits on a rerun."""
    inp = _inputs(8, 2, K, 128, T, quant, seed=12)
    if T == 18:
        inp.topk_ids[:, 0] = 3
        inp.topk_ids[:, 1] = torch.arange(18) % 7 + (torch.arange(18) % 7 >= 3).long()  # never 3
    one = decode.decode_fused_moe(**inp.kwargs(), config=CFG)
    outs = [decode.decode_fused_moe(**inp.kwargs(), config=_knobs(SPLIT=split)) for _ in range(2)]
    assert torch.equal(_bits(outs[1]), _bits(outs[0]))
    assert rel_l2(outs[0], oracle(**inp.kwargs())) <= TOL
    assert rel_l2(outs[0], one.double()) <= 5e-3
    assert _counters_zero()


@pytest.mark.parametrize("quant, n2", [(q, 128) for q in QUANTS] + [(None, 32)], ids=lambda v: str(v or "bf16"))
def test_block_n2_gives_the_bits_of_the_default(quant, n2):
    """GEMM2 and the combine compute each output column on its own: their tile width (BLOCK_N2 ≠
    BLOCK_N, and a partial last k-tile at K = 320) changes no bit."""
    inp = _inputs(8, 2, 320, 128, 5, quant, seed=13)
    default = decode.decode_fused_moe(**inp.kwargs(), config=CFG)
    wide = decode.decode_fused_moe(**inp.kwargs(), config=_knobs(BLOCK_N2=n2))
    assert torch.equal(_bits(wide), _bits(default))
    assert _counters_zero()


@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
def test_split_resets_its_arrival_counters_and_reruns_on_its_workspace(quant):
    """Each tile's finisher zeroes its arrival word (the workspace's, zeroed once when made): after
    a call they are all zero, and a second call on the same workspace — its partials overwritten
    with NaN in between, so that a read before a write would show — gives the same bits."""
    cfg = _knobs(SPLIT=4)
    inp = _inputs(8, 2, 256, 128, 5, quant, seed=14)
    ws = decode_host.decode_workspace(5, 2, 256, 128, quant, inp.x.device, cfg)
    assert ws["part"].shape == (4, 10, 128) and ws["arrive"].shape == (10 * 2,)
    assert "part" not in decode_host.decode_workspace(5, 2, 256, 128, quant, inp.x.device, CFG)
    first = decode.decode_fused_moe(**inp.kwargs(), config=cfg, workspace=ws)
    assert int(ws["arrive"].abs().sum()) == 0
    ws["part"].fill_(float("nan"))
    again = decode.decode_fused_moe(**inp.kwargs(), config=cfg, workspace=ws)
    assert int(ws["arrive"].abs().sum()) == 0 and _counters_zero()
    assert torch.equal(_bits(again), _bits(first))
    assert rel_l2(first, decode.decode_fused_moe(**inp.kwargs(), config=CFG).double()) <= 5e-3


def test_split_parts_set_the_data_check_bits(word):
    """Under SPLIT the parts read the weight scales (fp8_channel: each its gate or up channels) and
    the finisher zeroes a bad id's pair: the bits and the NaN row of SPLIT = 1."""
    inp = _inputs(8, 2, 256, 128, 4, "fp8_channel", seed=15)
    inp.topk_ids[2, 1] = 8
    inp.w1_scale[int(inp.topk_ids[0, 0]), 128 + 5] = 0.0  # an up channel of W1
    one = decode.decode_fused_moe(**inp.kwargs(), config=CFG)
    bits = int(word)
    word.zero_()
    four = decode.decode_fused_moe(**inp.kwargs(), config=_knobs(SPLIT=4))
    assert int(word) == bits == BAD_ID | BAD_W1_SCALE
    assert bool(four[2].isnan().all()) and bool(one[2].isnan().all())
    assert rel_l2(four[[0, 1, 3]], one[[0, 1, 3]].double()) <= 5e-3


@pytest.mark.parametrize(
    "knobs, error, match",
    [
        ({"SPLIT": 3}, ValueError, "^SPLIT=3: must be 1 or an even power of two"),
        ({"SPLIT": 0}, ValueError, "^SPLIT=0"),
        ({"SPLIT": 32}, ValueError, "^SPLIT=32"),
        ({"SPLIT": 2.0}, TypeError, "^SPLIT: expected an int"),
        ({"BLOCK_N2": 8}, ValueError, "^BLOCK_N2=8: must be 0"),
        ({"BLOCK_N2": 96}, ValueError, "^BLOCK_N2=96"),
        ({"BLOCK_N2": True}, TypeError, "^BLOCK_N2: expected an int"),
    ],
)
def test_the_knobs_are_checked_naming_the_field(knobs, error, match):
    with pytest.raises(error, match=match):
        DecodeConfig(**knobs)


def test_the_knobs_label_shared_memory_tasks_and_plan():
    default, knobs = DecodeConfig(), DecodeConfig(SPLIT=4, BLOCK_N2=128)
    assert default.label() == "64x128x16/w4s4" and knobs.label() == "64x128x16/w4s4/split4/n2=128"
    assert DecodeConfig(SPLIT=2).label() == "64x128x16/w4s4/split2"
    assert knobs.as_dict() == {**default.as_dict(), "SPLIT": 4, "BLOCK_N2": 128}
    assert (default.block_n2, knobs.block_n2) == (64, 128)
    # bytes per stage: GEMM1's gate and up tiles + tokens; one weight tile under SPLIT; GEMM2's where larger
    assert default.smem_bytes(None) == (2 * 64 + 16) * 128 * 2 * 4
    assert DecodeConfig(SPLIT=2).smem_bytes(None) == (64 + 16) * 128 * 2 * 4
    assert DecodeConfig(SPLIT=2, BLOCK_N2=256).smem_bytes("fp8_block") == (256 + 16) * 128 * 1 * 4
    # DeepSeek-V3 TP8 at T = 1: 8 pairs × 4 n-tiles × SPLIT GEMM1 tasks, (8 pairs + 1 token block) × K / block_n2
    assert decode_host.num_tasks(1, 8, 7168, 256, None, False, default) == 8 * 4 + 9 * 112
    assert decode_host.num_tasks(1, 8, 7168, 256, None, False, knobs) == 8 * 4 * 4 + 9 * 56
    assert decode_host.counter_words(7168, knobs) == decode_host.counter_words(7168, default) - 56
    p = plan(MoEDims(T=1, E=16, K=256, I=128, top_k=2), config=knobs)
    assert (p.gemm1.BLOCK_N, p.gemm2.BLOCK_N) == (64, 128)


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

"""triton_moe on the CPU (Triton interpreter): every quant format, swap-AB on and off, edge routings,
grouped rasterization, and NaN / overflow against the oracle.

The interpreter runs the same kernels as the GPU with ``INTERPRETER=True`` (see
:mod:`triton_moe.kernels`): bf16 tiles are widened to fp32 before ``tl.dot`` (its bf16 dot is
wrong) and bf16 / e4m3 casts are rounded explicitly (its casts truncate or mis-round). The checks
are the GPU's: relative L2 to the fp64 oracle ≤ 5e-3 (bf16) and ≤ 1e-2 (fp8). Shapes are tiny
(K = 160, I = 80: neither a multiple of the 64-wide tiles used) so the file runs in about a minute.
"""

import pytest
import torch

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from triton_moe import TritonConfig, fused_experts, fused_moe

TOL = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_channel": 1e-2, "fp8_block": 1e-2}
QUANTS = [None, "fp8_tensor", "fp8_channel", "fp8_block"]
# the interpreter's own numpy use (int() of a 1-element array) warns on every scalar load
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

SMALL = MoEShape("tiny", 8, 2, 160, 80, "test shape: K, I not multiples of the tiles")


def _config(quant, swap_ab):
    # swap: 64 weight rows × 16 tokens; no swap: 16 tokens × 32 columns; BLOCK_K 64 does not divide K=160
    return TritonConfig(16, 64 if swap_ab else 32, 64, 1, 4, 2, swap_ab)


def _check(inp, **options):
    out = fused_moe(**inp.kwargs(), **options)
    assert out.dtype == torch.bfloat16 and out.shape == inp.x.shape
    err = rel_l2(out, oracle(**inp.kwargs()))
    assert err <= TOL[inp.quant], f"rel L2 {err:.2e} > {TOL[inp.quant]:.0e}"
    return out


@pytest.mark.parametrize("swap_ab", [False, True], ids=["noswap", "swap"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_matches_oracle(quant, swap_ab):
    # T = 11: not a multiple of BLOCK_M; 22 pairs over 8 experts leave some experts empty
    inp = make_inputs(SMALL, 11, quant, seed=1)
    _check(inp, config=_config(quant, swap_ab))


@pytest.mark.parametrize("quant", [None, "fp8_block"], ids=lambda q: q or "bf16")
@pytest.mark.parametrize("swap_ab", [False, True], ids=["noswap", "swap"])
def test_single_token_top8(quant, swap_ab):
    shape = MoEShape("top8", 8, 8, 96, 48, "test: T=1, top_k=8 hits every expert once")
    _check(make_inputs(shape, 1, quant, seed=2), config=_config(quant, swap_ab))


@pytest.mark.parametrize("quant", [None, "fp8_channel"], ids=lambda q: q or "bf16")
def test_all_tokens_on_one_expert_top1(quant):
    # 40 tokens, top_k = 1, all on expert 3: three M-blocks of one expert, seven empty experts,
    # and GEMM2 writes the output directly (no combine)
    inp = make_inputs(MoEShape("one", 8, 1, 64, 48, "test"), 40, quant, seed=3)
    inp.topk_ids.fill_(3)
    _check(inp, config=_config(quant, True))


@pytest.mark.parametrize("quant", ["fp8_tensor", "fp8_channel"])
def test_deep_fp8_k_step_promotes_inside_the_dot(quant):
    # a K step deeper than 128 promotes every 128 of K inside tl.dot (max_num_imprecise_acc); the
    # interpreter sums in fp32 either way, so this checks the code path, not the GPU's accuracy
    # (tests/test_triton_gpu.py does)
    from triton_moe import moe

    cfg = TritonConfig(16, 32, 256, 1, 4, 2, False)
    assert moe._gemm_constants(cfg, quant, True, SMALL.top_k, SMALL.hidden)["FP8_IMPRECISE_ACC"] == 128
    _check(make_inputs(SMALL, 11, quant, seed=1), config=cfg)


def test_default_config_and_determinism():
    inp = make_inputs(SMALL, 5, "fp8_tensor", seed=4)
    a = _check(inp)  # heuristic config (swap-AB at 1.25 tokens per expert)
    b = fused_moe(**inp.kwargs())
    assert torch.equal(a, b)


def test_swap_ab_is_forcible_and_equivalent():
    inp = make_inputs(SMALL, 6, None, seed=5)
    on = fused_moe(**inp.kwargs(), swap_ab=True)
    off = fused_moe(**inp.kwargs(), swap_ab=False)
    assert rel_l2(on, off.double()) < 2e-3  # same products, different summation tiles


def test_empty_batch():
    inp = make_inputs(SMALL, 0, None)
    out = fused_moe(**inp.kwargs())
    assert out.shape == (0, SMALL.hidden) and out.dtype == torch.bfloat16


def test_vllm_spelling_per_channel():
    inp = make_inputs(SMALL, 3, "fp8_channel", seed=6)
    out = fused_experts(
        inp.x,
        inp.w1,
        inp.w2,
        inp.topk_weights,
        inp.topk_ids,
        use_fp8_w8a8=True,
        per_channel_quant=True,
        w1_scale=inp.w1_scale[..., None],
        w2_scale=inp.w2_scale[..., None],
    )
    assert rel_l2(out, oracle(**inp.kwargs())) <= 1e-2


def test_bad_input_is_named():
    inp = make_inputs(SMALL, 2, None)
    with pytest.raises(TypeError, match="^x:"):
        fused_moe(inp.x.float(), inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)


@pytest.mark.parametrize("T", [2, 0])  # refused whatever T (moe_spec.plan: the empty batch)
@pytest.mark.parametrize(
    "config, quant, match",
    [
        (TritonConfig(16, 64, 256, swap_ab=True), "fp8_block", "BLOCK_K to divide 128"),
        (TritonConfig(128, 256, 128, num_stages=6), None, "shared memory"),
    ],
)
def test_config_that_does_not_fit_is_rejected(config, quant, match, T):
    inp = make_inputs(SMALL, T, quant)
    with pytest.raises(ValueError, match=match):
        fused_moe(**inp.kwargs(), config=config)


@pytest.mark.parametrize("quant", QUANTS[1:])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantize_kernel_is_the_reference(quant, dtype):
    """x (bf16) and the intermediate (fp32) are quantized once, before their GEMM: the E4M3 values
    and the scales equal moe_spec.quant's. K = 300: a partial 128-group; a zero row (floor scale);
    a row 100× larger than the rest (per-channel and per-group scales must not mix). Values are
    compared, not bits: the interpreter's e4m3 cast turns −0 into +0 (the GPU's keeps the sign)."""
    from moe_spec.quant import quantize_activation
    from triton_moe.moe import _quantize

    g = torch.Generator().manual_seed(7)
    a = (torch.randn(6, 300, generator=g) * 3).to(dtype)
    a[1, :200] *= 100
    a[2] = 0
    q_ref, s_ref = quantize_activation(a, quant)
    q, s = _quantize(a, quant)
    assert torch.equal(q.float(), q_ref.float())
    assert torch.equal(s, s_ref)
    if quant != "fp8_tensor":  # the amax a GEMM1 epilogue would hand over gives the same result
        amax = s_ref * 448.0
        q2, s2 = _quantize(a, quant, amax.reshape(s_ref.shape))
        assert torch.equal(q2.float(), q_ref.float())


@pytest.mark.parametrize("quant", QUANTS[1:])
@pytest.mark.parametrize("rows", [1, 3, 100])
def test_a_few_long_rows_are_spread_over_programs_with_the_same_result(quant, rows):
    """At decode x is a few rows of thousands of columns: quantize_kernel's grid [rows, S] gives a row's
    steps of 8 × 128 columns to S programs, and amax_kernel's partial amaxes are pieces of rows, so one
    row is read by several programs. Codes and scales equal moe_spec.quant's whatever S (K = 2400: three
    steps, the last partial; a spike in the last step; a zero row), and the buffer the launch zeroes is
    zero everywhere (its share per program follows the grid)."""
    from moe_spec.quant import quantize_activation
    from triton_moe.launches import PARTS, _quantize_launches, quantize_splits
    from triton_moe.moe import _quantize

    g = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 2400, generator=g).to(torch.bfloat16)
    a[0, 2390] = 300.0  # in the third step: a per-tensor or per-row amax must see it
    if rows > 2:
        a[rows // 2] = 0
    assert quantize_splits(rows, 2400, zero_after=True) == 1 and quantize_splits(4096, 7168) == 1
    amax_launch, num_amax, quantize = _quantize_launches(rows, 2400, quant, False, 37, 0)
    assert quantize.grid == (rows, 3 if rows < 100 else 2)  # the grid the launch below runs
    if quant == "fp8_tensor":  # the amax partials: one program per 1024-column piece, up to PARTS
        assert amax_launch.grid == (num_amax,) and num_amax == (3 * rows if rows < 100 else PARTS)
    zero = torch.full((37,), 5.0)
    q_ref, s_ref = quantize_activation(a, quant)
    q, s = _quantize(a, quant, zero=zero)
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(s, s_ref)
    assert torch.equal(zero, torch.zeros(37))


@pytest.mark.parametrize("rows", [1, 5])
def test_a_static_scale_spread_over_programs_gives_the_static_codes(rows):
    """Static fp8_tensor with S > 1 programs per row: the codes are quantize_activation_static's."""
    from moe_spec.quant import quantize_activation_static
    from moe_spec.validate import BAD_A1_SCALE
    from triton_moe.moe import _quantize

    a = torch.randn(rows, 2400, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    scale = torch.tensor([0.05])
    q, s = _quantize(a, "fp8_tensor", scale=scale, static_bit=BAD_A1_SCALE)
    assert torch.equal(q.float(), quantize_activation_static(a, scale).float()) and s is scale


@pytest.mark.parametrize(
    "options, match",
    [
        ({"config": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}}, "^config: expected a triton_moe.TritonConfig"),
        ({"config": (16, 64, 64)}, "^config:"),
        ({"swap_ab": "no"}, "^swap_ab: expected True, False or None, got 'no'"),
        ({"swap_ab": 1}, "^swap_ab:"),
    ],
)
def test_backend_option_of_wrong_type_is_named_before_any_launch(options, match):
    from triton_moe.jit import count_compilations

    inp = make_inputs(SMALL, 2, None)
    with count_compilations(dry_run=True) as counter, pytest.raises(TypeError, match=match):
        fused_moe(**inp.kwargs(), **options)
    assert counter.total() == 0  # nothing was launched


def test_kernels_read_the_registry_and_its_constants():
    """The kernels' QUANT numbers are the registry's modes and their FP8 constants moe_spec.quant's;
    and the quantization kernel shows each constant where it matters: saturation at ±FP8_MAX, the
    AMAX_FLOOR scale of an all-zero group, and block scales that change exactly every FP8_BLOCK
    columns (a spike in the last column of one group and the first of the next)."""
    from moe_spec.quant import AMAX_FLOOR, FORMATS, FP8_BLOCK, FP8_MAX
    from triton_moe import kernel_parts, kernels
    from triton_moe.moe import _quantize

    assert kernels.QUANT_MODE == {q: f.mode for q, f in FORMATS.items()}
    assert (kernel_parts.FP8_MAX.value, kernel_parts.AMAX_FLOOR.value, kernel_parts.FP8_BLOCK.value) == (
        FP8_MAX,
        AMAX_FLOOR,
        FP8_BLOCK,
    )
    a = torch.zeros(2, 3 * FP8_BLOCK)
    a[0, FP8_BLOCK - 1], a[0, FP8_BLOCK] = 3.0, -5.0
    q, s = _quantize(a, "fp8_block")
    amax = torch.tensor([[3.0, 5.0, AMAX_FLOOR], [AMAX_FLOOR] * 3])
    assert torch.equal(s, amax / torch.full_like(amax, FP8_MAX))
    assert q.float()[0, FP8_BLOCK - 1] == FP8_MAX and q.float()[0, FP8_BLOCK] == -FP8_MAX
    assert int(q.float().count_nonzero()) == 2


def test_grouped_rasterization_with_a_partial_last_group():
    """GROUP_M = 8 M-blocks sweep the N tiles together; 10 M-blocks leave a last group of 2. One
    token per expert (E = 10, top_k = 1) makes every M-block real, and BLOCK_N = 16 gives 3 (GEMM1)
    and 4 (GEMM2) N tiles: a rasterization that took the last group as full would map its programs
    onto M-blocks past the end and never compute blocks 8 and 9's other N tiles."""
    from moe_spec.align import max_rows

    shape = MoEShape("groups", 10, 1, 64, 48, "test: 10 M-blocks of 16, GROUP_M = 8")
    cfg = TritonConfig(16, 16, 32, GROUP_M=8, num_warps=4, num_stages=2, swap_ab=False)
    assert max_rows(10, 10, cfg.BLOCK_M) // cfg.BLOCK_M == 10
    for quant in (None, "fp8_block"):
        inp = make_inputs(shape, 10, quant, seed=12)
        inp.topk_ids = torch.arange(10, dtype=torch.int32)[:, None].contiguous()
        _check(inp, config=cfg)


# --- NaN and overflow: as the oracle says ---------------------------------------------------------

NAN_SHAPE = MoEShape("nan", 4, 2, 160, 48, "test: 6 tokens over 4 experts")
# numpy, under the interpreter, warns at every NaN it computes
nan_arithmetic = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)


def _poison(inp, where):
    """A NaN in x[1, 5], or in W1 of token 0's expert (bf16 NaN, or E4M3's NaN byte 0x7F)."""
    if where == "x":
        inp.x[1, 5] = float("nan")
    elif inp.quant is None:
        inp.w1[int(inp.topk_ids[0, 0]), 3, 7] = float("nan")
    else:
        inp.w1.view(torch.uint8)[int(inp.topk_ids[0, 0]), 3, 7] = 0x7F
    return inp


@nan_arithmetic
@pytest.mark.parametrize("where", ["x", "w1"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_nan_comes_out_where_the_oracle_has_it(quant, where):
    """A NaN in x or in a weight spreads through the kernels' amaxes, scales and casts exactly as
    through the oracle's (fp8_tensor: every row; otherwise the rows that meet it); the other rows
    stay correct."""
    inp = _poison(make_inputs(NAN_SHAPE, 6, quant, seed=9), where)
    out = fused_moe(**inp.kwargs(), config=_config(quant, False))
    ref = oracle(**inp.kwargs())
    assert bool(ref.isnan().any())
    assert torch.equal(out.isnan(), ref.isnan())
    clean = ~ref.isnan().any(dim=1)
    if bool(clean.any()):
        assert rel_l2(out[clean], ref[clean]) <= TOL[quant]


@nan_arithmetic
@pytest.mark.parametrize("quant", QUANTS[1:])
def test_fp8_overflow_is_nan_where_the_oracle_has_it(quant):
    """x[1, 5] = 1e30: the intermediate of token 1 exceeds fp32 (the oracle models the kernel's fp32
    intermediate), so its scale group's amax is inf and the group dequantizes to NaN."""
    inp = make_inputs(NAN_SHAPE, 6, quant, seed=9)
    inp.x[1, 5] = 1e30
    out = fused_moe(**inp.kwargs(), config=_config(quant, True))
    ref = oracle(**inp.kwargs())
    assert bool(ref[1].isnan().all()) and torch.equal(out.isnan(), ref.isnan())


@nan_arithmetic
def test_bf16_overflow_is_non_finite_where_the_oracle_leaves_the_bf16_range():
    """x[1, 5] = 1e30 in bf16: GEMM1 gives |h| ≈ 1e29, SiLU(gate)·up ≈ 1e58 overflows fp32 to ±inf,
    and GEMM2 meets inf − inf: the kernel's row 1 is NaN (or ±inf). The fp64 oracle keeps finite
    values there, ≈ 1e57 — beyond bf16's range, ±inf once rounded to the output dtype. Both say "not
    representable"; the other rows are untouched."""
    inp = make_inputs(NAN_SHAPE, 6, None, seed=9)
    inp.x[1, 5] = 1e30
    out = fused_moe(**inp.kwargs(), config=_config(None, False))
    ref = oracle(**inp.kwargs())
    assert bool(torch.isfinite(ref).all())
    overflow = ~torch.isfinite(ref.to(torch.bfloat16))
    assert torch.equal(overflow.any(dim=1), torch.arange(6) == 1) and bool(overflow[1].all())
    assert not bool(torch.isfinite(out[1]).any())
    rest = torch.arange(6) != 1
    assert bool(torch.isfinite(out[rest]).all()) and rel_l2(out[rest], ref[rest]) <= TOL[None]


# --- the data checks on the device (moe_spec.contract): no sync, the error word, nothing plausible ----

from moe_spec.validate import BAD_ID, BAD_W1_SCALE, BAD_W2_SCALE, BAD_WEIGHT, REPEATED_ID, check  # noqa: E402

CHECK_SHAPE = MoEShape("check", 4, 2, 64, 48, "test: 6 tokens over 4 experts")


@nan_arithmetic
@pytest.mark.parametrize("bad", [4, -1], ids=["E", "negative"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_a_bad_id_gives_a_nan_row_and_the_flag(quant, bad, word):
    """Token 2's second id is outside [0, E): its output row is NaN, every other row is what a call
    without that pair computes (bit for bit; under fp8_tensor the shared activation scales do not
    see the pair either: its intermediate is zeroed), and check() names topk_ids."""
    inp = make_inputs(CHECK_SHAPE, 6, quant, seed=21)
    cfg = _config(quant, True)
    clean = fused_moe(**inp.kwargs(), config=cfg)
    ref = oracle(**inp.kwargs())
    check("cpu")
    inp.topk_ids[2, 1] = bad
    out = fused_moe(**inp.kwargs(), config=cfg)
    assert bool(out[2].isnan().all())
    rest = torch.arange(6) != 2
    if quant == "fp8_tensor":  # the clean call's intermediate amax included the pair: not bitwise
        assert rel_l2(out[rest], ref[rest]) <= TOL[quant]
    else:
        assert torch.equal(out[rest], clean[rest])
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E\)"):
        check("cpu")


@nan_arithmetic
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_gemm2_reads_its_routing_early_or_late_to_the_same_bytes(quant, word, monkeypatch):
    """EARLY_ROUTING (GEMM2's ids and weights loaded before the K loop) and the epilogue's read give
    the same output bit for bit — a bad id's NaN row, an infinite weight's row — and the same error bits."""
    import triton_moe.launches as launches
    import triton_moe.moe as moe

    inp = make_inputs(CHECK_SHAPE, 6, quant, seed=24)
    inp.topk_ids[2, 1] = -1
    inp.topk_weights[4, 0] = float("inf")
    outs, words, early = [], [], []
    for steps in (0, 1 << 20):  # no GEMM2 is short enough / every GEMM2 is
        monkeypatch.setattr(launches, "EARLY_ROUTING_MAX_K_STEPS", steps)
        moe.forget_plans()
        outs.append(fused_moe(**inp.kwargs(), config=_config(quant, True)))
        words.append(int(word))
        early.append(moe._gemm_constants(_config(quant, True).gemm2_config(), quant, False, 1, 64)["EARLY_ROUTING"])
        word.zero_()
    moe.forget_plans()
    assert early == [False, True]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert words[0] == words[1] == BAD_ID | BAD_WEIGHT and bool(outs[0][2].isnan().all())


def test_a_repeated_expert_is_summed_as_the_formula_reads_and_flagged(word):
    """[e, e] in a row: both slots computed and summed — out = w0·f_e + w1·f_e, the sum of the two
    top_k = 1 calls — and REPEATED_ID set."""
    inp = make_inputs(CHECK_SHAPE, 6, None, seed=22)
    inp.topk_ids[3, 1] = inp.topk_ids[3, 0]
    out = fused_moe(**inp.kwargs())
    assert int(word) == REPEATED_ID
    word.zero_()
    halves = [
        fused_moe(
            inp.x, inp.w1, inp.w2, inp.topk_weights[:, j : j + 1].contiguous(), inp.topk_ids[:, j : j + 1].contiguous()
        ).float()
        for j in (0, 1)
    ]
    assert int(word) == 0 and rel_l2(out, (halves[0] + halves[1]).double()) < 1e-2


@nan_arithmetic
def test_a_non_finite_routing_weight_is_flagged(word):
    inp = make_inputs(CHECK_SHAPE, 6, "fp8_channel", seed=23)
    inp.topk_weights[4, 0] = float("inf")
    out = fused_moe(**inp.kwargs())
    assert int(word) == BAD_WEIGHT and not bool(torch.isfinite(out[4]).all())
    with pytest.raises(ValueError, match="^topk_weights: expected finite routing weights"):
        check("cpu")


@nan_arithmetic
@pytest.mark.parametrize("quant", QUANTS[1:])
@pytest.mark.parametrize("which, value", [("w1_scale", 0.0), ("w2_scale", float("nan")), ("w1_scale", -1.0)])
def test_a_bad_scale_that_is_read_is_flagged(quant, which, value, word):
    """A weight scale of an expert some token reaches, set to 0, NaN or −1: the GEMM that reads it
    flags its argument. A bad scale of an expert no token reaches is not read, not flagged."""
    inp = make_inputs(CHECK_SHAPE, 6, quant, seed=24)
    inp.topk_ids[:, 0], inp.topk_ids[:, 1] = 0, 1  # experts 2 and 3 idle
    scale = getattr(inp, which)
    scale[3] = value  # idle expert
    fused_moe(**inp.kwargs())
    assert int(word) == 0
    scale[1] = value
    fused_moe(**inp.kwargs())
    assert int(word) == (BAD_W1_SCALE if which == "w1_scale" else BAD_W2_SCALE)
    with pytest.raises(ValueError, match=f"^{which}: expected finite, positive scales"):
        check("cpu")


def test_sync_mode_raises_before_any_launch():
    from moe_spec.validate import checks
    from triton_moe.jit import count_compilations

    inp = make_inputs(CHECK_SHAPE, 6, None, seed=25)
    inp.topk_ids[0, 0] = 9
    with (
        checks("sync"),
        count_compilations(dry_run=True) as counter,
        pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E=4\)"),
    ):
        fused_moe(**inp.kwargs())
    assert counter.launches == []

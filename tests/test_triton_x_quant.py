"""x quantized to E4M3 in GEMM1's A load (``triton_moe.plan.x_quant_in_gemm1``, THE rule): fp8_block
with 128-deep K steps, static fp8_tensor, fp8_channel where its pre-pass is cheap — decode-size tiles.

On the CPU (Triton interpreter): the helpers GEMM1 calls (``triton_moe.kernel_quant``), run on
gathered rows by a probe kernel, give ``quantize_kernel``'s codes and scales bit for bit; the same
expert computation run with the rule and without it (``triton_moe.moe.separate_x_quant``: x's own
``quantize_kernel`` launch) gives the same intermediate (fp32, or E4M3 with its scales), the same
output and the same error word — over shapes with K a multiple of 128 and not, swap-AB on and off,
split-K, the persistent TMA kernel (the rule widened to its 64-row tile), a NaN in x, a bad expert
id and bad static scales, and twice in a row on one workspace (the intermediate's amax, no longer
zeroed by x's launch, is left zero by its reader). Launch counts read the rule. The product leaves
the rule's switch off (measured slower on an H100: triton_moe.plan.X_QUANT_IN_GEMM1); every test here
turns it on. The ``-m gpu``
test repeats the comparison on CUDA; the sm_90a compile is in tests/test_triton_sm90.py.
"""

import pytest
import torch
import triton
import triton.language as tl
from triton_fused_quant import fused_and_separate, run_layer, same_bits

from moe_spec.oracle import calibrate_static_scales
from moe_spec.problem import MoEShape, get_shape, make_inputs
from moe_spec.validate import BAD_A1_SCALE, BAD_ID, error_word
from triton_moe import TritonConfig
from triton_moe.jit import INTERPRET
from triton_moe.kernel_quant import _a_scale, _quantize_a

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")


@pytest.fixture(autouse=True)
def rule_on():
    """The rule's switch on for every test here: the product leaves it off (measured slower)."""
    from triton_moe import moe

    with moe.rule_set("X_QUANT_IN_GEMM1", True):
        yield


EVEN = MoEShape("xq256", 8, 2, 256, 256, "test: K a multiple of 128")
ODD = MoEShape("xq200", 8, 2, 200, 192, "test: K not a multiple of 128 (the last group 72 wide)")


def _cfg(block_m=16, block_n=64, block_k=128, swap_ab=True, split_k=1, tma=False, warps=4):
    return TritonConfig(block_m, block_n, block_k, 1, warps, 2, swap_ab, split_k=split_k, persistent_tma=tma)


def compare(kw, quant, cfg, a1=None, a2=None):
    """Run GEMM1 quantizing x and the separate path; assert the rule applied to the first only and that
    the intermediate, its scales, the output and the error word agree bit for bit; the first run is
    repeated on its workspace (the amax left zero). Returns (output, error word)."""
    fused, separate = fused_and_separate(kw, quant, cfg, "X_QUANT_IN_GEMM1", a1, a2)
    (out, ws, in_gemm1, _, bits), (ref, ref_ws, ref_in_gemm1, _, ref_bits) = fused, separate
    assert in_gemm1 and not ref_in_gemm1, "the rule (triton_moe.plan.x_quant_in_gemm1) should apply here"
    assert "xq" not in ws and "xq" in ref_ws  # no E4M3 copy of x
    assert bits == ref_bits
    for name in ("act", "aq", "act_scale"):  # the intermediate GEMM1 made from x's codes and scales
        if ws.get(name) is not None and not (a2 is not None and name == "act_scale"):  # static: a2_scale
            assert same_bits(ws[name], ref_ws[name]), f"{name} differs from the separate path's"
    assert same_bits(out, ref), "the layer's output changed"
    if "act_amax" in ws:  # left zero by the intermediate's quantization, for the next call
        assert not bool(ws["act_amax"].view(torch.int32).any())
        again = run_layer(kw, quant, cfg, a1, a2, ws=ws)[0]
        assert same_bits(again, out), "a second call on the same workspace differs"
    error_word(kw["x"].device).zero_()
    return out, bits


# --- the rule ------------------------------------------------------------------------------------


def test_the_rule():
    from triton_moe import moe
    from triton_moe.config import DecodeConfig
    from triton_moe.plan import X_QUANT_MAX_BLOCK_M, LayerPlan, x_quant_in_gemm1

    assert X_QUANT_MAX_BLOCK_M == 32
    for bm in (16, 32):
        for bk, want in ((32, False), (64, False), (128, True)):
            assert x_quant_in_gemm1(_cfg(bm, 128, bk), "fp8_block") is want
        assert x_quant_in_gemm1(_cfg(bm, 64, 64), "fp8_tensor", static=True) is True
        assert x_quant_in_gemm1(_cfg(bm, 128), "fp8_tensor") is False  # the amax of all of x
        assert x_quant_in_gemm1(_cfg(bm, 128), None) is False
    for bm in (64, 128):  # prefill tiles: the A tile through registers spills (tests/test_triton_sm90.py)
        for quant, static in (("fp8_block", False), ("fp8_tensor", True), ("fp8_channel", False)):
            assert x_quant_in_gemm1(_cfg(bm, 256, swap_ab=False), quant, static) is False
    # fp8_channel: BM·(2·split_k + 1) ≤ BN — the pre-pass's extra bytes at most half the weights'
    for bm, bn, split, want in ((16, 64, 1, True), (16, 32, 1, False), (32, 128, 1, True), (32, 64, 1, False)):
        assert x_quant_in_gemm1(_cfg(bm, bn, 64, split_k=split), "fp8_channel") is want, (bm, bn, split)
    assert x_quant_in_gemm1(_cfg(16, 128, split_k=2), "fp8_channel") is True  # 80 ≤ 128
    assert x_quant_in_gemm1(_cfg(16, 128, split_k=4), "fp8_channel") is False  # 144 > 128
    assert LayerPlan(DecodeConfig(), "fp8_block").x_quant_in_gemm1() is False  # its own kernel
    assert LayerPlan(_cfg().resolved().check("fp8_block"), "fp8_block").x_quant_in_gemm1() is True
    with moe.separate_x_quant():
        assert x_quant_in_gemm1(_cfg(), "fp8_block") is False
        assert x_quant_in_gemm1(_cfg(), "fp8_tensor", static=True) is False
    assert x_quant_in_gemm1(_cfg(), "fp8_block") is True  # restored


# --- the helpers, on gathered rows, against quantize_kernel ----------------------------------------


@triton.jit
def _probe(x_ptr, scale_ptr, q_ptr, qs_ptr, rows_ptr, error_ptr, K, QUANT: tl.constexpr, INTERPRETER: tl.constexpr):
    """GEMM1's A load alone: 16 rows gathered by ``rows`` (−1: padding), quantized step by step as
    GEMM1 does → q [16, K] and the scales (per group [16, ⌈K/128⌉], per row [16], per tensor [1])."""
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, 128)
    row = tl.load(rows_ptr + offs_m)
    row_ok = row >= 0
    a_row = tl.where(row_ok, row, 0)
    a_s = _a_scale(x_ptr, scale_ptr, a_row, row_ok, error_ptr, K, QUANT, True, 16, 128)
    for k0 in range(0, K, 128):
        k_ok = offs_k < K - k0
        a = tl.load(x_ptr + a_row[:, None] * K + k0 + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        q, s = _quantize_a(a, row_ok[:, None] & k_ok[None, :], a_s, row_ok, QUANT, True, INTERPRETER)
        tl.store(q_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], q, mask=k_ok[None, :])
        if QUANT == 3:
            tl.store(qs_ptr + offs_m * tl.cdiv(K, 128) + k0 // 128, s)
    if QUANT == 2:
        tl.store(qs_ptr + offs_m, a_s)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("K", [256, 200])
@pytest.mark.parametrize("quant", ["fp8_block", "fp8_channel", "fp8_tensor"])
def test_the_a_load_quantizes_as_quantize_kernel(quant, K):
    from moe_spec.quant import FP8_DTYPE, get_format
    from triton_moe.jit import launch
    from triton_moe.launches import _quantize

    g = torch.Generator().manual_seed(K)
    x = (torch.randn(9, K, generator=g) * torch.logspace(-3, 2, 9)[:, None]).bfloat16()
    x[4, 7] = float("nan")
    x[5] = 0
    rows = torch.tensor([3, 0, 8, 4, 4, 5, 1, 2, 7, 6] + [-1] * 6, dtype=torch.int32)
    word = error_word("cpu")
    word.zero_()
    a1 = torch.tensor([0.02]) if quant == "fp8_tensor" else None
    if a1 is not None:
        ref_q, ref_s = _quantize(x, quant, scale=a1, static_bit=BAD_A1_SCALE)
    else:
        ref_q, ref_s = _quantize(x, quant)
    q = torch.zeros(16, K, dtype=FP8_DTYPE)
    shape = get_format(quant).activation_scale_shape(16, K)
    qs = torch.zeros(shape if quant != "fp8_tensor" else (1,))
    launch(_probe, (1,), x, a1 if a1 is not None else qs, q, qs, rows, word, K, get_format(quant).mode, INTERPRET)
    ok = rows >= 0
    assert same_bits(q[ok], ref_q[rows[ok].long()]), "codes differ from quantize_kernel's"
    assert not bool(q[~ok].view(torch.uint8).any())
    if quant != "fp8_tensor":
        assert same_bits(qs[ok].reshape(-1), ref_s[rows[ok].long()].reshape(-1)), "scales differ"
        assert bool((qs[~ok] == 1.0).all())  # padding rows: the separate path's masked loads
        assert bool(qs[3].isnan().any()) and not bool(qs[[0, 1, 2, 5, 6, 7, 8, 9]].isnan().any())
    assert int(word) == 0


# --- the layer, against the separate path ---------------------------------------------------------

CASES = {  # (format, shape, config, static)
    "block-swap": ("fp8_block", EVEN, _cfg(), False),
    "block-oddK": ("fp8_block", ODD, _cfg(), False),
    "block-noswap-32": ("fp8_block", ODD, _cfg(32, 64, swap_ab=False), False),
    "block-128wide": ("fp8_block", EVEN, _cfg(16, 128), False),  # the intermediate quantized in the epilogue too
    "block-split2": ("fp8_block", EVEN, _cfg(split_k=2), False),
    "channel-swap": ("fp8_channel", ODD, _cfg(block_k=64), False),
    "channel-noswap": ("fp8_channel", EVEN, _cfg(16, 64, 128, swap_ab=False), False),
    "channel-split2": ("fp8_channel", ODD, _cfg(16, 128, 64, split_k=2), False),
    "static-swap": ("fp8_tensor", ODD, _cfg(block_k=64), True),
    "static-noswap-split2": ("fp8_tensor", EVEN, _cfg(32, 64, 64, swap_ab=False, split_k=2), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_the_separate_path(case, word):
    quant, shape, cfg, static = CASES[case]
    kw = make_inputs(shape, 9, quant, seed=3).kwargs()
    a1 = a2 = None
    if static:
        a1, a2 = calibrate_static_scales(**kw)
    _, bits = compare(kw, quant, cfg, a1, a2)
    assert bits == 0


@pytest.mark.parametrize("quant", ["fp8_block", "fp8_channel"])
def test_persistent_tma_kernel(quant, word, monkeypatch):
    """The rule keeps to ≤ 32-row tiles, which the TMA kernel (non-swap, ≥ 64 rows) never has: widened
    here, its A load quantizes x as moe_gemm_kernel's does."""
    import importlib

    import triton_moe.kernels_tma as kt
    from triton_moe import moe

    rules = importlib.import_module("triton_moe.plan")  # the module: triton_moe.plan is also a function

    monkeypatch.setattr(kt, "sm_count", lambda device=None: 3)  # programs loop over several tiles
    monkeypatch.setattr(rules, "X_QUANT_MAX_BLOCK_M", 64)
    moe.forget_plans()
    try:
        cfg = _cfg(64, 256 if quant == "fp8_channel" else 64, swap_ab=False, tma=True)
        compare(make_inputs(EVEN, 9, quant, seed=5).kwargs(), quant, cfg)
    finally:
        monkeypatch.undo()
        moe.forget_plans()


@pytest.mark.parametrize("quant", ["fp8_block", "fp8_channel"])
def test_bad_expert_id(quant, word):
    kw = make_inputs(ODD, 9, quant, seed=6).kwargs()
    kw["topk_ids"][2, 1] = 8
    _, bits = compare(kw, quant, _cfg(block_k=128 if quant == "fp8_block" else 64))
    assert bits == BAD_ID


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("swap_ab", [False, True], ids=["noswap", "swap"])
@pytest.mark.parametrize("quant", ["fp8_block", "fp8_channel"])
def test_nan_in_x(quant, swap_ab, word):
    """A NaN in token 3's x: its scale group / row keeps it (integer maxima of the bits), as on the
    separate path; token 3's output row is NaN, the others finite."""
    kw = make_inputs(ODD, 9, quant, seed=7).kwargs()
    kw["x"][3, 5] = float("nan")
    out, _ = compare(kw, quant, _cfg(block_k=128) if swap_ab else _cfg(16, 64, swap_ab=False))
    assert bool(out[3].isnan().all()) and not bool(out[torch.arange(9) != 3].isnan().any())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("value", [0.0, -0.01, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_static_bad_a1_scale_sets_its_error_bit(value, word):
    kw = make_inputs(ODD, 9, "fp8_tensor", seed=3).kwargs()
    _, a2 = calibrate_static_scales(**kw)
    _, bits = compare(kw, "fp8_tensor", _cfg(block_k=64), torch.tensor([value]), a2)
    assert bits & BAD_A1_SCALE


# --- launches ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_x_quantize_launch_is_gone(case, word):
    from triton_moe import fused_moe, moe
    from triton_moe.jit import count_compilations

    quant, shape, cfg, static = CASES[case]
    kw = make_inputs(shape, 9, quant, seed=8).kwargs()
    if static:
        kw["a1_scale"], kw["a2_scale"] = calibrate_static_scales(**kw)
    with count_compilations(dry_run=True):
        fused_moe(**kw, config=cfg)
    with count_compilations(dry_run=True) as fused:
        fused_moe(**kw, config=cfg)
    with moe.separate_x_quant(), count_compilations(dry_run=True) as separate:
        fused_moe(**kw, config=cfg)
    gemm1 = fused.launches.index("moe_gemm_kernel")
    assert fused.launches[:gemm1] == ["_count_kernel", "_place_kernel"], fused.launches
    assert separate.launches == fused.launches[:gemm1] + ["quantize_kernel"] + fused.launches[gemm1:]


# --- on the GPU ----------------------------------------------------------------------------------

GPU_SHAPES = {"mixtral": "mixtral-8x7b", "deepseek-tp8": "deepseek-v3:tp8"}
GPU_CASES = {  # the decode tiles of the H200 tables, and one of split-K
    "block-swap16x64": ("fp8_block", TritonConfig(16, 64, 128, 1, 4, 5, True)),
    "block-swap16x128": ("fp8_block", TritonConfig(16, 128, 128, 1, 4, 3, True)),
    "block-swap16x128-split2": ("fp8_block", TritonConfig(16, 128, 128, 1, 4, 3, True, split_k=2)),
    "channel-swap16x64": ("fp8_channel", TritonConfig(16, 64, 128, 1, 4, 4, True)),
    "channel-swap32x128": ("fp8_channel", TritonConfig(32, 128, 128, 1, 4, 3, True)),
    "static-swap16x128": ("static", TritonConfig(16, 128, 128, 1, 4, 3, True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_x_quant_in_gemm1_matches_the_separate_path(shape, case):
    quant, cfg = GPU_CASES[case]
    q = "fp8_tensor" if quant == "static" else quant
    for T in (1, 8, 64):
        kw = make_inputs(get_shape(GPU_SHAPES[shape]), T, q, seed=11 + T, device="cuda").kwargs()
        kw["x"][0, 3] = float("nan")  # token 0's row: NaN on both paths
        a1 = a2 = None
        if quant == "static":
            a1, a2 = calibrate_static_scales(**kw)
        compare(kw, q, cfg, a1, a2)
        torch.cuda.synchronize()
    error_word("cuda").zero_()


def test_the_product_leaves_the_rule_off():
    """Measured slower than x's own quantize launch (notes/results/x_quant_h100_2026-12-06.md): off by default."""
    import importlib

    rules = importlib.import_module("triton_moe.plan")
    source = importlib.util.find_spec("triton_moe.plan").loader.get_source("triton_moe.plan")
    assert "\nX_QUANT_IN_GEMM1 = False\n" in source
    assert rules.X_QUANT_IN_GEMM1 is True  # this module's fixture turned it on

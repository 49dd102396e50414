"""The FP8 intermediate quantized in GEMM1's epilogue (``triton_moe.plan.epilogue_quant``, THE rule):
static fp8_tensor scales, and fp8_block when GEMM1's BLOCK_N holds whole 1×128 groups.

On the CPU (Triton interpreter), for each case the rule applies to, the same expert computation is
run twice — GEMM1's epilogue writing the E4M3 intermediate (and fp8_block's scales), and the
separate path of before (``triton_moe.moe.separate_act_quant``: fp32 intermediate →
``quantize_kernel``) — and compared bit for bit: the E4M3 codes, the scales, the layer's output
and the error word. The separate path's fp32 intermediate, quantized by ``moe_spec.quant``, gives the
same codes and scales too. Cases: fp8_block with I a multiple of 128 and not, 128- and 256-wide
tiles, swap-AB on and off, split-K, the persistent TMA kernel, a bad expert id, a NaN in x; static
fp8_tensor with a calibrated scale, a tiny scale that saturates, and bad scales that set the error
bit. The ``-m gpu`` test repeats the comparison on CUDA at a Mixtral-like and a DeepSeek-V3 TP8-like
shape. The sm_90a compile of the fused GEMM1 is in tests/test_triton_sm90.py, the launch counts in
tests/test_launches.py and tests/test_fp8_static.py.
"""

import pytest
import torch
from triton_fused_quant import fused_and_separate, same_bits

from moe_spec.oracle import calibrate_static_scales
from moe_spec.problem import MoEShape, get_shape, make_inputs
from moe_spec.quant import FP8_MAX, quantize_activation, quantize_activation_static
from moe_spec.validate import BAD_A2_SCALE, BAD_ID, error_word
from triton_moe import TritonConfig

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

EVEN = MoEShape("eq256", 8, 2, 256, 256, "test: I a multiple of 128 (two whole groups)")
ODD = MoEShape("eq200", 8, 2, 256, 200, "test: I not a multiple of 128 (the last group 72 wide)")


def _cfg(block_n=128, swap_ab=False, split_k=1, tma=False, block_m=16):
    return TritonConfig(block_m, block_n, 64, 1, 4, 2, swap_ab, split_k=split_k, persistent_tma=tma)


def _codes(q):
    """E4M3 bytes with the two spellings the interpreter cannot reproduce made one: −0 as +0 (its
    e4m3 cast), every NaN as 0x7F (torch writes one sign, the kernel keeps the value's)."""
    b = q.view(torch.uint8).clone()
    b[b == 0x80] = 0
    b[(b & 0x7F) == 0x7F] = 0x7F
    return b


def compare(kw, quant, cfg, a1=None, a2=None):
    """Run the fused and the separate path; assert the rule applied to the first only, and that
    codes, scales, output and error word agree bit for bit, with moe_spec.quant too.
    Returns (fused aq, fused scales or None, error word)."""
    runs = fused_and_separate(kw, quant, cfg, "EPILOGUE_QUANT", a1, a2)
    (out, ws, _, fused, bits), (ref_out, ref_ws, _, ref_fused, ref_bits) = runs
    assert fused and not ref_fused, "the rule (triton_moe.plan.epilogue_quant) should apply here"
    assert ws["act"] is None and "act_amax" not in ws  # no fp32 intermediate
    act = ref_ws["act"]
    assert act.dtype == torch.float32
    assert same_bits(ws["aq"], ref_ws["aq"]), "E4M3 codes differ from the separate quantize pass"
    assert bits == ref_bits
    assert same_bits(out, ref_out), "the layer's output changed"
    if a2 is not None:  # static: the scale is the given one, untouched
        q_ref = quantize_activation_static(act.cpu(), a2.cpu())
        scale = None
    else:
        assert same_bits(ws["act_scale"], ref_ws["act_scale"]), "block scales differ from the separate pass"
        q_ref, s_ref = quantize_activation(act.cpu(), quant)
        assert same_bits(ws["act_scale"].cpu(), s_ref), "block scales differ from moe_spec.quant"
        scale = ws["act_scale"]
    assert torch.equal(_codes(ws["aq"].cpu()), _codes(q_ref)), "E4M3 codes differ from moe_spec.quant"
    return ws["aq"], scale, bits


# --- the rule ------------------------------------------------------------------------------------


def test_the_rule():
    from triton_moe import moe
    from triton_moe.config import DecodeConfig
    from triton_moe.plan import LayerPlan, epilogue_quant

    for bn, want in ((32, False), (64, False), (128, True), (256, True)):
        assert epilogue_quant(_cfg(bn), "fp8_block") is want
        assert epilogue_quant(_cfg(bn), "fp8_tensor", static=True) is True
        for quant in (None, "fp8_tensor", "fp8_channel"):
            assert epilogue_quant(_cfg(bn), quant) is False  # dynamic per-tensor / per-row: other tiles
    assert LayerPlan(DecodeConfig(), "fp8_tensor").epilogue_quant(True) is False  # its own kernel
    assert LayerPlan(_cfg(128).resolved().check("fp8_block"), "fp8_block").epilogue_quant() is True
    with moe.separate_act_quant():
        assert epilogue_quant(_cfg(128), "fp8_block") is False
        assert epilogue_quant(_cfg(64), "fp8_tensor", static=True) is False
    assert epilogue_quant(_cfg(128), "fp8_block") is True  # restored


# --- fp8_block -----------------------------------------------------------------------------------

BLOCK_CASES = {
    "even": (EVEN, _cfg()),
    "odd": (ODD, _cfg()),
    "odd-256wide": (ODD, _cfg(256)),  # one tile: a whole group and a 72-wide one
    "even-swap": (EVEN, _cfg(swap_ab=True)),
    "odd-swap": (ODD, _cfg(swap_ab=True)),
    "odd-split2": (ODD, _cfg(split_k=2)),
    "even-swap-split4": (EVEN, _cfg(swap_ab=True, split_k=4)),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_fp8_block_matches_the_separate_pass(case, word):
    shape, cfg = BLOCK_CASES[case]
    aq, scale, bits = compare(make_inputs(shape, 9, "fp8_block", seed=3).kwargs(), "fp8_block", cfg)
    assert bits == 0
    I = shape.intermediate  # noqa: E741
    groups = -(-I // 128)
    assert scale.shape == (18, groups) and bool((scale > 0).all())
    # every group's largest value is its amax, so it quantizes to ±448 — the last, partial group of
    # ODD too: only its 72 columns count, nothing of the tile's masked columns
    for g in range(groups):
        assert bool((aq[:, 128 * g : min(128 * (g + 1), I)].float().abs().amax(dim=1) == FP8_MAX).all()), g


def test_fp8_block_persistent_tma(word, monkeypatch):
    import triton_moe.kernels_tma as kt

    monkeypatch.setattr(kt, "sm_count", lambda device=None: 3)  # programs loop over several tiles
    compare(make_inputs(EVEN, 9, "fp8_block", seed=5).kwargs(), "fp8_block", _cfg(tma=True))


def test_fp8_block_bad_expert_id(word):
    """A pair with an id outside [0, E): GEMM1 zeroes its intermediate, so its scales are the floor's
    (amax 0), its codes zero; the error bit is the alignment's, as on the separate path."""
    kw = make_inputs(ODD, 9, "fp8_block", seed=6).kwargs()
    kw["topk_ids"][2, 1] = 8
    aq, scale, bits = compare(kw, "fp8_block", _cfg())
    assert bits == BAD_ID
    assert not bool(aq[2 * 2 + 1].float().any()) and bool((scale[2 * 2 + 1] == 1e-12 / 448).all())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("swap_ab", [False, True], ids=["noswap", "swap"])
def test_fp8_block_nan_in_x(swap_ab, word):
    """A NaN in token 3's x: its rows' amaxes keep it (integer maxima of the bits), so their scales and
    codes are NaN, as moe_spec.quant's; the other rows are finite."""
    kw = make_inputs(ODD, 9, "fp8_block", seed=7).kwargs()
    kw["x"][3, 5] = float("nan")
    aq, scale, _ = compare(kw, "fp8_block", _cfg(swap_ab=swap_ab))
    nan_rows = torch.zeros(18, dtype=torch.bool)
    nan_rows[6:8] = True
    assert bool(scale[nan_rows].isnan().all()) and not bool(scale[~nan_rows].isnan().any())
    assert bool(aq[nan_rows].float().isnan().all())


# --- static fp8_tensor ----------------------------------------------------------------------------

STATIC_CFGS = {
    "32wide": _cfg(32),  # any BLOCK_N: the scale is one number
    "swap": _cfg(64, swap_ab=True),
    "split2": _cfg(32, split_k=2),
}


def _static_inputs(seed=2):
    kw = make_inputs(ODD, 9, "fp8_tensor", seed=seed).kwargs()
    a1, a2 = calibrate_static_scales(**kw)
    return kw, a1, a2


@pytest.mark.parametrize("cfg", list(STATIC_CFGS))
@pytest.mark.parametrize("scale", ["calibrated", "tiny"])
def test_static_fp8_tensor_matches_the_separate_pass(cfg, scale, word):
    kw, a1, a2 = _static_inputs()
    if scale == "tiny":
        a2 = a2 / 64
    aq, _, bits = compare(kw, "fp8_tensor", STATIC_CFGS[cfg], a1, a2)
    assert bits == 0
    saturated = int((aq.float().abs() == FP8_MAX).sum())
    assert (saturated > 100) if scale == "tiny" else (saturated < 10)  # 448·s clips the tiny scale


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy divides by the bad scale
@pytest.mark.parametrize("value", [0.0, -0.01, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_static_bad_scale_sets_its_error_bit(value, word):
    kw, a1, _ = _static_inputs(seed=3)
    _, _, bits = compare(kw, "fp8_tensor", _cfg(32), a1, torch.tensor([value]))
    assert bits == BAD_A2_SCALE


# --- the whole layer through fused_moe -----------------------------------------------------------

LAYER_CASES = [
    ("fp8_block", ODD, _cfg(), False),
    ("fp8_block", EVEN, _cfg(swap_ab=True, split_k=2), False),
    ("fp8_tensor", ODD, _cfg(32), True),
]


@pytest.mark.parametrize("quant, shape, cfg, static", LAYER_CASES, ids=["block", "block-swap-split", "static"])
def test_fused_moe_output_is_unchanged_and_one_launch_shorter(quant, shape, cfg, static, word):
    from triton_moe import fused_moe, moe
    from triton_moe.jit import count_compilations

    kw = make_inputs(shape, 9, quant, seed=8).kwargs()
    if static:
        kw["a1_scale"], kw["a2_scale"] = calibrate_static_scales(**kw)
    with count_compilations() as fused:
        out = fused_moe(**kw, config=cfg)
    with moe.separate_act_quant(), count_compilations() as separate:
        ref = fused_moe(**kw, config=cfg)
    assert same_bits(out, ref)
    assert separate.launches.count("quantize_kernel") == fused.launches.count("quantize_kernel") + 1
    assert len(separate.launches) == len(fused.launches) + 1
    assert int(word) == 0


# --- the lab's measurement (python -m triton_moe.lab.bench_epilogue_quant), on the CPU --------------


def test_the_bench_report_renders_and_its_cells_are_catalog_shapes(tmp_path):
    import json

    from triton_moe.lab import bench_epilogue_quant as bench

    for spec, T, fmt in bench.CELLS:
        get_shape(spec)  # raises on a name the catalog lacks
        assert fmt in bench.FORMATS and T >= 1
    timed = dict(applies=True, tile="64x128x128", separate_us=100.0, epilogue_us=90.0, equal=True, rel_l2=4e-3)
    results = dict(
        date="d",
        device="dev",
        commit="c",
        command="cmd",
        cut=["mixtral-8x7b fp8_block T=4096"],
        rows=[
            dict(shape="mixtral-8x7b", format="fp8_block", T=128, **timed),
            dict(shape="mixtral-8x7b", format="fp8_block", T=1, applies=False, tile="16x64x128"),
            dict(shape="qwen3-30b-a3b", format="fp8_tensor static", T=1, error="RuntimeError('x')"),
        ],
    )
    bench._write(tmp_path, results)
    md = (tmp_path / "epilogue_quant.md").read_text()
    assert "| mixtral-8x7b | fp8_block | 128 | 64x128x128 | 100.0 | 90.0 | 0.900 | yes | 4.0e-03 |" in md, md
    assert "| mixtral-8x7b | fp8_block | 1 | 16x64x128 | the rule does not apply: not timed |" in md, md
    assert "| qwen3-30b-a3b | fp8_tensor static | 1 | error: RuntimeError('x') |" in md, md
    assert "Not run (deadline): mixtral-8x7b fp8_block T=4096" in md
    assert json.loads((tmp_path / "epilogue_quant.json").read_text())["rows"][0]["epilogue_us"] == 90.0


# --- on the GPU ----------------------------------------------------------------------------------

GPU_SHAPES = {"mixtral": "mixtral-8x7b", "deepseek-tp8": "deepseek-v3:tp8"}
GPU_CFGS = {  # 128-wide GEMM1 tiles: the prefill tile, a swap-AB decode tile, a split-K decode tile
    "128x128": TritonConfig(128, 128, 128, 8, 8, 3),
    "swap16x128": TritonConfig(16, 128, 128, 1, 4, 4, True),
    "swap16x128-split4": TritonConfig(16, 128, 128, 1, 4, 4, True, split_k=4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", list(GPU_CFGS))
@pytest.mark.parametrize("quant", ["fp8_block", "static"])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_fused_epilogue_matches_the_separate_pass(shape, quant, cfg):
    s = get_shape(GPU_SHAPES[shape])
    T = 4 if "split" in cfg else 256
    q = "fp8_tensor" if quant == "static" else quant
    kw = make_inputs(s, T, q, seed=11, device="cuda").kwargs()
    a1 = a2 = None
    if quant == "static":
        a1, a2 = calibrate_static_scales(**kw)
        a2 = a2 / 4  # some values saturate
    compare(kw, q, GPU_CFGS[cfg], a1, a2)
    torch.cuda.synchronize()
    error_word("cuda").zero_()

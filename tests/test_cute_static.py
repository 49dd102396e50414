"""cute_moe with static (calibrated) activation scales: ``a1_scale`` (x's) and ``a2_scale`` (the
intermediate SiLU·up's), fp8_tensor only (moe_spec.contract).

CPU (no launch): the static quantize kernels compile for sm_90a without any amax reduction and
with IEEE divisions; a warm static call (``cute_moe.lab.bench_align.gpu_stand_in``) launches no amax
kernel, exactly the expected kernels and no torch op; bad arguments are refused, naming the
argument, before any launch; the warm-up takes ``static``.

GPU (``-m gpu``): the static layer against the static oracle and triton_moe's static layer, reruns
bit-identical, a token alone equal bit for bit to its row in a batch of 37, a bad scale value
flagged in the error word (and its output like triton_moe's) — on both paths (swap-AB on and off),
with GEMM1 gated and plain (cute_moe.plan.GATED_FP8_GEMM1).
"""

import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cute_moe = pytest.importorskip("cute_moe")

from moe_spec.oracle import calibrate_static_scales, oracle, rel_l2  # noqa: E402
from moe_spec.problem import MoEShape, make_inputs  # noqa: E402
from moe_spec.validate import BAD_A1_SCALE, BAD_A2_SCALE, MoEDims, check  # noqa: E402

plan_module = importlib.import_module("cute_moe.plan")  # the module (cute_moe.plan is also the function)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

SHAPE = MoEShape("static", 8, 2, 128, 64, "test: Mixtral-like routing, small sizes")
#: T = 4: one alignment chunk (its place kernel alone); T = 1100: two chunks (its count kernel too).
CUTE_ALIGN = {4: ["place"], 1100: ["count", "place"]}
#: aten ops that read a device value on the host (a sync on a GPU): none may run.
HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal"}
#: GATED_FP8_GEMM1 settings: GEMM1 plain on both paths, gated on both (the default).
GATED = {"plain": (), "gated": ("swap_ab", "normal")}


def _static_inputs(T: int, seed: int = 0, shape=SHAPE, device="cpu"):
    """(fused_moe's keyword arguments, a1_scale, a2_scale): the scales calibrated on the batch itself."""
    kw = make_inputs(shape, T, "fp8_tensor", seed=seed, device=device).kwargs()
    a1, a2 = calibrate_static_scales(**kw)
    return kw, a1.to(device), a2.to(device)


# ---- the kernels ---------------------------------------------------------------------------------
def test_static_quantize_kernels_divide_by_the_given_scale_without_an_amax():
    kernels = cute_moe.compile_quant_kernels("fp8_tensor", keep_ptx=True, static=True)
    assert set(kernels) == {"x_quantize_static", "silu_quantize_static", "a_quantize_static"}
    bits = {"x_quantize_static": BAD_A1_SCALE, "silu_quantize_static": BAD_A2_SCALE, "a_quantize_static": BAD_A2_SCALE}
    for name, k in kernels.items():
        p = k.__ptx__
        assert ".target sm_90a" in p
        assert "div.rn.f32" in p and "cvt.rn.satfinite.e4m3x2.f32" in p  # v / s as moe_spec divides, saturating
        assert not re.search(r"div\.(approx|full)|rcp\.", p)  # never a reciprocal multiply
        # no amax: no max, no warp reduction, no atomic max — one atomic OR of the bad-scale bit
        assert "atom.global.max" not in p and "shfl.sync.bfly" not in p and not re.search(r"max(\.NaN)?\.f32", p)
        assert re.findall(r"atom\.global\.or\.b32\s+%r\d+, \[%rd\d+\], (\d+);", p) == [str(bits[name])]
        assert ("ex2.approx" in p) == (name == "silu_quantize_static")  # SiLU·up computed on the way


def test_static_kernels_are_fp8_tensor_only():
    with pytest.raises(ValueError, match="^quant: static activation scales are per tensor"):
        cute_moe.compile_quant_kernels("fp8_block", static=True)


# ---- the launches of a warm call ---------------------------------------------------------------
CASES = [(g, swap, T) for g in GATED for swap in (False, True) for T in CUTE_ALIGN]


@pytest.mark.parametrize("gated, swap_ab, T", CASES, ids=[f"{g}-{'swap' if s else 'normal'}-T{T}" for g, s, T in CASES])
def test_static_call_launches_no_amax(gated, swap_ab, T, monkeypatch):
    from cute_moe.lab.bench_align import gpu_stand_in, launches_per_call

    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", GATED[gated])  # gpu_stand_in forgets the bound calls
    kw, a1, a2 = _static_inputs(T)
    kw.update(a1_scale=a1, a2_scale=a2.reshape(()), swap_ab=swap_ab)  # a 0-d scale as vLLM passes it
    with gpu_stand_in() as (fused_moe, launches):
        cute, torch_ops, ops = launches_per_call(fused_moe, launches, kw)
    # plain: SiLU·up inside the quantize kernel; gated on the normal path: GEMM1's epilogue divides by a2_scale
    # and writes the E4M3 intermediate itself (cute_moe.plan.epilogue_quant), no quantize launch
    a_quantize = ["a_quantize_static" if gated == "gated" else "silu_quantize_static"]
    if gated == "gated" and not swap_ab:
        a_quantize = []
    gathering = plan_module.gather_quant("fp8_tensor", "fused", swap_ab, SHAPE.top_k)  # the plan's rule
    x = ["x_gather_quantize"] if gathering else ["x_quantize_static", "gather"]
    layer = [*x, "GroupedGemm", *a_quantize, "GroupedGemm", "combine"]
    assert cute == CUTE_ALIGN[T] + layer, cute
    assert not [name for name in cute if "amax" in name]
    assert torch_ops == [] and not HOST_READS & set(ops), (torch_ops, ops)


# ---- bad arguments: named before any launch ----------------------------------------------------
def _bad(kw, a1, a2):
    block = make_inputs(SHAPE, 3, "fp8_block", seed=0).kwargs()
    return [
        (dict(kw, a1_scale=a1), ValueError, "a2_scale: required when a1_scale is given"),
        (dict(kw, a2_scale=a2), ValueError, "a1_scale: required when a2_scale is given"),
        (
            dict(block, a1_scale=a1, a2_scale=a2),
            ValueError,
            "a1_scale: static activation scales need quant='fp8_tensor'",
        ),
        (dict(kw, a1_scale=a1.double(), a2_scale=a2), TypeError, "a1_scale:"),
        (
            dict(kw, a1_scale=a1, a2_scale=a2.repeat(2)),
            ValueError,
            r"a2_scale: expected one scale, shape \(\) or \(1,\)",
        ),
        (
            dict(kw, a1_scale=a1, a2_scale=a2, fusion="separate"),
            ValueError,
            "fusion: 'separate' quantizes with dynamic",
        ),
    ]


def test_bad_static_arguments_are_named_before_any_launch():
    from cute_moe.lab.bench_align import gpu_stand_in

    kw, a1, a2 = _static_inputs(3)
    with gpu_stand_in() as (fused_moe, launches):
        for args, exc, match in _bad(kw, a1, a2):
            launches.clear()
            with pytest.raises(exc, match=f"^{match}"):
                fused_moe(**args)
            assert launches == [], (match, launches)


def test_the_public_function_checks_static_scales_then_the_device():
    """Through ``cute_moe.fused_moe`` (the op's entry) on CPU tensors: the contract's refusals first;
    good static scales pass every argument check and meet the device rule (no static refusal left)."""
    kw, a1, a2 = _static_inputs(3)
    for args, exc, match in _bad(kw, a1, a2)[:5]:
        with pytest.raises(exc, match=f"^{match}"):
            cute_moe.fused_moe(**args)
    with pytest.raises(ValueError) as err:
        cute_moe.fused_moe(**kw, a1_scale=a1, a2_scale=a2)
    assert "scale" not in str(err.value).split(":")[0], err.value


def test_warmup_takes_static():
    report = cute_moe.warmup(8, 128, 64, 2, "fp8_tensor", max_tokens=16, device="cpu", dry_run=True, static=True)
    step = [s for s in report.steps if s.what == "static-scale quantize kernels"]
    assert len(step) == 1 and set(step[0].compiled) == {
        "x_quantize_static",
        "silu_quantize_static",
        "a_quantize_static",
    }
    with pytest.raises(ValueError, match="^static: static activation scales need quant='fp8_tensor'"):
        cute_moe.warmup(8, 128, 64, 2, "fp8_block", max_tokens=16, device="cpu", dry_run=True, static=True)
    with pytest.raises(TypeError, match="^static:"):
        cute_moe.warmup(8, 128, 64, 2, "fp8_tensor", max_tokens=16, device="cpu", dry_run=True, static=1)
    with pytest.raises(ValueError, match="^fusion: static activation scales need the fused pipeline"):
        cute_moe.warmup(
            8, 128, 64, 2, "fp8_tensor", max_tokens=16, device="cpu", dry_run=True, static=True, fusion="separate"
        )


def test_compile_plan_names_static_for_a_plan_without_static_scales():
    from cute_moe.plan import plan
    from cute_moe.warmup import compile_plan
    from moe_spec.validate import MoEDims

    bf16 = plan(MoEDims(T=4, E=8, K=128, I=64, top_k=2), None)
    with pytest.raises(ValueError, match="^static: static activation scales need a fp8_tensor plan, got quant=None"):
        compile_plan(bf16, static=True)


# ---- GPU: the layer --------------------------------------------------------------------------------
GPU_SHAPE = MoEShape("static-gpu", 8, 2, 320, 208, "test shape: K and I not multiples of 128")
TOL_ORACLE = 1e-2


def _cross_tolerance() -> float:
    from compare.metrics import cross_backend_tolerance

    return cross_backend_tolerance("fp8_tensor")


@pytest.fixture(params=list(GATED))
def gemm1(request, monkeypatch):
    """GEMM1 gated or plain on both paths, the bound calls forgotten before and after."""
    from cute_moe.moe import forget_calls

    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", GATED[request.param])
    forget_calls()
    yield request.param
    monkeypatch.undo()
    forget_calls()


def _gpu_inputs(T, seed=0):
    return _static_inputs(T, seed=seed, shape=GPU_SHAPE, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 37, 300])
@pytest.mark.parametrize("clip", [False, True], ids=["calibrated", "clipping"])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["normal", "swap_ab"])
def test_static_layer(gemm1, swap_ab, clip, T):
    import triton_moe

    kw, a1, a2 = _gpu_inputs(T, seed=T)
    if clip:  # scales below the batch's amaxes: x and the intermediate saturate in places
        a1, a2 = a1 / 4, a2 / 8
    check()
    out = cute_moe.fused_moe(**kw, a1_scale=a1, a2_scale=a2, swap_ab=swap_ab)
    again = cute_moe.fused_moe(**kw, a1_scale=a1, a2_scale=a2, swap_ab=swap_ab)
    assert out.shape == kw["x"].shape and out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "reruns must be bit-identical"
    assert rel_l2(out, oracle(**kw, a1_scale=a1, a2_scale=a2)) <= TOL_ORACLE
    tri = triton_moe.fused_moe(**kw, a1_scale=a1, a2_scale=a2)
    assert rel_l2(out, tri) <= _cross_tolerance()
    check()  # good scales set no bit


@pytest.mark.gpu
@pytest.mark.parametrize("swap_ab", [False, True], ids=["normal", "swap_ab"])
def test_a_token_alone_is_its_row_in_the_batch(gemm1, swap_ab):
    """With static scales nothing of a token's output depends on the other tokens: the same kernels
    (the batch's configs, passed to both calls) give its row bit for bit, alone or among 37."""
    kw, a1, a2 = _gpu_inputs(37, seed=3)
    p = plan_module.plan(MoEDims(T=37, E=8, K=320, I=208, top_k=2), "fp8_tensor", swap_ab=swap_ab, static=True)
    options = dict(a1_scale=a1, a2_scale=a2, configs=(p.gemm1, p.gemm2))
    batch = cute_moe.fused_moe(**kw, **options)
    for i in (0, 17, 36):
        one = dict(kw, **{k: kw[k][i : i + 1].contiguous() for k in ("x", "topk_weights", "topk_ids")})
        alone = cute_moe.fused_moe(**one, **options)
        assert torch.equal(alone.view(torch.int16), batch[i : i + 1].view(torch.int16)), i


def _same_damage(out, ref, tol):
    """NaN in the same places; elsewhere the values within ``tol`` (or both all zero)."""
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    a, b = out[finite].float(), ref[finite].float()
    if b.numel() and b.abs().max() > 0:
        assert rel_l2(a, b) <= tol
    else:
        assert torch.equal(a, b)  # both zero (or nothing finite)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["a1_scale", "a2_scale"])
@pytest.mark.parametrize("value", [0.0, -0.01, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["normal", "swap_ab"])
def test_bad_static_scale_sets_its_bit(gemm1, swap_ab, which, value):
    import triton_moe

    kw, a1, a2 = _gpu_inputs(5, seed=1)
    scales = {"a1_scale": a1, "a2_scale": a2}
    scales[which] = torch.tensor([value], device="cuda")
    check()
    out = cute_moe.fused_moe(**kw, **scales, swap_ab=swap_ab)
    with pytest.raises(ValueError, match=f"^{which}: expected a finite, positive static activation scale"):
        check()
    check()  # cleared
    tri = triton_moe.fused_moe(**kw, **scales)
    with pytest.raises(ValueError, match=f"^{which}:"):
        check()
    _same_damage(out, tri, _cross_tolerance())


@pytest.mark.gpu
def test_static_warmup_leaves_nothing_to_compile():
    cute_moe.warmup(8, 320, 208, 2, "fp8_tensor", max_tokens=64, static=True, ids_dtypes=(torch.int32,))
    before = cute_moe.compile_count()
    for T in (1, 5, 64):
        kw, a1, a2 = _gpu_inputs(T)
        kw["topk_ids"] = kw["topk_ids"].int()
        cute_moe.fused_moe(**kw, a1_scale=a1, a2_scale=a2)
    torch.cuda.synchronize()
    assert cute_moe.compile_count() == before

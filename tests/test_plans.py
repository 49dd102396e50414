"""Both backends' plans (moe_spec.plan): one interface, the enumeration a warm-up reads, the
empty-batch rule, and the harness reading them (CPU)."""

import dataclasses

import pytest
import torch

import cute_moe
import triton_moe
from moe_spec.plan import LayerPlan
from moe_spec.problem import MoEShape, get_shape, make_inputs
from moe_spec.validate import MoEDims
from triton_moe import heuristic as triton_config

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

BACKENDS = {"cute_moe": cute_moe, "triton_moe": triton_moe}
SWEEP = 4096  # dense: every T from 1 to here


def dims(spec, T):
    s = get_shape(spec)
    return MoEDims(T=T, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k)


@pytest.mark.parametrize("name", BACKENDS)
def test_one_interface(name):
    p = BACKENDS[name].plan(dims("mixtral-8x7b", 8))
    assert isinstance(p, LayerPlan) and dataclasses.is_dataclass(p)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.quant = "fp8_tensor"
    assert p.align_tile == (p.gemm1.BLOCK_M if name == "triton_moe" else p.gemm1.tokens_tile)
    assert p.swap_ab == (True, True)  # 2 tokens per expert: both backends swap
    assert all(m.startswith("wgmma.mma_async.sync.aligned.m64n") for m in p.mma)
    line = p.describe()
    assert line and "\n" not in line and "swap-AB" in line
    with pytest.raises(TypeError, match="^dims: expected a moe_spec.validate.MoEDims"):
        BACKENDS[name].plan((8, 8, 4096, 14336, 2))


def _sweep(backend, spec, quant, options):
    d = dims(spec, 1)
    listed = backend.plans_for(d.E, d.K, d.I, d.top_k, quant, max_tokens=SWEEP, **options)
    assert len(set(listed)) == len(listed)
    seen = {}
    for T in range(1, SWEEP + 1):
        p = backend.plan(dataclasses.replace(d, T=T), quant, **options)
        assert p in listed, (spec, quant, options, T, p)
        seen.setdefault(p, T)
    assert list(seen) == list(listed)  # nothing listed that no T reaches, in order of T
    return listed


CUTE_FORMATS = [None, "fp8_tensor", "fp8_channel", "fp8_block"]


@pytest.mark.parametrize("options", [{}, {"swap_ab": True}, {"swap_ab": False}, {"fusion": "separate"}], ids=str)
@pytest.mark.parametrize("quant", CUTE_FORMATS, ids=lambda q: q or "bf16")
@pytest.mark.parametrize("spec", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"])
def test_cute_plans_for_lists_every_plan_of_a_dense_sweep(spec, quant, options):
    from cute_moe.plan import GATED_FP8_GEMM1, one_launch, path_rule
    from cute_moe.unfused import GATED_GEMM1

    listed = _sweep(cute_moe, spec, quant, options)
    s = get_shape(spec)  # these layers reach every bucket by T = 4096, and the one launch at T = 1 where it applies
    one = one_launch(MoEDims(T=1, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k), quant, **options)
    assert len(listed) == len(path_rule(options.get("swap_ab"))) + one
    assert [p.path for p in listed] == ["decode"] * one + ["grouped"] * (len(listed) - one)
    for p in listed[one:]:  # every grouped plan is of the call's format and pipeline
        assert p.quant == quant and p.fusion == options.get("fusion", "fused")
        assert {p.gemm1.quant, p.gemm2.quant} == {quant}
        assert (p.gemm1.out_dtype, p.gemm2.out_dtype) == ("bfloat16" if quant is None else "float32", "bfloat16")
        assert p.gemm2.row_scale == (p.fusion == "fused")
        # SiLU·up in GEMM1's epilogue exactly in the fused pipeline while the switches are on (FP8: on the
        # paths listed; fp8_block where I is whole 128-row scale blocks); GEMM2 never
        path = "swap_ab" if p.gemm1.swap_ab else "normal"
        fp8_gated = path in GATED_FP8_GEMM1 and (quant != "fp8_block" or get_shape(spec).intermediate % 128 == 0)
        gated = GATED_GEMM1 if quant is None else fp8_gated
        assert (p.gemm1.gated, p.gemm2.gated) == (gated and p.fusion == "fused", False)


@pytest.mark.parametrize("quant", CUTE_FORMATS[1:])
def test_cute_fp8_plans_are_e4m3_kernels(quant):
    """An FP8 plan: E4M3 GEMMs of the format, k32 WGMMAs on 128-deep stages, GEMM1 to fp32, and the
    same path and token tile as the bf16 plan of the same call (one path rule)."""
    for T in (1, 100, 4096):
        p, bf16 = cute_moe.plan(dims("mixtral-8x7b", T), quant), cute_moe.plan(dims("mixtral-8x7b", T))
        assert all(c.dtype == "float8_e4m3fn" and c.tile_k == 128 for c in (p.gemm1, p.gemm2))
        assert all(m.endswith("k32.f32.e4m3.e4m3") for m in p.mma)
        assert p.swap_ab == bf16.swap_ab and p.align_tile == bf16.align_tile
        assert " k128 " in p.describe() and "k32" in p.describe()
    separate = cute_moe.plan(dims("mixtral-8x7b", 8), quant, fusion="separate")
    assert separate.describe().endswith("| separate") and not separate.gemm2.row_scale
    assert separate.gemm1.epilogue_scales == (quant == "fp8_block")  # block scales stay in the main loop


@pytest.mark.parametrize("device", [None, "NVIDIA H200"], ids=["heuristic", "h200-tables"])
@pytest.mark.parametrize("options", [{}, {"swap_ab": False}], ids=str)
@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
@pytest.mark.parametrize("spec", ["mixtral-8x7b", "deepseek-v3:tp8"])
def test_triton_plans_for_lists_every_plan_of_a_dense_sweep(spec, quant, options, device, monkeypatch):
    monkeypatch.setattr(triton_config, "current_device_name", lambda: device)
    listed = _sweep(triton_moe, spec, quant, options)
    assert len(listed) > 1


@pytest.mark.parametrize("name", BACKENDS)
def test_a_fixed_config_is_one_plan(name):
    backend = BACKENDS[name]
    fixed = backend.plan(dims("qwen3-30b-a3b", 100))
    option = {"configs": (fixed.gemm1, fixed.gemm2)} if name == "cute_moe" else {"config": fixed.gemm1}
    d = dims("qwen3-30b-a3b", 1)
    assert backend.plans_for(d.E, d.K, d.I, d.top_k, max_tokens=SWEEP, **option) == (fixed,)


# ---- the empty batch: planned like any other -----------------------------------------------------
TINY = MoEShape("tiny", 4, 2, 64, 32, "test")


@pytest.mark.parametrize("name", BACKENDS)
def test_an_empty_batch_of_a_supported_call_is_empty(name):
    fused_moe = BACKENDS[name].fused_moe
    if name == "cute_moe" and not torch.cuda.is_available():  # no CuTe launch here: T = 0 refused as T = 1 is
        errors = []
        for T in (0, 1):
            with pytest.raises(ValueError, match=r"^x: ") as refused:
                fused_moe(**make_inputs(TINY, T).kwargs())
            errors.append(str(refused.value))
        assert errors[0] == errors[1]
        return
    out = fused_moe(**make_inputs(TINY, 0).kwargs())
    assert out.shape == (0, TINY.hidden) and out.dtype == torch.bfloat16


REFUSED = [
    ("cute_moe", MoEShape("odd-K", 4, 2, 12, 32, "test"), None, {}, ValueError, r"^x: hidden size K"),
    ("cute_moe", TINY, None, {"swap_ab": 1}, TypeError, r"^swap_ab:"),
    (
        "cute_moe",
        MoEShape("K-72", 4, 2, 72, 32, "test"),
        "fp8_tensor",
        {},
        ValueError,
        r"^x: hidden size K = x\.shape\[1\] = 72 must be a multiple of 16 for cute_moe with quant='fp8_tensor'",
    ),
    ("cute_moe", TINY, "fp8_block", {"fusion": "unfused"}, ValueError, r"^fusion: expected one of"),
    (
        "triton_moe",
        TINY,
        "fp8_block",
        {"config": triton_moe.TritonConfig(16, 64, 256)},
        ValueError,
        r"^config: fp8_block needs BLOCK_K",
    ),
    ("triton_moe", TINY, None, {"swap_ab": "no"}, TypeError, r"^swap_ab:"),
    ("triton_moe", TINY, None, {"config": {"BLOCK_M": 16}}, TypeError, r"^config:"),
]


@pytest.mark.parametrize("name, shape, quant, options, error, match", REFUSED)
def test_a_call_refused_at_one_token_is_refused_at_zero(name, shape, quant, options, error, match):
    for T in (1, 0):
        with pytest.raises(error, match=match):
            BACKENDS[name].fused_moe(**make_inputs(shape, T, quant).kwargs(), **options)


# ---- the harness reads the plans ---------------------------------------------------------------------
@pytest.mark.parametrize("name", BACKENDS)
def test_the_harness_config_column_is_the_plan(name):
    from compare.backends import load_backend

    b = load_backend(name)
    d = dims("deepseek-v3:tp8", 4096)
    assert b.plan is BACKENDS[name].plan
    assert b.describe(d, None) == BACKENDS[name].plan(d, None).describe()

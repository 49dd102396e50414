"""CPU checks of x's quantization where its rows are gathered (``cute_moe.quantops.GatherQuantizeRows``, the
plan's ``gather_quant`` while ``cute_moe.plan.GATHER_QUANT``): the rule, the launches a call makes with it,
and the kernel's PTX — the same quantization arithmetic as ``QuantizeRows`` (whose output the GPU lane
compares it with bit for bit: ``tests/test_cute_fp8_gpu.py``), the group's amax only where it is per block,
no spills.  The CuTe DSL compiles for sm_90a here; nothing runs."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

import importlib  # noqa: E402

from cute_moe.moe import plan_switches  # noqa: E402
from moe_spec.problem import MoEShape, make_inputs  # noqa: E402
from moe_spec.validate import MoEDims  # noqa: E402

plan_module = importlib.import_module("cute_moe.plan")  # the module: cute_moe.plan is its function

FORMATS = ("fp8_tensor", "fp8_channel", "fp8_block")
SHAPE = MoEShape("host", 128, 8, 256, 128, "host cost")


@pytest.fixture
def gather_quant():
    with plan_switches(GATHER_QUANT=True, GATHER_QUANT_NORMAL_TOP_K=None):  # on both paths, any top_k
        yield


def test_plan_switches_sets_forgets_and_restores():
    """``cute_moe.moe.plan_switches``: the switch is on inside and as it was after, the cached calls are
    dropped on the way in and out, and a name cute_moe.plan does not have is refused before anything is set."""
    from cute_moe.moe import _call_of

    dims = MoEDims(T=8, E=128, K=2048, I=768, top_k=8)
    _call_of(dims, "fp8_block", None, None, "fused", "cpu", "int32", False)
    assert _call_of.cache_info().currsize > 0
    before = plan_module.GATHER_QUANT
    with plan_switches(GATHER_QUANT=not before):
        assert plan_module.GATHER_QUANT is (not before) and _call_of.cache_info().currsize == 0
        _call_of(dims, "fp8_block", None, None, "fused", "cpu", "int32", False)
    assert plan_module.GATHER_QUANT is before and _call_of.cache_info().currsize == 0
    with pytest.raises(AttributeError, match="NO_SUCH_SWITCH"):
        with plan_switches(GATHER_QUANT=not before, NO_SUCH_SWITCH=1):
            pass
    assert plan_module.GATHER_QUANT is before


def test_the_rule_takes_the_fused_fp8_pipeline(gather_quant):
    assert plan_module.gather_quant("fp8_block", "fused")
    assert not plan_module.gather_quant(None, "fused")  # bf16: nothing to quantize
    assert not plan_module.gather_quant("fp8_channel", "separate")  # the unfused reference
    dims = MoEDims(T=8, E=128, K=2048, I=768, top_k=8)
    p = plan_module.plan(dims, "fp8_channel")
    words = p.describe().split(" | ")  # compare's config column reads the first two as G1 and G2
    assert p.gather_quant and [w[:3] for w in words] == ["G1 ", "G2 ", "xq:"], words
    assert plan_module.plan(dims, "fp8_tensor", static=True).gather_quant  # by the caller's scale
    assert not plan_module.plan(dims, "fp8_tensor", fusion="separate").gather_quant


def test_on_by_default_where_it_was_timed():
    """The plan ships it where notes/results/gpu_h100_2026-12-07_e27de90.md timed it: on the swap-AB path
    at any top_k, on the normal path at two slots per token (Mixtral-8x7B prefill), not at eight (Qwen3-30B-A3B
    prefill); the switch turns it off everywhere."""
    decode, qwen3 = MoEDims(T=8, E=128, K=2048, I=768, top_k=8), MoEDims(T=4096, E=128, K=2048, I=768, top_k=8)
    mixtral = MoEDims(T=4096, E=8, K=4096, I=14336, top_k=2)
    assert plan_module.GATHER_QUANT is True and plan_module.GATHER_QUANT_NORMAL_TOP_K == 2
    for q in FORMATS:
        p = {name: plan_module.plan(d, q) for name, d in (("decode", decode), ("qwen3", qwen3), ("mixtral", mixtral))}
        assert p["decode"].gemm1.swap_ab and not p["qwen3"].gemm1.swap_ab and not p["mixtral"].gemm1.swap_ab
        assert p["decode"].gather_quant and p["mixtral"].gather_quant and not p["qwen3"].gather_quant
        with plan_switches(GATHER_QUANT=False):
            assert not any(plan_module.plan(d, q).gather_quant for d in (decode, qwen3, mixtral))


@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("T", [4, 1100])
def test_a_call_launches_one_gathering_quantize(quant, T, gather_quant):
    """x's quantize launch, its E4M3 gather and (channel, block) the torch gather of its scales become one
    launch; fp8_block has no x amax launch either."""
    from cute_moe.lab.bench_align import gpu_stand_in, launches_per_call

    kw = make_inputs(SHAPE, T, quant, seed=0).kwargs()
    with gpu_stand_in() as (fused_moe, launches):
        cute, torch_ops, _ = launches_per_call(fused_moe, launches, kw)
    assert torch_ops == [], torch_ops
    head = cute[: cute.index("GroupedGemm")]
    x_steps = [name for name in head if name not in ("count", "place")]
    assert x_steps == ([] if quant == "fp8_block" else ["x_amax"]) + ["x_gather_quantize"], cute


@pytest.mark.parametrize("T", [4, 1100])
def test_a_static_scale_call_launches_one_gathering_quantize(T, gather_quant):
    """Static fp8_tensor scales: x's quantize launch and its gather become one, with no amax launch."""
    import torch

    from cute_moe.lab.bench_align import gpu_stand_in, launches_per_call

    kw = make_inputs(SHAPE, T, "fp8_tensor", seed=0).kwargs()
    kw.update(a1_scale=torch.tensor(0.01), a2_scale=torch.tensor(0.02))
    with gpu_stand_in() as (fused_moe, launches):
        cute, torch_ops, _ = launches_per_call(fused_moe, launches, kw)
    assert torch_ops == [], torch_ops
    head = cute[: cute.index("GroupedGemm")]
    assert [name for name in head if name not in ("count", "place")] == ["x_gather_quantize"], cute


@pytest.fixture(scope="module")
def ptx():
    from cute_moe.quantops import compile_gather_quantize, compile_quant_kernels

    out = {q: compile_gather_quantize(q, 132, keep_ptx=True).__ptx__ for q in FORMATS}
    out["static"] = compile_gather_quantize("fp8_tensor", 132, keep_ptx=True, static=True).__ptx__
    out["QuantizeRows"] = compile_quant_kernels("fp8_block", 132, keep_ptx=True)["x_quantize"].__ptx__
    static = compile_quant_kernels("fp8_tensor", 132, keep_ptx=True, static=True)
    out["StaticQuantizeRows"] = static["x_quantize_static"].__ptx__
    return out


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("quant", FORMATS)
def test_the_quantization_is_quantize_rows_arithmetic(quant, ptx):
    """Per group: four IEEE divisions of a value by its scale and one of the amax by 448 (no reciprocal),
    two saturating E4M3 pair conversions — QuantizeRows' own instructions; the scale floor as a max."""
    for text in (ptx[quant], ptx["QuantizeRows"]):
        assert _count(r"div\.rn\.f32", text) == 5
        assert _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", text) == 2
        assert _count(r"rcp\.", text) == 0


def test_the_static_quantization_is_static_quantize_rows_arithmetic(ptx):
    """Static scales: four IEEE divisions by the caller's scale per group (no scale of its own to compute),
    two saturating E4M3 pair conversions, and one atomic OR — the bad-scale bit — as StaticQuantizeRows."""
    for text in (ptx["static"], ptx["StaticQuantizeRows"]):
        assert _count(r"div\.rn\.f32", text) == 4
        assert _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", text) == 2
        assert _count(r"\batom\.[\w.]*or", text) == 1
        assert _count(r"rcp\.", text) == 0


@pytest.mark.parametrize("quant", FORMATS)
def test_only_fp8_block_reduces_an_amax_in_the_warp(quant, ptx):
    """fp8_block: the group's amax over the warp — four NaN-keeping maxima per lane and five butterfly
    shuffles; the tensor and channel formats read the amax their RowAmax launch took, and reduce nothing.
    No format issues an atomic: nothing is accumulated across warps."""
    text = ptx[quant]
    block = quant == "fp8_block"
    assert _count(r"shfl\.sync\.bfly", text) == (5 if block else 0)
    assert _count(r"max\.NaN\.f32", text) == (9 if block else 0)
    assert _count(r"\batom\.", text) == 0


@pytest.mark.parametrize("quant", [*FORMATS, "static"])
def test_ptxas_reports_no_spills(quant, capfd):
    import cutlass
    import cutlass.cute as cute

    from cute_moe.limits import FP8_ALIGN_ELEMS
    from cute_moe.quantops import GatherQuantizeRows, StaticGatherQuantizeRows
    from cute_moe.runtime import fake_rows, fake_stream, fake_vector

    capfd.readouterr()
    f32, static = cutlass.Float32, quant == "static"
    cute.compile(
        StaticGatherQuantizeRows(132) if static else GatherQuantizeRows(quant, 132),
        fake_rows(cutlass.BFloat16, FP8_ALIGN_ELEMS),
        fake_vector(f32),
        fake_rows(cutlass.Float8E4M3FN, FP8_ALIGN_ELEMS),
        fake_vector(cutlass.Int32 if static else f32),
        fake_vector(cutlass.Int64),
        fake_vector(cutlass.Int32),
        fake_stream(),
        options="remarks{ptx}",
    )
    text = "".join(capfd.readouterr())
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert frame and frame.groups() == ("0", "0", "0"), text[-2000:]


def test_warm_up_compiles_the_gathering_quantize(gather_quant):
    """compile_plan of a plan with ``gather_quant`` compiles its kernel: nothing left for the first call."""
    import cute_moe
    from cute_moe.quantops import compile_gather_quantize

    (p,) = cute_moe.plans_for(128, 2048, 768, 8, "fp8_block", max_tokens=1)
    assert p.gather_quant
    sms = 77  # an SM count no other test compiles for: the kernel is new to this process's cache here
    cute_moe.compile_plan(p, sms)
    n = cute_moe.compile_count()
    compile_gather_quantize("fp8_block", sms)
    assert cute_moe.compile_count() == n and cute_moe.compile_plan(p, sms) == 0


@pytest.mark.parametrize("quant", FORMATS)
def test_the_workspace_holds_only_what_the_gathering_call_reads(quant, gather_quant):
    """x's token-order scales only under fp8_tensor (its one scale; channel and block write straight into the
    sorted order), and under fp8_block x's amax shrinks to a one-element stand-in, so the alignment zeroes
    ⌈K/128⌉·T elements fewer; switched off, the workspace keeps both at full size."""
    import math

    import torch

    from cute_moe.moe import _buffers, _Call
    from cute_moe.moe_fp8 import amax_sizes
    from moe_spec.quant import activation_scale_shape

    dims = MoEDims(T=64, E=8, K=512, I=256, top_k=2)
    for on in (True, False):
        with plan_switches(GATHER_QUANT=on):
            p = plan_module.plan(dims, quant)
            ws = _buffers(_Call(p, dims, torch.device("cpu"), torch.int32, False))
        n_x, n_a = amax_sizes(quant, dims.T, ws["aq"].shape[0], dims.K, dims.I)
        x_scales = math.prod(activation_scale_shape(quant, dims.T, dims.K))
        if on and quant != "fp8_tensor":
            assert "x_scale" not in ws and "x_scale_shaped" not in ws
        else:
            assert ws["x_scale"].numel() == x_scales
        want_x = 1 if on and quant == "fp8_block" else n_x
        assert ws["x_amax"].numel() == want_x and ws["a_amax"].numel() == n_a
        assert ws["rows"].scratch.numel() == want_x + n_a  # what the alignment zeroes

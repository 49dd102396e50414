"""cute_moe's path rule between the one-launch decode kernel (cute_moe/decode.py) and the grouped pipeline:
the rule (``cute_moe.plan.one_launch``, each condition and the switch), the plan it gives (``path``,
``describe``, ``plans_for``), ``fused_moe``'s dispatch (each compiled kernel behind a recorder, as in
tests/test_cute_host.py), bad input named before any launch, and the warm-up's listing. The GPU test: a
Qwen3-shaped call takes the one launch and equals it and the grouped pipeline bit for bit.
"""

import dataclasses
import importlib
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")

from test_cute_host import _mismatches, _Recorder  # noqa: E402

import cute_moe  # noqa: E402
from cute_moe import decode_parts as dp  # noqa: E402
from cute_moe.decode import check_decode_sizes, compile_decode  # noqa: E402
from moe_spec.hopper import WGMMA_M  # noqa: E402
from moe_spec.problem import MoEShape, get_shape, make_inputs  # noqa: E402
from moe_spec.validate import MoEDims  # noqa: E402

PLAN = importlib.import_module("cute_moe.plan")  # the module (cute_moe.plan is the function)
QWEN3 = get_shape("qwen3-30b-a3b")
#: Qwen3-30B-A3B's E and top_k, small K and I (whole tiles of the decode kernel): the host path on the CPU.
SMALL = MoEShape("one-launch", 128, 8, 256, 128, "one-launch host path")


def _dims(shape, T):
    return MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)


@pytest.fixture
def switch(monkeypatch):
    """Set ``cute_moe.plan.ONE_LAUNCH`` for one test (fused_moe's cached plans dropped around it)."""
    from cute_moe import moe

    def set_to(on: bool):
        monkeypatch.setattr(PLAN, "ONE_LAUNCH", on)
        moe.forget_calls()

    moe.forget_calls()
    yield set_to
    monkeypatch.undo()
    moe.forget_calls()


# ---- the rule -------------------------------------------------------------------------------------------
def test_the_rule_takes_a_small_bf16_call_without_options():
    last = dp.PAIR_LANES // QWEN3.top_k  # the most tokens within the kernel's pair lanes
    assert PLAN.ONE_LAUNCH and all(PLAN.one_launch(_dims(QWEN3, T)) for T in (0, 1, last))
    assert not PLAN.one_launch(_dims(QWEN3, last + 1))
    d = _dims(QWEN3, 1)
    assert PLAN.ONE_LAUNCH_FORMATS == (None,)  # bf16: the FP8 one launch measured slower in a graph
    assert not PLAN.one_launch(d, "fp8_tensor")
    assert not PLAN.one_launch(d, None, "separate")  # the fused pipeline only
    for swap_ab in (True, False):  # an explicit option asks for the grouped pipeline
        assert not PLAN.one_launch(d, swap_ab=swap_ab)
    cfgs = PLAN.layer_configs(1, d.E, d.K, d.I, d.top_k)
    assert not PLAN.one_launch(d, configs=cfgs)


def test_the_rule_reads_the_kernels_size_limits_and_the_widest_i():
    d = _dims(QWEN3, 1)
    # K and I: whole tiles of the kernel (check_decode_sizes' limits), exactly
    for K, I in ((d.K + dp.Y_TILE // 2, d.I), (d.K, d.I + dp.H_TILE // 2), (d.K + dp.Y_TILE, d.I + dp.H_TILE)):  # noqa: E741
        e = dataclasses.replace(d, K=K, I=I)
        try:
            check_decode_sizes(e)
            fits = True
        except ValueError:
            fits = False
        assert PLAN.one_launch(e) == fits
    wide = PLAN.ONE_LAUNCH_MAX_I
    assert wide % dp.H_TILE == 0 and PLAN.one_launch(dataclasses.replace(d, I=wide))
    assert not PLAN.one_launch(dataclasses.replace(d, I=wide + dp.H_TILE))
    mixtral = get_shape("mixtral-8x7b")  # wide experts: the grouped pipeline until measured
    assert mixtral.intermediate > wide and not PLAN.one_launch(_dims(mixtral, 1))


def test_the_rule_says_why_it_leaves_a_call_to_the_grouped_pipeline(switch):
    d = _dims(QWEN3, 1)
    assert PLAN.grouped_because(d) is None
    cfgs = PLAN.layer_configs(1, d.E, d.K, d.I, d.top_k)
    reasons = {
        "not in ONE_LAUNCH_FORMATS": PLAN.grouped_because(d, "fp8_tensor"),
        "fusion was given": PLAN.grouped_because(d, None, "separate"),
        "swap_ab was given": PLAN.grouped_because(d, swap_ab=True),
        "configs was given": PLAN.grouped_because(d, configs=cfgs),
        "at most 64 (token, slot) pairs": PLAN.grouped_because(_dims(QWEN3, dp.PAIR_LANES // QWEN3.top_k + 1)),
        "a multiple of 64": PLAN.grouped_because(dataclasses.replace(d, I=d.I + dp.H_TILE // 2)),
        "ONE_LAUNCH_MAX_I": PLAN.grouped_because(_dims(get_shape("mixtral-8x7b"), 1)),
    }
    for needle, reason in reasons.items():
        assert reason is not None and needle in reason, (needle, reason)
    switch(False)
    assert "switch is off" in PLAN.grouped_because(d)


def test_an_fp8_format_added_to_the_formats_takes_the_fp8_one_launch(monkeypatch, switch):
    from cute_moe import moe

    monkeypatch.setattr(PLAN, "ONE_LAUNCH_FORMATS", (None, "fp8_tensor", "fp8_block"))
    moe.forget_calls()
    d = _dims(QWEN3, 1)
    for quant in ("fp8_tensor", "fp8_block"):
        p = cute_moe.plan(d, quant)
        assert p.path == "decode" and p.quant == quant and p.mma == (dp.WGMMA_FP8, dp.WGMMA_FP8)
        assert p.describe() == f"decode 1-launch swap-AB W{WGMMA_M}xT{dp.TOKENS} k128 s{dp.stages()} m64n16k32"
    assert cute_moe.plan(d, "fp8_channel").path == "grouped"  # not added
    assert "multiple of 128" in PLAN.grouped_because(dataclasses.replace(d, I=d.I + dp.H_TILE), "fp8_tensor")
    assert dp.WGMMA_FP8 == "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"


def test_the_switch_turns_the_rule_off(switch):
    switch(False)
    assert not PLAN.one_launch(_dims(QWEN3, 1)) and cute_moe.plan(_dims(QWEN3, 1)).path == "grouped"


# ---- the plan ---------------------------------------------------------------------------------------------
def test_the_one_launch_plan_and_its_line():
    p = cute_moe.plan(_dims(QWEN3, 1))
    assert p.path == "decode" and (p.gemm1, p.gemm2) == (None, None) and p.quant is None
    assert p.swap_ab == (True, True) and p.mma == (dp.WGMMA, dp.WGMMA) and p.align_tile == dp.TOKENS
    # the instruction test_cute_decode.py finds in the kernel's PTX; the line built from the kernel's constants
    assert dp.WGMMA == "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
    assert p.describe() == f"decode 1-launch swap-AB W{WGMMA_M}xT{dp.TOKENS} k{dp.TILE_K} s{dp.stages()} m64n16k16"
    # the harness's config column is the plan's line
    from compare.backends import load_backend

    assert load_backend("cute_moe").describe(_dims(QWEN3, 1), None) == p.describe()
    # the explicit options and the other formats keep the grouped pipeline
    for kw in ({"swap_ab": True}, {"fusion": "separate"}):
        assert cute_moe.plan(_dims(QWEN3, 1), **kw).path == "grouped"
    assert cute_moe.plan(_dims(QWEN3, 1), "fp8_block").path == "grouped"
    # layer_configs (configs only): the grouped pipeline's, those the call runs with the switch off
    grouped = PLAN._grouped_plan(_dims(QWEN3, 1), None, None, None, "fused", False)
    assert cute_moe.layer_configs(1, QWEN3.num_experts, QWEN3.hidden, QWEN3.intermediate, 8) == (
        grouped.gemm1,
        grouped.gemm2,
    )


@pytest.mark.parametrize(
    "layer",
    [(128, 2048, 768, 8), (256, 7168, 256, 8), (2, 256, 128, 2), (8, 4096, 14336, 2)],
    ids=["qwen3", "deepseek-tp8", "two-experts", "mixtral"],
)
def test_plans_for_lists_the_one_launch_where_a_dense_sweep_meets_it(layer, switch):
    E, K, I, top_k = layer  # noqa: E741
    listed = cute_moe.plans_for(E, K, I, top_k, max_tokens=600)
    seen = {}
    for T in range(1, 601):
        p = cute_moe.plan(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k))
        assert (p.path == "decode") == PLAN.one_launch(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k)), T
        seen.setdefault(p, T)
    assert list(seen) == list(listed)
    one = PLAN.one_launch(MoEDims(T=1, E=E, K=K, I=I, top_k=top_k))
    assert [p.path for p in listed[:1]] == ["decode" if one else "grouped"]
    switch(False)  # the grouped plans are those of the switch off, from the first T past the pair lanes
    off = cute_moe.plans_for(E, K, I, top_k, max_tokens=600)
    past = cute_moe.plan(MoEDims(T=dp.PAIR_LANES // top_k + 1, E=E, K=K, I=I, top_k=top_k))
    assert listed[one:] == off[off.index(past) if one else 0 :]


# ---- fused_moe's dispatch ------------------------------------------------------------------------------
@pytest.fixture
def recorded(monkeypatch, switch):
    """``cute_moe.moe.fused_moe`` on CPU tensors, each compiled kernel (compiled for real) behind a recorder."""
    from cute_moe import moe

    calls: list = []
    monkeypatch.setattr(moe, "ffi_function", lambda fn: _Recorder(fn, calls))
    monkeypatch.setattr(moe, "check_runs_on", lambda *a: None)
    monkeypatch.setattr(moe, "surface_errors", lambda *a: None)
    moe.forget_calls()
    yield moe.fused_moe, calls


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_a_small_bf16_call_is_one_launch_of_the_decode_kernel(recorded, ids_dtype):
    fused_moe, calls = recorded
    T = 2
    kw = make_inputs(SMALL, T, None, seed=0).kwargs()
    kw["topk_ids"] = kw["topk_ids"].to(ids_dtype)
    out = fused_moe(**kw)
    assert out.shape == (T, SMALL.hidden) and out.dtype == torch.bfloat16
    assert len(calls) == 1
    fn, args = calls[0]
    assert fn is compile_decode(str(ids_dtype).removeprefix("torch."))
    assert _mismatches(fn, args) == []  # the launch fits the compiled signature
    grid = dp.grid_size(T, SMALL.top_k, SMALL.num_experts, SMALL.hidden, SMALL.intermediate, 132)
    assert args[12] == grid and args[13:] == (None,) * 10  # the grid, then the FP8 arguments and the trace: None


@pytest.mark.parametrize(
    "T, options, quant",
    [(dp.PAIR_LANES // SMALL.top_k + 1, {}, None), (1, {"swap_ab": True}, None), (1, {}, "fp8_tensor")],
    ids=["past-the-pair-lanes", "swap_ab", "fp8"],
)
def test_other_calls_run_the_grouped_pipeline(recorded, T, options, quant):
    fused_moe, calls = recorded
    fused_moe(**make_inputs(SMALL, T, quant, seed=0).kwargs(), **options)
    assert len(calls) > 1 and all(fn is not compile_decode("int32") for fn, _ in calls)


def test_the_switch_off_runs_the_grouped_pipeline(recorded, switch):
    fused_moe, calls = recorded
    switch(False)
    fused_moe(**make_inputs(SMALL, 1, None, seed=0).kwargs())
    assert len(calls) > 1 and all(fn is not compile_decode("int32") for fn, _ in calls)


def test_bad_input_is_named_before_any_launch(recorded):
    fused_moe, calls = recorded
    kw = make_inputs(SMALL, 1, None, seed=0).kwargs()
    bad = [
        (dict(kw, x=kw["x"].float()), TypeError, r"^x"),
        (dict(kw, topk_ids=kw["topk_ids"][:, :4]), ValueError, r"topk"),
        (dict(kw, w2=kw["w2"][:, :, :64]), ValueError, r"w2"),
        (dict(kw, topk_weights=kw["topk_weights"].double()), TypeError, r"^topk_weights"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            fused_moe(**args)
    with pytest.raises(TypeError, match=r"^swap_ab"):
        fused_moe(**kw, swap_ab="yes")
    assert calls == []
    empty = make_inputs(SMALL, 0, None, seed=0).kwargs()  # T = 0: the empty output, nothing launched
    assert fused_moe(**empty).shape == (0, SMALL.hidden) and calls == []


def test_the_op_takes_the_same_path(recorded):
    """``torch.ops.cute_moe.fused_moe`` runs the backend's fused_moe: the same one launch."""
    from cute_moe.ops import OP

    fused_moe, calls = recorded
    kw = make_inputs(SMALL, 1, None, seed=0).kwargs()
    out = OP(kw["x"], kw["w1"], kw["w2"], kw["topk_weights"], kw["topk_ids"])
    assert out.shape == (1, SMALL.hidden) and len(calls) == 1 and calls[0][0] is compile_decode("int32")


# ---- the warm-up ---------------------------------------------------------------------------------------
def test_the_warmup_lists_the_decode_kernel_per_ids_dtype(switch):
    from cute_moe.warmup import decode_name

    E, K, I, top_k = SMALL.num_experts, SMALL.hidden, SMALL.intermediate, SMALL.top_k  # noqa: E741
    both = cute_moe.warmup(E, K, I, top_k, max_tokens=64, device="cpu", dry_run=True)
    names = [n for s in both.steps for n in s.compiled]
    assert [n for n in names if n.startswith("decode")] == [decode_name(torch.int32), decode_name(torch.int64)]
    assert {("decode", torch.int32), ("decode", torch.int64)} <= both.covered
    assert both.plans[0] == cute_moe.plan(MoEDims(T=1, E=E, K=K, I=I, top_k=top_k)).describe()
    one = cute_moe.warmup(E, K, I, top_k, max_tokens=64, device="cpu", dry_run=True, ids_dtypes=(torch.int32,))
    assert [n for s in one.steps for n in s.compiled if n.startswith("decode")] == [decode_name(torch.int32)]
    # within the pair lanes only the one launch runs: nothing of the grouped pipeline is listed
    small = cute_moe.warmup(E, K, I, top_k, max_tokens=dp.PAIR_LANES // top_k, device="cpu", dry_run=True)
    assert [s.what for s in small.steps] == [decode_name(torch.int32), decode_name(torch.int64)]
    switch(False)
    off = cute_moe.warmup(E, K, I, top_k, max_tokens=64, device="cpu", dry_run=True)
    assert not [n for s in off.steps for n in s.compiled if n.startswith("decode")]
    assert len(off.plans) == len(both.plans) - 1


def test_compile_plan_of_the_one_launch_compiles_its_kernel_only():
    from cute_moe.cache import compile_count

    p = cute_moe.plan(MoEDims(T=1, E=SMALL.num_experts, K=SMALL.hidden, I=SMALL.intermediate, top_k=8))
    cute_moe.compile_plan(p, ids_dtypes=(torch.int32,))
    compile_decode("int32")  # cached: compile_plan compiled exactly this
    n = compile_count()
    assert cute_moe.compile_plan(p, ids_dtypes=(torch.int32,)) == 0 and compile_count() == n


# ---- GPU -----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_qwen3_t1_takes_the_one_launch_bit_for_bit(switch):
    """Qwen3-30B-A3B bf16, T = 1: ``cute_moe.fused_moe`` takes the one launch (its bound call holds the decode
    kernel only) and equals ``decode_fused_moe`` and the grouped pipeline (the switch off) bit for bit."""
    from cute_moe import moe
    from cute_moe.decode import decode_fused_moe

    kw = make_inputs(QWEN3, 1, None, seed=0).to("cuda").kwargs()
    assert cute_moe.plan(_dims(QWEN3, 1)).path == "decode"
    out = cute_moe.fused_moe(**kw)
    dims = moe.validate_moe_args(**{k: kw[k] for k in ("x", "w1", "w2", "topk_weights", "topk_ids")})
    call = moe._call_of(dims, None, None, None, "fused", kw["x"].device, kw["topk_ids"].dtype, False)
    assert call.plan.path == "decode" and set(call.launches) == {"decode"}
    direct = decode_fused_moe(**{k: kw[k] for k in ("x", "w1", "w2", "topk_weights", "topk_ids")})
    switch(False)
    grouped = cute_moe.fused_moe(**kw)
    torch.cuda.synchronize()
    for other in (direct, grouped):
        assert torch.equal(out.view(torch.int16), other.view(torch.int16))

"""The gated FP8 GEMM1 (SiLU·up in the epilogue of an E4M3 GEMM1, fp32 [M_pad, I] out): its configs and
register budget, the plan's rule (``cute_moe.plan.gated_gemm1``), the PTX of every config the plans pick,
the amax kernel of its output — on the CPU — and, marked ``gpu``, the kernel and the layer against
today's ungated path (bit for bit), an fp64 reference and the W8A8 oracle.
"""

import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cute_moe = pytest.importorskip("cute_moe")

from cute_moe.config import SMEM_BUDGET_BYTES, GemmConfig, max_stages  # noqa: E402
from cute_moe.limits import FP8_TILE_K, TWO_ACCUMULATOR_REGISTERS  # noqa: E402
from moe_spec.problem import MoEShape, get_shape  # noqa: E402
from moe_spec.validate import MoEDims  # noqa: E402

plan_module = importlib.import_module("cute_moe.plan")  # the module (cute_moe.plan is also the function)
FORMATS = ("fp8_tensor", "fp8_channel", "fp8_block")
CATALOG = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
_WGMMA = r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.[\w.]+"
_EXPECT_TX = r"mov\.b32\s+(%r\d+), (\d+);\s*mbarrier\.arrive\.expect_tx\.shared\.b64 [^,]+, \[[^\]]+\], \1;"


def _gated(quant="fp8_tensor", **kw):
    cfg = GemmConfig(dtype="float8_e4m3fn", quant=quant, tile_k=FP8_TILE_K, out_dtype="float32", gated=True, **kw)
    return cfg.replace(stages=max_stages(cfg)).validate()


def _dims(spec, T):
    s = get_shape(spec)
    return MoEDims(T=T, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k)


#: The shipped setting; every test here runs the gated GEMM1 on both paths (the ``gated_on`` fixture).
SHIPPED_GATED = plan_module.GATED_FP8_GEMM1
BOTH = ("swap_ab", "normal")


@pytest.fixture(autouse=True)
def gated_on(monkeypatch):
    """Both paths gated, with the per-signature calls of cute_moe.moe dropped before and after (a
    call bound under one setting must not serve a test of the other)."""
    from cute_moe.moe import _call_of

    _call_of.cache_clear()
    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", BOTH)
    yield
    _call_of.cache_clear()


def test_the_shipped_plans_gate_every_fp8_gemm1_the_layer_allows(monkeypatch):
    """Shipped: both paths gated (notes/cute_moe.md §6 cites the layer's timing); every fused FP8 plan of the
    catalog then gates its GEMM1 exactly where ``limits.gated_quant_layer`` takes the layer."""
    from cute_moe.limits import gated_quant_layer

    assert SHIPPED_GATED == BOTH
    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", SHIPPED_GATED)
    seen = set()
    for spec in CATALOG:
        s = get_shape(spec)
        for quant in FORMATS:
            for p in cute_moe.plans_for(s.num_experts, s.hidden, s.intermediate, s.top_k, quant):
                assert p.gemm1.gated == gated_quant_layer(quant, s.intermediate), (spec, quant, p)
                seen.add(p.gemm1.gated)
    assert seen == {True}


def _plan_gemm1s():
    """Every GEMM1 the fused FP8 plans of the catalog layers pick (both paths gated), in order of first
    appearance."""
    found = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_module, "GATED_FP8_GEMM1", BOTH)
        for spec in CATALOG:
            s = get_shape(spec)
            for quant in FORMATS:
                for p in cute_moe.plans_for(s.num_experts, s.hidden, s.intermediate, s.top_k, quant):
                    found[p.gemm1] = None
    return list(found)


GEMM1S = _plan_gemm1s()


def _id(cfg):
    path = f"swap-W{cfg.weights_tile}xT{cfg.tokens_tile}" if cfg.swap_ab else f"T{cfg.tokens_tile}xW{cfg.weights_tile}"
    return f"{cfg.quant}-{path}{'-silu' if cfg.gated else ''}"


# ---- configs and the register budget -------------------------------------------------------------
def test_four_accumulators_are_counted():
    """gate and up, each a block and a promoted accumulator: four times one tile's fp32 per thread."""
    for kw, per_acc in (
        (dict(tokens_tile=128, weights_tile=64), 128 * 64 // 256),
        (dict(tokens_tile=64, weights_tile=64, consumer_warpgroups=1), 64 * 64 // 128),
        (dict(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1), 64 * 64 // 128),
        (dict(swap_ab=True, tokens_tile=8, weights_tile=64, consumer_warpgroups=1), 64 * 8 // 128),
    ):
        cfg = _gated(**kw)
        assert cfg.accumulator_registers == 4 * per_acc <= TWO_ACCUMULATOR_REGISTERS
        assert cfg.replace(gated=False).accumulator_registers == 2 * per_acc  # FP8 alone: block + promoted
        assert cfg.replace(quant=None, dtype="bfloat16", tile_k=64, out_dtype="bfloat16").accumulator_registers == (
            2 * per_acc  # bf16 gated: gate + up
        )
        # one stage: the token tile, the gate and the up tile, 128 E4M3 deep
        assert cfg.stage_bytes == (cfg.tokens_tile + 2 * cfg.weights_tile) * FP8_TILE_K
        assert cfg.smem_bytes() <= SMEM_BUDGET_BYTES


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tokens_tile=128, weights_tile=128), r"the gated tile 128×128 .* needs 256 .*gate \+ up, each block"),
        (
            dict(swap_ab=True, tokens_tile=128, weights_tile=64, consumer_warpgroups=1),
            r"the gated tile 64×128 .* needs 256 accumulator registers",
        ),
        (dict(tokens_tile=128, weights_tile=64, out_dtype="bfloat16"), r"^gated=True with quant='fp8_tensor', out_"),
        (dict(tokens_tile=128, weights_tile=64, row_scale=True), r"^gated=True .*row_scale=True: SiLU·up .*GEMM1's"),
        (dict(tokens_tile=128, weights_tile=64, epilogue_scales=False), r"^gated=True .*epilogue_scales=False"),
    ],
)
def test_gated_fp8_limits_are_named(kw, needle):
    base = dict(dtype="float8_e4m3fn", quant="fp8_tensor", tile_k=FP8_TILE_K, out_dtype="float32", gated=True)
    with pytest.raises(ValueError, match=needle):
        GemmConfig(**{**base, **kw})


# ---- the plan's rule -----------------------------------------------------------------------------
def test_the_fused_fp8_plans_gate_gemm1_on_both_paths():
    paths = set()
    for spec in CATALOG:
        for quant in FORMATS:
            for T in (1, 8, 64, 4096):
                p = cute_moe.plan(_dims(spec, T), quant)
                g1 = p.gemm1
                assert g1.gated and g1.quant == quant and g1.out_dtype == "float32" and not g1.gather_rows
                assert g1.weights_tile == 64 and g1.accumulator_registers <= TWO_ACCUMULATOR_REGISTERS
                assert g1.consumer_warpgroups == (1 if g1.swap_ab else g1.tokens_tile // 64)
                assert not p.gemm2.gated and p.gemm2.weights_tile == 128  # GEMM2 as before
                assert " silu " in p.describe().split("|")[0] and " silu " not in p.describe().split("|")[1]
                paths.add(g1.swap_ab)
                # the same path and token tile as the bf16 plan of the call (one path rule)
                d = _dims(spec, T)  # the bf16 grouped pipeline's GEMM1 (layer_configs: the one launch aside)
                bf16 = cute_moe.layer_configs(T, d.E, d.K, d.I, d.top_k)[0]
                assert (g1.swap_ab, g1.tokens_tile) == (bf16.swap_ab, bf16.tokens_tile)
    assert paths == {True, False}


@pytest.mark.parametrize("paths", [(), ("swap_ab",), ("normal",)], ids=["off", "swap-only", "normal-only"])
def test_the_rule_is_one_constant(monkeypatch, paths):
    """Dropping a path from GATED_FP8_GEMM1 gives it back the plain FP8 GEMM1 (128 weight rows, fp32 H
    [M_pad, 2I]); the other path keeps the gated one."""
    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", paths)
    for T in (8, 4096):  # swap-AB and normal buckets of Mixtral-8x7B
        for quant in FORMATS:
            g1 = cute_moe.plan(_dims("mixtral-8x7b", T), quant).gemm1
            assert g1.gated == (("swap_ab" if g1.swap_ab else "normal") in paths)
            assert g1.weights_tile == (64 if g1.gated else 128)
    for swap_ab in (True, False):  # a forced path follows the same rule
        g1 = cute_moe.plan(_dims("qwen3-30b-a3b", 100), "fp8_channel", swap_ab=swap_ab).gemm1
        assert (g1.swap_ab, g1.gated) == (swap_ab, ("swap_ab" if swap_ab else "normal") in paths)


def test_fp8_block_is_gated_where_the_up_rows_are_whole_scale_blocks():
    """fp8_block reads one weight scale per half, tile and K step: the up rows I + n share a 128-row
    block only when I is a multiple of 128; elsewhere the plain GEMM1 stays, and given configs are refused."""
    for I, gated in ((208, False), (256, True), (320, False), (768, True)):  # noqa: E741
        dims = MoEDims(T=500, E=8, K=320, I=I, top_k=2)
        assert cute_moe.plan(dims, "fp8_block").gemm1.gated == gated
        assert cute_moe.plan(dims, "fp8_tensor").gemm1.gated and cute_moe.plan(dims, "fp8_channel").gemm1.gated
    good = cute_moe.plan(MoEDims(T=500, E=8, K=320, I=256, top_k=2), "fp8_block")
    with pytest.raises(ValueError, match=r"^configs\[0\]: gated=True with quant='fp8_block' needs w2: .* = 208"):
        cute_moe.plan(MoEDims(T=500, E=8, K=320, I=208, top_k=2), "fp8_block", configs=(good.gemm1, good.gemm2))


def test_the_unfused_pipeline_and_bf16_are_not_touched():
    for quant in FORMATS:
        p = cute_moe.plan(_dims("mixtral-8x7b", 4096), quant, fusion="separate")
        assert not p.gemm1.gated and p.gemm1.epilogue_scales == (quant == "fp8_block")
    bf16 = cute_moe.plan(_dims("mixtral-8x7b", 4096)).gemm1
    assert bf16.quant is None and bf16.weights_tile == 128  # the bf16 gated tile keeps its 128 features


def test_the_workspace_holds_the_gated_intermediate_only():
    """H is the fp32 [M_pad, I] SiLU·up (not [M_pad, 2I]), and no second fp32 buffer for it."""
    from cute_moe.moe import _buffers, _Call

    dims = MoEDims(T=64, E=8, K=256, I=384, top_k=2)
    for paths, h_cols in ((("swap_ab", "normal"), 384), ((), 768)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan_module, "GATED_FP8_GEMM1", paths)
            p = cute_moe.plan(dims, "fp8_tensor")
        ws = _buffers(_Call(p, dims, torch.device("cpu"), torch.int32))
        assert ws["h"].dtype == torch.float32 and ws["h"].shape[1] == h_cols
        assert (ws["a"] is None) == p.gemm1.gated


# ---- PTX of every gated config the plans pick ----------------------------------------------------
@pytest.fixture(scope="module")
def ptx():
    return {}


def _ptx(cache, cfg):
    if cfg not in cache:
        cache[cfg] = cute_moe.compile_ptx(cfg)
    return cache[cfg]


def test_the_plans_pick_these_gemm1s():
    assert {(c.swap_ab, c.tokens_tile) for c in GEMM1S} == {
        (True, 8),
        (True, 16),
        (True, 32),
        (True, 64),
        (False, 128),
    }
    assert all(c.gated for c in GEMM1S) and {c.quant for c in GEMM1S} == set(FORMATS)


@pytest.mark.parametrize("cfg", GEMM1S, ids=_id)
def test_gated_fp8_ptx_two_promoted_chains_and_the_silu_epilogue(ptx, cfg):
    """Each K step issues the plain FP8 kernel's k32 WGMMAs twice (gate chain, up chain) into two block
    accumulators, waits for both (no batch in flight) before promoting; both weight boxes come through
    the 4-D descriptor on the stage's full barrier; SiLU·up once per output register, stored in fp32."""
    p = _ptx(ptx, cfg)
    assert set(re.findall(_WGMMA, p)) == {f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k32.f32.e4m3.e4m3"}
    per_step = cfg.tile_m // 64 // cfg.consumer_warpgroups * FP8_TILE_K // 32
    groups = {n for n in (len(re.findall(_WGMMA, g)) for g in p.split("wgmma.commit_group")) if n}
    assert groups == {2 * per_step}
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", p)) == {"0"}
    assert {int(n) for _, n in re.findall(_EXPECT_TX, p)} == {cfg.stage_bytes}
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global\.tile\.mbarrier", p)
    per_acc = cfg.accumulator_registers // 4
    for op in ("ex2.approx.ftz.f32", "div.rn.f32"):
        assert len(re.findall(rf"\b{re.escape(op)}\b", p)) == per_acc
    assert not re.search(r"stmatrix", p) and re.search(r"st\.shared(\.v2)?\.b32", p)  # fp32 C


@pytest.mark.parametrize("quant, loads", [("fp8_tensor", 2), ("fp8_channel", 2 + 16 + 16), ("fp8_block", 2 + 2)])
def test_each_half_reads_its_own_weight_scales(ptx, quant, loads):
    """128 tokens × 64 features, two warpgroups: a thread holds 2 token rows × 16 features of each half.
    Besides the 3 scheduler loads: s_x[0], s_w[e] shared by both halves (tensor); 2 row scales and 16
    gate + 16 up column scales (channel: the up half's at I + n); 2 row scales and the gate and the up
    block's weight scale per K step (block) — one load per address, the rows' shared by both halves."""
    cfg = _gated(quant, tokens_tile=128, weights_tile=64)
    p = _ptx(ptx, cfg)
    assert len(re.findall(r"ld\.global\.\w+", p)) == 3 + loads
    up_only = {"fp8_tensor": 0, "fp8_channel": 16, "fp8_block": 1}[quant]  # the up half's weight scales
    plain = cute_moe.compile_ptx(cfg.replace(gated=False))
    assert len(re.findall(r"ld\.global\.\w+", plain)) == 3 + loads - up_only


def test_the_intermediate_amax_kernel_reads_fp32_rows_and_the_row_mask():
    """``a_amax``: x_amax's walk over fp32 rows, plus the row mask (one more load); no SiLU, no store."""
    kernels = cute_moe.compile_quant_kernels("fp8_tensor", keep_ptx=True)
    a, x = kernels["a_amax"].__ptx__, kernels["x_amax"].__ptx__
    loads = lambda t: re.findall(r"ld\.global\.[\w.]+", t)  # noqa: E731
    assert len(loads(a)) == len(loads(x)) + 1
    assert "ex2" not in a and "st.global" not in a and a.count("atom.global.max.s32") == 1
    assert "max.NaN.f32" in a and not re.search(r"max\.f32", a)
    assert any(".f32" in op or ".b32" in op for op in loads(a))  # fp32 values, not bf16 pairs


# ---- GPU: the kernel and the layer ---------------------------------------------------------------
TOL_ORACLE = 1e-2
SMALL = MoEShape("small", 8, 2, 320, 208, "test shape: K, I not multiples of 128 (fp8_block stays plain)")
SMALL_BLOCK = MoEShape("small-block", 8, 2, 320, 256, "test shape: K not a multiple of 128, I = two blocks")


def _bits(q):
    return q.view(torch.uint8)


def _gemm_case(cfg, counts, I, k, seed=0):  # noqa: E741
    """The gated GEMM1 and the plain one of the same tile on one routing (an expert with no token):
    ``gated`` (its fp32 output), ``h`` (the plain one's [M_pad, 2I]), ``today`` and ``today_amax``
    (quantops' SiLU·up of h and its amax, today's path) and ``ref`` (fp64 SiLU·up of the dequantized
    operands, per pair), with the sorted ``rows``."""
    from cute_moe.moe import grouped_gemm, sort_rows
    from cute_moe.moe_fp8 import silu_mul_amax, sorted_token_scales
    from moe_spec.quant import dequantize_activation, dequantize_weight, quantize_activation, quantize_weight

    quant = cfg.quant
    g = torch.Generator(device="cuda").manual_seed(seed)
    E = len(counts)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).cuda()
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed)).cuda()]
    T = ids.numel()
    rows = sort_rows(ids.view(T, 1), torch.rand(T, 1, device="cuda", generator=g), E, cfg.tokens_tile)
    xq, xs = quantize_activation(torch.randn(T, k, device="cuda", generator=g).bfloat16(), quant)
    wq, ws = quantize_weight((torch.randn(E, 2 * I, k, device="cuda", generator=g) * k**-0.5).bfloat16(), quant)
    x_sorted = _bits(xq)[rows.token_of_row].view(torch.float8_e4m3fn)
    x_scale = sorted_token_scales(xs, rows.token_of_row, quant)
    gated = grouped_gemm(x_sorted, wq, rows, cfg, x_scale=x_scale, w_scale=ws)
    h = grouped_gemm(x_sorted, wq, rows, cfg.replace(gated=False), x_scale=x_scale, w_scale=ws)
    today, today_amax = silu_mul_amax(h, rows, quant)
    xd = dequantize_activation(xq, xs, quant, torch.float64)
    hd = torch.einsum("tk,tnk->tn", xd, dequantize_weight(wq, ws, quant, torch.float64)[ids.long()])
    ref = torch.nn.functional.silu(hd[:, :I]) * hd[:, I:]
    return dict(rows=rows, gated=gated, h=h, today=today, today_amax=today_amax, ref=ref)


GPU_TILES = [
    dict(tokens_tile=128, weights_tile=64),
    dict(tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
    dict(swap_ab=True, tokens_tile=8, weights_tile=64, consumer_warpgroups=1),
    dict(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", GPU_TILES, ids=lambda kw: _id(_gated(**kw)).removeprefix("fp8_tensor-"))
@pytest.mark.parametrize("quant", FORMATS)
def test_gated_fp8_gemm1_is_todays_silu_up_bit_for_bit(quant, kw):
    """The gated GEMM1's fp32 output equals the plain GEMM1 of the same tile followed by quantops'
    SiLU·up (today's path) bit for bit on every row that holds a pair, and an fp64 SiLU·up of the
    dequantized operands within fp32 accumulation.  I = 208 (a partial last feature tile: the
    per-channel scales clamped at I − 1 / 2I − 1) except fp8_block, whose gated I is whole blocks;
    K = 464, a partial last K block."""
    from moe_spec.oracle import rel_l2

    cfg = _gated(quant, **kw)
    I = 256 if quant == "fp8_block" else 208  # noqa: E741
    c = _gemm_case(cfg, counts=[37, 0, 5, 130, 1], I=I, k=464)
    rows, gated = c["rows"], c["gated"]
    assert gated.shape == (rows.rows, I) and gated.dtype == torch.float32
    used = rows.row_of_pair
    assert torch.equal(gated[used], c["today"][used])
    assert rel_l2(gated.index_select(0, used), c["ref"]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("quant", FORMATS)
def test_the_gated_intermediate_is_quantized_as_today(quant):
    """``moe_fp8.gated_amax`` over the gated output leaves the padding rows out whatever they hold —
    the torch amax of the rows that hold a pair, bit for bit, and today's silu_mul_amax of the plain H —
    and ``quantize_intermediate(gated=True)`` gives today's E4M3 values and scales on those rows."""
    from cute_moe.moe_fp8 import gated_amax, quantize_intermediate

    cfg = _gated(quant, tokens_tile=128, weights_tile=64)
    c = _gemm_case(cfg, counts=[37, 0, 5, 130, 1], I=256, k=464, seed=3)
    rows, gated = c["rows"], c["gated"]
    real = torch.zeros(rows.rows, dtype=torch.bool, device="cuda").index_fill_(0, rows.row_of_pair, True)
    gated[~real] = 1e4  # padding rows: never counted
    got = gated_amax(gated, rows, quant)
    assert torch.equal(got, c["today_amax"])
    ref = torch.where(real[:, None], gated, torch.zeros_like(gated)).abs()
    if quant == "fp8_tensor":
        assert torch.equal(got, ref.amax().view(1))
    elif quant == "fp8_channel":
        assert torch.equal(got[real], ref.amax(1)[real])
    else:
        assert torch.equal(got.view(rows.rows, -1)[real], ref.view(rows.rows, -1, 128).amax(2)[real])
    q, s = quantize_intermediate(gated, rows, quant, gated=True)
    q_today, s_today = quantize_intermediate(c["h"], rows, quant)
    assert torch.equal(_bits(q[real]), _bits(q_today[real]))
    if quant == "fp8_tensor":
        assert torch.equal(s, s_today)
    else:
        assert torch.equal(s.view(rows.rows, -1)[real], s_today.view(rows.rows, -1)[real])


def _inputs(shape, quant, T, seed=0):
    from moe_spec.problem import MoEInputs, draw_weights, make_inputs
    from moe_spec.quant import quantize_weight

    w1, w2 = draw_weights(shape, 1, device="cuda")
    base = make_inputs(shape, T, None, seed=seed, device="cuda", weights_bf16=(w1, w2))
    (w1q, s1), (w2q, s2) = quantize_weight(w1, quant), quantize_weight(w2, quant)
    return MoEInputs(base.x, w1q, w2q, base.topk_weights, base.topk_ids, quant, s1, s2)


def _shape(spec):
    return {"small": SMALL, "small-block": SMALL_BLOCK}.get(spec) or get_shape(spec)


def _check_layer(inp, monkeypatch, **options):
    """The layer with the plan's gated GEMM1: reruns bit for bit, the oracle within TOL_ORACLE, and
    today's layer (the rule off: plain GEMM1, quantops' SiLU·up) bit for bit."""
    from cute_moe.moe import forget_calls
    from moe_spec.oracle import oracle, rel_l2

    kw = inp.kwargs()
    out = cute_moe.fused_moe(**kw, **options)
    again = cute_moe.fused_moe(**kw, **options)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "reruns must be bit-identical"
    err = rel_l2(out, oracle(**kw))
    assert err <= TOL_ORACLE, err
    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", ())
    forget_calls()
    try:
        today = cute_moe.fused_moe(**kw, **options)
    finally:
        monkeypatch.undo()
        forget_calls()
    assert torch.equal(out.view(torch.int16), today.view(torch.int16)), rel_l2(out, today)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8, 1024])
@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("spec", ["small", "small-block", "qwen3-30b-a3b"])
def test_gated_fp8_layer(spec, quant, T, monkeypatch):
    shape = _shape(spec)
    dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
    assert cute_moe.plan(dims, quant).gemm1.gated == (quant != "fp8_block" or shape.intermediate % 128 == 0)
    _check_layer(_inputs(shape, quant, T, seed=T), monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("swap_ab", [True, False], ids=["swap_ab", "normal"])
@pytest.mark.parametrize("quant", FORMATS)
def test_gated_fp8_layer_forced_paths(quant, swap_ab, monkeypatch):
    """Both paths forced at one T: swap-AB's 64-feature × 64-token tile, the normal path's 64 × 64 one
    warpgroup tile."""
    _check_layer(_inputs(SMALL_BLOCK, quant, 300, seed=4), monkeypatch, swap_ab=swap_ab)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", FORMATS)
def test_gated_fp8_layer_mixtral(quant, monkeypatch):
    """Mixtral-8x7B at T = 1024 (the prefill tile; GEMM1 32 K steps, I = 14336)."""
    _check_layer(_inputs(get_shape("mixtral-8x7b"), quant, 1024, seed=7), monkeypatch)

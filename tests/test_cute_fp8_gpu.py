"""GPU lane for cute_moe's FP8 (E4M3) path (H200): quantization bit for bit against moe_spec.quant,
the grouped GEMM against an fp64 matmul of the dequantized operands, the layer against the W8A8
oracle and against triton_moe, bitwise reruns, and the promotion study.

Run on the device: ``source .ci/on-device && python3 -m pytest -m gpu -q tests/test_cute_fp8_gpu.py``
(``-s`` prints the promotion study's table).
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from moe_spec.oracle import oracle, rel_l2  # noqa: E402
from moe_spec.problem import MoEInputs, MoEShape, draw_weights, get_shape, make_inputs  # noqa: E402
from moe_spec.quant import dequantize_activation, dequantize_weight, quantize_activation, quantize_weight  # noqa: E402

pytestmark = pytest.mark.gpu

FORMATS = ("fp8_tensor", "fp8_channel", "fp8_block")
TOL_ORACLE = 1e-2  # the W8A8 oracle: same quantization, so only bf16 outputs and accumulation order differ
TOL_TRITON = 2e-2  # two kernels, each within TOL_ORACLE of the oracle
TOL_GEMM = {"float32": 1e-3, "bfloat16": 5e-3}  # one GEMM on exactly dequantizable operands
# K = 320 and I = 208: partial 128-wide scale blocks and groups along both K and I (multiples of 16)
SMALL = MoEShape("small", 8, 2, 320, 208, "test shape: K and I not multiples of 128")


def _bits(q):
    return q.view(torch.uint8)


# ---- activation quantization: bit for bit ------------------------------------------------------
@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("T, K", [(1, 320), (37, 208), (1024, 2048)])
def test_quantize_tokens_is_the_reference_bit_for_bit(quant, T, K):
    from cute_moe.moe_fp8 import quantize_tokens

    g = torch.Generator(device="cuda").manual_seed(T + K)
    x = (torch.randn(T, K, device="cuda", generator=g) * 3).bfloat16()
    x[0, :16] = torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 448, -448, 1000, -1000, 0.5, 0.25, 3, -3, 7, 1e-8, 2, 5], device="cuda"
    ).bfloat16()  # zeros, tiny, saturating, exact grid points
    q, s = quantize_tokens(x, quant)
    q_ref, s_ref = quantize_activation(x, quant)
    assert s.shape == s_ref.shape and torch.equal(s, s_ref)
    assert torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.parametrize("quant", FORMATS)
def test_quantize_intermediate_is_the_reference_on_the_rows_that_exist(quant):
    """SiLU·up in fp32 (fast exp: within fp32 rounding of torch's), then — on the rows that exist —
    exactly moe_spec.quant's quantization of that fp32 intermediate; padding rows do not count."""
    from cute_moe.moe import sort_rows
    from cute_moe.moe_fp8 import quantize_intermediate, silu_mul_amax

    g = torch.Generator(device="cuda").manual_seed(1)
    T, k, E, I = 50, 3, 6, 208  # noqa: E741
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]).int()
    sorted_rows = sort_rows(ids, torch.rand(T, k, device="cuda", generator=g), E, 16)
    al, rows = sorted_rows.alignment, sorted_rows.row_of_pair
    h = torch.randn(al.rows, 2 * I, device="cuda", generator=g) * 4
    h[~torch.zeros(al.rows, dtype=torch.bool, device="cuda").index_fill_(0, rows, True)] = 1e4  # padding
    a, _ = silu_mul_amax(h, al, quant)
    q, s = quantize_intermediate(h, al, quant)
    a_ref = torch.nn.functional.silu(h[rows, :I]) * h[rows, I:]
    assert rel_l2(a[rows], a_ref) < 1e-6
    q_ref, s_ref = quantize_activation(a[rows], quant)
    assert torch.equal(_bits(q[rows]), _bits(q_ref))
    got = s if quant == "fp8_tensor" else s.view(al.rows, -1)[rows]
    assert torch.equal(got.view(s_ref.shape), s_ref)


@pytest.mark.parametrize("quant", FORMATS)
def test_a_nan_reaches_its_whole_scale_group(quant):
    """One NaN in x: the amax of its group is NaN (the tensor's, under fp8_tensor), as torch's amax
    in moe_spec.quant makes it, so the scale and the dequantized group are NaN, exactly where the
    reference has NaN; every other value and scale is the reference's. A NaN-dropping maximum
    (PTX ``max.f32``) anywhere in the reduction would leave the group finite."""
    from cute_moe.moe_fp8 import quantize_tokens

    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(1024, 2048, device="cuda", generator=g) * 3).bfloat16()
    x[700, 1300] = float("nan")  # row 700, scale group 10 of 16, far from lane 0 of its group
    q, s = quantize_tokens(x, quant)
    q_ref, s_ref = quantize_activation(x, quant)
    torch.testing.assert_close(s.view(s_ref.shape), s_ref, rtol=0, atol=0, equal_nan=True)
    assert int(s_ref.isnan().sum()) == 1
    torch.testing.assert_close(
        dequantize_activation(q, s.view(s_ref.shape), quant),
        dequantize_activation(q_ref, s_ref, quant),
        rtol=0,
        atol=0,
        equal_nan=True,
    )


@pytest.mark.parametrize("quant", FORMATS)
def test_a_nan_on_a_padding_row_of_the_intermediate_counts_for_nothing(quant):
    """The SiLU·up amax: a NaN on a row that holds a pair makes its group's amax NaN; the same NaN
    on a padding row of the sorted order (row_mask 0) leaves every amax the reference's."""
    from cute_moe.moe import sort_rows
    from cute_moe.moe_fp8 import silu_mul_amax

    g = torch.Generator(device="cuda").manual_seed(2)
    T, k, E, I = 300, 2, 8, 1024  # noqa: E741
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]).int()
    sorted_rows = sort_rows(ids, torch.rand(T, k, device="cuda", generator=g), E, 64)
    al, rows = sorted_rows.alignment, sorted_rows.row_of_pair
    real = torch.zeros(al.rows, dtype=torch.bool, device="cuda").index_fill_(0, rows, True)
    pad_row = int((~real).nonzero()[0])
    h = torch.randn(al.rows, 2 * I, device="cuda", generator=g)
    h[pad_row, 3] = float("nan")
    a, amax = silu_mul_amax(h, al, quant)
    _, s_ref = quantize_activation(a[rows], quant)
    assert not bool(amax.isnan().any())
    want = s_ref.flatten() if quant == "fp8_tensor" else None
    if want is not None:
        torch.testing.assert_close(amax.max(), (want * 448).max().clamp_min(1e-12), rtol=1e-6, atol=0)
    h[rows[17], I + 900] = float("nan")  # a real row: its up value NaN → its SiLU·up value NaN
    a, amax = silu_mul_amax(h, al, quant)
    assert bool(amax.isnan().any())
    if quant == "fp8_tensor":
        assert bool(amax[0].isnan())
    else:
        assert int(amax.isnan().sum()) == 1


# ---- the grouped GEMM alone --------------------------------------------------------------------
def _gemm_case(cfg, counts, n_out, k, seed=0):
    """One FP8 grouped GEMM on explicit per-expert token counts (an expert with none, N_out not a
    multiple of the weight tile, K not a multiple of 128) vs fp64 of the dequantized operands."""
    from cute_moe.moe import grouped_gemm, sort_rows
    from cute_moe.moe_fp8 import sorted_token_scales

    quant = cfg.quant
    g = torch.Generator(device="cuda").manual_seed(seed)
    E = len(counts)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).cuda()
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed)).cuda()]
    T = ids.numel()
    weights = torch.rand(T, 1, device="cuda", generator=g)
    rows = sort_rows(ids.view(T, 1), weights, E, cfg.tokens_tile)
    xq, xs = quantize_activation(torch.randn(T, k, device="cuda", generator=g).bfloat16(), quant)
    wq, ws = quantize_weight((torch.randn(E, n_out, k, device="cuda", generator=g) * k**-0.5).bfloat16(), quant)
    x_sorted = _bits(xq)[rows.token_of_row].view(torch.float8_e4m3fn)  # rows gathered as bytes
    out = grouped_gemm(
        x_sorted,
        wq,
        rows,
        cfg,
        row_scale=rows.weight_of_row if cfg.row_scale else None,
        x_scale=sorted_token_scales(xs, rows.token_of_row, quant),
        w_scale=ws,
    )
    xd = dequantize_activation(xq, xs, quant, torch.float64)
    wd = dequantize_weight(wq, ws, quant, torch.float64)
    ref = torch.einsum("tk,tnk->tn", xd, wd[ids.long()])
    if cfg.row_scale:
        ref = ref * weights.double()
    return out.index_select(0, rows.row_of_pair), ref


GEMM_SHAPES = [
    dict(tokens_tile=128, weights_tile=128, consumer_warpgroups=2),
    dict(tokens_tile=64, weights_tile=128, consumer_warpgroups=1),
    dict(swap_ab=True, tokens_tile=8, weights_tile=128),
    dict(swap_ab=True, tokens_tile=32, weights_tile=128),
    dict(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
]


@pytest.mark.parametrize("out_dtype, row_scale", [("float32", False), ("bfloat16", True)])
@pytest.mark.parametrize(
    "kw",
    GEMM_SHAPES,
    ids=lambda kw: "swap{}-t{}-w{}".format(kw.get("swap_ab", False), kw["tokens_tile"], kw["weights_tile"]),
)
@pytest.mark.parametrize("quant", FORMATS)
def test_fp8_grouped_gemm(quant, kw, out_dtype, row_scale):
    from cute_moe.config import GemmConfig, max_stages
    from cute_moe.limits import FP8_TILE_K

    cfg = GemmConfig(
        dtype="float8_e4m3fn", quant=quant, tile_k=FP8_TILE_K, out_dtype=out_dtype, row_scale=row_scale, **kw
    )
    cfg = cfg.replace(stages=max_stages(cfg)).validate()
    out, ref = _gemm_case(cfg, counts=[37, 0, 5, 130, 1], n_out=320, k=464)
    assert out.dtype == getattr(torch, out_dtype)
    assert rel_l2(out, ref) < TOL_GEMM[out_dtype]


# ---- the layer: oracle, triton_moe, reruns -----------------------------------------------------
_weights: dict = {}


def _inputs(shape: MoEShape, quant: str, T: int, seed: int = 0) -> MoEInputs:
    """Inputs of ``shape`` with its weights quantized once per (shape, format) and kept on the card."""
    key = (shape, quant)
    if key not in _weights:
        _weights.clear()  # one weight set resident at a time
        w1, w2 = draw_weights(shape, 1, device="cuda")
        _weights[key] = (w1, w2, *quantize_weight(w1, quant), *quantize_weight(w2, quant))
    w1, w2, w1q, s1, w2q, s2 = _weights[key]
    base = make_inputs(shape, T, None, seed=seed, device="cuda", weights_bf16=(w1, w2))
    return MoEInputs(base.x, w1q, w2q, base.topk_weights, base.topk_ids, quant, s1, s2)


def _check_layer(inp: MoEInputs, **options):
    import cute_moe
    import triton_moe

    out = cute_moe.fused_moe(**inp.kwargs(), **options)
    again = cute_moe.fused_moe(**inp.kwargs(), **options)
    assert out.shape == inp.x.shape and out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "reruns must be bit-identical"
    err = rel_l2(out, oracle(**inp.kwargs()))
    assert err <= TOL_ORACLE, err
    vs_triton = rel_l2(out, triton_moe.fused_moe(**inp.kwargs()))
    assert vs_triton <= TOL_TRITON, vs_triton


@pytest.mark.parametrize("T", [1, 8, 32, 128, 1024])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["normal", "swap_ab"])
@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("spec", ["small", "qwen3-30b-a3b"])
def test_fp8_layer(spec, quant, swap_ab, T):
    shape = SMALL if spec == "small" else get_shape(spec)
    _check_layer(_inputs(shape, quant, T, seed=T), swap_ab=swap_ab)


@pytest.mark.parametrize("T", [8, 4096])
@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("spec", ["qwen3-30b-a3b", "deepseek-v3:tp8"])
def test_fp8_pingpong_layer_is_the_cooperative_layer_bit_for_bit(spec, quant, T):
    """The FP8 layer with both GEMMs' ping-pong twins (``configs=``: one warpgroup's 64 rows of the plan's
    tile each, its block and promoted accumulators, the gated GEMM1's epilogue step kept) gives the very
    bytes of the plan's cooperative layer, and meets the oracle and triton_moe."""
    import cute_moe
    from cute_moe.gemm_rules import pingpong_config
    from moe_spec.validate import MoEDims

    inp = _inputs(get_shape(spec), quant, T, seed=31)
    s = get_shape(spec)
    p = cute_moe.plan(MoEDims(T=T, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k), quant)
    twins = (pingpong_config(p.gemm1), pingpong_config(p.gemm2))
    out = cute_moe.fused_moe(**inp.kwargs())
    pp = cute_moe.fused_moe(**inp.kwargs(), configs=twins)
    assert torch.equal(out.view(torch.int16), pp.view(torch.int16))
    _check_layer(inp, configs=twins)


@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("spec", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"])
def test_fp8_cluster_layer_is_the_single_cta_layer_bit_for_bit(spec, quant):
    """The FP8 layer at T = 4096 with its normal-path GEMMs on clusters of two CTAs multicasting the weight
    tile (``configs=``) gives the very bytes of the same layer on single CTAs (the plan clusters Mixtral's
    GEMM2 itself), and meets the oracle and triton_moe."""
    import cute_moe
    from moe_spec.validate import MoEDims

    s, T = get_shape(spec), 4096
    inp = _inputs(s, quant, T, seed=37)
    p = cute_moe.plan(MoEDims(T=T, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k), quant)
    clustered = tuple(g if g.swap_ab else g.replace(cluster=2) for g in (p.gemm1, p.gemm2))
    single = tuple(g.replace(cluster=1) for g in (p.gemm1, p.gemm2))
    assert any(g.cluster == 2 for g in clustered), p.describe()
    out = cute_moe.fused_moe(**inp.kwargs(), configs=single)
    cl = cute_moe.fused_moe(**inp.kwargs(), configs=clustered)
    assert torch.equal(out.view(torch.int16), cl.view(torch.int16))
    _check_layer(inp, configs=clustered)


def _poison_x_buffers() -> None:
    """Fill every cached workspace's sorted E4M3 rows with NaN codes and x's scales with NaN: a switch-on call
    then could reuse buffers a switch-off call filled (were the workspace key not to hold the switch), and only
    what the new launch writes itself can come out right."""
    from cute_moe import moe

    for ws in moe._workspaces.values():
        if ws.get("x_sorted") is not None:  # (a bf16 layer's gathering GEMM1 has none)
            ws["x_sorted"].view(torch.uint8).fill_(0x7F)  # E4M3 NaN
        for name in ("x_scale", "x_scale_sorted"):
            if ws.get(name) is not None:
                ws[name].fill_(float("nan"))


@pytest.mark.parametrize("T", [1, 8, 128, 4096])
@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("spec", ["small", "qwen3-30b-a3b", "deepseek-v3:tp8"])
def test_fp8_gather_quant_layer_is_the_plan_layer_bit_for_bit(spec, quant, T):
    """x quantized where its rows are gathered (``cute_moe.plan.GATHER_QUANT``: one GatherQuantizeRows launch
    in place of x's quantize launch and the gathers of its codes and scales; fp8_block without an amax
    launch) gives the very bytes of the plan's layer — a NaN in x included, whose scale group (its token,
    fp8_channel; its 128 columns, fp8_block; all of x, fp8_tensor) turns NaN in both — and meets the oracle
    and triton_moe."""
    import cute_moe
    from cute_moe.moe import plan_switches
    from moe_spec.validate import MoEDims

    shape = SMALL if spec == "small" else get_shape(spec)
    inp = _inputs(shape, quant, T, seed=41)
    x_nan = inp.x.clone()
    x_nan[T // 2, 130] = float("nan")
    with plan_switches(GATHER_QUANT=False):
        out = cute_moe.fused_moe(**inp.kwargs())
        out_nan = cute_moe.fused_moe(**{**inp.kwargs(), "x": x_nan})
    with plan_switches(GATHER_QUANT=True, GATHER_QUANT_NORMAL_TOP_K=None):
        _poison_x_buffers()
        dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
        assert "xq:gather" in cute_moe.plan(dims, quant).describe()
        fused = cute_moe.fused_moe(**inp.kwargs())
        assert torch.equal(out.view(torch.int16), fused.view(torch.int16))
        _poison_x_buffers()
        fused_nan = cute_moe.fused_moe(**{**inp.kwargs(), "x": x_nan})
        assert torch.equal(out_nan.isnan(), fused_nan.isnan())
        assert torch.equal(out_nan.nan_to_num().view(torch.int16), fused_nan.nan_to_num().view(torch.int16))
        _check_layer(inp)


@pytest.mark.parametrize("T", [1, 8, 1024])
def test_fp8_static_gather_quant_layer_is_the_plan_layer_bit_for_bit(T):
    """Static fp8_tensor scales with x quantized where its rows are gathered (StaticGatherQuantizeRows): the
    very bytes of the plan's layer; a zero ``a1_scale`` is flagged in the error word by the new launch too."""
    import cute_moe
    from cute_moe.moe import plan_switches
    from moe_spec.oracle import calibrate_static_scales
    from moe_spec.validate import check

    inp = _inputs(get_shape("qwen3-30b-a3b"), "fp8_tensor", T, seed=43)
    a1, a2 = calibrate_static_scales(**inp.kwargs())
    with plan_switches(GATHER_QUANT=False):
        out = cute_moe.fused_moe(**inp.kwargs(), a1_scale=a1, a2_scale=a2)
    with plan_switches(GATHER_QUANT=True, GATHER_QUANT_NORMAL_TOP_K=None):
        _poison_x_buffers()
        fused = cute_moe.fused_moe(**inp.kwargs(), a1_scale=a1, a2_scale=a2)
        assert torch.equal(out.view(torch.int16), fused.view(torch.int16))
        torch.cuda.synchronize()
        check()
        cute_moe.fused_moe(**inp.kwargs(), a1_scale=torch.zeros(1, device="cuda"), a2_scale=a2)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="a1_scale"):
            check()


@pytest.mark.parametrize("T", [8, 1024])
@pytest.mark.parametrize("quant", FORMATS)
def test_fp8_layer_long_k(quant, T):
    """Mixtral-8x7B: GEMM2 reduces over K = I = 14336 (112 promotions per tile)."""
    _check_layer(_inputs(get_shape("mixtral-8x7b"), quant, T, seed=5))


def test_fp8_t_sweep_does_not_compile():
    import cute_moe

    shape = get_shape("qwen3-30b-a3b")
    sweep = (1, 3, 17, 100, 555, 2049)
    for T in sweep:
        cute_moe.fused_moe(**_inputs(shape, "fp8_block", T).kwargs())
    before = cute_moe.compile_count()
    for seed, T in enumerate(sweep):
        cute_moe.fused_moe(**_inputs(shape, "fp8_block", T + 1, seed=seed + 11).kwargs())
    torch.cuda.synchronize()
    assert cute_moe.compile_count() == before


# ---- the unfused pipeline (fusion="separate") ---------------------------------------------------
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", ["fp8_tensor", "fp8_channel"])
def test_scale_pass_reproduces_the_fused_epilogue(quant, out_dtype):
    """Unscaled GEMM + the scale pass vs the GEMM with the scales in its epilogue: bit for bit in
    fp32 (the same product in the same order); in bf16 the unscaled output is rounded once more."""
    from cute_moe.config import GemmConfig, max_stages
    from cute_moe.limits import FP8_TILE_K
    from cute_moe.moe import grouped_gemm, sort_rows
    from cute_moe.moe_fp8 import sorted_token_scales
    from cute_moe.unfused import scale_rows

    g = torch.Generator(device="cuda").manual_seed(2)
    E, T, n_out, k = 4, 300, 320, 464
    ids = torch.randint(0, E, (T, 1), device="cuda", generator=g, dtype=torch.int32)
    cfg = GemmConfig(dtype="float8_e4m3fn", quant=quant, tile_k=FP8_TILE_K, out_dtype=out_dtype)
    cfg = cfg.replace(stages=max_stages(cfg)).validate()
    sr = sort_rows(ids, torch.rand(T, 1, device="cuda", generator=g), E, cfg.tokens_tile)
    xq, xs = quantize_activation(torch.randn(T, k, device="cuda", generator=g).bfloat16(), quant)
    wq, ws = quantize_weight((torch.randn(E, n_out, k, device="cuda", generator=g) * k**-0.5).bfloat16(), quant)
    x_sorted, x_scale = (
        _bits(xq)[sr.token_of_row].view(torch.float8_e4m3fn),
        sorted_token_scales(xs, sr.token_of_row, quant),
    )
    fused = grouped_gemm(x_sorted, wq, sr, cfg, x_scale=x_scale, w_scale=ws)
    raw = grouped_gemm(x_sorted, wq, sr, cfg.replace(epilogue_scales=False), x_scale=x_scale, w_scale=ws)
    separate = scale_rows(raw, sr.alignment, x_scale, ws, quant)
    rows = sr.row_of_pair
    if out_dtype == "float32":
        assert torch.equal(separate[rows], fused[rows])
    else:
        assert rel_l2(separate[rows], fused[rows]) < TOL_GEMM["bfloat16"]


@pytest.mark.parametrize("T", [8, 1024])
@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("spec", ["small", "qwen3-30b-a3b"])
def test_fp8_layer_separate(spec, quant, T):
    """The unfused pipeline computes the same function: oracle, the fused layer, reruns."""
    import cute_moe

    inp = _inputs(SMALL if spec == "small" else get_shape(spec), quant, T, seed=T + 1)
    out = cute_moe.fused_moe(**inp.kwargs(), fusion="separate")
    again = cute_moe.fused_moe(**inp.kwargs(), fusion="separate")
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    assert rel_l2(out, oracle(**inp.kwargs())) <= TOL_ORACLE
    assert rel_l2(out, cute_moe.fused_moe(**inp.kwargs())) <= TOL_TRITON


@pytest.mark.parametrize("T", [8, 1024])
def test_bf16_layer_separate(T):
    """bf16 has no scales: ``separate`` moves only the routing weight into the aggregation pass."""
    import cute_moe

    shape = get_shape("qwen3-30b-a3b")
    inp = make_inputs(shape, T, seed=T, device="cuda", weights_bf16=draw_weights(shape, 1, device="cuda"))
    out = cute_moe.fused_moe(**inp.kwargs(), fusion="separate")
    assert rel_l2(out, oracle(**inp.kwargs())) <= 5e-3  # the bf16 layer's tolerance (test_cute_gpu.TOL)


# ---- the promotion study -----------------------------------------------------------------------
def test_promotion_study(capsys):
    """rel L2 of one FP8 GEMM (fp32 out, 256 tokens × 256 outputs) against fp64 vs K, with the
    block accumulator promoted into fp32 every 128 of K (the kernel's default) and without
    (``cute_moe.lab.promotion.one_level``: the WGMMA accumulates all of K, possible for per-tensor and
    per-channel scales only).  fp8_block promotes by necessity — its scales change every 128 of K — and is
    listed for comparison.  Expected: the promoted error stays flat in K, the unpromoted one grows.
    """
    from cute_moe.config import GemmConfig, max_stages
    from cute_moe.lab.promotion import one_level
    from cute_moe.limits import FP8_TILE_K

    rows = []
    for k in (512, 2048, 8192, 16384):
        row = {"K": k}
        for name, quant, promote in (
            ("tensor, promoted", "fp8_tensor", True),
            ("tensor, one level", "fp8_tensor", False),
            ("channel, promoted", "fp8_channel", True),
            ("channel, one level", "fp8_channel", False),
            ("block, promoted", "fp8_block", True),
        ):
            cfg = GemmConfig(dtype="float8_e4m3fn", quant=quant, tile_k=FP8_TILE_K, out_dtype="float32")
            cfg = cfg.replace(stages=max_stages(cfg)).validate()
            if not promote:
                cfg = one_level(cfg)
            out, ref = _gemm_case(cfg, counts=[256], n_out=256, k=k, seed=k)
            row[name] = rel_l2(out, ref)
        rows.append(row)
    with capsys.disabled():
        names = list(rows[0])[1:]
        print("\nFP8 promotion study (rel L2 vs fp64 of the dequantized operands)")
        print("| K | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for row in rows:
            print(f"| {row['K']} | " + " | ".join(f"{row[n]:.2e}" for n in names) + " |")
    for row in rows:
        for name in ("tensor, promoted", "channel, promoted", "block, promoted"):
            assert row[name] < TOL_GEMM["float32"], (name, row)
    longest = rows[-1]
    assert longest["tensor, one level"] > 2 * longest["tensor, promoted"], longest
    assert longest["channel, one level"] > 2 * longest["channel, promoted"], longest

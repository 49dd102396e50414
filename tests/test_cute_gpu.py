"""GPU lane for cute_moe (H200): the grouped GEMM and the MoE layer against references.

Run on the device: ``source .ci/on-device && python3 -m pytest -m gpu tests/test_cute_gpu.py``.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from moe_spec.oracle import oracle, rel_l2  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 5e-3  # rel-L2 against the fp64 oracle (bf16 operands, fp32 accumulation)


@pytest.fixture(autouse=True)
def grouped_pipeline(monkeypatch):
    """This module tests the grouped pipeline: the one launch (``cute_moe.plan.ONE_LAUNCH``; its GPU tests are
    tests/test_cute_decode_gpu.py and tests/test_cute_one_launch.py) is off, fused_moe's cached plans dropped."""
    import importlib

    import cute_moe.moe as moe

    monkeypatch.setattr(importlib.import_module("cute_moe.plan"), "ONE_LAUNCH", False)
    moe.forget_calls()
    yield
    moe.forget_calls()


def _gemm_case(cfg, counts, n_out, k, seed=0):
    """Grouped GEMM on explicit per-expert token counts vs a per-expert fp32 matmul."""
    from cute_moe.moe import grouped_gemm, sort_rows

    g = torch.Generator(device="cuda").manual_seed(seed)
    E = len(counts)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).cuda()
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed)).cuda()]
    T = ids.numel()
    weights = torch.rand(T, 1, device="cuda", generator=g)
    rows = sort_rows(ids.view(T, 1), weights, E, cfg.tokens_tile)
    x = torch.randn(T, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, n_out, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    xs = x.index_select(0, rows.token_of_row)
    scale = rows.weight_of_row if cfg.row_scale else None
    out = grouped_gemm(xs, w, rows, cfg, row_scale=scale)
    ref = torch.einsum("tk,tnk->tn", x.float(), w.float()[ids.long()])
    if cfg.row_scale:
        ref = ref * weights
    return out.index_select(0, rows.row_of_pair), ref  # row of token t (top_k = 1)


GEMM_CONFIGS = [
    dict(swap_ab=False, tokens_tile=64, weights_tile=128, consumer_warpgroups=1),
    dict(swap_ab=False, tokens_tile=128, weights_tile=128, consumer_warpgroups=2),
    dict(swap_ab=False, tokens_tile=128, weights_tile=256, consumer_warpgroups=2, stages=4),
    dict(swap_ab=True, tokens_tile=8, weights_tile=128),
    dict(swap_ab=True, tokens_tile=16, weights_tile=128),
    dict(swap_ab=True, tokens_tile=32, weights_tile=128),
    dict(swap_ab=True, tokens_tile=64, weights_tile=128, stages=4),
    dict(swap_ab=True, tokens_tile=8, weights_tile=64, consumer_warpgroups=1),
    dict(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1),  # square swap-AB tile
    dict(swap_ab=True, tokens_tile=16, weights_tile=128, tile_k=32),  # a 64-B swizzle row per stage
    dict(swap_ab=False, tokens_tile=128, weights_tile=128, tile_k=128, stages=3),  # two swizzle rows per stage
]


@pytest.mark.parametrize("row_scale", [False, True])
@pytest.mark.parametrize(
    "kw",
    GEMM_CONFIGS,
    ids=lambda kw: "swap{swap_ab}-t{tokens_tile}-w{weights_tile}-k{k}".format(k=kw.get("tile_k", 64), **kw),
)
def test_grouped_gemm(kw, row_scale):
    from cute_moe.config import GemmConfig

    cfg = GemmConfig(row_scale=row_scale, **kw)
    # uneven experts, one with zero tokens, N_out not a multiple of the weights tile
    out, ref = _gemm_case(cfg, counts=[37, 0, 5, 130, 1], n_out=320, k=512)
    assert rel_l2(out, ref) < TOL


@pytest.fixture(scope="module")
def shapes():
    from moe_spec.problem import draw_weights, get_shape

    cache = {}

    def get(spec):
        if spec not in cache:
            s = get_shape(spec)
            w1, w2 = draw_weights(s, 1, device="cuda")
            cache.clear()  # keep one shape's weights resident at a time
            cache[spec] = (s, w1, w2)
        return cache[spec]

    return get


def _inputs(shapes, spec, T, seed=0, skew=0.0):
    from moe_spec.problem import make_inputs

    s, w1, w2 = shapes(spec)
    return make_inputs(s, T, seed=seed, device="cuda", skew=skew, weights_bf16=(w1, w2))


@pytest.mark.parametrize("spec", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"])
@pytest.mark.parametrize("T", [1, 8, 32, 128, 1024, 4096])
def test_fused_moe_oracle(shapes, spec, T):
    import cute_moe

    inp = _inputs(shapes, spec, T)
    out = cute_moe.fused_moe(**inp.kwargs())
    ref = oracle(**inp.kwargs())
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert rel_l2(out, ref) < TOL


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("T", [8, 256])
def test_paths_forced(shapes, swap_ab, T):
    import cute_moe

    inp = _inputs(shapes, "qwen3-30b-a3b", T, seed=3)
    out = cute_moe.fused_moe(**inp.kwargs(), swap_ab=swap_ab)
    assert rel_l2(out, oracle(**inp.kwargs())) < TOL


def test_square_swap_ab_layer_against_the_oracle(shapes):
    """The 64-token × 64-weight swap-AB tile (one consumer warpgroup) — the CPU layout tests' square
    case — through the whole layer, by values against the fp64 oracle."""
    import cute_moe
    from cute_moe.config import GemmConfig

    square = dict(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1)
    configs = (GemmConfig(**square), GemmConfig(row_scale=True, **square))
    inp = _inputs(shapes, "qwen3-30b-a3b", 1000, seed=9)  # ~62 tokens per expert: mostly full tiles
    out = cute_moe.fused_moe(**inp.kwargs(), configs=configs)
    assert rel_l2(out, oracle(**inp.kwargs())) < TOL


def test_zero_token_experts_and_odd_T(shapes):
    import cute_moe

    inp = _inputs(shapes, "qwen3-30b-a3b", 8191, seed=5, skew=4.0)  # skew: most experts get nothing
    assert int(torch.bincount(inp.topk_ids.flatten().long(), minlength=128).eq(0).sum()) > 0
    out = cute_moe.fused_moe(**inp.kwargs())
    assert rel_l2(out, oracle(**inp.kwargs())) < TOL


def test_bit_identical_reruns(shapes):
    import cute_moe

    inp = _inputs(shapes, "mixtral-8x7b", 333, seed=7)
    a = cute_moe.fused_moe(**inp.kwargs())
    b = cute_moe.fused_moe(**inp.kwargs())
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_t_sweep_does_not_compile(shapes):
    """After one warm-up per config, new T values and new routings compile nothing."""
    import cute_moe

    sweep = (1, 3, 17, 100, 555, 2049, 4000)
    for T in sweep:
        cute_moe.fused_moe(**_inputs(shapes, "deepseek-v3:tp8", T).kwargs())
    before = cute_moe.compile_count()
    for seed, T in enumerate(sweep):
        for dT in (0, 1):
            cute_moe.fused_moe(**_inputs(shapes, "deepseek-v3:tp8", T + dT, seed=seed + 11).kwargs())
    torch.cuda.synchronize()
    assert cute_moe.compile_count() == before


def test_row_kernels_match_torch():
    from cute_moe.moe import combine, gather_rows, silu_mul, sort_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    T, k, E = 50, 3, 6
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]).int()
    rows = sort_rows(ids, torch.rand(T, k, device="cuda", generator=g), E, 16)
    used = int(rows.alignment.num_padded)
    x = torch.randn(T, 72, device="cuda", generator=g).bfloat16()
    assert torch.equal(gather_rows(x, rows)[:used], x[rows.token_of_row[:used]])
    h = torch.randn(rows.rows, 2 * 96, device="cuda", generator=g).bfloat16()
    ref = torch.nn.functional.silu(h[:used, :96].float()) * h[:used, 96:].float()
    assert rel_l2(silu_mul(h, rows)[:used], ref) < 4e-3
    y = torch.randn(rows.rows, 72, device="cuda", generator=g).bfloat16()
    ref = y.float()[rows.row_of_pair].view(T, k, 72).sum(1)
    assert rel_l2(combine(y, rows, T, k), ref) < 4e-3


def test_sort_rows_on_the_gpu_is_the_cpu_reference():
    """The alignment the layer runs on the device equals the same routine on the CPU, bit for bit."""
    from cute_moe.moe import sort_rows

    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.rand(3000, 64, device="cuda", generator=g).topk(6, dim=1).indices.int()
    w = torch.rand(3000, 6, device="cuda", generator=g)
    gpu, cpu = sort_rows(ids, w, 64, 32), sort_rows(ids.cpu(), w.cpu(), 64, 32)
    for name in ("token_of_row", "weight_of_row", "row_of_pair"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    for name in ("sorted_ids", "expert_of_block", "expert_end"):
        assert torch.equal(getattr(gpu.alignment, name).cpu(), getattr(cpu.alignment, name)), name


# ---- the gated GEMM1: SiLU·up in the epilogue -----------------------------------------------------
GATED_CONFIGS = [  # the path rule's gated configs (swap-AB 64 features, one warpgroup), and 128 with two
    dict(swap_ab=True, tokens_tile=8, weights_tile=64, consumer_warpgroups=1),
    dict(swap_ab=True, tokens_tile=16, weights_tile=64, consumer_warpgroups=1),
    dict(swap_ab=True, tokens_tile=32, weights_tile=64, consumer_warpgroups=1),
    dict(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
    dict(swap_ab=True, tokens_tile=8, weights_tile=128),
    dict(swap_ab=True, tokens_tile=64, weights_tile=128),
    dict(swap_ab=False, tokens_tile=64, weights_tile=128, consumer_warpgroups=1),
    dict(swap_ab=False, tokens_tile=128, weights_tile=128, consumer_warpgroups=2),
]


@pytest.mark.parametrize(
    "kw", GATED_CONFIGS, ids=lambda kw: "swap{swap_ab}-t{tokens_tile}-w{weights_tile}".format(**kw)
)
def test_gated_gemm(kw):
    """SiLU(x·W1gᵀ)·(x·W1uᵀ) straight out of GEMM1, against fp32 torch; I = 200 is not a multiple of
    the weights tile (the last tile's gate rows must not read up rows), uneven experts, one idle;
    and bit for bit the row kernel's SiLU·mul when both read the same (bf16-representable) values:
    a plain GEMM1 whose H needs no rounding (integer-valued operands, exact fp32 sums)."""
    from cute_moe.config import GemmConfig, max_stages
    from cute_moe.moe import grouped_gemm, silu_mul, sort_rows

    cfg = GemmConfig(gated=True, stages=2, **kw)
    cfg = cfg.replace(stages=max_stages(cfg))
    I, k, counts = 200, 512, [37, 0, 5, 130, 1]
    g = torch.Generator(device="cuda").manual_seed(4)
    E = len(counts)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).cuda()
    T = ids.numel()
    rows = sort_rows(ids.view(T, 1), torch.ones(T, 1, device="cuda"), E, cfg.tokens_tile)
    x = torch.randn(T, k, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * I, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    a = grouped_gemm(x.index_select(0, rows.token_of_row), w1, rows, cfg)
    assert a.shape == (rows.rows, I)
    h = torch.einsum("tk,tnk->tn", x.float(), w1.float()[ids.long()])
    ref = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    assert rel_l2(a.index_select(0, rows.row_of_pair), ref) < TOL
    # bitwise against the row kernel on exact inputs: small integers, sums exact in fp32 and bf16
    xi = torch.randint(-2, 3, (T, 64), device="cuda", generator=g).bfloat16()
    wi = (torch.randint(-2, 3, (E, 2 * I, 64), device="cuda", generator=g).float() / 8).bfloat16()
    xs = xi.index_select(0, rows.token_of_row)
    fused = grouped_gemm(xs, wi, rows, cfg)
    plain = silu_mul(grouped_gemm(xs, wi, rows, cfg.replace(gated=False, stages=2)), rows)
    used = int(rows.alignment.num_padded)
    assert torch.equal(fused[:used].view(torch.int16), plain[:used].view(torch.int16))


@pytest.fixture
def fresh_calls():
    """``cute_moe.moe.forget_calls``: fused_moe's plans and bound launches are cached per call signature, so a
    test that flips a switch the plan reads, or stands in for a kernel, drops them (and they go again after it)."""
    import cute_moe.moe as moe

    moe.forget_calls()
    yield moe.forget_calls
    moe.forget_calls()


@pytest.mark.parametrize("spec", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"])
@pytest.mark.parametrize("T", [1, 8, 128, 4096])
def test_gated_layer_runs_no_silu_kernel_and_agrees_with_separate(shapes, spec, T, monkeypatch, fresh_calls):
    """With the switch on, the bf16 plan's GEMM1 is gated: the layer never calls the SiLU·mul row kernel, meets the
    oracle, reruns bit for bit, and agrees with the unfused pipeline (plain GEMM1 + row kernel, whose
    H is rounded to bf16 before SiLU) within the tolerance."""
    import importlib

    import cute_moe
    import cute_moe.moe as moe

    monkeypatch.setattr(importlib.import_module("cute_moe.plan"), "GATED_GEMM1", True)  # whichever way it stands
    fresh_calls()  # the switch changes the plan
    inp = _inputs(shapes, spec, T, seed=21)
    assert cute_moe.plan(_dims(inp)).gemm1.gated
    separate = cute_moe.fused_moe(**inp.kwargs(), fusion="separate")

    def refuse(*args, **kwargs):
        raise AssertionError("the fused bf16 layer launched the SiLU·mul row kernel")

    row_kernels = moe._row_kernels
    monkeypatch.setattr(moe, "_row_kernels", lambda device: {**row_kernels(device), "silu_mul": refuse})
    fresh_calls()  # the call binds its launches again: the SiLU·mul kernel is the refusal
    out = cute_moe.fused_moe(**inp.kwargs())
    again = cute_moe.fused_moe(**inp.kwargs())
    ref = oracle(**inp.kwargs())
    assert rel_l2(out, ref) < TOL and rel_l2(separate, ref) < TOL
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    assert rel_l2(out, separate) < TOL


def _dims(inp):
    from moe_spec.validate import MoEDims

    T, K = inp.x.shape
    E, two_i, _ = inp.w1.shape
    return MoEDims(T=T, E=E, K=K, I=two_i // 2, top_k=inp.topk_ids.shape[1])


# ---- the gathering GEMM1: token rows read by index from x (no X_sorted) ----------------------------
GATHER_CONFIGS = GATED_CONFIGS + [  # the gated configs of the rule, and plain GEMMs of both paths
    dict(swap_ab=True, tokens_tile=8, weights_tile=128, gated=False),
    dict(swap_ab=False, tokens_tile=128, weights_tile=256, consumer_warpgroups=2, gated=False),
]


@pytest.mark.parametrize(
    "kw",
    GATHER_CONFIGS,
    ids=lambda kw: "swap{swap_ab}-t{tokens_tile}-w{weights_tile}-g{g}".format(g=kw.get("gated", True), **kw),
)
def test_gathering_gemm_is_the_tma_path_bit_for_bit(kw):
    """A gather_rows GEMM reads x [T, K] by token index (cp.async in the producer) and must give the
    very bytes of the same kernel reading the sorted copy through TMA — the shared-memory tile holds
    the same values either way — on uneven experts with one idle expert and padding rows, with int64
    and int32 token indices; and meet fp32 torch."""
    import dataclasses

    from cute_moe.config import GemmConfig, max_stages
    from cute_moe.moe import grouped_gemm, sort_rows

    kw = dict(kw)
    gated = kw.pop("gated", True)
    cfg = GemmConfig(gated=gated, stages=2, **kw)
    cfg = cfg.replace(stages=max_stages(cfg))
    I, k, counts = 200, 512, [37, 0, 5, 130, 1]
    g = torch.Generator(device="cuda").manual_seed(6)
    E = len(counts)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).cuda()
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(6)).cuda()]
    T = ids.numel()
    rows = sort_rows(ids.view(T, 1), torch.ones(T, 1, device="cuda"), E, cfg.tokens_tile)
    used = int(rows.alignment.num_padded)
    assert used > T  # padding rows exist
    x = torch.randn(T, k, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * I, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    tma = grouped_gemm(x.index_select(0, rows.token_of_row), w1, rows, cfg)
    gathered = grouped_gemm(x, w1, rows, cfg.replace(gather_rows=True))
    rows32 = dataclasses.replace(rows, token_of_row=rows.token_of_row.to(torch.int32))
    gathered32 = grouped_gemm(x, w1, rows32, cfg.replace(gather_rows=True))
    assert gathered.shape == tma.shape == (rows.rows, I if gated else 2 * I)
    for out in (gathered, gathered32):
        assert torch.equal(out[:used].view(torch.int16), tma[:used].view(torch.int16))
    h = torch.einsum("tk,tnk->tn", x.float(), w1.float()[ids.long()])
    ref = torch.nn.functional.silu(h[:, :I]) * h[:, I:] if gated else h
    assert rel_l2(gathered.index_select(0, rows.row_of_pair), ref) < TOL


@pytest.mark.parametrize("spec", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"])
@pytest.mark.parametrize("T", [1, 8, 128, 4096])
def test_gathering_layer_runs_no_gather_kernel(shapes, spec, T, monkeypatch, fresh_calls):
    """With the switch on, the bf16 plan's GEMM1 gathers its rows: the layer never launches the gather row kernel, meets
    the oracle, reruns bit for bit, and equals the layer with the switch off (gather kernel + TMA)."""
    import importlib

    import cute_moe
    import cute_moe.moe as moe

    plan_module = importlib.import_module("cute_moe.plan")
    inp = _inputs(shapes, spec, T, seed=23)
    monkeypatch.setattr(plan_module, "GATHER_IN_PRODUCER", False)  # the switch off: gather kernel + TMA
    fresh_calls()  # the switch changes the plan
    assert not cute_moe.plan(_dims(inp)).gemm1.gather_rows
    tma = cute_moe.fused_moe(**inp.kwargs())
    monkeypatch.setattr(plan_module, "GATHER_IN_PRODUCER", True)  # on, whichever way the module has it
    assert cute_moe.plan(_dims(inp)).gemm1.gather_rows

    def refuse(*args, **kwargs):
        raise AssertionError("the gathering bf16 layer launched the gather row kernel")

    row_kernels = moe._row_kernels
    monkeypatch.setattr(moe, "_row_kernels", lambda device: {**row_kernels(device), "gather": refuse})
    fresh_calls()  # the plan and its launches again: the gather kernel is the refusal
    out = cute_moe.fused_moe(**inp.kwargs())
    again = cute_moe.fused_moe(**inp.kwargs())
    assert rel_l2(out, oracle(**inp.kwargs())) < TOL
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    assert torch.equal(out.view(torch.int16), tma.view(torch.int16))


# ---- the ping-pong schedule: each consumer warpgroup owns whole tiles ------------------------------
def _pingpong_pairs():
    """(cooperative, ping-pong) configs with the same WGMMA sequence per output element: the bf16
    layer's prefill GEMM1 (gated, gathering) and GEMM2 (row scale) against their ping-pong twins
    (one warpgroup's 64 rows), a 128-row ping-pong tile (two WGMMAs along M in one warpgroup)
    against the cooperative 128-row tile of two warpgroups, and swap-AB twins."""
    from cute_moe.config import GemmConfig, max_stages
    from cute_moe.gemm_rules import pingpong_config
    from cute_moe.plan import choose_config

    def cfg(**kw):
        c = GemmConfig(stages=2, **kw)
        return c.replace(stages=max_stages(c))

    gemm1 = choose_config(1024, 768, 2048, gated=True).replace(gather_rows=True)
    gemm2 = choose_config(1024, 2048, 768, row_scale=True)
    coop128 = cfg(tokens_tile=128, weights_tile=128)
    swap = cfg(swap_ab=True, tokens_tile=32, weights_tile=128)
    return {
        "gemm1-gated-gather": (gemm1, pingpong_config(gemm1)),
        "gemm2-row-scale": (gemm2, pingpong_config(gemm2)),
        "gemm2-plain": (gemm2.replace(row_scale=False), pingpong_config(gemm2.replace(row_scale=False))),
        "128x128-one-wg": (coop128, cfg(tokens_tile=128, weights_tile=128, schedule="pingpong")),
        "gated-128x64-one-wg": (
            cfg(tokens_tile=128, weights_tile=64, gated=True),
            cfg(tokens_tile=128, weights_tile=64, gated=True, schedule="pingpong"),
        ),
        "swap-w128-t32": (swap, pingpong_config(swap)),
        "swap-w128-t8": (
            cfg(swap_ab=True, tokens_tile=8, weights_tile=128),
            pingpong_config(cfg(swap_ab=True, tokens_tile=8, weights_tile=128)),
        ),
        "swap-w128-t64-one-wg": (
            cfg(swap_ab=True, tokens_tile=64, weights_tile=128),
            cfg(swap_ab=True, tokens_tile=64, weights_tile=128, schedule="pingpong"),
        ),
    }


PINGPONG_PAIRS = list(_pingpong_pairs())


@pytest.mark.parametrize("ctas", [None, 5], ids=["grid-sms", "grid-5"])
@pytest.mark.parametrize("name", PINGPONG_PAIRS)
def test_pingpong_is_the_cooperative_kernel_bit_for_bit(name, ctas, monkeypatch):
    """The ping-pong kernel gives the very bytes of the cooperative one on the rows both write (uneven
    experts, an idle one, partial token blocks, N_out not a multiple of the tile, K a few stages
    deep), and meets fp32 torch.  With 5 CTAs each warpgroup runs many tiles, wg 0 one more than wg 1
    on some CTAs, and the ring wraps inside and across tiles."""
    import math

    import cute_moe.moe as moe
    from cute_moe.moe import grouped_gemm, sort_rows

    coop, pp = _pingpong_pairs()[name]
    if ctas is not None:
        monkeypatch.setattr(moe, "sm_count", lambda device=None: ctas)
    gated, gather = coop.gated, coop.gather_rows
    n_out, k, counts = (200 if gated else 328), 640, [37, 0, 5, 300, 1, 129, 64]
    g = torch.Generator(device="cuda").manual_seed(31)
    E = len(counts)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).cuda()
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(31)).cuda()]
    T = ids.numel()
    weights = torch.rand(T, 1, device="cuda", generator=g)
    tile = math.lcm(coop.tokens_tile, pp.tokens_tile)
    rows = sort_rows(ids.view(T, 1), weights, E, tile, (coop.tokens_tile, pp.tokens_tile))
    used = int(rows.alignment.num_padded)
    x = torch.randn(T, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, (2 if gated else 1) * n_out, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    xs = x if gather else x.index_select(0, rows.token_of_row)
    scale = rows.weight_of_row if coop.row_scale else None
    a = grouped_gemm(xs, w, rows, coop, row_scale=scale)
    b = grouped_gemm(xs, w, rows, pp, row_scale=scale)
    again = grouped_gemm(xs, w, rows, pp, row_scale=scale)
    assert a.shape == b.shape == (rows.rows, n_out)
    assert torch.equal(a[:used].view(torch.int16), b[:used].view(torch.int16))
    assert torch.equal(b[:used].view(torch.int16), again[:used].view(torch.int16))
    h = torch.einsum("tk,tnk->tn", x.float(), w.float()[ids.long()])
    ref = torch.nn.functional.silu(h[:, :n_out]) * h[:, n_out:] if gated else h
    if coop.row_scale:
        ref = ref * weights
    assert rel_l2(b.index_select(0, rows.row_of_pair), ref) < TOL


@pytest.mark.parametrize("spec", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"])
@pytest.mark.parametrize("T", [8, 4096])
def test_pingpong_layer_is_the_cooperative_layer_bit_for_bit(shapes, spec, T):
    """The bf16 layer with both GEMMs' ping-pong twins (``configs=``) gives the very bytes of the plan's
    cooperative layer, and meets the oracle."""
    import cute_moe
    from cute_moe.gemm_rules import pingpong_config

    inp = _inputs(shapes, spec, T, seed=29)
    p = cute_moe.plan(_dims(inp))
    twins = (pingpong_config(p.gemm1), pingpong_config(p.gemm2))
    out = cute_moe.fused_moe(**inp.kwargs())
    pp = cute_moe.fused_moe(**inp.kwargs(), configs=twins)
    assert torch.equal(out.view(torch.int16), pp.view(torch.int16))
    assert rel_l2(pp, oracle(**inp.kwargs())) < TOL

"""CPU lane for cute_moe: PTX of both paths, layout data, the path rule, alignment, bad input.

Everything here runs without a GPU: the CuTe DSL compiles Hopper kernels on the CPU
(``CUTE_DSL_ARCH=sm_90a``), and the layout data is read from the kernel's own objects.
"""

import json
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cute_moe = pytest.importorskip("cute_moe")

from cute_moe.config import SMEM_BUDGET_BYTES, GemmConfig, choose_config, max_stages  # noqa: E402
from cute_moe.layouts import describe, evaluate, swizzle_bytes  # noqa: E402
from cute_moe.moe import align_tokens  # noqa: E402


def _cfg(**kw):
    cfg = GemmConfig(**kw)
    return cfg.replace(stages=max_stages(cfg)).validate()


NORMAL = [_cfg(tokens_tile=m, weights_tile=n, consumer_warpgroups=m // 64) for m in (64, 128) for n in (64, 128, 256)]
SWAP = [_cfg(swap_ab=True, tokens_tile=t, weights_tile=128, consumer_warpgroups=2) for t in (8, 16, 32, 64)]


def _id(cfg):
    return f"{'swap' if cfg.swap_ab else 'normal'}-{cfg.tile_m}x{cfg.tile_n}"


# ---- PTX ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", NORMAL + SWAP, ids=_id)
def test_ptx_has_the_intended_instructions(cfg):
    ptx = cute_moe.compile_ptx(cfg)
    wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.[\w.]+", ptx))
    assert wgmma == {f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16.f32.bf16.bf16"}
    # TMA: 2-D token loads, 3-D weight loads (the expert is the 3rd coordinate), 2-D store
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)
    # warp specialization: the producer gives registers away, the consumers take them
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
    stmatrix = set(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x\d(?:\.trans)?\.shared\.b16", ptx))
    want = f"stmatrix.sync.aligned.m8n8.x{2 if cfg.tile_n == 8 else 4}{'.trans' if cfg.swap_ab else ''}.shared.b16"
    assert stmatrix == {want}


def test_row_scale_epilogue_reads_the_routing_weights():
    # plain: the two device scalars the scheduler reads (block count, block's expert);
    # row_scale adds the fp32 weight of each distinct token row the thread holds (2 for N = 8)
    loads = lambda ptx: len(re.findall(r"ld\.global\.\w+", ptx))  # noqa: E731
    plain = cute_moe.compile_ptx(SWAP[0])
    scaled = cute_moe.compile_ptx(SWAP[0].replace(row_scale=True))
    assert loads(scaled) == loads(plain) + 2


def test_compile_cache_and_counter():
    cfg = SWAP[1]
    cute_moe.compile_gemm(cfg)
    n = cute_moe.compile_count()
    assert cute_moe.compile_gemm(cfg) is cute_moe.compile_gemm(cfg)
    assert cute_moe.compile_count() == n
    cute_moe.compile_gemm(cfg.replace(group_tokens=cfg.group_tokens + 1))
    assert cute_moe.compile_count() == n + 1


def test_row_kernels_compile_once():
    cute_moe.compile_row_kernels()
    n = cute_moe.compile_count()
    kernels = cute_moe.compile_row_kernels()
    assert set(kernels) == {"gather", "silu_mul", "combine"} and cute_moe.compile_count() == n


# ---- layouts as data ---------------------------------------------------------------------------
LAYOUT_CFGS = [_cfg(tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
               _cfg(tokens_tile=128, weights_tile=128, consumer_warpgroups=2),
               _cfg(swap_ab=True, tokens_tile=8, weights_tile=128),
               _cfg(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1)]


@pytest.fixture(scope="module")
def layouts():
    return {c: describe(c) for c in LAYOUT_CFGS}


@pytest.mark.parametrize("cfg", LAYOUT_CFGS, ids=_id)
def test_every_c_element_owned_once(layouts, cfg):
    acc = layouts[cfg]["accumulators"]
    assert len(acc) == 128 * cfg.consumer_warpgroups
    owners = {}
    for t, regs in enumerate(acc):
        assert len(regs) == cfg.tile_m * cfg.tile_n // len(acc)
        for r, mn in enumerate(regs):
            assert mn not in owners, f"{mn} held by {owners[mn]} and {(t, r)}"
            owners[mn] = (t, r)
    assert set(owners) == {(m, n) for m in range(cfg.tile_m) for n in range(cfg.tile_n)}


def test_swap_ab_c_is_the_transpose_of_normal(layouts):
    normal, swap = LAYOUT_CFGS[0], LAYOUT_CFGS[3]  # both 64 tokens × 64 weights, one warpgroup
    n_moe, s_moe = layouts[normal]["accumulators_moe"], layouts[swap]["accumulators_moe"]
    assert layouts[normal]["tile"]["gemm_mnk"][:2] == layouts[swap]["tile"]["gemm_mnk"][:2][::-1]
    # same thread, same register: (token, weight) in one path is (weight, token) in the other
    assert all(s == n[::-1] for ns, ss in zip(n_moe, s_moe) for n, s in zip(ns, ss))
    # and both write element (token, weight) to the same byte of the [M_pad, N_out] output:
    n_out = 4096
    normal_c = lambda m, n: m * n_out + n  # noqa: E731  row-major (tokens, weights)
    swap_c = lambda m, n: m + n * n_out  # noqa: E731  M-major view (weights, tokens)
    # keyed by (token, weight): normal has m = token, n = weight; swap-AB has m = weight, n = token
    written_normal = {(m, n): normal_c(m, n) for regs in layouts[normal]["accumulators"] for (m, n) in regs}
    written_swap = {(n, m): swap_c(m, n) for regs in layouts[swap]["accumulators"] for (m, n) in regs}
    assert written_normal == written_swap


@pytest.mark.parametrize("cfg", LAYOUT_CFGS, ids=_id)
def test_swizzle_in_bytes_spreads_an_atom_over_all_chunks(layouts, cfg):
    for operand in ("A", "B"):
        smem = layouts[cfg]["smem"][operand]
        assert smem["swizzle"] == [3, 4, 3]  # 128-B swizzle: bits 4..6 ^= bits 7..9 of the byte address
        rows = smem["atom_rows"]
        rows_here = min(8, len(rows))
        assert [r["logical_byte"] for r in rows] == [128 * r for r in range(rows_here)]  # 64 bf16 per row
        assert len({r["chunk16"] for r in rows}) == rows_here  # 8 rows → 8 distinct 16-B chunks
        banks = {r["bank"] + b for r in rows for b in range(4)}  # a chunk spans 4 banks
        assert len(banks) == 4 * rows_here


def test_swizzle_in_element_units_would_collide():
    """The pitfall in FINDINGS: S<3,4,3> applied to bf16 *element* offsets is not the hardware pattern."""
    chunks_bytes = {(swizzle_bytes(128 * r, 3, 4, 3) >> 4) & 7 for r in range(8)}
    chunks_elems = {((swizzle_bytes(64 * r, 3, 4, 3) * 2) >> 4) & 7 for r in range(8)}
    assert len(chunks_bytes) == 8 and len(chunks_elems) < 8


def test_layout_function_definition():
    assert [evaluate((4, 8), (8, 1), i) for i in (0, 1, 4, 5, 31)] == [0, 8, 1, 9, 31]
    assert evaluate(((2, 2), 3), ((1, 6), 2), 7) == 1 + 6 + 2  # i=7 → (1, 1, 1)


def test_layout_data_is_plain_json(layouts):
    d = cute_moe.describe_json(LAYOUT_CFGS[2])
    assert json.loads(json.dumps(d)) == d
    assert d["tma"]["load_tokens_box"] == [8, 64] and d["tma"]["load_weights_box"] == [128, 64]
    assert d["smem"]["total_bytes"] <= SMEM_BUDGET_BYTES


_WGMMA = r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.[\w.]+"
# the producer's `expect_tx` on a stage's full barrier, with the byte count moved into its register
_EXPECT_TX = r"mov\.b32\s+(%r\d+), (\d+);\s*mbarrier\.arrive\.expect_tx\.shared\.b64 [^,]+, \[[^\]]+\], \1;"


@pytest.mark.parametrize("cfg", LAYOUT_CFGS, ids=_id)
def test_layout_data_agrees_with_the_ptx(layouts, cfg):
    """describe() reads the tiled MMA's atom and the plan's stage bytes; the compiled kernel must agree."""
    d, ptx = layouts[cfg], cute_moe.compile_ptx(cfg)
    assert set(re.findall(_WGMMA, ptx)) == {d["mma"]["instruction"]}
    assert d["mma"]["atom_mnk"] == [64, cfg.tile_n, 16]
    # the full barriers expect exactly the bytes of one stage's two TMA loads (KernelPlan.stage_bytes)
    expect_tx = {int(n) for _, n in re.findall(_EXPECT_TX, ptx)}
    assert expect_tx == {d["tma"]["stage_bytes"]} == {(cfg.tile_m + cfg.tile_n) * cfg.tile_k * cfg.element_bytes}


# ---- the path rule and validation --------------------------------------------------------------
def test_path_rule():
    assert choose_config(0.5, 28672, 4096).swap_ab and choose_config(0.5, 28672, 4096).tokens_tile == 8
    assert choose_config(20, 28672, 4096).tokens_tile == 32
    assert choose_config(64, 28672, 4096).swap_ab
    big = choose_config(65, 28672, 4096)
    assert not big.swap_ab and (big.tile_m, big.tile_n) == (128, 256)
    assert choose_config(2, 28672, 4096, swap_ab=False).tokens_tile == 64
    assert choose_config(500, 28672, 4096, swap_ab=True).swap_ab
    for t in (1, 10, 100, 1000):
        assert choose_config(t, 4096, 14336).smem_bytes() <= SMEM_BUDGET_BYTES


@pytest.mark.parametrize("kw, needle", [
    (dict(swap_ab=True, tokens_tile=12), "multiple of 8"),
    (dict(weights_tile=100), "multiple of 8"),
    (dict(swap_ab=True, tokens_tile=24), "odd multiples of 8"),
    (dict(tokens_tile=96), "must be a multiple of 64"),
    (dict(weights_tile=256, stages=6), "shared memory over budget"),
    (dict(quant="fp8_tensor"), r"expected dtype='float8_e4m3fn'"),
    (dict(dtype="float8_e4m3fn"), r"with quant=None: expected dtype='bfloat16'"),
    (dict(quant="fp8_block", dtype="float8_e4m3fn"), r"tile_k=64: FP8 configs need tile_k=128"),
    (dict(quant="fp8_tensor", dtype="float8_e4m3fn", tile_k=128, weights_tile=256), r"needs 256 accumulator registers"),
    (dict(quant="fp8_block", dtype="float8_e4m3fn", tile_k=128, tokens_tile=64, weights_tile=96,
          consumer_warpgroups=1), r"weights_tile=96: fp8_block needs a weights tile that divides the 128-row"),
    (dict(quant="fp8_rowwise"), r"GemmConfig\.quant='fp8_rowwise': expected one of"),
    (dict(out_dtype="float16"), r"GemmConfig\.out_dtype='float16'"),
    (dict(consumer_warpgroups=3), "1 or 2"),
    (dict(stages=1), "at least 2"),
    (dict(swap_ab=True, tokens_tile=8, weights_tile=256, stages=4), "above 128.*untested on the GPU"),
])
def test_bad_configs_name_the_limit(kw, needle):
    with pytest.raises(ValueError, match=needle):
        GemmConfig(**kw).validate()


def test_compile_of_bad_config_raises_before_the_dsl():
    with pytest.raises(ValueError, match="shared memory over budget"):
        cute_moe.compile_ptx(GemmConfig(weights_tile=256, stages=7))


# ---- alignment (torch ops, CPU) ----------------------------------------------------------------
@pytest.mark.parametrize("tile", [8, 64])
def test_align_tokens(tile):
    g = torch.Generator().manual_seed(0)
    T, k, E = 37, 2, 6
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)]).int()  # expert E-1 unused
    w = torch.rand(T, k, generator=g)
    al = align_tokens(ids, w, E, tile)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    padded = (counts + tile - 1) // tile * tile
    assert torch.equal(al.padded_end, padded.cumsum(0))
    assert al.rows % tile == 0 and al.rows >= T * k + E * (tile - 1)
    for t in range(T):
        for j in range(k):
            r = int(al.pair_row[t * k + j])
            assert int(al.sorted_token[r]) == t and float(al.sorted_weight[r]) == float(w[t, j])
            e = int(ids[t, j])
            assert int(al.padded_end[e] - padded[e]) <= r < int(al.padded_end[e])
    assert len(set(al.pair_row.tolist())) == T * k
    used = torch.zeros(al.rows, dtype=torch.bool)
    used[al.pair_row] = True
    assert float(al.sorted_weight[~used].abs().sum()) == 0.0  # padding rows weigh nothing
    block_expert, num_blocks = al.blocks(tile)
    assert int(num_blocks) == int(padded.sum()) // tile
    for b in range(int(num_blocks)):
        rows = torch.arange(b * tile, (b + 1) * tile)
        real = rows[used[rows]]
        assert all(int(ids.flatten()[torch.nonzero(al.pair_row == r)[0, 0]]) == int(block_expert[b]) for r in real)
    with pytest.raises(ValueError, match="does not divide"):
        al.blocks(tile * 2)


# ---- the backend contract on the CPU -----------------------------------------------------------
def _small_inputs(T=4, quant=None):
    from moe_spec.problem import MoEShape, make_inputs

    return make_inputs(MoEShape("tiny", 4, 2, 64, 32, "test"), T, quant)


def test_fused_moe_validates_before_anything():
    inp = _small_inputs()
    with pytest.raises(TypeError, match=r"^x:"):
        cute_moe.fused_moe(inp.x.float(), inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)
    with pytest.raises(TypeError, match=r"^topk_weights:"):
        cute_moe.fused_moe(inp.x, inp.w1, inp.w2, inp.topk_weights.double(), inp.topk_ids)
    with pytest.raises(ValueError, match=r"^w2:"):
        cute_moe.fused_moe(inp.x, inp.w1, inp.w2[:, :, :16], inp.topk_weights, inp.topk_ids)


def _tiny(hidden=64, intermediate=32, T=3):
    from moe_spec.problem import MoEShape, make_inputs

    return make_inputs(MoEShape("tiny", 4, 2, hidden, intermediate, "test"), T).kwargs()


GEMM1, GEMM2 = choose_config(1, 64, 64), choose_config(1, 64, 32, row_scale=True)


@pytest.mark.parametrize("inputs, options, error, needle", [
    (dict(hidden=12), {}, ValueError, r"^x: hidden size K = x\.shape\[1\] = 12 must be a multiple of 8"),
    (dict(intermediate=20), {}, ValueError, r"^w2: intermediate size I = w2\.shape\[2\] = 20 must be a multiple of 8"),
    (dict(hidden=12, T=0), {}, ValueError, r"^x: hidden size K"),  # an unsupported shape, whatever T
    ({}, dict(swap_ab="yes"), TypeError, r"^swap_ab: expected None or a bool"),
    ({}, dict(configs=GEMM1), TypeError, r"^configs: expected a \(GEMM1, GEMM2\) pair"),
    ({}, dict(configs=(GEMM1, "128x128")), TypeError, r"^configs: expected a \(GEMM1, GEMM2\) pair"),
    ({}, dict(configs=(GEMM1, GEMM2.replace(row_scale=False))), ValueError, r"^configs\[1\]: row_scale must be True"),
    ({}, dict(configs=(GEMM2, GEMM2)), ValueError, r"^configs\[0\]: row_scale must be False"),
    ({}, dict(configs=(GEMM1.replace(stages=1), GEMM2)), ValueError, r"^configs\[0\]: stages=1"),
    ({}, dict(configs=(GEMM1, GEMM2), swap_ab=True), ValueError, r"^swap_ab and configs: pass at most one"),
])
def test_fused_moe_checks_its_limits_before_any_launch(inputs, options, error, needle):
    """CPU tensors: a check that ran after a launch (or after the CUDA-device check) would raise
    something else here (the device error, or the DSL's)."""
    with pytest.raises(error, match=needle):
        cute_moe.fused_moe(**_tiny(**inputs), **options)


def test_fused_moe_accepts_checked_configs_up_to_the_device_check():
    with pytest.raises(ValueError, match="CUDA"):
        cute_moe.fused_moe(**_tiny(), configs=[GEMM1, GEMM2])


def test_row_kernel_wrappers_refuse_a_partial_vector():
    """The row kernels walk cols // 8 vectors: the host wrappers must refuse a tail, before any launch."""
    from cute_moe.moe import combine, gather_rows, silu_mul

    T, k, E = 5, 2, 4
    ids = torch.arange(T * k, dtype=torch.int32).remainder(E).view(T, k)
    al = align_tokens(ids, torch.rand(T, k), E, 8)
    bf16 = dict(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^gather_rows: x\.shape\[1\] = 12 must be a multiple of 8"):
        gather_rows(torch.zeros(T, 12, **bf16), al)
    with pytest.raises(ValueError, match=r"^silu_mul: h\.shape\[1\] \(2I\) = 24 must be a multiple of 16"):
        silu_mul(torch.zeros(al.rows, 24, **bf16), al)
    with pytest.raises(ValueError, match=r"^combine: y\.shape\[1\] = 20 must be a multiple of 8"):
        combine(torch.zeros(al.rows, 20, **bf16), al, T, k)
    with pytest.raises(ValueError, match=r"^combine: alignment has 10 \(token, slot\) pairs, T·top_k = 4·2 = 8"):
        combine(torch.zeros(al.rows, 16, **bf16), al, T - 1, k)


def test_fused_moe_empty_batch_and_cpu_tensors():
    inp = _small_inputs(T=0)
    out = cute_moe.fused_moe(**inp.kwargs())
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="CUDA"):
        cute_moe.fused_moe(**_small_inputs(T=3).kwargs())


def test_bench_draws_the_shared_weights():
    """bench rotates weight sets drawn by moe_spec.problem.draw_weights (one generator, n sets)."""
    from moe_spec.problem import MoEShape, draw_weights
    from cute_moe.bench import _weights

    shape = MoEShape("tiny", 4, 2, 64, 32, "test")
    g = torch.Generator().manual_seed(3)
    want = [draw_weights(shape, g) for _ in range(2)]
    got = _weights(shape, 2, seed=3, device="cpu")
    assert all(torch.equal(a, b) for gs, ws in zip(got, want) for a, b in zip(gs, ws))
    assert not torch.equal(got[0][0], got[1][0])  # the sets differ (cold L2 when rotated)

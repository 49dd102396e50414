"""CPU lane for cute_moe: PTX of both paths, layout data, the path rule, the config's checks,
the rasterization, the row maps, bad input.

Everything here runs without a GPU: the CuTe DSL compiles Hopper kernels on the CPU
(``CUTE_DSL_ARCH=sm_90a``), and the layout data is read from the kernel's own objects.
"""

import dataclasses
import json
import os
import re
from collections import Counter

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cute_moe = pytest.importorskip("cute_moe")

from cute_moe.config import SMEM_BUDGET_BYTES, GemmConfig, max_stages  # noqa: E402
from cute_moe.layouts import describe, evaluate, plan_layouts, swizzle_bytes  # noqa: E402
from cute_moe.limits import tokens_tiles  # noqa: E402
from cute_moe.moe import gemm_blocks, sort_rows  # noqa: E402
from cute_moe.plan import choose_config  # noqa: E402
from cute_moe.ptx import mma_instruction  # noqa: E402


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
    assert wgmma == {f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16.f32.bf16.bf16"} == {mma_instruction(cfg)}
    # TMA: 2-D token loads, 3-D weight loads (the expert is the 3rd coordinate), 2-D store
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)
    # warp specialization: the producer gives registers away, the consumers take them
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
    stmatrix = set(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x\d(?:\.trans)?\.shared\.b16", ptx))
    want = f"stmatrix.sync.aligned.m8n8.x{2 if cfg.tile_n == 8 else 4}{'.trans' if cfg.swap_ab else ''}.shared.b16"
    assert stmatrix == {want}


@pytest.mark.parametrize("cfg", [SWAP[0], SWAP[1], SWAP[2], NORMAL[-1]], ids=_id)
def test_row_scale_epilogue_reads_the_routing_weights(cfg):
    """Plain: the two device scalars the scheduler reads (block count, block's expert). row_scale
    adds one fp32 load per distinct token row a consumer thread holds — its accumulators' token
    coordinates (layouts.describe, the kernel's own partition): 2 for the normal path and for
    swap-AB at 8 tokens, 4 at 16, 8 at 32. Indexing the weights by the other coordinate (the
    weight row) changes that count everywhere but at 8 tokens."""
    loads = lambda ptx: len(re.findall(r"ld\.global\.\w+", ptx))  # noqa: E731
    tokens_per_thread = len({token for token, _ in describe(cfg)["accumulators_moe"][0]})
    plain = cute_moe.compile_ptx(cfg)
    scaled = cute_moe.compile_ptx(cfg.replace(row_scale=True))
    assert loads(scaled) == loads(plain) + tokens_per_thread


def test_compile_cache_and_counter():
    cfg = SWAP[1]
    cute_moe.compile_gemm(cfg)
    n = cute_moe.compile_count()
    assert cute_moe.compile_gemm(cfg) is cute_moe.compile_gemm(cfg)
    assert cute_moe.compile_count() == n
    cute_moe.compile_gemm(cfg.replace(group_tokens=cfg.group_tokens + 1))
    assert cute_moe.compile_count() == n + 1


def test_the_plans_wgmma_is_the_one_the_kernel_issues():
    """A plan's ``mma`` is each config's ``GemmConfig.wgmma`` (from its tiles and dtype); the kernel's own
    tiled MMA (``ptx.mma_instruction``) is the same instruction, for every config the plans of the
    catalog's layers pick in every format, path and pipeline (ping-pong and clustered ones included).
    A one-launch plan (no GemmConfig) names its kernel's own instruction (tests/test_cute_one_launch.py)."""
    from cute_moe.decode_parts import WGMMA
    from moe_spec.problem import get_shape
    from moe_spec.quant import QUANT_FORMATS

    configs, plans = {}, 0
    for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"):
        s = get_shape(spec)
        for quant in QUANT_FORMATS:
            for options in ({}, {"swap_ab": True}, {"swap_ab": False}, {"fusion": "separate"}):
                for p in cute_moe.plans_for(s.num_experts, s.hidden, s.intermediate, s.top_k, quant, **options):
                    if p.path == "decode":
                        assert p.mma == (WGMMA, WGMMA) and (p.gemm1, p.gemm2) == (None, None)
                        continue
                    assert p.mma == (p.gemm1.wgmma, p.gemm2.wgmma)
                    configs.update(dict.fromkeys((p.gemm1, p.gemm2)))
                    plans += 1
    assert plans > len(configs) > 40 and {c.schedule for c in configs} == {"cooperative", "pingpong"}
    assert {c.cluster for c in configs} == {1, 2} and {c.swap_ab for c in configs} == {True, False}
    assert [c for c in configs if c.wgmma != mma_instruction(c)] == []


def test_warm_up_compiles_every_plan_once():
    """compile_plan over plans_for compiles what those calls run; a second pass compiles nothing."""
    plans = cute_moe.plans_for(8, 4096, 14336, 2, max_tokens=64)  # Mixtral up to 64 tokens: two plans
    assert len(plans) == 2
    for p in plans:
        cute_moe.compile_plan(p)
    assert sum(cute_moe.compile_plan(p) for p in plans) == 0
    for p in plans:
        assert cute_moe.compile_gemm(p.gemm1) is cute_moe.compile_gemm(p.gemm1)


def test_row_kernels_compile_once():
    cute_moe.compile_row_kernels()
    n = cute_moe.compile_count()
    kernels = cute_moe.compile_row_kernels()
    assert set(kernels) == {"gather", "silu_mul", "combine"} and cute_moe.compile_count() == n


# ---- layouts as data ---------------------------------------------------------------------------
LAYOUT_CFGS = [
    _cfg(tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
    _cfg(tokens_tile=128, weights_tile=128, consumer_warpgroups=2),
    _cfg(swap_ab=True, tokens_tile=8, weights_tile=128),
    _cfg(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
]


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
    """The pitfall of reading the DSL's printed swizzle: S<3,4,3> applied to bf16 *element* offsets
    is not the hardware pattern (the hardware XORs byte addresses)."""
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
    assert expect_tx == {d["tma"]["stage_bytes"]} == {cfg.stage_bytes}  # the budget's per-stage term


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


BAD_CONFIGS = [
    (dict(swap_ab=1), TypeError, r"^swap_ab: expected a bool"),
    (dict(tokens_tile=128.0), TypeError, r"^tokens_tile: expected an int"),
    (dict(weights_tile="128"), TypeError, r"^weights_tile: expected an int"),
    (dict(tile_k="64"), TypeError, r"^tile_k: expected an int, got '64'"),
    (dict(stages=4.5), TypeError, r"^stages: expected an int"),
    (dict(consumer_warpgroups=True), TypeError, r"^consumer_warpgroups: expected an int"),
    (dict(epi_stages=None), TypeError, r"^epi_stages: expected an int"),
    (dict(dtype=2), TypeError, r"^dtype: expected a str"),
    (dict(quant=8), TypeError, r"^quant: expected None or a str"),
    (dict(row_scale="yes"), TypeError, r"^row_scale: expected a bool"),
    (dict(group_tokens=8.0), TypeError, r"^group_tokens: expected an int"),
    (dict(out_dtype=None), TypeError, r"^out_dtype: expected a str"),
    (dict(epilogue_scales="no"), TypeError, r"^epilogue_scales: expected a bool"),
    (dict(swap_ab=True, tokens_tile=12), ValueError, r"^tokens_tile=12: .*multiple of 8.*allowed .*: 8, 16, 32, 48"),
    (dict(swap_ab=True, tokens_tile=24), ValueError, r"^tokens_tile=24: .*not an odd multiple of 8 above 8"),
    (dict(swap_ab=True, tokens_tile=40), ValueError, r"^tokens_tile=40: .*odd multiple of 8"),
    (dict(weights_tile=100), ValueError, r"^weights_tile=100: .*a multiple of 16 up to 256; allowed .*: 16, 32, 48"),
    (dict(tokens_tile=96), ValueError, r"^tokens_tile=96: .*multiple of 64 rows per consumer warpgroup.*: 128 "),
    (dict(tokens_tile=64), ValueError, r"^tokens_tile=64: .*consumer_warpgroups=2: 128 "),
    (dict(swap_ab=True, tokens_tile=8, weights_tile=256), ValueError, r"^weights_tile=256: .*at most 128"),
    (dict(tile_k=8), ValueError, r"^tile_k=8: must be a positive multiple of 16, WGMMA's K for bfloat16"),
    (dict(tile_k=24), ValueError, r"^tile_k=24: must be a positive multiple of 16"),
    (dict(weights_tile=256, stages=6), ValueError, r"^stages=6: shared memory over budget.*at most 4 stages fit"),
    (dict(dtype="float16"), ValueError, r"^dtype='float16': supported dtypes are \('bfloat16', 'float8_e4m3fn'\)"),
    (dict(quant="fp8_rowwise"), ValueError, r"^quant='fp8_rowwise': expected one of"),
    (dict(out_dtype="float16"), ValueError, r"^out_dtype='float16': supported output dtypes"),
    (
        dict(quant="fp8_tensor"),
        ValueError,
        r"^dtype='bfloat16' with quant='fp8_tensor': expected dtype='float8_e4m3fn'",
    ),
    (dict(dtype="float8_e4m3fn"), ValueError, r"^dtype='float8_e4m3fn' with quant=None: expected dtype='bfloat16'"),
    (dict(quant="fp8_block", dtype="float8_e4m3fn"), ValueError, r"^tile_k=64: FP8 configs need tile_k=128"),
    (
        dict(quant="fp8_block", dtype="float8_e4m3fn", tile_k=16),
        ValueError,
        r"^tile_k=16: must be a positive multiple of 32, WGMMA's K for float8_e4m3fn",
    ),
    (
        dict(quant="fp8_tensor", dtype="float8_e4m3fn", tile_k=128, weights_tile=256),
        ValueError,
        r"^tokens_tile=128, weights_tile=256: .*needs 256 accumulator registers",
    ),
    (
        dict(
            quant="fp8_block", dtype="float8_e4m3fn", tile_k=128, tokens_tile=64, weights_tile=96, consumer_warpgroups=1
        ),
        ValueError,
        r"^weights_tile=96: fp8_block needs a weights tile that divides the 128-row",
    ),
    (dict(consumer_warpgroups=3), ValueError, r"^consumer_warpgroups=3: must be 1 or 2"),
    (dict(stages=1), ValueError, r"^stages=1: the TMA/WGMMA ring needs at least 2"),
    (dict(epi_stages=0), ValueError, r"^epi_stages=0: needs at least 1"),
    (dict(group_tokens=0), ValueError, r"^group_tokens=0: must be ≥ 1"),
    (dict(gated=1), TypeError, r"^gated: expected a bool"),
    (dict(gated=True, row_scale=True), ValueError, r"^gated=True with .*row_scale=True: SiLU·up in the epilogue"),
    (dict(gated=True, out_dtype="float32"), ValueError, r"^gated=True with .*out_dtype='float32'"),
    (
        dict(gated=True, quant="fp8_tensor", dtype="float8_e4m3fn", tile_k=128),
        ValueError,
        r"^gated=True with quant='fp8_tensor'",
    ),
    (
        dict(gated=True, weights_tile=256),
        ValueError,
        r"^tokens_tile=128, weights_tile=256: the gated tile 128×256 .* needs 256 accumulator registers "
        r".*\(gate \+ up\)",
    ),
    (
        dict(gated=True, swap_ab=True, tokens_tile=256, weights_tile=128),
        ValueError,
        r"^tokens_tile=256, weights_tile=128: the gated tile 128×256 .* needs 256 accumulator registers",
    ),
    (
        dict(gated=True, swap_ab=True, tokens_tile=8, weights_tile=128, stages=7),
        ValueError,
        r"^stages=7: shared memory over budget: .*7 × \(8\+256\)×64×2 B.*at most 6 stages fit",
    ),
    (dict(schedule=1), TypeError, r"^schedule: expected a str"),
    (dict(cluster=2.0), TypeError, r"^cluster: expected an int"),
    (dict(cluster=4), ValueError, r"^cluster=4: expected one of \(1, 2\)"),
    (dict(cluster=2, swap_ab=True, tokens_tile=8), ValueError, r"^cluster=2 with swap_ab=True.*the normal path"),
    (dict(cluster=2, schedule="pingpong"), ValueError, r"^cluster=2 with swap_ab=False, schedule='pingpong'"),
    (dict(schedule="async"), ValueError, r"^schedule='async': expected one of \('cooperative', 'pingpong'\)"),
    (
        dict(schedule="pingpong", tokens_tile=64, consumer_warpgroups=1),
        ValueError,
        r"^schedule='pingpong' with consumer_warpgroups=1: ping-pong needs consumer_warpgroups=2",
    ),
    (
        dict(schedule="pingpong", quant="fp8_tensor", dtype="float8_e4m3fn", tile_k=128),
        ValueError,
        r"^tokens_tile=128, weights_tile=128: under schedule='pingpong' one warpgroup holds the whole 128×128 tile, "
        r"block and promoted: 256 accumulator registers",
    ),
    (
        dict(schedule="pingpong", weights_tile=256),
        ValueError,
        r"^tokens_tile=128, weights_tile=256: under schedule='pingpong' one warpgroup holds the whole 128×256 tile: "
        r"256 accumulator registers",
    ),
    (
        dict(schedule="pingpong", gated=True),
        ValueError,
        r"^tokens_tile=128, weights_tile=128: under schedule='pingpong' .*128×128 tile \(gate \+ up\): 256",
    ),
    (dict(gather_rows=1), TypeError, r"^gather_rows: expected a bool"),
    (dict(epilogue_quant=1), TypeError, r"^epilogue_quant: expected None or a str"),
    (dict(epilogue_quant="fused"), ValueError, r"^epilogue_quant='fused': expected None or one of"),
    (dict(epilogue_quant="amax"), ValueError, r"^epilogue_quant='amax' with gated=False, quant=None"),
    (
        dict(gather_rows=True, quant="fp8_tensor", dtype="float8_e4m3fn", tile_k=128),
        ValueError,
        r"^gather_rows=True: takes bf16 \(quant='fp8_tensor'\)",
    ),
]


@pytest.mark.parametrize("kw, error, needle", BAD_CONFIGS, ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_a_bad_field_is_named_on_construction(kw, error, needle):
    with pytest.raises(error, match=needle):
        GemmConfig(**kw)


def test_every_field_is_checked():
    assert {name for kw, _, _ in BAD_CONFIGS for name in kw} == {f.name for f in dataclasses.fields(GemmConfig)}


@pytest.mark.parametrize("tile_k", [16, 32, 48, 128])
def test_tile_k_in_whole_wgmma_steps_is_accepted(tile_k):
    assert GemmConfig(tile_k=tile_k, stages=2).validate().tile_k == tile_k


@pytest.mark.parametrize("tile_k", [32, 128])
def test_other_tile_k_compiles_to_the_planned_stage(tile_k):
    """A stage moves tile_k of K: the full barrier expects the config's stage bytes."""
    cfg = GemmConfig(swap_ab=True, tokens_tile=16, weights_tile=64, consumer_warpgroups=1, tile_k=tile_k, stages=3)
    ptx = cute_moe.compile_ptx(cfg)
    assert {int(n) for _, n in re.findall(_EXPECT_TX, ptx)} == {cfg.stage_bytes}
    assert set(re.findall(_WGMMA, ptx)) == {mma_instruction(cfg)}


def test_the_docstring_lists_the_swap_ab_token_tiles():
    doc = GemmConfig.__doc__
    listed = re.search(r"swap-AB: ([\d,\s]+)\(", doc[doc.index("tokens_tile:") :]).group(1)
    assert tuple(int(v) for v in listed.replace(",", " ").split()) == tokens_tiles(swap_ab=True)


def test_a_config_over_budget_cannot_be_built():
    with pytest.raises(ValueError, match=r"^stages=7: shared memory over budget"):
        GemmConfig(weights_tile=256, stages=7)
    assert GemmConfig(weights_tile=256).replace(stages=max_stages(GemmConfig(weights_tile=256))).stages == 4


# ---- rasterization: every tile once ------------------------------------------------------------
def test_tile_coordinates_visit_every_tile_exactly_once():
    """raster.tile_coordinates in plain Python: a bijection of tile ids onto (token block, weight
    block) for every grid shape and group size — a partial last group of token blocks included."""
    from cute_moe.gemm_parts import tile_coordinates

    for n_tokens in range(1, 14):
        for n_weights in range(1, 6):
            for group in range(1, 10):
                seen = [tile_coordinates(t, n_tokens, n_weights, group) for t in range(n_tokens * n_weights)]
                assert sorted(seen) == [(b, w) for b in range(n_tokens) for w in range(n_weights)], (
                    n_tokens,
                    n_weights,
                    group,
                )


# ---- the row maps and blocks of the CuTe layer (torch ops, CPU) --------------------------------
def test_sort_rows_feeds_padding_a_real_token_weighted_zero():
    T, k, E = 9, 2, 5
    ids = torch.arange(T * k, dtype=torch.int32).remainder(E - 1).view(T, k)  # expert E-1 unused
    w = torch.rand(T, k, generator=torch.Generator().manual_seed(0))
    rows = sort_rows(ids, w, E, 8)
    holds = rows.alignment.holds_pair()
    assert bool((rows.token_of_row[~holds] == T - 1).all())  # a real row: finite; its weight is 0
    assert bool((rows.weight_of_row[~holds] == 0).all())
    assert torch.equal(rows.token_of_row[holds], rows.alignment.token_of_row(k)[holds])


def test_gemm_blocks_split_the_alignment_blocks():
    ids = torch.tensor([[0], [0], [1], [2], [2], [2]], dtype=torch.int32)
    al = sort_rows(ids, torch.ones(6, 1), 3, 16).alignment
    experts, used = gemm_blocks(al, 16)
    assert experts is al.expert_of_block and int(used) == 3
    experts, used = gemm_blocks(al, 8)  # two GEMM blocks per alignment block
    assert experts.tolist()[:6] == [0, 0, 1, 1, 2, 2] and int(used) == 6
    with pytest.raises(ValueError, match="does not divide the alignment tile 16"):
        gemm_blocks(al, 32)


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


@pytest.mark.parametrize(
    "inputs, options, error, needle",
    [
        (dict(hidden=12), {}, ValueError, r"^x: hidden size K = x\.shape\[1\] = 12 must be a multiple of 8"),
        (
            dict(intermediate=20),
            {},
            ValueError,
            r"^w2: intermediate size I = w2\.shape\[2\] = 20 must be a multiple of 8",
        ),
        (dict(hidden=12, T=0), {}, ValueError, r"^x: hidden size K"),  # refused whatever T (moe_spec.plan)
        ({}, dict(swap_ab="yes"), TypeError, r"^swap_ab: expected None or a bool"),
        (dict(T=0), dict(swap_ab="yes"), TypeError, r"^swap_ab: expected None or a bool"),
        ({}, dict(configs=GEMM1), TypeError, r"^configs: expected a \(GEMM1, GEMM2\) pair"),
        ({}, dict(configs=(GEMM1, "128x128")), TypeError, r"^configs: expected a \(GEMM1, GEMM2\) pair"),
        (
            {},
            dict(configs=(GEMM1, GEMM2.replace(row_scale=False))),
            ValueError,
            r"^configs\[1\]: row_scale must be True",
        ),
        ({}, dict(configs=(GEMM2, GEMM2)), ValueError, r"^configs\[0\]: row_scale must be False"),
        ({}, dict(configs=(GEMM1, GEMM2), swap_ab=True), ValueError, r"^swap_ab and configs: pass at most one"),
    ],
)
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
    rows = sort_rows(ids, torch.rand(T, k), E, 8)
    bf16 = dict(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^gather_rows: x\.shape\[1\] = 12 must be a multiple of 8"):
        gather_rows(torch.zeros(T, 12, **bf16), rows)
    with pytest.raises(ValueError, match=r"^silu_mul: h\.shape\[1\] \(2I\) = 24 must be a multiple of 16"):
        silu_mul(torch.zeros(rows.rows, 24, **bf16), rows)
    with pytest.raises(ValueError, match=r"^combine: y\.shape\[1\] = 20 must be a multiple of 8"):
        combine(torch.zeros(rows.rows, 20, **bf16), rows, T, k)
    with pytest.raises(ValueError, match=r"^combine: rows has 10 \(token, slot\) pairs, T·top_k = 4·2 = 8"):
        combine(torch.zeros(rows.rows, 16, **bf16), rows, T - 1, k)


def test_fused_moe_refuses_cpu_tensors_the_empty_batch_too():
    """What T = 1 refuses, T = 0 refuses (moe_spec.contract): CPU tensors, for every T."""
    for T in (3, 0):
        with pytest.raises(ValueError, match="^x: cute_moe runs on a CUDA device"):
            cute_moe.fused_moe(**_small_inputs(T=T).kwargs())


def test_bench_draws_the_shared_weights():
    """bench rotates weight sets drawn by moe_spec.problem.draw_weights (one generator, n sets)."""
    from cute_moe.lab.bench import _weights
    from moe_spec.problem import MoEShape, draw_weights

    shape = MoEShape("tiny", 4, 2, 64, 32, "test")
    g = torch.Generator().manual_seed(3)
    want = [draw_weights(shape, g) for _ in range(2)]
    got = _weights(shape, 2, seed=3, device="cpu")
    assert all(torch.equal(a, b) for gs, ws in zip(got, want) for a, b in zip(gs, ws))
    assert not torch.equal(got[0][0], got[1][0])  # the sets differ (cold L2 when rotated)


# ---- the gated GEMM1: SiLU·up in the epilogue -------------------------------------------------
def _gated_plan_configs():
    """Every gated GEMM1 the bf16 plans of the catalog's three layers pick (rule and forced paths)."""
    import importlib

    from moe_spec.problem import get_shape

    plan = importlib.import_module("cute_moe.plan")
    found = {}
    with pytest.MonkeyPatch.context() as mp:  # the configs the switch would pick, whichever way it stands
        mp.setattr(plan, "GATED_GEMM1", True)
        mp.setattr(plan, "GATHER_IN_PRODUCER", True)
        for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"):
            s = get_shape(spec)
            for options in ({}, {"swap_ab": True}, {"swap_ab": False}):
                for p in cute_moe.plans_for(s.num_experts, s.hidden, s.intermediate, s.top_k, **options):
                    if p.path == "grouped":  # the one launch has no GemmConfig
                        found[p.gemm1] = None
    return list(found)


GATHERED = _gated_plan_configs()  # the plans' GEMM1: gated, and gathering its rows (plan.GATHER_IN_PRODUCER)
GATED = [c.replace(gather_rows=False) for c in GATHERED]  # the same kernels reading X_sorted through TMA


def test_the_bf16_plans_gate_gemm1_when_switched_on_and_separate_does_not():
    assert GATED and all(c.gated for c in GATED)
    # every bucket of both paths: swap-AB 8/16/32/64 tokens, normal 64 (one warpgroup) and 128
    assert {(c.swap_ab, c.tokens_tile) for c in GATED} == {
        (True, 8),
        (True, 16),
        (True, 32),
        (True, 64),
        (False, 64),
        (False, 128),
    }
    assert all(c.smem_bytes() <= SMEM_BUDGET_BYTES and c.stages == max_stages(c) for c in GATED)
    # half the plain weights tile (gate + up): the plain GEMM1's stage bytes, ring and tile count
    for c in GATED:
        plain = choose_config(c.tokens_tile, 28672, 4096, swap_ab=c.swap_ab)
        assert (c.weight_rows, c.stage_bytes, c.stages) == (plain.weights_tile, plain.stage_bytes, plain.stages)
        assert (c.weights_tile, c.consumer_warpgroups) == ((64, 1) if c.swap_ab else (128, c.tokens_tile // 64))
    for quant, fusion in ((None, "separate"), ("fp8_block", "separate")):  # FP8 fused: test_cute_fp8_gated
        for p in cute_moe.plans_for(8, 4096, 14336, 2, quant, fusion=fusion):
            assert not p.gemm1.gated and not p.gemm2.gated
    from cute_moe.unfused import GATED_GEMM1

    p = cute_moe.plan(__import__("moe_spec.validate").validate.MoEDims(T=8, E=8, K=4096, I=14336, top_k=2))
    assert (" silu " in p.describe().split("|")[0]) == GATED_GEMM1 and " silu " not in p.describe().split("|")[1]


def test_gated_stage_carries_both_weight_tiles():
    """A gated stage: the token tile plus the gate and up tiles; the ring shrinks to fit."""
    plain = _cfg(swap_ab=True, tokens_tile=8, weights_tile=128)
    gated = _cfg(swap_ab=True, tokens_tile=8, weights_tile=128, gated=True)
    assert gated.stage_bytes == plain.stage_bytes + 128 * 64 * 2 == (8 + 2 * 128) * 64 * 2
    assert (plain.stages, gated.stages) == (8, 6)
    assert gated.accumulator_registers == 2 * plain.accumulator_registers


@pytest.mark.parametrize("cfg", GATED, ids=_id)
def test_gated_ptx_has_two_accumulator_chains_and_the_silu_epilogue(cfg):
    """Each K step issues the plain kernel's WGMMAs twice (gate chain, up chain: same instruction),
    both weight boxes come through the 4-D weight descriptor (gate/up is a TMA coordinate) on the
    stage's full barrier, and the epilogue computes SiLU(gate)·up once per output register with the
    row kernel's instructions (ex2.approx.ftz for e^(−g), div.rn for the division)."""
    plain_cfg = cfg.replace(gated=False)
    ptx, plain = cute_moe.compile_ptx(cfg), cute_moe.compile_ptx(plain_cfg)
    wgmma = re.findall(_WGMMA, ptx)
    assert set(wgmma) == {f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16.f32.bf16.bf16"} == {mma_instruction(cfg)}

    # WGMMAs per commit group (one K step): tile_k/16 per chain, two chains into two accumulators
    def groups(text):
        return {n for n in (len(re.findall(_WGMMA, g)) for g in text.split("wgmma.commit_group")) if n}

    def accumulators(text):  # the distinct accumulator register lists the WGMMAs write
        return {m for m in re.findall(r"wgmma\.mma_async[^{]*(\{[^}]*\})", text)}

    assert groups(ptx) == {2 * cfg.tile_k // 16} and groups(plain) == {cfg.tile_k // 16}
    assert len(accumulators(ptx)) == 2 * len(accumulators(plain))
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert not re.search(r"cp\.async\.bulk\.tensor\.3d", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert {int(n) for _, n in re.findall(_EXPECT_TX, ptx)} == {cfg.stage_bytes} == {plan_layouts(cfg)["stage_bytes"]}
    per_acc = cfg.accumulator_registers // 2
    for op in ("ex2.approx.ftz.f32", "div.rn.f32"):
        assert len(re.findall(rf"\b{re.escape(op)}\b", ptx)) == per_acc
        assert op not in plain
    stmatrix = set(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x\d(?:\.trans)?\.shared\.b16", ptx))
    assert stmatrix == set(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x\d(?:\.trans)?\.shared\.b16", plain))


def test_gated_epilogue_is_the_row_kernels_formula():
    """The SiLU·up of the epilogue and of the row kernel compile to the same instructions per element
    (negate, × log2 e, ex2.approx.ftz, + 1, div.rn, × up, then cvt.rn to bf16): one formula, one
    rounding (the row kernel's inputs are GEMM1's bf16 H, the epilogue's its fp32 accumulators)."""

    def chain(ptx):  # the float ops from the first negate to the bf16 conversion, as a sequence
        start, end = ptx.index("neg.f32"), ptx.index("cvt.rn.bf16x2.f32")
        ops = re.findall(
            r"^\s*(neg\.f32|mul\.f32|ex2\.approx\.ftz\.f32|add\.f32|div\.rn\.f32)\s+[^;]*?(0f[0-9A-F]{8})?;",
            ptx[start : end + 1],
            flags=re.M,
        )
        return [(op, const) for op, const in ops]

    row = cute_moe.compile_row_kernels(132, keep_ptx=True)["silu_mul"].__ptx__
    gated = cute_moe.compile_ptx(_cfg(swap_ab=True, tokens_tile=8, weights_tile=128, gated=True))
    one_element = [
        ("neg.f32", ""),
        ("mul.f32", "0f3FB8AA3B"),
        ("ex2.approx.ftz.f32", ""),
        ("add.f32", "0f3F800000"),
        ("div.rn.f32", ""),
        ("mul.f32", ""),
    ]  # −g, ·log2 e, 2^x, +1, g / (…), · up
    # 8 elements per row-kernel vector, 4 accumulator registers per thread in a 128×8 swap-AB tile
    assert Counter(chain(row)) == Counter(one_element * 8)
    assert Counter(chain(gated)) == Counter(one_element * 4)


@pytest.mark.parametrize("cfg", [GATED[0], GATED[-1]], ids=_id)
def test_gated_kernel_roles_per_thread(cfg):
    """test_cute_store's per-thread walk of the PTX on a gated kernel: thread 0 alone issues every
    TMA load (the gate and up boxes included) and announces the stage's bytes, one consumer thread
    stores, every consumer thread runs the SiLU epilogue."""
    from test_cute_store import LOAD, STORE, Ptx, _threads_reaching

    ptx = Ptx(cute_moe.compile_ptx(cfg))
    loads = _threads_reaching(ptx, cfg.threads, LOAD)
    assert len([i for i in loads if ".4d." in ptx.lines[i]]) >= 2  # the gate copy and the up copy
    assert set().union(*loads.values()) == {0}
    assert set().union(*_threads_reaching(ptx, cfg.threads, re.compile(r"mbarrier\.arrive\.expect_tx")).values()) == {0}
    assert len(set().union(*_threads_reaching(ptx, cfg.threads, STORE).values())) == 1
    silu = _threads_reaching(ptx, cfg.threads, re.compile(r"ex2\.approx\.ftz\.f32"))
    assert all(t == set(range(128, cfg.threads)) for t in silu.values())


def test_gated_grouped_gemm_checks_w1_before_any_launch():
    """A gated GEMM takes W1 [E, 2I, K]: an odd row count is refused on the host, naming w."""
    from cute_moe.moe import grouped_gemm

    ids = torch.zeros(4, 1, dtype=torch.int32)
    rows = sort_rows(ids, torch.ones(4, 1), 2, 8)
    cfg = _cfg(swap_ab=True, tokens_tile=8, weights_tile=128, gated=True)
    x = torch.zeros(rows.rows, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^grouped_gemm: a gated config takes w = W1 \[E, 2I, K\].*w has 33 rows"):
        grouped_gemm(x, torch.zeros(2, 33, 64, dtype=torch.bfloat16), rows, cfg)
    with pytest.raises(ValueError, match=r"^grouped_gemm: N_out=12 must be a positive multiple of 8"):
        grouped_gemm(x, torch.zeros(2, 24, 64, dtype=torch.bfloat16), rows, cfg)  # I = 12


# ---- the gathering GEMM1: token rows by index from x, cp.async in the producer ----------------------
def test_the_bf16_plans_gather_in_gemm1_only(monkeypatch):
    """With both switches on (cute_moe.unfused), every bf16 fused plan's GEMM1 (gated) reads x by token
    index; GEMM2, FP8 and the unfused pipeline keep their TMA loads; a K that is no multiple of tile_k
    is not gathered."""
    import importlib

    from cute_moe.plan import check_options
    from moe_spec.validate import MoEDims

    plan_module = importlib.import_module("cute_moe.plan")
    monkeypatch.setattr(plan_module, "GATED_GEMM1", True)
    monkeypatch.setattr(plan_module, "GATHER_IN_PRODUCER", True)
    assert GATHERED and all(c.gather_rows and c.gated for c in GATHERED)
    for spec_dims in ((8, 4096, 14336, 2), (128, 2048, 768, 8)):
        for p in cute_moe.plans_for(*spec_dims):
            if p.path == "decode":  # the one launch reads x by token index itself (cute_moe.decode)
                continue
            assert p.gemm1.gather_rows and not p.gemm2.gather_rows
            assert " gather" in p.describe().split("|")[0] and " gather" not in p.describe().split("|")[1]
        for quant, fusion in ((None, "separate"), ("fp8_tensor", "fused"), ("fp8_block", "separate")):
            for p in cute_moe.plans_for(*spec_dims, quant, fusion=fusion):
                assert not p.gemm1.gather_rows and not p.gemm2.gather_rows
    odd = cute_moe.plan(MoEDims(T=8, E=8, K=4104, I=512, top_k=2))  # 4104 = 64·64 + 8
    assert odd.gemm1.gated and not odd.gemm1.gather_rows
    g1 = GATHERED[-1]
    with pytest.raises(ValueError, match=r"configs\[1\]: gated and gather_rows"):
        check_options(4096, 512, configs=(g1, GemmConfig(row_scale=True, gather_rows=True)))
    with pytest.raises(ValueError, match=r"configs\[0\]: gather_rows needs x: hidden size K = 4104"):
        check_options(4104, 512, configs=(g1, GemmConfig(row_scale=True)))


@pytest.mark.parametrize(
    "kw",
    [
        dict(quant="fp8_tensor", dtype="float8_e4m3fn", tile_k=128),
        dict(tile_k=48),
        dict(swap_ab=True, tokens_tile=48, weights_tile=128, tile_k=32),
    ],
)
def test_gather_rows_config_refuses_what_it_cannot_copy(kw):
    """FP8 (x is quantized first), a row of 6 vectors (does not divide 128 threads), 48 rows with
    32 rows per pass: each refused by name when the config is built."""
    with pytest.raises(ValueError, match="gather_rows=True"):
        GemmConfig(gather_rows=True, **kw)
    GemmConfig(**kw)  # the same config without gathering is valid


_CP_ASYNC = r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 16, 16;"


@pytest.mark.parametrize("cfg", GATHERED, ids=_id)
def test_gathering_ptx_copies_rows_by_cp_async_and_keeps_the_wgmma_chain(cfg):
    """The gathering GEMM1 loads no token tile by TMA (no 2-D tensor load: only the 4-D weight
    boxes), copies 16-byte vectors by cp.async, from every producer warp, each arriving on the full
    barrier through cp.async.mbarrier.arrive.noinc; the barriers count 1 + 128 arrivals and the
    weight bytes only; the consumers fence the proxies after each wait; the WGMMAs are the TMA twin's."""
    from cute_moe.gemm_parts import gather_geometry

    twin = cfg.replace(gather_rows=False)
    ptx, tma = cute_moe.compile_ptx(cfg), cute_moe.compile_ptx(twin)
    assert not re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", tma)
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert re.search(_CP_ASYNC, ptx) and not re.search(r"cp\.async\.c[ag]\.shared", tma)
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx
    init = set(re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^\]]+\], (%r\d+|\d+);", ptx))
    counts = {
        int(re.search(rf"mov\.b32\s+{re.escape(r)}, (\d+);", ptx).group(1)) if r.startswith("%") else int(r)
        for r in init
    }
    assert 1 + 128 in counts and 1 not in counts  # full barriers: the TMA lane and 128 cp.async arrivals
    token_bytes = cfg.tokens_tile * cfg.tile_k * cfg.element_bytes
    assert (
        {int(n) for _, n in re.findall(_EXPECT_TX, ptx)}
        == {cfg.stage_bytes - token_bytes}
        == {plan_layouts(cfg)["stage_bytes"]}
    )
    vecs, rows, passes = gather_geometry(cfg)
    assert rows * passes == cfg.tokens_tile and vecs * 8 == cfg.tile_k
    assert len(re.findall(r"fence\.proxy\.async", ptx)) > len(re.findall(r"fence\.proxy\.async", tma))
    assert re.findall(_WGMMA, ptx) and Counter(re.findall(_WGMMA, ptx)) == Counter(re.findall(_WGMMA, tma))
    assert ptx.count("wgmma.commit_group") == tma.count("wgmma.commit_group")


def test_gathering_kernel_compiles_for_int32_and_int64_indices():
    """The token index dtype is part of the compiled signature: one kernel per dtype, a clear error else."""
    cfg = GATHERED[0]
    a, b = (cute_moe.compile_gemm(cfg, index_dtype=d) for d in ("int64", "int32"))
    assert a is not b and a is cute_moe.compile_gemm(cfg)
    with pytest.raises(ValueError, match="index_dtype='int16'"):
        cute_moe.compile_gemm(cfg, index_dtype="int16")

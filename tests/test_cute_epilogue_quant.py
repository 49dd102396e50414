"""The FP8 intermediate quantized in the gated GEMM1's epilogue (``GemmConfig.epilogue_quant``,
:mod:`cute_moe.epilogue_quant`, the plan's rule :func:`cute_moe.plan.epilogue_quant`).

CPU: the configs' limits, the plan's rule (static / block / amax; swap-AB amax only; off under ``fusion="separate"``
and with ``EPILOGUE_QUANT = False``), the register layout the row reductions read (every consumer thread
against the PTX ISA's accumulator fragment), the PTX of every variant at a Mixtral-like and a Qwen3-like
layer (IEEE divisions and the saturating E4M3 conversion, the quad's butterfly shuffles, the atomics and
where they sit), the E4M3 staging map, the launches of a warm call and the workspace, the warm-up.

GPU (``-m gpu``): GEMM1 with the fused epilogue against GEMM1 without it followed by today's amax and
quantize launches — the E4M3 codes, the scales and the amax bit for bit, whatever the padding rows of the
sorted order hold — and the layer bit for bit against the layer with ``EPILOGUE_QUANT = False`` and
within the W8A8 oracle's bound, each format at both layers and T = 1, 128, 4096.
"""

import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cute_moe = pytest.importorskip("cute_moe")

import cute_moe.limits as limits_module  # noqa: E402
from cute_moe.config import GemmConfig, max_stages  # noqa: E402
from cute_moe.limits import FP8_TILE_K  # noqa: E402
from moe_spec.problem import MoEShape  # noqa: E402
from moe_spec.validate import BAD_A2_SCALE, MoEDims  # noqa: E402

plan_module = importlib.import_module("cute_moe.plan")  # the module (cute_moe.plan is also the function)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

FORMATS = ("fp8_tensor", "fp8_channel", "fp8_block")
#: (format, static scales): the four variants of the brief — static, and the three dynamic formats.
VARIANTS = [("fp8_tensor", True), ("fp8_tensor", False), ("fp8_channel", False), ("fp8_block", False)]
MIXTRAL = MoEShape("mixtral-like", 8, 2, 4096, 14336, "test: Mixtral-8x7B's sizes")
QWEN3 = MoEShape("qwen3-like", 128, 8, 2048, 768, "test: Qwen3-30B-A3B's sizes")
SHAPES = {"mixtral": MIXTRAL, "qwen3": QWEN3}
BOTH = ("swap_ab", "normal")


@pytest.fixture(autouse=True)
def gated_on(monkeypatch):
    """GEMM1 gated on both paths and the fused epilogue on (the plan's defaults, set here so these tests hold
    whatever the defaults become), the swap-AB epilogue amax off (tests that take it set it) and x quantized
    on its own (the launch lists below name x's steps), and the per-signature calls of cute_moe.moe dropped
    before and after."""
    from cute_moe.moe import forget_calls

    forget_calls()
    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", BOTH)
    monkeypatch.setattr(plan_module, "EPILOGUE_QUANT", True)
    monkeypatch.setattr(plan_module, "SWAP_AB_EPILOGUE_AMAX", False)
    monkeypatch.setattr(plan_module, "GATHER_QUANT", False)
    yield
    monkeypatch.undo()
    forget_calls()


def _dims(shape, T):
    return MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)


def _gated(quant, epilogue_quant=None, **kw):
    cfg = GemmConfig(dtype="float8_e4m3fn", quant=quant, tile_k=FP8_TILE_K, out_dtype="float32", gated=True, **kw)
    return cfg.replace(stages=max_stages(cfg), epilogue_quant=epilogue_quant)


@pytest.fixture
def wide_gated(monkeypatch):
    """The register bound raised so a gated FP8 tile can be 128 features wide — the only tiles the "block"
    variant takes (whole 128-column groups); no plan picks one (four accumulators: 256 registers a thread)."""
    monkeypatch.setattr(limits_module, "TWO_ACCUMULATOR_REGISTERS", 256)


def _block_cfg(tokens_tile=128):
    return _gated(
        "fp8_block", "block", tokens_tile=tokens_tile, weights_tile=128, consumer_warpgroups=tokens_tile // 64
    )


# ---- the configs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(quant="fp8_channel", epilogue_quant="static"), r"^epilogue_quant='static' with quant='fp8_channel'"),
        (dict(quant="fp8_tensor", epilogue_quant="block"), r"^epilogue_quant='block' with quant='fp8_tensor'"),
        (dict(quant="fp8_block", epilogue_quant="block"), r"^epilogue_quant='block' with weights_tile=64: .*128"),
        (
            dict(quant="fp8_tensor", epilogue_quant="static", swap_ab=True, tokens_tile=8, consumer_warpgroups=1),
            r"^epilogue_quant='static' with swap_ab=True: under swap-AB the epilogue takes the amax only",
        ),
        (dict(quant="fp8_tensor", epilogue_quant="amax", gated=False), r"^epilogue_quant='amax' with gated=False"),
    ],
)
def test_epilogue_quant_limits_are_named(kw, needle):
    base = dict(
        dtype="float8_e4m3fn", tile_k=FP8_TILE_K, out_dtype="float32", gated=True, tokens_tile=128, weights_tile=64
    )
    with pytest.raises(ValueError, match=needle):
        GemmConfig(**{**base, **kw})


def test_the_stored_dtype_follows_the_variant():
    """static / block store E4M3 (1 byte: smaller staging buffers, 16-element rows), amax and None fp32."""
    for eq, c_dtype in ((None, "float32"), ("amax", "float32"), ("static", "float8_e4m3fn")):
        cfg = _gated("fp8_tensor", eq, tokens_tile=128, weights_tile=64)
        assert cfg.c_dtype == c_dtype and cfg.out_dtype == "float32"
        assert cfg.out_align == 16 // cfg.c_bytes
        assert cfg.smem_bytes() - cfg.stages * cfg.stage_bytes - 1024 == cfg.epi_stages * 128 * 32 * cfg.c_bytes


# ---- the plan's rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("swap_amax", (False, True), ids=("swap-today", "swap-amax"))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("quant, static", VARIANTS, ids=lambda v: str(v))
def test_the_plan_picks_the_variant(shape, quant, static, swap_amax, monkeypatch):
    """Normal path (prefill): static with static scales, else amax (fp8_block too: its gated tiles are 64
    features, half a scale group); swap-AB (decode): amax with dynamic scales while SWAP_AB_EPILOGUE_AMAX,
    else today's path."""
    monkeypatch.setattr(plan_module, "SWAP_AB_EPILOGUE_AMAX", swap_amax)
    for T in (1, 128, 4096):
        p = cute_moe.plan(_dims(SHAPES[shape], T), quant, static=static)
        want = ("amax" if swap_amax and not static else None) if p.gemm1.swap_ab else ("static" if static else "amax")
        assert p.gemm1.gated and p.gemm1.epilogue_quant == want and p.gemm2.epilogue_quant is None
        assert plan_module.epilogue_quant(p.gemm1.replace(epilogue_quant=None), static) == want
        assert (f" epi:{want} " in p.describe().split("|")[0]) == (want is not None)
        forced = cute_moe.plan(_dims(SHAPES[shape], T), quant, static=static, swap_ab=False).gemm1
        assert forced.epilogue_quant == ("static" if static else "amax")
    assert cute_moe.plan(_dims(SHAPES[shape], 4096), quant, static=static).gemm1.swap_ab is False


def test_block_is_the_rule_for_whole_scale_groups(wide_gated):
    assert plan_module.epilogue_quant(_block_cfg().replace(epilogue_quant=None)) == "block"
    assert plan_module.epilogue_quant(_gated("fp8_block", tokens_tile=128, weights_tile=64)) == "amax"


def test_the_rule_keeps_todays_path(monkeypatch):
    """Off under fusion='separate', for bf16, with the gated GEMM1 off, and with EPILOGUE_QUANT = False
    (the switch tests and benches use to force today's path)."""
    dims = _dims(MIXTRAL, 4096)
    assert cute_moe.plan(dims, "fp8_tensor", fusion="separate").gemm1.epilogue_quant is None
    assert cute_moe.plan(dims).gemm1.epilogue_quant is None
    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", ())
    assert cute_moe.plan(dims, "fp8_tensor", static=True).gemm1.epilogue_quant is None
    monkeypatch.setattr(plan_module, "GATED_FP8_GEMM1", BOTH)
    monkeypatch.setattr(plan_module, "EPILOGUE_QUANT", False)
    for quant, static in VARIANTS:
        g1 = cute_moe.plan(dims, quant, static=static).gemm1
        assert g1.gated and g1.epilogue_quant is None


def test_given_configs_must_match_the_scales():
    dims = _dims(QWEN3, 4096)
    dynamic, static = cute_moe.plan(dims, "fp8_tensor"), cute_moe.plan(dims, "fp8_tensor", static=True)
    assert cute_moe.plan(dims, "fp8_tensor", configs=(dynamic.gemm1, dynamic.gemm2)) == dynamic
    assert cute_moe.plan(dims, "fp8_tensor", static=True, configs=(static.gemm1, static.gemm2)) == static
    today = (static.gemm1.replace(epilogue_quant=None), static.gemm2)  # None: today's path, with either
    assert cute_moe.plan(dims, "fp8_tensor", static=True, configs=today).gemm1.epilogue_quant is None
    with pytest.raises(ValueError, match=r"^configs\[0\]: epilogue_quant='amax' quantizes with dynamic scales"):
        cute_moe.plan(dims, "fp8_tensor", static=True, configs=(dynamic.gemm1, dynamic.gemm2))
    with pytest.raises(ValueError, match=r"^configs\[0\]: epilogue_quant='static' needs static activation"):
        cute_moe.plan(dims, "fp8_tensor", configs=(static.gemm1, static.gemm2))
    with pytest.raises(ValueError, match=r"^static: static activation scales need quant='fp8_tensor'"):
        cute_moe.plan(dims, "fp8_block", static=True)
    with pytest.raises(TypeError, match=r"^static: expected a bool"):
        cute_moe.plan(dims, "fp8_tensor", static=1)
    # the unfused pipeline turns a given fused GEMM1 back into its plain GEMM1
    assert (
        cute_moe.plan(dims, "fp8_tensor", configs=(dynamic.gemm1, dynamic.gemm2), fusion="separate").gemm1
        == (plan_module.separate_configs(dynamic.gemm1.replace(gated=False, epilogue_quant=None), dynamic.gemm2)[0])
    )


# ---- which lanes share a row -------------------------------------------------------------------------
FRAGMENT_CFGS = [
    dict(tokens_tile=128, weights_tile=64),
    dict(tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
]


def _fragment_and_partition(cfg):
    import cutlass
    import cutlass.cute as cute

    from cute_moe.epilogue_quant import row_fragment
    from cute_moe.gemm_plan import KernelPlan

    out = {}

    @cute.jit
    def probe():
        mma = KernelPlan(cfg).tiled_mma
        out["frag"] = row_fragment(cfg, mma)
        identity = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
        coords = []
        for t in cutlass.range_constexpr(128 * cfg.tile_warpgroups):
            c = mma.get_slice(t).partition_C(identity)
            coords.append([tuple(int(v) for v in c[i]) for i in range(cute.size(c))])
        out["coords"] = coords

    probe()
    return out["frag"], out["coords"]


@pytest.mark.parametrize("kw", FRAGMENT_CFGS + ["wide"], ids=str)
def test_a_row_lies_in_the_four_lanes_of_a_quad(kw, request):
    """The layout the reductions read (``row_fragment``, from the kernel's tiled MMA) is the PTX ISA's D
    fragment of ``wgmma … m64nNk32`` (Register Fragments, the accumulator figure of m64nNk16/m64nNk32;
    notes/hopper.md §3): thread t = 128·wg + 32·warp + lane holds row 64·wg + 16·warp + lane/4 in its
    registers i with (i/2) mod 2 = 0 and that row + 8 in the others, columns 8·(i/4) + 2·(lane mod 4) +
    (i mod 2) — so a row's values sit in lanes 4q … 4q+3 and its butterfly offsets are 1 and 2."""
    if kw == "wide":
        request.getfixturevalue("wide_gated")
        cfg = _block_cfg()
    else:
        cfg = _gated("fp8_block", "amax", **kw)
    frag, coords = _fragment_and_partition(cfg)
    assert frag.offsets == (1, 2) and frag.writer_mask == 3
    regs = len(coords[0])
    assert [sorted(r) for r, _ in frag.cells] == [
        [i for i in range(regs) if (i // 2) % 2 == half] for half in (0, 1)
    ] and {g for _, g in frag.cells} == {0}
    assert coords == _formula(128 * cfg.tile_warpgroups, regs)


def _formula(threads, regs):
    """The PTX ISA's m64nNk32 D fragment, as coordinates[thread][register] (notes/hopper.md §3)."""
    return [
        [
            (
                64 * (t // 128) + 16 * (t % 128 // 32) + t % 32 // 4 + 8 * ((i // 2) % 2),
                8 * (i // 4) + 2 * (t % 4) + i % 2,
            )
            for i in range(regs)
        ]
        for t in range(threads)
    ]


@pytest.mark.parametrize("tokens_tile", (8, 16, 64))
def test_a_swap_ab_token_lies_in_one_lane_residue_of_every_warp(tokens_tile):
    """Under swap-AB the token is the D fragment's column, 8·(i/4) + 2·(lane mod 4) + (i mod 2): a token's
    values lie in the lanes of one residue lane mod 4 of every warp, so ``row_fragment`` reduces over the
    lane offsets 4, 8 and 16 (lanes 0–3 write, one atomic per warp) and keys its cells by the token."""
    cfg = _gated("fp8_channel", "amax", swap_ab=True, tokens_tile=tokens_tile, weights_tile=64, consumer_warpgroups=1)
    frag, coords = _fragment_and_partition(cfg)
    assert coords == _formula(128, len(coords[0]))  # the same WGMMA fragment; only the row axis differs
    assert frag.row_axis == 1 and frag.offsets == (4, 8, 16) and frag.writer_mask == 28
    tokens = sorted({coords[0][r][1] for regs, _ in frag.cells for r in regs})
    assert len(frag.cells) == len(tokens) == tokens_tile // 4  # every token column of thread 0 once
    for regs, g in frag.cells:
        assert g == 0 and len({coords[0][r][1] for r in regs}) == 1  # one token per cell, 64 features: one group


def test_the_derivation_refuses_a_layout_it_cannot_reduce():
    """``derive_fragment`` checks what the reduction relies on, so it can fail: the formula's layout
    passes; one register moved to another row, or rows shared across warps, are refused."""
    from cute_moe.epilogue_quant import derive_fragment

    good = _formula(128, 32)
    assert derive_fragment(good).offsets == (1, 2)
    moved = [list(r) for r in good]
    moved[1][5] = (moved[1][5][0] + 1, moved[1][5][1])  # thread 1, register 5: a row of its own
    with pytest.raises(ValueError, match="^thread 1: its accumulator rows are not thread 0's shifted"):
        derive_fragment(moved)
    shared = [[(m % 16, n) for m, n in r] for r in good]  # every warp on the same 16 rows
    with pytest.raises(ValueError, match="^thread 0: the threads sharing its rows are not lanes"):
        derive_fragment(shared)
    assert derive_fragment(shared, across_warps=True).offsets == (1, 2)  # each warp adds its own share
    transposed = [[(n, m) for m, n in r] for r in good]  # swap-AB: the token is the column
    assert derive_fragment(transposed, across_warps=True).offsets == (4, 8, 16)
    with pytest.raises(ValueError, match="^thread 0: the threads sharing its rows are not lanes"):
        derive_fragment(transposed)


# ---- the PTX of every variant ------------------------------------------------------------------------
def _plan_gemm1(shape, quant, static, T=4096, **options):
    return cute_moe.plan(_dims(SHAPES[shape], T), quant, static=static, **options).gemm1


CASES = [(s, q, st, T) for s in SHAPES for q, st in VARIANTS for T in (1, 4096)]


def _count(p, pattern):
    return len(re.findall(pattern, p))


def _back_branches(p):
    labels = {m.group(1): m.start() for m in re.finditer(r"^\s*(\$L__BB\w+):", p, re.M)}
    return [m.start() for m in re.finditer(r"bra(?:\.uni)?\s+(\$L__BB\w+);", p) if labels[m.group(1)] < m.start()]


def _common(p, cfg):
    """What every variant keeps: the gated FP8 GEMM1 (SiLU·up once per register), IEEE divisions only,
    NaN-keeping maxima only, and the tile stored by TMA from its staging buffer."""
    per_acc = cfg.accumulator_registers // 4
    assert _count(p, r"\bex2\.approx\.ftz\.f32\b") == per_acc
    assert not re.search(r"div\.(approx|full)|rcp\.", p)  # never a reciprocal multiply
    assert not re.search(r"\bmax\.f32", p)  # a NaN-dropping maximum would lose a NaN's group
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", p)
    return per_acc


@pytest.mark.parametrize(
    "shape, quant, static, T", CASES, ids=[f"{s}-{q}{'-static' if st else ''}-T{T}" for s, q, st, T in CASES]
)
def test_each_variant_compiles_to_what_it_needs(shape, quant, static, T):
    """The plan's GEMM1 (forced onto the normal path at T = 1) compiled for sm_90a."""
    cfg = _plan_gemm1(shape, quant, static, T, swap_ab=False)
    p = cute_moe.compile_ptx(cfg)
    assert ".target sm_90a" in p
    per_acc = _common(p, cfg)
    rows = 2  # a thread's token rows: lane/4 and lane/4 + 8 of its warp's 16
    bfly = re.findall(r"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, (\d+), 31, -1;", p)
    if static:
        assert cfg.epilogue_quant == "static" and cfg.c_dtype == "float8_e4m3fn"
        assert _count(p, r"\bdiv\.rn\.f32\b") == 2 * per_acc  # SiLU's and a / s
        assert _count(p, r"cvt\.rn\.satfinite\.e4m3x2\.f32") == per_acc // 2  # two codes per conversion
        assert _count(p, r"st\.shared\.b16") == per_acc // 2  # two E4M3 codes per store
        assert re.findall(r"atom\.global\.or\.b32\s+%r\d+, \[%rd\d+\], (\d+);", p) == [str(BAD_A2_SCALE)]
        assert not bfly and "atom.global.max" not in p and "st.global" not in p
        return
    assert cfg.epilogue_quant == "amax" and cfg.c_dtype == "float32"
    assert _count(p, r"\bdiv\.rn\.f32\b") == per_acc and "cvt.rn.satfinite" not in p  # fp32 A, as today
    atomics = re.findall(r"atom\.global\.max\.s32", p)
    if quant == "fp8_tensor":  # each lane's running maximum; one warp reduction and one atomic, after the tiles
        assert bfly == ["16", "8", "4", "2", "1"] and len(atomics) == 1
        assert p.index("atom.global.max.s32") > max(_back_branches(p))
    else:  # per row and tile: the quad's two shuffles, one atomic
        assert bfly == ["1", "2"] * rows and len(atomics) == rows
    assert _count(p, r"max\.NaN\.f32") >= per_acc


def test_the_block_variant_compiles_to_what_it_needs(wide_gated):
    """fp8_block with whole groups (128 × 128, at the raised bound): per (row, group) the lane maximum, the
    quad's two shuffles, ``max(amax, 1e-12) / 448`` by ``div.rn``, every value divided by its scale and
    converted saturating to E4M3, one scale store per row (lane 0 of the quad), no atomic."""
    cfg = _block_cfg()
    p = cute_moe.compile_ptx(cfg)
    per_acc = _common(p, cfg)
    rows = 2
    assert re.findall(r"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, (\d+), 31, -1;", p) == ["1", "2"] * rows
    assert _count(p, r"div\.rn\.f32\s+%r\d+, %r\d+, 0f43E00000;") == rows  # the scale: / 448.0
    assert _count(p, r"\bdiv\.rn\.f32\b") == 2 * per_acc + rows
    assert _count(p, r"cvt\.rn\.satfinite\.e4m3x2\.f32") == per_acc // 2
    assert _count(p, r"st\.global\.b32") == rows and "atom.global" not in p
    assert _count(p, r"max\.NaN\.f32") == per_acc + 2 * rows


@pytest.mark.parametrize("quant", ("fp8_tensor", "fp8_channel", "fp8_block"))
def test_the_swap_ab_amax_compiles_to_what_it_needs(quant, monkeypatch):
    """The plan's swap-AB GEMM1 at decode with ``SWAP_AB_EPILOGUE_AMAX``: "amax", fp32 A as today; under
    fp8_tensor each lane's running maximum and one warp reduction and atomic after the tiles, else per token
    column of a thread the shuffles over lanes 4, 8, 16 apart and one atomic (lanes 0–3 write)."""
    monkeypatch.setattr(plan_module, "SWAP_AB_EPILOGUE_AMAX", True)
    cfg = _plan_gemm1("qwen3", quant, False, 8)
    assert cfg.swap_ab and cfg.epilogue_quant == "amax" and cfg.c_dtype == "float32"
    p = cute_moe.compile_ptx(cfg)
    per_acc = _common(p, cfg)
    assert _count(p, r"\bdiv\.rn\.f32\b") == per_acc and "cvt.rn.satfinite" not in p
    bfly = re.findall(r"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, (\d+), 31, -1;", p)
    atomics = re.findall(r"atom\.global\.max\.s32", p)
    if quant == "fp8_tensor":
        assert bfly == ["16", "8", "4", "2", "1"] and len(atomics) == 1
        assert p.index("atom.global.max.s32") > max(_back_branches(p))
    else:
        columns = cfg.tokens_tile // 4  # a thread's token columns: 2 of every 8
        assert bfly == ["4", "8", "16"] * columns and len(atomics) == columns
    assert _count(p, r"max\.NaN\.f32") >= per_acc
    plain = cute_moe.compile_ptx(cfg.replace(epilogue_quant=None))
    for pattern in (r"wgmma\.mma_async[^;]*;", r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global[^;]*;"):
        assert len(re.findall(pattern, p)) == len(re.findall(pattern, plain))


def test_configs_without_the_variant_compile_as_before():
    """epilogue_quant=None is today's kernel: no shuffle, no atomic, no E4M3 conversion; a fused variant
    adds to the same main loop (the WGMMAs and the TMA loads are the same)."""
    plain = _gated("fp8_channel", None, tokens_tile=128, weights_tile=64)
    fused = plain.replace(epilogue_quant="amax")
    p, q = cute_moe.compile_ptx(plain), cute_moe.compile_ptx(fused)
    assert "shfl.sync.bfly" not in p and "atom.global" not in p and "cvt.rn.satfinite" not in p
    for pattern in (r"wgmma\.mma_async[^;]*;", r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global[^;]*;"):
        assert len(re.findall(pattern, p)) == len(re.findall(pattern, q))


def test_the_e4m3_staging_buffer_holds_every_register_at_its_coordinate():
    """The universal register → shared-memory copy of the E4M3 tile over stmatrix's partition: every
    accumulator register lands on its own (m, n) of the staging buffer (as the fp32 epilogue's)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_cute_fp8_cpu import _r2s_map

    for kw in FRAGMENT_CFGS:
        cfg = _gated("fp8_tensor", "static", **kw)
        pairs = _r2s_map(cfg)
        assert len(pairs) == cfg.tile_m * cfg.tile_n and all(acc == smem for acc, smem in pairs)
        assert {smem for _, smem in pairs} == {(m, n) for m in range(cfg.tile_m) for n in range(cfg.tile_n)}


# ---- the launches of a warm call, the workspace, the warm-up ---------------------------------------
LAYER = MoEShape("eq-launches", 8, 2, 128, 128, "test: Mixtral-like routing, I one scale group")
PREFILL = 1100  # 275 pairs per expert: the normal path


def _static_kwargs(kw):
    from moe_spec.oracle import calibrate_static_scales

    a1, a2 = calibrate_static_scales(**kw)
    return dict(kw, a1_scale=a1, a2_scale=a2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "forced-off"])
@pytest.mark.parametrize("quant, static", VARIANTS, ids=lambda v: str(v))
def test_the_launches_of_a_warm_call(quant, static, fused, monkeypatch):
    """Fused: static — no quantize launch for the intermediate; dynamic — its amax launch gone, the
    quantize launch left.  EPILOGUE_QUANT = False: today's launches."""
    from cute_moe.lab.bench_align import gpu_stand_in, launches_per_call
    from moe_spec.problem import make_inputs

    monkeypatch.setattr(plan_module, "EPILOGUE_QUANT", fused)
    kw = make_inputs(LAYER, PREFILL, quant, seed=0).kwargs()
    if static:
        kw = _static_kwargs(kw)
    with gpu_stand_in() as (fused_moe, launches):
        cute, _, _ = launches_per_call(fused_moe, launches, kw)
    if static:
        a = [] if fused else ["a_quantize_static"]
        layer = ["x_quantize_static", "gather", "GroupedGemm", *a, "GroupedGemm", "combine"]
    else:
        a = ["a_quantize"] if fused else ["a_amax", "a_quantize"]
        layer = ["x_amax", "x_quantize", "gather", "GroupedGemm", *a, "GroupedGemm", "combine"]
    assert cute == ["count", "place"] + layer, cute


@pytest.mark.parametrize("quant, static", VARIANTS, ids=lambda v: str(v))
def test_the_workspace_drops_what_the_epilogue_makes_unneeded(quant, static):
    """static: no fp32 intermediate at all (GEMM1 writes aq); amax: the fp32 [M_pad, I] it still writes."""
    from cute_moe.moe import _buffers, _Call

    dims = _dims(LAYER, PREFILL)
    p = cute_moe.plan(dims, quant, static=static)
    ws = _buffers(_Call(p, dims, torch.device("cpu"), torch.int32, static))
    assert ws["aq"].dtype == torch.float8_e4m3fn and ws["aq"].shape[1] == LAYER.intermediate
    if static:
        assert "h" not in ws
    else:
        assert ws["h"].dtype == torch.float32 and ws["h"].shape[1] == LAYER.intermediate
        assert ws["a_amax"] is not None


@pytest.mark.parametrize("swap_amax", [False, True], ids=["swap-today", "swap-amax"])
@pytest.mark.parametrize("static", [False, True])
def test_the_warmup_compiles_the_variants_of_the_layer(static, swap_amax, monkeypatch):
    monkeypatch.setattr(plan_module, "SWAP_AB_EPILOGUE_AMAX", swap_amax)
    quant = "fp8_tensor"
    report = cute_moe.warmup(8, 256, 128, 2, quant, max_tokens=4096, device="cpu", dry_run=True, static=static)
    want = "static" if static else "amax"
    assert any(f"epi:{want}" in step.what for step in report.steps)
    assert any(f"epi:{want}" in p for p in report.plans)
    swap = [step.what for step in report.steps if "swap-AB" in step.what and " silu" in step.what]
    assert swap and all(("epi:amax" in w) == (swap_amax and not static) for w in swap), swap


# ---- GPU -----------------------------------------------------------------------------------------
TOL_ORACLE = 1e-2  # the W8A8 oracle: same quantization (tests/test_cute_fp8_gpu.py)


def _bits(t):
    return t.view(torch.uint8)


def _gemm1_case(cfg, T, shape, static, seed=0):
    """GEMM1 ``cfg`` (a fused variant) and its twin without the epilogue step, on one routing of ``T``
    tokens whose padding rows hold NaN in the sorted x: returns the fused output and scales, today's
    (the twin's fp32 output → ``gated_amax`` → ``quantize_intermediate`` / ``StaticQuantizeRows``), the
    rows and the amaxes."""
    from cute_moe.moe import grouped_gemm, sort_rows
    from cute_moe.moe_fp8 import gated_amax, quantize_intermediate, sorted_token_scales
    from moe_spec.problem import make_inputs
    from moe_spec.quant import activation_scale_shape, quantize_activation

    quant = cfg.quant
    kw = make_inputs(shape, T, quant, seed=seed, device="cuda").kwargs()
    E, I = shape.num_experts, shape.intermediate  # noqa: E741
    rows = sort_rows(kw["topk_ids"], kw["topk_weights"], E, cfg.tokens_tile)
    xq, xs = quantize_activation(kw["x"], quant)
    x_sorted = _bits(xq)[rows.token_of_row].view(torch.float8_e4m3fn)
    real = torch.zeros(rows.rows, dtype=torch.bool, device="cuda").index_fill_(0, rows.row_of_pair, True)
    _bits(x_sorted)[~real] = 0x7F  # E4M3 NaN in the padding rows: nothing of them may reach a scale or amax
    x_scale = sorted_token_scales(xs, rows.token_of_row, quant)
    h = grouped_gemm(
        x_sorted, kw["w1"], rows, cfg.replace(epilogue_quant=None), x_scale=x_scale, w_scale=kw["w1_scale"]
    )
    n = int(torch.tensor(activation_scale_shape(quant, rows.rows, I)).prod())
    out = dict(rows=rows, real=real, h=h)
    if cfg.epilogue_quant == "static":
        s = h[real].abs().amax().view(1) / (2 * 448)  # half the range's scale: the largest values saturate
        word = torch.zeros(1, dtype=torch.int32, device="cuda")
        out["aq"] = grouped_gemm(
            x_sorted, kw["w1"], rows, cfg, x_scale=x_scale, w_scale=kw["w1_scale"], epilogue=(s, word)
        )
        kernels = cute_moe.compile_quant_kernels("fp8_tensor", static=True)
        today, today_word = torch.empty_like(out["aq"]), torch.zeros_like(word)
        kernels["a_quantize_static"](h, s, today, today_word, rows.alignment.num_padded)
        out.update(today=today, word=word, today_word=today_word)
    elif cfg.epilogue_quant == "block":
        scale = torch.full((n,), float("nan"), device="cuda")
        out["aq"] = grouped_gemm(
            x_sorted, kw["w1"], rows, cfg, x_scale=x_scale, w_scale=kw["w1_scale"], epilogue=(scale, rows.row_mask)
        )
        out["scale"] = scale.view(rows.rows, -1)
        out["today"], out["today_scale"] = quantize_intermediate(h, rows, quant, gated=True)
    else:  # amax
        amax = torch.zeros(n, device="cuda")
        a = grouped_gemm(
            x_sorted, kw["w1"], rows, cfg, x_scale=x_scale, w_scale=kw["w1_scale"], epilogue=(amax, rows.row_mask)
        )
        out.update(a=a, amax=amax, today_amax=gated_amax(h, rows, quant))
    return out


GPU_TS = (1, 128, 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("quant, static", VARIANTS, ids=lambda v: str(v))
def test_fused_gemm1_is_todays_quantization_bit_for_bit(quant, static, shape, T):
    """The plan's fused GEMM1 (normal path forced at small T) against today's launches on its own output."""
    cfg = _plan_gemm1(shape, quant, static, T, swap_ab=False)
    c = _gemm1_case(cfg, T, SHAPES[shape], static, seed=T)
    rows, real = c["rows"], c["real"]
    used = rows.alignment.num_padded.item()
    if static:
        assert torch.equal(_bits(c["aq"][real]), _bits(c["today"][real]))
        assert c["word"].item() == c["today_word"].item() == 0
    else:
        assert torch.equal(c["a"][real], c["h"][real])  # the fp32 intermediate itself unchanged
        # the amax slots, padding rows (NaN in x) left out as today; channel / block: every slot of the used rows
        got, want = c["amax"], c["today_amax"]
        if quant == "fp8_tensor":
            assert torch.equal(got, want) and not torch.isnan(got).any()
        else:
            assert torch.equal(got.view(rows.rows, -1)[:used], want.view(rows.rows, -1)[:used])


@pytest.mark.gpu
@pytest.mark.parametrize("T", (1, 8, 128))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("quant", ("fp8_tensor", "fp8_channel", "fp8_block"))
def test_swap_ab_gemm1_amax_is_todays_bit_for_bit(quant, shape, T, monkeypatch):
    """The swap-AB GEMM1 with the amax in its epilogue (``SWAP_AB_EPILOGUE_AMAX``) against the amax of its
    own output as today's launch takes it: the fp32 intermediate unchanged, every amax slot of the used
    rows bit for bit (padding rows, NaN in x, left out)."""
    monkeypatch.setattr(plan_module, "SWAP_AB_EPILOGUE_AMAX", True)
    cfg = _plan_gemm1(shape, quant, False, T)
    assert cfg.swap_ab and cfg.epilogue_quant == "amax"
    c = _gemm1_case(cfg, T, SHAPES[shape], False, seed=T)
    rows, real = c["rows"], c["real"]
    used = rows.alignment.num_padded.item()
    assert torch.equal(c["a"][real], c["h"][real])
    got, want = c["amax"], c["today_amax"]
    if quant == "fp8_tensor":
        assert torch.equal(got, want) and not torch.isnan(got).any()
    else:
        assert torch.equal(got.view(rows.rows, -1)[:used], want.view(rows.rows, -1)[:used])


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TS)
def test_fused_block_gemm1_is_todays_quantization_bit_for_bit(T, wide_gated):
    """The block variant (128-wide gated tile, at the raised register bound: its registers spill, the
    values do not change): codes on the real rows and scales on every used row bit for bit."""
    shape = MoEShape("block", 8, 2, 512, 384, "test: I three scale groups")
    cfg = _block_cfg()
    c = _gemm1_case(cfg, T, shape, False, seed=T)
    real, used = c["real"], c["rows"].alignment.num_padded.item()
    assert torch.equal(_bits(c["aq"][real]), _bits(c["today"][real]))
    assert torch.equal(c["scale"][:used], c["today_scale"].view(c["rows"].rows, -1)[:used])


@pytest.mark.gpu
@pytest.mark.parametrize("value", [0.0, float("nan"), float("inf")], ids=["zero", "nan", "inf"])
def test_a_bad_static_scale_sets_its_bit_from_the_epilogue(value):
    cfg = _plan_gemm1("qwen3", "fp8_tensor", True, 4096)
    assert cfg.epilogue_quant == "static"
    from cute_moe.moe import grouped_gemm, sort_rows
    from moe_spec.problem import make_inputs
    from moe_spec.quant import quantize_activation

    kw = make_inputs(QWEN3, 64, "fp8_tensor", seed=1, device="cuda").kwargs()
    rows = sort_rows(kw["topk_ids"], kw["topk_weights"], QWEN3.num_experts, cfg.tokens_tile)
    xq, xs = quantize_activation(kw["x"], "fp8_tensor")
    x_sorted = _bits(xq)[rows.token_of_row].view(torch.float8_e4m3fn)
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    s = torch.tensor([value], device="cuda")
    grouped_gemm(x_sorted, kw["w1"], rows, cfg, x_scale=xs, w_scale=kw["w1_scale"], epilogue=(s, word))
    assert word.item() == BAD_A2_SCALE


def _layer(kw, static, **options):
    """(output, aq, a_scale) of one fused_moe call: the E4M3 intermediate and its scales read back from the
    call's workspace (cute_moe.moe's, this stream and thread)."""
    from cute_moe import moe

    out = cute_moe.fused_moe(**kw, **options)
    (T, K), (E, _, I), top_k = kw["x"].shape, kw["w2"].shape, kw["topk_ids"].shape[1]  # noqa: E741
    dims = MoEDims(T=T, E=E, K=K, I=I, top_k=top_k)
    c = moe._call_of(
        dims, kw["quant"], options.get("swap_ab"), None, "fused", kw["x"].device, kw["topk_ids"].dtype, static
    )
    ws = moe._workspace(c)
    scale = kw["a2_scale"] if static else ws["a_scale"]
    return out, ws["aq"].clone(), scale.clone(), ws["rows"].rows


#: (T, swap_ab, SWAP_AB_EPILOGUE_AMAX): the path rule's plan at every T, the normal path forced where the rule
#: swaps, and the swap-AB GEMM1 taking the amax in its epilogue.
LAYER_CASES = [
    (1, None, False),
    (1, False, False),
    (128, None, False),
    (128, False, False),
    (4096, None, False),
    (1, None, True),
    (8, None, True),
    (128, None, True),
]
LAYER_IDS = [f"T{T}-{'rule' if s is None else 'normal'}{'-swap_amax' if a else ''}" for T, s, a in LAYER_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("T, swap_ab, swap_amax", LAYER_CASES, ids=LAYER_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("quant, static", VARIANTS, ids=lambda v: str(v))
def test_the_layer_is_todays_bit_for_bit(quant, static, shape, T, swap_ab, swap_amax, monkeypatch):
    """fused_moe with the fused epilogue against EPILOGUE_QUANT = False (today's launches after the same
    gated GEMM1): the output, the E4M3 intermediate on the rows that hold a pair and its scales on every
    used row bit for bit; the oracle within TOL_ORACLE; reruns bit for bit."""
    from cute_moe.moe import forget_calls
    from moe_spec.oracle import oracle, rel_l2
    from moe_spec.problem import make_inputs

    if swap_amax and static:
        pytest.skip("static scales: the swap-AB GEMM1 takes no amax (the switch changes nothing)")
    monkeypatch.setattr(plan_module, "SWAP_AB_EPILOGUE_AMAX", swap_amax)
    forget_calls()
    kw = make_inputs(SHAPES[shape], T, quant, seed=T, device="cuda").kwargs()
    if static:
        kw = _static_kwargs(kw)
    options = {} if swap_ab is None else {"swap_ab": swap_ab}
    out, aq, scale, rows = _layer(kw, static, **options)
    again, _, _, _ = _layer(kw, static, **options)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "reruns must be bit-identical"
    assert rel_l2(out, oracle(**kw)) <= TOL_ORACLE
    monkeypatch.setattr(plan_module, "EPILOGUE_QUANT", False)
    forget_calls()
    today, aq_today, scale_today, rows_today = _layer(kw, static, **options)
    assert torch.equal(out.view(torch.int16), today.view(torch.int16))
    used, pairs = rows.alignment.num_padded.item(), rows.row_of_pair
    assert torch.equal(rows_today.row_of_pair, pairs)
    assert torch.equal(_bits(aq[pairs]), _bits(aq_today[pairs]))
    if quant == "fp8_tensor":
        assert torch.equal(scale, scale_today)
    else:
        assert torch.equal(scale.view(rows.rows, -1)[:used], scale_today.view(rows.rows, -1)[:used])

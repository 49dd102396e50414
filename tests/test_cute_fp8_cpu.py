"""CPU lane for cute_moe's FP8 (E4M3) path: configs, PTX of both paths, the fp32 epilogue's
register → shared-memory map, the quantization kernels' instructions, and the host checks.

Nothing here launches a kernel (no GPU): the CuTe DSL compiles Hopper kernels on the CPU and the
layouts are evaluated by the DSL itself.  The GPU lane is tests/test_cute_fp8_gpu.py.
"""

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cute_moe = pytest.importorskip("cute_moe")

from cute_moe.config import SMEM_BUDGET_BYTES, GemmConfig, max_stages  # noqa: E402
from cute_moe.lab.promotion import OneLevelConfig, one_level  # noqa: E402
from cute_moe.layouts import describe  # noqa: E402
from cute_moe.limits import FP8_TILE_K  # noqa: E402
from cute_moe.plan import choose_config  # noqa: E402

FORMATS = ("fp8_tensor", "fp8_channel", "fp8_block")


def _fp8(quant="fp8_tensor", **kw):
    cfg = GemmConfig(dtype="float8_e4m3fn", quant=quant, tile_k=FP8_TILE_K, **kw)
    return cfg.replace(stages=max_stages(cfg)).validate()


# both paths, both output dtypes, with and without the routing-weight row scale, one and two warpgroups
SHAPES = [
    dict(tokens_tile=128, weights_tile=128, out_dtype="float32"),
    dict(tokens_tile=64, weights_tile=128, consumer_warpgroups=1, row_scale=True),
    dict(swap_ab=True, tokens_tile=8, weights_tile=128, row_scale=True),
    dict(swap_ab=True, tokens_tile=32, weights_tile=128, out_dtype="float32"),
    dict(swap_ab=True, tokens_tile=64, weights_tile=64, consumer_warpgroups=1, row_scale=True),
]
CONFIGS = [_fp8(q, **kw) for q in FORMATS for kw in SHAPES]


def _id(cfg):
    return (
        f"{cfg.quant}-{'swap' if cfg.swap_ab else 'normal'}-{cfg.tile_m}x{cfg.tile_n}-{cfg.out_dtype}"
        f"{'-rowscale' if cfg.row_scale else ''}"
    )


_WGMMA = r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.[\w.]+"
_EXPECT_TX = r"mov\.b32\s+(%r\d+), (\d+);\s*mbarrier\.arrive\.expect_tx\.shared\.b64 [^,]+, \[[^\]]+\], \1;"


# ---- configs -----------------------------------------------------------------------------------
def test_fp8_config_sizes():
    cfg = _fp8(tokens_tile=128, weights_tile=128)
    assert (cfg.element_bytes, cfg.out_bytes, cfg.swizzle_bytes, cfg.operand_align) == (1, 2, 128, 16)
    assert cfg.accumulator_registers == 2 * 128 * 128 // 256  # block + promoted accumulators
    # one stage: (128 + 128) rows × 128 B; the budget formula of config.py
    assert cfg.smem_bytes() == cfg.stages * 256 * 128 + cfg.epi_stages * 128 * 32 * 2 + 1024 <= SMEM_BUDGET_BYTES
    f32 = cfg.replace(out_dtype="float32")
    assert (f32.out_bytes, f32.out_align) == (4, 4)
    assert f32.smem_bytes() - cfg.smem_bytes() == cfg.epi_stages * 128 * 32 * 2
    assert one_level(cfg).accumulator_registers == 64  # without promotion (the lab's study variant): one


@pytest.mark.parametrize("quant", FORMATS)
def test_path_rule_under_fp8(quant):
    for tpe, swap in ((0.5, True), (20, True), (64, True), (65, False), (500, False)):
        cfg = choose_config(tpe, 28672, 4096, quant=quant, out_dtype="float32")
        assert cfg.swap_ab == swap and cfg.quant == quant and cfg.dtype == "float8_e4m3fn"
        assert cfg.tile_k == FP8_TILE_K and cfg.weights_tile == 128 and cfg.out_dtype == "float32"
        assert cfg.smem_bytes() <= SMEM_BUDGET_BYTES and cfg.stages >= 4
    forced = choose_config(2, 28672, 4096, quant=quant, swap_ab=False)
    assert (forced.tokens_tile, forced.consumer_warpgroups) == (64, 1)


def test_layer_configs_under_fp8():
    from cute_moe.plan import layer_configs

    g1, g2 = layer_configs(8, 8, 4096, 14336, 2, quant="fp8_block")
    assert (g1.quant, g1.out_dtype, g1.row_scale) == ("fp8_block", "float32", False)
    assert (g2.quant, g2.out_dtype, g2.row_scale) == ("fp8_block", "bfloat16", True)
    b1, b2 = layer_configs(8, 8, 4096, 14336, 2)
    assert b1.out_dtype == b2.out_dtype == "bfloat16" and b1.quant is None


@pytest.mark.parametrize(
    "kw, needle",
    [
        (
            dict(
                quant="fp8_channel", dtype="float8_e4m3fn", tile_k=128, swap_ab=True, tokens_tile=256, weights_tile=128
            ),
            r"needs 256 accumulator registers",
        )
    ],
)
def test_bad_fp8_configs_name_the_limit(kw, needle):
    with pytest.raises(ValueError, match=needle):
        GemmConfig(**kw).validate()


# ---- PTX ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ptx():
    return {cfg: cute_moe.compile_ptx(cfg) for cfg in CONFIGS}


@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_fp8_ptx_has_the_intended_instructions(ptx, cfg):
    p = ptx[cfg]
    assert set(re.findall(_WGMMA, p)) == {f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k32.f32.e4m3.e4m3"}
    # the ring's full barriers expect exactly one stage: (tile_m + tile_n) rows of 128 E4M3
    assert {int(n) for _, n in re.findall(_EXPECT_TX, p)} == {(cfg.tile_m + cfg.tile_n) * FP8_TILE_K}
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier", p)
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.mbarrier", p)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", p)
    # two-level accumulation: every K step waits for its WGMMAs before the promotion reads them
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", p)) == {"0"}
    stmatrix = set(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x\d(?:\.trans)?\.shared\.b16", p))
    if cfg.out_dtype == "bfloat16":
        assert stmatrix == {
            f"stmatrix.sync.aligned.m8n8.x{2 if cfg.tile_n == 8 else 4}{'.trans' if cfg.swap_ab else ''}.shared.b16"
        }
    else:  # fp32 C: plain shared stores (stmatrix moves 16-bit values only)
        assert not stmatrix and re.search(r"st\.shared(\.v2)?\.b32", p)


@pytest.mark.parametrize(
    "kw", [dict(), dict(quant="fp8_block", dtype="float8_e4m3fn", tile_k=128)], ids=["bf16", "block"]
)
def test_only_tensor_and_channel_scales_run_without_promotion(kw):
    with pytest.raises(ValueError, match=r"a kernel without promotion takes \('fp8_tensor', 'fp8_channel'\)"):
        OneLevelConfig(**kw)


def test_fp8_without_promotion_is_the_single_accumulator_loop():
    """The promotion study's variant (cute_moe.lab.promotion): the kernel's bf16 main loop on E4M3,
    cached apart from the promoted kernel (its own compile key)."""
    promoted = _fp8("fp8_channel", tokens_tile=128, weights_tile=128)
    cfg = one_level(promoted)
    assert cfg.key() != promoted.key()
    p = cute_moe.compile_ptx(cfg)
    assert set(re.findall(_WGMMA, p)) == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}
    # the bf16 loop: one WGMMA batch kept in flight, no block accumulator to wait for every step
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", p)) == {"0", "1"}


@pytest.mark.parametrize("quant, loads", [("fp8_tensor", 2), ("fp8_channel", 2 + 32), ("fp8_block", 2 + 1)])
def test_scale_loads_one_per_distinct_row_and_column(quant, loads):
    """128×128 tile, two warpgroups: a thread holds 2 token rows × 32 weight columns.  Besides the
    3 scheduler loads (block count; the block's expert in producer and consumers), the kernel reads
    s_x[0], s_w[e] (tensor); 2 row + 32 column scales once per tile (channel); 2 row scales and
    the tile's one weight-block scale per K step (block): the compiler keeps one load per address."""
    p = cute_moe.compile_ptx(_fp8(quant, tokens_tile=128, weights_tile=128))
    assert len(re.findall(r"ld\.global\.\w+", p)) == 3 + loads


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.quant == "fp8_tensor"], ids=_id)
def test_fp8_layout_data_agrees_with_the_ptx(ptx, cfg):
    d = describe(cfg)
    assert set(re.findall(_WGMMA, ptx[cfg])) == {d["mma"]["instruction"]}
    assert d["mma"]["atom_mnk"] == [64, cfg.tile_n, 32]
    assert d["tma"]["stage_bytes"] == (cfg.tile_m + cfg.tile_n) * FP8_TILE_K
    for op in ("A", "B"):  # a K-major E4M3 row of 128 values is one 128-B swizzle row
        assert d["smem"][op]["swizzle"] == [3, 4, 3]
        assert [r["logical_byte"] for r in d["smem"][op]["atom_rows"]] == [128 * r for r in range(8)]


# ---- the fp32 epilogue: every register lands on its own (m, n) ----------------------------------
def _r2s_map(cfg):
    """[(accumulator coordinate, staging-buffer coordinate)] of every consumer thread's registers,
    through the kernel's own tiled copy (universal fp32 stores), sub-tile by sub-tile."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import warp
    from cutlass.tensor_utils import LayoutEnum

    from cute_moe.gemm_plan import KernelPlan

    pairs = []

    @cute.jit
    def probe():
        plan = KernelPlan(cfg)
        mma = plan.tiled_mma
        stmatrix = cute.make_copy_atom(
            warp.StMatrix8x8x16bOp(cfg.swap_ab, 4 if cfg.tile_n >= 16 else 2), plan.out_dtype
        )
        store = sm90.get_smem_store_op(
            LayoutEnum.COL_MAJOR if cfg.swap_ab else LayoutEnum.ROW_MAJOR, plan.out_dtype, cutlass.Float32
        )
        r2s = cute.make_tiled_copy_S(store, cute.make_tiled_copy_C_atom(stmatrix, mma))
        epi_m, epi_n = cfg.epi_tile
        grid_n = cfg.tile_n // epi_n
        for t in cutlass.range_constexpr(128 * cfg.consumer_warpgroups):
            tCcC = mma.get_slice(t).partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            regs = r2s.retile(cute.make_tensor(0, cute.make_layout(tCcC.shape)))  # copy order → register
            dst = r2s.get_slice(t).partition_D(cute.make_identity_tensor(cfg.epi_tile))
            n = cute.size(dst)
            # sub-tile e covers rows (e // grid_n)·epi_m…, columns (e % grid_n)·epi_n… (gemm.py's epi_order)
            pairs.extend(
                (
                    tuple(int(c) for c in tCcC[int(regs[e * n + v])]),
                    ((e // grid_n) * epi_m + int(dst[v][0]), (e % grid_n) * epi_n + int(dst[v][1])),
                )
                for e in range(cute.size(tCcC) // n)
                for v in range(n)
            )

    probe()
    return pairs


# every fp32-output tile GEMM1 can get: the path rule's normal and swap-AB tiles, and the forced
# normal path's one-warpgroup tile
FP32_TILES = [
    _fp8(out_dtype="float32", **kw)
    for kw in (
        dict(tokens_tile=128, weights_tile=128),
        dict(tokens_tile=64, weights_tile=128, consumer_warpgroups=1),
        dict(swap_ab=True, tokens_tile=8, weights_tile=128),
        dict(swap_ab=True, tokens_tile=32, weights_tile=128),
    )
]


@pytest.mark.parametrize("cfg", FP32_TILES, ids=_id)
def test_fp32_epilogue_stores_every_register_at_its_coordinate(cfg):
    pairs = _r2s_map(cfg)
    assert len(pairs) == cfg.tile_m * cfg.tile_n
    assert all(acc == smem for acc, smem in pairs)
    assert {smem for _, smem in pairs} == {(m, n) for m in range(cfg.tile_m) for n in range(cfg.tile_n)}


# ---- the quantization kernels ------------------------------------------------------------------
@pytest.mark.parametrize("quant", FORMATS)
def test_quant_kernels_divide_exactly_and_round_to_nearest_even(quant):
    kernels = cute_moe.compile_quant_kernels(quant, keep_ptx=True)
    for name in ("x_quantize", "a_quantize"):
        p = kernels[name].__ptx__
        assert "div.rn.f32" in p and "cvt.rn.satfinite.e4m3x2.f32" in p
        assert not re.search(r"div\.(approx|full)|rcp\.", p)  # never a reciprocal multiply
    for name in ("x_amax", "silu_amax", "a_amax"):
        p = kernels[name].__ptx__
        assert "shfl.sync.bfly" in p and p.count("atom.global.max.s32") == 1  # warp max, then the atomic
        # every maximum keeps NaN (max.NaN.f32); a NaN-dropping max.f32 would lose a NaN's group
        assert "max.NaN.f32" in p and not re.search(r"max\.f32", p)
        if quant == "fp8_tensor":  # one atomic per warp: after the walk's loop, not inside it
            labels = {m.group(1): m.start() for m in re.finditer(r"^\s*(\$L__BB\w+):", p, re.M)}
            back = [
                m.start() for m in re.finditer(r"bra(?:\.uni)?\s+(\$L__BB\w+);", p) if labels[m.group(1)] < m.start()
            ]
            assert back and p.index("atom.global.max.s32") > max(back)
            # ... and only a warp with something to add issues it: the guard is the ORDERED compare with +0
            # (setp.eq.f32 is false for NaN, so a NaN amax is always added; an unordered equ would drop it)
            guard = p[max(back) : p.index("atom.global.max.s32")]
            assert re.search(r"setp\.eq\.f32\s+%p\d+, %r\d+, 0f00000000;", guard) and "setp.equ" not in guard
        assert "st.global" not in p if name != "silu_amax" else "st.global.v4.b32" in p  # SiLU·up kept in fp32


def test_quant_kernels_compile_once_per_format():
    cute_moe.compile_quant_kernels("fp8_block")
    n = cute_moe.compile_count()
    kernels = {"x_amax", "x_quantize", "silu_amax", "a_amax", "a_quantize"}
    assert set(cute_moe.compile_quant_kernels("fp8_block")) == kernels
    assert cute_moe.compile_count() == n


def test_fp8_rows_gather_as_bf16_pairs_bit_for_bit():
    """The layer moves E4M3 rows with the bf16 gather kernel: a view, no conversion."""
    q = (torch.randn(6, 64) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    idx = torch.tensor([3, 0, 0, 5])
    pairs = q.view(torch.bfloat16)
    assert pairs.shape == (6, 32)
    assert torch.equal(pairs[idx].view(torch.float8_e4m3fn).view(torch.uint8), q[idx].view(torch.uint8))


# ---- host checks of the FP8 layer (CPU tensors: any launch would fail differently) --------------
def _inputs(quant, hidden=64, intermediate=32, T=3):
    from moe_spec.problem import MoEShape, make_inputs

    return make_inputs(MoEShape("tiny", 4, 2, hidden, intermediate, "test"), T, quant).kwargs()


def _pair(quant, **kw):
    from cute_moe.limits import gemm1_out_dtype

    g1 = choose_config(1, 64, 64, quant=quant, out_dtype=gemm1_out_dtype(quant))
    g2 = choose_config(1, 64, 32, quant=quant, row_scale=True)
    return g1.replace(**kw), g2


@pytest.mark.parametrize(
    "inputs, options, error, needle",
    [
        (
            dict(quant="fp8_tensor", hidden=72),
            {},
            ValueError,
            r"^x: hidden size K = x\.shape\[1\] = 72 must be a multiple of 16 for cute_moe with quant='fp8_tensor'",
        ),
        (
            dict(quant="fp8_block", intermediate=40),
            {},
            ValueError,
            r"^w2: intermediate size I = w2\.shape\[2\] = 40 must be a multiple of 16",
        ),
        (
            dict(quant="fp8_tensor"),
            dict(configs=_pair(None)),
            ValueError,
            r"^configs\[0\]: quant=None, but the call's quant='fp8_tensor'",
        ),
        (
            dict(quant=None),
            dict(configs=_pair("fp8_channel")),
            ValueError,
            r"^configs\[0\]: quant='fp8_channel', but the call's quant=None",
        ),
        (
            dict(quant="fp8_channel"),
            dict(configs=_pair("fp8_channel", out_dtype="bfloat16")),
            ValueError,
            r"^configs\[0\]: out_dtype must be 'float32' with quant='fp8_channel'",
        ),
        (
            dict(quant="fp8_block"),
            dict(configs=_pair("fp8_tensor")),
            ValueError,
            r"^configs\[0\]: quant='fp8_tensor', but the call's quant='fp8_block'",
        ),
        (
            dict(quant="fp8_channel"),
            dict(configs=_pair("fp8_channel", epilogue_scales=False)),
            ValueError,
            r"^configs\[0\]: epilogue_scales must be True",
        ),
    ],
)
def test_fp8_layer_checks_its_limits_before_any_launch(inputs, options, error, needle):
    quant = inputs.pop("quant")
    with pytest.raises(error, match=needle):
        cute_moe.fused_moe(**_inputs(quant, **inputs), **options)


@pytest.mark.parametrize("quant", FORMATS)
def test_fp8_layer_reaches_the_device_check(quant):
    with pytest.raises(ValueError, match="CUDA"):
        cute_moe.fused_moe(**_inputs(quant))
    with pytest.raises(ValueError, match="CUDA"):
        cute_moe.fused_moe(**_inputs(quant), configs=_pair(quant))
    with pytest.raises(ValueError, match="CUDA"):  # what T = 1 refuses, T = 0 refuses
        cute_moe.fused_moe(**_inputs(quant, T=0))


def test_fp8_scale_shapes_are_checked_by_the_contract():
    kw = _inputs("fp8_block")
    kw["w1_scale"] = torch.ones(4, 2, 1)  # [E, ⌈2I/128⌉, ⌈K/128⌉] is [4, 1, 1]
    with pytest.raises(ValueError, match=r"^w1_scale: expected shape \(4, 1, 1\)"):
        cute_moe.fused_moe(**kw)
    kw = _inputs("fp8_channel")
    kw["w2_scale"] = kw["w2_scale"].t()
    with pytest.raises(ValueError, match=r"^w2_scale:"):
        cute_moe.fused_moe(**kw)


def test_grouped_gemm_refuses_mismatched_operands():
    from cute_moe.moe import grouped_gemm, sort_rows

    cfg = _fp8("fp8_tensor", swap_ab=True, tokens_tile=8, weights_tile=128)
    al = sort_rows(torch.zeros(4, 1, dtype=torch.int32), torch.ones(4, 1), 2, 8)
    xq = torch.zeros(al.rows, 64, dtype=torch.float8_e4m3fn)
    wq = torch.zeros(2, 128, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"^grouped_gemm: x_sorted is torch\.bfloat16"):
        grouped_gemm(xq.view(torch.bfloat16), wq.view(torch.bfloat16), al, cfg)
    with pytest.raises(ValueError, match=r"^grouped_gemm: pass x_scale and w_scale exactly when cfg\.quant"):
        grouped_gemm(xq, wq, al, cfg, x_scale=torch.ones(1))
    with pytest.raises(ValueError, match=r"^grouped_gemm: K=24 must be a positive multiple of 16"):
        grouped_gemm(xq[:, :24], wq[:, :, :24], al, cfg, x_scale=torch.ones(1), w_scale=torch.ones(2))


# ---- the unfused pipeline (fusion="separate") ---------------------------------------------------
def test_separate_configs_leave_the_scales_and_the_routing_weight_out():
    from cute_moe.unfused import separate_configs

    for quant in FORMATS:
        g1, g2 = separate_configs(*_pair(quant))
        assert not g2.row_scale and g1.out_dtype == "float32" and g2.out_dtype == "bfloat16"
        # block scales change every 128 of K: they stay in the main loop
        assert g1.epilogue_scales == g2.epilogue_scales == (quant == "fp8_block")
    b1, b2 = separate_configs(*_pair(None))
    assert b1.epilogue_scales and not b2.row_scale
    with pytest.raises(ValueError, match=r"epilogue_scales=False with quant='fp8_block'"):
        _fp8("fp8_block", tokens_tile=128, weights_tile=128).replace(epilogue_scales=False).validate()


@pytest.mark.parametrize("quant, loads", [("fp8_tensor", 2), ("fp8_channel", 2), ("fp8_block", 3 + 2 + 1)])
def test_unscaled_gemm_reads_no_epilogue_scale(quant, loads):
    """epilogue_scales=False: the 128×128 kernel reads what the bf16 one reads — the block count
    and the producer's block expert — and no scale; fp8_block keeps its main-loop scales (and the
    consumer's expert they need)."""
    cfg = _fp8(quant, tokens_tile=128, weights_tile=128)
    if quant != "fp8_block":
        cfg = cfg.replace(epilogue_scales=False)
    assert len(re.findall(r"ld\.global\.\w+", cute_moe.compile_ptx(cfg))) == loads


@pytest.mark.parametrize("quant", [None, *FORMATS])
def test_unfused_passes_compile_once(quant):
    from cute_moe.rowops import compile_unfused_kernels

    kernels = compile_unfused_kernels(quant)
    n = cute_moe.compile_count()
    assert compile_unfused_kernels(quant) is kernels and cute_moe.compile_count() == n
    want = {"weighted_combine"} | ({"scale_f32", "scale_bf16"} if quant in ("fp8_tensor", "fp8_channel") else set())
    assert set(kernels) == want


@pytest.mark.parametrize("quant", [None, *FORMATS])
def test_fusion_option_is_checked_before_any_launch(quant):
    with pytest.raises(ValueError, match=r"^fusion: expected one of \('fused', 'separate'\), got 'unfused'"):
        cute_moe.fused_moe(**_inputs(quant), fusion="unfused")
    with pytest.raises(ValueError, match="CUDA"):
        cute_moe.fused_moe(**_inputs(quant), fusion="separate")


def test_warm_up_of_an_fp8_plan_compiles_what_the_layer_runs():
    """compile_plan of an FP8 plan of the unfused pipeline: its GEMMs, the row kernels, the format's
    quantization kernels and the scale / weighted-combine passes — nothing left for the first call."""
    from cute_moe.rowops import compile_unfused_kernels

    (p,) = cute_moe.plans_for(8, 4096, 14336, 2, "fp8_channel", max_tokens=8, fusion="separate")
    assert (p.quant, p.fusion, p.gemm1.epilogue_scales) == ("fp8_channel", "separate", False)
    cute_moe.compile_plan(p)
    n = cute_moe.compile_count()
    for cfg in (p.gemm1, p.gemm2):
        cute_moe.compile_gemm(cfg)
    cute_moe.compile_row_kernels()
    cute_moe.compile_quant_kernels("fp8_channel")
    compile_unfused_kernels("fp8_channel")
    assert cute_moe.compile_count() == n and cute_moe.compile_plan(p) == 0


@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_channel", "fp8_block"])
def test_hbm_bytes_of_the_two_pipelines(quant):
    """The byte model compare prints beside fused vs separate: the unfused pipeline moves GEMM1's
    fp32 H and GEMM2's bf16 Y once more through a scale pass where the scales can leave the GEMM
    (per-tensor, per-channel), and reads the routing weights in its combine; the weights of the
    hit experts dominate at decode."""
    from cute_moe.unfused import GATHER_IN_PRODUCER, gated_gemm1, hbm_bytes

    T, K, I, top_k, hit = 4, 2048, 768, 8, 30
    fused, separate = (hbm_bytes(T, K, I, top_k, hit, quant, f) for f in ("fused", "separate"))
    M, wb = T * top_k, 1 if quant else 2
    extra = M * 4
    if quant in ("fp8_tensor", "fp8_channel"):
        extra += 2 * M * 2 * I * 4 + 2 * M * K * 2
        assert set(separate) - set(fused) == {"scale pass 1", "scale pass 2"}
    elif quant is None and gated_gemm1():  # the fused bf16 GEMM1 writes [M, I]; no SiLU·up pass
        extra += M * 2 * I * 2 - M * I * 2 + M * 2 * I * 2 + M * I * 2
        gone = {"GEMM1", "SiLU·up"} | ({"gather"} if GATHER_IN_PRODUCER else set())
        extra += 2 * M * K * 2 if GATHER_IN_PRODUCER else 0  # x read and X_sorted written by the row kernel
        assert set(fused) == set(separate) - gone | {"GEMM1 + SiLU·up"}
    else:
        assert set(separate) == set(fused)
    assert sum(separate.values()) - sum(fused.values()) == extra
    weights = hit * 3 * I * K * wb
    assert weights < sum(fused.values()) < 1.1 * weights
    with pytest.raises(ValueError, match=r"^fusion: expected one of"):
        hbm_bytes(T, K, I, top_k, hit, quant, "unfused")

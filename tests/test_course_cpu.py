"""The course's steps compile on the CPU (CUTE_DSL_ARCH=sm_90a, fake tensors), and each step's PTX
has the instructions that step introduces — and not yet those of the steps after it.

The numbered files in course/ are scripts, not a package: they are loaded by file location.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

COURSE = Path(__file__).resolve().parents[1] / "course"


def step(name: str):
    """A course file as a module (``_common.load`` caches it per process)."""
    if str(COURSE) not in sys.path:
        sys.path.insert(0, str(COURSE))
    spec = importlib.util.spec_from_file_location("course_common", COURSE / "_common.py")
    common = sys.modules.get("_common")
    if common is None:
        common = importlib.util.module_from_spec(spec)
        sys.modules["_common"] = common
        spec.loader.exec_module(common)
    return common.load(name)


def opcodes(ptx: str) -> list[str]:
    """Every instruction of the PTX text, with its modifiers, in order (predicates dropped)."""
    return re.findall(r"^\s*(?:@!?%?\w+\s+)?([a-z][\w.:]*)", ptx, re.M)


def has(ptx: str, prefix: str) -> int:
    return sum(op.startswith(prefix) for op in opcodes(ptx))


# ---- step 1: one WGMMA ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [8, 256])
def test_01_one_wgmma_instruction(n):
    s1 = step("01_wgmma")
    ptx = s1.ptx(n)
    assert has(ptx, f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16") == 1  # K = 16: one instruction
    for op in (
        "wgmma.fence.sync.aligned",
        "wgmma.commit_group.sync.aligned",
        "wgmma.wait_group.sync.aligned",
        "fence.proxy.async.shared::cta",
    ):
        assert has(ptx, op) >= 1, op
    # not yet: TMA, mbarriers (step 2), setmaxnreg (step 4)
    assert has(ptx, "cp.async.bulk") == 0 and has(ptx, "mbarrier") == 0 and has(ptx, "setmaxnreg") == 0


@pytest.mark.parametrize("n", [8, 64, 256])
def test_01_owner_map_is_the_ptx_fragment_layout(n):
    s1 = step("01_wgmma")
    owners = s1.owner_map(n)
    assert len(owners) == 64 * n  # every (m, n) of the tile has exactly one (thread, register)
    assert len(set(owners.values())) == 64 * n
    for (m, col), (t, r) in owners.items():
        assert s1.ptx_owner(t, r) == (m, col), (m, col, t, r)


def test_01_partition_c_agrees_with_tv_layout():
    """The kernel stores through ``partition_C`` of an identity tensor; owner_map reads
    ``tv_layout_C``: both name the same (m, n) for every thread and register (N = 16)."""
    import cutlass
    import cutlass.cute as cute

    s1 = step("01_wgmma")
    got = {}

    @cute.jit
    def probe():
        mma = s1.make_tiled_mma(16)
        for t in cutlass.range_constexpr(128):
            cc = mma.get_slice(t).partition_C(cute.make_identity_tensor((64, 16)))
            for r in cutlass.range_constexpr(8):
                got[(int(cc[r][0]), int(cc[r][1]))] = (t, r)

    probe()
    assert got == s1.owner_map(16)


def test_01_bad_n_is_refused():
    with pytest.raises(ValueError, match="n=12"):
        step("01_wgmma").OneWgmma(12)


# ---- step 2: TMA under an mbarrier --------------------------------------------------------------
def test_02_tma_and_mbarrier():
    s2 = step("02_tma")
    ptx = s2.ptx(128)
    assert has(ptx, "cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes") == 2  # A and B
    assert has(ptx, "mbarrier.init.shared.b64") == 1
    assert has(ptx, "fence.mbarrier_init") == 1
    assert has(ptx, "mbarrier.arrive.expect_tx.shared.b64") == 1
    assert has(ptx, "mbarrier.try_wait.parity.shared.b64") >= 1
    # the transaction count is the stage's bytes: (64 + n) rows × 64 bf16
    expect = re.search(
        r"mov\.b32\s+(%r\d+), (\d+);(?:(?!mov\.b32\s+\1,).)*?mbarrier\.arrive\.expect_tx\.shared\.b64 "
        r"%rd\d+, \[%r\d+\], \1;",
        ptx,
        re.S,
    )
    assert expect and int(expect.group(2)) == (64 + 128) * 64 * 2
    assert has(ptx, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 4  # 64 of K per load
    # one elected lane arrives and issues each copy (every thread executing cp.async.bulk.tensor starts one)
    assert has(ptx, "elect.sync") >= has(ptx, "cp.async.bulk.tensor") + has(ptx, "mbarrier.arrive.expect_tx")
    # not yet: the producer / consumer split with register moves (step 4)
    assert has(ptx, "setmaxnreg") == 0


def init_counts(ptx: str) -> list[int]:
    """The arrival count of every ``mbarrier.init`` (the register it reads, traced to its ``mov``)."""
    movs = dict(re.findall(r"mov\.b32\s+(%r\d+), (\d+);", ptx))
    return [int(movs[r]) for r in re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^\]]+\], (%r\d+);", ptx)]


# ---- step 3: the ring ---------------------------------------------------------------------------
@pytest.mark.parametrize("stages", [2, 4])
def test_03_ring_of_full_and_empty_barriers(stages):
    s3 = step("03_ring")
    ptx = s3.ptx(128, stages)
    # full[s]: 1 arrival (the producer's expect_tx); empty[s]: the 128 consumer threads
    assert sorted(init_counts(ptx)) == [1] * stages + [128] * stages
    assert has(ptx, "mbarrier.arrive.shared.b64") >= 1  # the consumers' release of a slot
    assert has(ptx, "mbarrier.arrive.expect_tx.shared.b64") >= 1
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)  # one batch kept in flight
    assert ".reqntid 256" in ptx  # a producer and a consumer warpgroup
    assert has(ptx, "setmaxnreg") == 0  # not yet (step 4)


def test_03_ring_position_is_what_the_kernel_waits_on():
    s3 = step("03_ring")
    # first lap: consumers wait for phase 0 of full[s]; producers on "the phase before" of empty[s]
    assert [s3.ring_position(k, 4) for k in range(9)] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
        (0, 0),
    ]


# ---- step 4: setmaxnreg -------------------------------------------------------------------------
def test_04_setmaxnreg_moves_registers():
    s4 = step("04_setmaxnreg")
    ptx = s4.ptx(256, 4)
    dec = re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)
    inc = re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)
    assert dec == [str(s4.PRODUCER_REGISTERS)] and inc == [str(s4.CONSUMER_REGISTERS)]
    assert ".reqntid 384" in ptx  # producer + two consumer warpgroups
    assert sorted(init_counts(ptx)) == [1] * 4 + [256] * 4  # both consumer warpgroups release a slot
    assert has(ptx, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") >= 4
    budget = s4.register_budget(s4.PRODUCER_REGISTERS, s4.CONSUMER_REGISTERS, 2)
    assert budget["fits"] and budget["after"] == 40 * 128 + 232 * 256 <= budget["pool"] <= 65536


def test_04_ptxas_launches_at_the_budgeted_count(tmp_path):
    """The cubin the CPU compile also writes: ptxas gives every thread register_budget's launch count (168,
    from .reqntid 384) and keeps both setmaxnreg as SASS USETMAXREG (the ISA: without a known register
    limit setmaxnreg may have no effect)."""
    import subprocess

    import cutlass.cute as cute
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("no cuobjdump (triton's NVIDIA backend) to read the cubin")
    s4 = step("04_setmaxnreg")
    fakes = (
        s4.course.fake_matrix(s4.BF16, 128, s4.TILE_K),
        s4.course.fake_matrix(s4.BF16, 256, s4.TILE_K),
        s4.course.fake_matrix(s4.F32, 128, 256),
        s4.course.fake_stream(),
    )
    cute.compile(s4.SpecializedGemm(256, 4), *fakes, options=f"--keep-cubin --dump-dir {tmp_path}")
    (cubin,) = tmp_path.glob("*.cubin")
    out = subprocess.run(
        [str(cuobjdump), "-res-usage", "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    budget = s4.register_budget(s4.PRODUCER_REGISTERS, s4.CONSUMER_REGISTERS, 2)
    assert re.search(rf"\bREG:{budget['launch']}\b", out), budget
    assert f"USETMAXREG.DEALLOC.CTAPOOL {s4.PRODUCER_REGISTERS:#x}" in out
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, {s4.CONSUMER_REGISTERS:#x}" in out


def test_04_register_budget_refuses_a_bad_count():
    with pytest.raises(ValueError, match="consumer=236"):
        step("04_setmaxnreg").register_budget(40, 236, 2)


# ---- step 5: persistent, rasterized -------------------------------------------------------------
@pytest.mark.parametrize("ctas", [7, 132])
def test_05_persistent_walk_steps_by_the_grid(ctas):
    """No new instruction: the producer's and the consumers' tile loops both step by the grid size."""
    ptx = step("05_persistent").ptx(256, 4, ctas)
    assert len(re.findall(rf"add\.s32\s+(%r\d+), \1, {ctas};", ptx)) == 2
    assert has(ptx, "setmaxnreg.dec") == 1 and has(ptx, "setmaxnreg.inc") == 1  # still step 4's roles


@pytest.mark.parametrize("m_blocks,n_blocks,group", [(5, 3, 2), (16, 7, 8), (3, 4, 8)])
def test_05_rasterization_visits_every_tile_once_in_groups(m_blocks, n_blocks, group):
    s5 = step("05_persistent")
    order = [s5.tile_coordinates(t, m_blocks, n_blocks, group) for t in range(m_blocks * n_blocks)]
    assert sorted(order) == [(m, n) for m in range(m_blocks) for n in range(n_blocks)]
    for t, (m, _) in enumerate(order):  # ids of one group cover only that group's M blocks
        first = (t // (group * n_blocks)) * group
        assert first <= m < first + group
    tiles = [tile for cta in range(4) for tile in s5.cta_tiles(cta, 4, m_blocks, n_blocks, group)]
    assert sorted(tiles) == sorted(order)


# ---- step 6: swap-AB ----------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [2, 20])
def test_06_swap_ab_puts_the_tokens_in_n(tokens):
    s6 = step("06_swap_ab")
    n = s6.token_tile(tokens)
    ptx = s6.ptx(tokens)
    assert has(ptx, f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16") >= 4  # tokens are N: 8, 24
    assert has(ptx, "wgmma.mma_async.sync.aligned.m64n256k16") == 0
    # the epilogue checks bounds: every store of an accumulator register (128·n fp32 over 256 consumer
    # threads) is jumped over when its (m, n) lies outside C — a branch right before each store
    regs = 128 * n // 256
    assert len(re.findall(r"st\.global\.b32", ptx)) == regs
    assert guarded_stores(ptx) == regs


def guarded_stores(ptx: str) -> int:
    """Stores skipped by a conditional branch whose target is right after them (an ``if`` around one store)."""
    lines, count = ptx.splitlines(), 0
    for i, line in enumerate(lines):
        if "st.global" not in line:
            continue
        branch = next(x for x in reversed(lines[:i]) if re.search(r"\bbra\b", x))
        target = re.search(r"@%p\d+ bra\s+(\$L__BB\d+_\d+);", branch)
        after = lines[i + 1 : i + 3]
        count += bool(target) and any(x.strip() == target.group(1) + ":" for x in after)
    return count


def test_06_swap_ab_choice():
    s6 = step("06_swap_ab")
    two, big = s6.swap_ab_choice(2), s6.swap_ab_choice(500)
    assert two["swap"] and two["swapped_token_cols"] == 8 and two["normal_padding"] == 62
    assert not big["swap"] and big["normal_token_rows"] == 512 and big["swapped_token_cols"] == 512


def test_06_swap_ab_follows_the_production_rule(monkeypatch):
    """Step 6 decides with cute_moe's path rule itself: moving the production threshold moves the course's."""
    import importlib

    production_plan = importlib.import_module("cute_moe.plan")  # the module (the package's `plan` is a function)
    s6 = step("06_swap_ab")
    assert s6.SWAP_AB_MAX_TOKENS_PER_EXPERT == production_plan.SWAP_AB_MAX_TOKENS_PER_EXPERT
    assert s6.swap_ab_choice(48)["swap"]
    monkeypatch.setattr(production_plan, "SWAP_AB_MAX_TOKENS_PER_EXPERT", 32)
    assert not s6.swap_ab_choice(48)["swap"] and s6.swap_ab_choice(32)["swap"]


def test_course_constants_are_the_products():
    """The numbers a step restates (so that it reads alone) are cute_moe's and moe_spec's: a change there
    fails here until the course follows."""
    from cute_moe.config import BARRIER_RESERVE_BYTES, GemmConfig
    from cute_moe.gemm import CONSUMER_REGISTERS, PRODUCER_REGISTERS
    from cute_moe.limits import FP8_TILE_K, MAX_TILE_M
    from cute_moe.plan import SWAP_TOKEN_TILES
    from moe_spec.hopper import H200_SM_COUNT, SMEM_PER_CTA_BYTES, WARPGROUP_THREADS, WGMMA_M

    s3, s4, s5, s7, s8 = (step(n) for n in ("03_ring", "04_setmaxnreg", "05_persistent", "07_fp8", "08_grouped_moe"))
    default = GemmConfig()
    answers = step("exercises").answers()
    pairs = {
        "producer registers": (s4.PRODUCER_REGISTERS, PRODUCER_REGISTERS),
        "consumer registers": (s4.CONSUMER_REGISTERS, CONSUMER_REGISTERS),
        "bf16 tile_k": (s3.TILE_K, default.tile_k),
        "FP8 tile_k": (s7.TILE_K, FP8_TILE_K),
        "token block rows": (s8.TILE_M, MAX_TILE_M),
        "SMs of an H200": (s5.H200_SMS, H200_SM_COUNT),
        "rasterization group": (s5.PersistentGemm().group, default.group_tokens),
        "ring stages": (s3.RingGemm().stages, default.stages),
        "shared memory per CTA": (answers["stages"]["capacity"], SMEM_PER_CTA_BYTES),
        "barrier reserve": (answers["stages"]["barriers"], BARRIER_RESERVE_BYTES),
        "warpgroup threads and WGMMA M": ((128, 64), (WARPGROUP_THREADS, WGMMA_M)),
        "largest swapped token tile": (step("06_swap_ab").swap_ab_choice(500)["swapped_tile"], SWAP_TOKEN_TILES[-1]),
    }
    for name, (course_value, product_value) in pairs.items():
        assert course_value == product_value, name


# ---- step 7: FP8 and two-level promotion -------------------------------------------------------
def test_07_fp8_wgmma_and_the_promotion_adds():
    s7 = step("07_fp8")
    ptx = s7.ptx(128, 4)
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3 \{([^}]*)\}", ptx)
    assert len(mmas) == 4  # tile_k 128 = 4 × K32 per stage
    assert has(ptx, "wgmma.mma_async.sync.aligned.m64n128k16") == 0
    block = {r.strip() for r in mmas[0].split(",")}  # the block accumulator's registers (level 1)
    assert len(block) == 128 * 128 // 256
    # level 2: right after wait_group 0, one fp32 add per block register into the tile accumulator
    after_wait = ptx.split("wgmma.wait_group.sync.aligned \t0;", 1)[1]
    adds = re.findall(r"add\.f32\s+(%r\d+), (%r\d+), (%r\d+);", after_wait)[: len(block)]
    assert len(adds) == len(block) and {a[2] for a in adds} == block
    assert all(a[0] == a[1] and a[0] not in block for a in adds)  # acc += blk, acc distinct from blk
    assert not re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)  # no batch in flight over a promotion


def test_07_fp8_refuses_a_wide_tile():
    with pytest.raises(ValueError, match="n=256"):
        step("07_fp8").Fp8Gemm(256)


# ---- step 8: grouped by expert ------------------------------------------------------------------
def test_08_grouped_expert_is_a_tma_coordinate():
    ptx = step("08_grouped_moe").ptx(256, 4)
    # tokens: a 2-D box; weights: a 3-D box (N, K, expert) — the expert read from block_expert at run time
    # (the compiler unrolls the producer's K loop: count pairs)
    boxes_2d = has(ptx, "cp.async.bulk.tensor.2d.shared::cta.global.tile")
    assert boxes_2d >= 1 and has(ptx, "cp.async.bulk.tensor.3d.shared::cta.global.tile") == boxes_2d
    assert len(re.findall(r"ld\.global\.b32", ptx)) == 2  # num_blocks[0] and block_expert[b]: device data


def test_08_sort_by_expert_pads_every_run():
    import torch

    s8 = step("08_grouped_moe")
    experts = torch.tensor([2, 0, 2, 2, 1, 0, 2])
    rows, block_expert, blocks = s8.sort_by_expert(experts, 4)
    tile = s8.TILE_M
    assert blocks == 3 and block_expert.tolist() == [0, 1, 2]  # expert 3 has no tokens: no block
    assert len(set(rows.tolist())) == len(experts)
    for t, e in enumerate(experts.tolist()):  # every token lands in a block of its own expert
        assert block_expert[rows[t] // tile] == e


# ---- the figures: drawn from the steps, held to them --------------------------------------------
FIGURES = COURSE.parent / "notes" / "figures" / "course"


@pytest.fixture(scope="module")
def figures():
    return step("figures").generate()


def test_figures_are_current(figures):
    for name, text in figures.items():
        assert (FIGURES / name).read_text() == text, f"{name} is stale: run python course/figures.py"


def marks(svg: str, attr: str) -> list[dict]:
    """Every element carrying ``data-<attr>``, as a dict of its data attributes (ints where numeric)."""
    out = []
    for tag in re.findall(rf"<rect[^>]*data-{attr}=[^>]*>", svg):
        d = dict(re.findall(r'data-([\w-]+)="([^"]*)"', tag))
        out.append({k: int(v) if re.fullmatch(r"-?\d+", v) else v for k, v in d.items()})
    return out


def test_ring_parity_figure_reads_back(figures):
    cells = marks(figures["ring_parity.svg"], "k")
    assert len(cells) == 12
    for c in cells:  # independent of ring_position: the k-th use of a slot, counted
        uses = sum(1 for j in range(c["k"]) if j % 4 == c["slot"])
        assert c["slot"] == c["k"] % 4 and c["consumer"] == uses % 2 and c["producer"] == 1 - uses % 2


def test_descriptor_figure_reads_back(figures):
    svg = figures["descriptor.svg"]
    value = int(re.search(r'data-value="(\d+)"', svg).group(1))
    bits = marks(svg, "bit")
    assert sum(b["on"] << b["bit"] for b in bits) == value
    assert {f["field"]: (f["lo"], f["width"]) for f in marks(svg, "field")} == {
        "start address": (0, 14),
        "leading dimension byte offset": (16, 14),
        "stride dimension byte offset": (32, 14),
        "base offset": (49, 3),
        "swizzle mode": (62, 2),
    }


def test_register_pool_figure_reads_back(figures):
    parts = marks(figures["register_pool.svg"], "part")
    launch = sum(p["registers"] for p in parts if p["row"] == "at launch")
    after = sum(p["registers"] for p in parts if p["row"] == "after setmaxnreg")
    assert after == 40 * 128 + 232 * 256 <= launch <= 65536


def test_tile_walk_figure_reads_back(figures):
    tiles = marks(figures["tile_walk.svg"], "tile")
    assert sorted((t["m"], t["n"]) for t in tiles) == [(m, n) for m in range(10) for n in range(6)]
    for t in tiles:
        assert t["cta"] == t["tile"] % 7
        assert (t["tile"] // (4 * 6)) * 4 <= t["m"] < (t["tile"] // (4 * 6)) * 4 + 4  # inside its group


def elements(svg: str, kind: str) -> list[dict]:
    """Every rect, text or line whose ``data-kind`` is ``kind``, as a dict of its data attributes."""
    out = []
    for tag in re.findall(rf'<(?:rect|text|line)[^>]*data-kind="{kind}"[^>]*>', svg):
        d = dict(re.findall(r'data-([\w-]+)="([^"]*)"', tag))
        out.append(
            {
                k: (int(v) if re.fullmatch(r"-?\d+", v) else float(v) if re.fullmatch(r"-?\d+\.\d+", v) else v)
                for k, v in d.items()
            }
        )
    return out


def test_store_ring_figure_reads_back(figures):
    """Drawn from the plan's config and its PTX: no staging buffer is rewritten before its store has read it."""
    from cute_moe.lab.fig_pipeline import epilogue_boxes

    svg = figures["store_ring.svg"]
    cfg, _ = step("production").layer_gemm2(step("production").LAYERS["store_ring"])
    p = step("production").ptx_facts(cfg)
    stores = elements(svg, "store")
    assert len(stores) == epilogue_boxes(cfg) == p["tma_stores"]  # one TMA store per box, as the PTX has
    assert all(s["buf"] == s["e"] % cfg.epi_stages for s in stores)
    assert p["store_waits"] == [0, cfg.epi_stages - 1]  # producer_tail and producer_acquire
    for b in range(cfg.epi_stages):  # a buffer's uses, write then read-out, never overlap
        held = sorted((h["start"], h["end"]) for h in elements(svg, "held") if h["buf"] == b)
        assert all(nxt[0] >= prev[1] - 1e-9 for prev, nxt in zip(held, held[1:]))
    assert all(w["waits-for"] == w["e"] - (cfg.epi_stages - 1) for w in elements(svg, "wait"))


def test_pingpong_figure_reads_back(figures):
    from cute_moe.gemm_parts import EPI_ORDER_BARRIER_ID, MMA_ORDER_BARRIER_ID

    svg = figures["pingpong.svg"]
    prod = step("production")
    cfg, k_steps = prod.layer_gemm2(prod.LAYERS["pingpong"])
    assert cfg.pingpong and prod.ptx_facts(cfg)["order_grants"] == [MMA_ORDER_BARRIER_ID, EPI_ORDER_BARRIER_ID]
    main = {m["tile"]: m for m in elements(svg, "mainloop")}
    epi = {e["tile"]: e for e in elements(svg, "epilogue")}
    for i, m in main.items():
        assert m["wg"] == i % 2 and m["waits"] == MMA_ORDER_BARRIER_ID + m["wg"]
        assert epi[i]["waits"] == EPI_ORDER_BARRIER_ID + m["wg"]
        assert abs(m["end"] - m["start"] - k_steps) < 1e-9
        assert epi[i]["start"] >= m["end"]  # wait_group 0 before the epilogue
        if i:  # the tensor cores take one warpgroup at a time; epilogues take turns too
            assert m["start"] >= main[i - 1]["end"] and epi[i]["start"] >= epi[i - 1]["end"]
        if i > 1:
            assert m["start"] >= epi[i - 2]["end"]  # a warpgroup's next main loop after its own epilogue


def test_cluster_multicast_figure_reads_back(figures):
    from cute_moe.layouts import plan_layouts

    svg = figures["cluster_multicast.svg"]
    prod = step("production")
    cfg, _ = prod.layer_gemm2(prod.LAYERS["multicast"])
    data = dict(re.findall(r'data-([\w-]+)="(\d+)"', svg.split("<title>")[0]))
    half, token, half_bytes = int(data["half-rows"]), int(data["token-bytes"]), int(data["half-bytes"])
    assert cfg.cluster == 2 and half * cfg.cluster == cfg.weights_tile
    assert token + cfg.cluster * half_bytes == plan_layouts(cfg)["stage_bytes"]  # the full barrier's tx count
    assert prod.ptx_facts(cfg)["rank_shifts"] == sorted([half.bit_length() - 1, half_bytes.bit_length() - 1])
    loads = elements(svg, "load")
    lines = elements(svg, "multicast")
    for ld in loads:  # every half goes to every CTA of the cluster
        assert sorted(x["to"] for x in lines if (x["rank"], x["k"]) == (ld["rank"], ld["k"])) == [0, 1]
    for f in elements(svg, "full"):  # a full barrier completes when both halves have landed
        assert f["at"] >= max(ld["lands"] for ld in loads if ld["k"] == f["k"]) - 1e-9
    release = {(x["rank"], x["k"]): x["at"] for x in elements(svg, "release")}
    for ld in loads:  # a slot is reloaded only after both CTAs released its previous use
        if ld["k"] >= cfg.stages:
            assert ld["at"] >= max(release[(q, ld["k"] - cfg.stages)] for q in range(cfg.cluster))


def test_production_timelines_follow_the_config(monkeypatch):
    """Another epi_stages in the plan's config gives another ring (and another PTX wait depth)."""
    prod = step("production")
    cfg, k = prod.layer_gemm2(prod.LAYERS["store_ring"])
    monkeypatch.setattr(prod, "layer_gemm2", lambda layer: (cfg.replace(epi_stages=3, stages=3), k))
    r = prod.store_ring()
    assert r["depth"] == 2 and {e["buf"] for e in r["events"]} == {0, 1, 2}
    assert r["ptx"]["store_waits"] == [0, 2]

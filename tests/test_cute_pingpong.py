"""CPU lane for the ping-pong schedule of the grouped GEMM (``GemmConfig.schedule="pingpong"``), bf16 and FP8.

Without a GPU: the config's rules and twin, the sm_90a PTX of the ping-pong kernels (the WGMMAs of
the cooperative twin, the order barriers each warpgroup waits on and arrives at — evaluated per
thread id with ``test_cute_store``'s walk of the PTX —, one store thread per warpgroup, the empty
barriers' count), ptxas's register report (no spills), and the epilogue's register runs.  The
GPU lane (``tests/test_cute_gpu.py``) checks that the results are the cooperative kernel's, bit for bit.
"""

import os
import re
from collections import Counter

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cute_moe = pytest.importorskip("cute_moe")

from test_cute_store import COMMIT, LOAD, STORE, WAIT, Ptx, _threads_reaching  # noqa: E402

from cute_moe.config import GemmConfig, max_stages  # noqa: E402
from cute_moe.gemm_parts import EPI_ORDER_BARRIER_ID, EPILOGUE_BARRIER_ID, MMA_ORDER_BARRIER_ID  # noqa: E402
from cute_moe.gemm_rules import PINGPONG_MAX_K_STEPS, pingpong_config, short_k_gemm2  # noqa: E402
from cute_moe.limits import PINGPONG_ACCUMULATOR_REGISTERS  # noqa: E402
from cute_moe.plan import choose_config  # noqa: E402
from cute_moe.ptx import mma_instruction  # noqa: E402


def _cfg(**kw):
    cfg = GemmConfig(stages=2, **kw)
    return cfg.replace(stages=max_stages(cfg))


# The bf16 layer's prefill GEMMs (T = 4096: the normal path's 128-token tiles, two warpgroups) and
# their ping-pong twins; a 128-row ping-pong tile (two WGMMAs along M per warpgroup); swap-AB twins.
PREFILL_GEMM1 = choose_config(1024, 768, 2048, gated=True).replace(gather_rows=True)  # T128xW128 silu gather
PREFILL_GEMM2 = choose_config(1024, 2048, 768, row_scale=True)  # T128xW256, routing weights in the epilogue
COOPERATIVE = {
    "gemm1-gated-gather": PREFILL_GEMM1,
    "gemm2-row-scale": PREFILL_GEMM2,
    "plain-128x128": _cfg(tokens_tile=128, weights_tile=128),
    "swap-w128-t32": _cfg(swap_ab=True, tokens_tile=32, weights_tile=128),
    "swap-w128-t8": _cfg(swap_ab=True, tokens_tile=8, weights_tile=128),
}
PINGPONG = {name: pingpong_config(cfg) for name, cfg in COOPERATIVE.items()}
PINGPONG["plain-128x128-one-wg"] = _cfg(tokens_tile=128, weights_tile=128, schedule="pingpong")
PINGPONG["swap-w128-t64-one-wg"] = _cfg(swap_ab=True, tokens_tile=64, weights_tile=128, schedule="pingpong")
PINGPONG["gated-128x64"] = _cfg(tokens_tile=128, weights_tile=64, gated=True, schedule="pingpong")


def _fp8_plan_gemms():
    """The FP8 layer's GEMMs as the plan picks them: Qwen3-30B-A3B fp8_tensor prefill (the gated GEMM1 with
    the intermediate's amax in its epilogue, 128 × 64; GEMM2 128 × 128 with the routing weights) and
    fp8_block at T = 32 (swap-AB GEMM2, 128 weight rows over two warpgroups)."""
    from moe_spec.validate import MoEDims

    pre = cute_moe.plan(MoEDims(T=4096, E=128, K=2048, I=768, top_k=8), "fp8_tensor")
    dec = cute_moe.plan(MoEDims(T=32, E=128, K=2048, I=768, top_k=8), "fp8_block")
    return {"fp8-gemm1-gated-epi": pre.gemm1, "fp8-gemm2-row-scale": pre.gemm2, "fp8-block-swap-gemm2": dec.gemm2}


FP8_COOPERATIVE = _fp8_plan_gemms()
COOPERATIVE.update(FP8_COOPERATIVE)
PINGPONG.update({name: pingpong_config(cfg) for name, cfg in FP8_COOPERATIVE.items()})

_WGMMA = r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.[\w.]+"


def test_the_prefill_configs_are_what_the_layer_runs():
    from moe_spec.problem import get_shape
    from moe_spec.validate import MoEDims

    for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"):
        s = get_shape(spec)
        p = cute_moe.plan(MoEDims(T=4096, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k))
        # the plan's GEMM1 runs on clusters of two (cluster.py), its GEMM2 when K is long (Mixtral-8x7B)
        assert p.gemm1 == PREFILL_GEMM1.replace(cluster=2) and p.gemm1.schedule == "cooperative", spec
        if s.intermediate <= PINGPONG_MAX_K_STEPS * PREFILL_GEMM2.tile_k:  # DeepSeek-V3 TP8: I = 256, 4 K steps
            assert spec == "deepseek-v3:tp8"
            assert (
                p.gemm2
                == short_k_gemm2(PREFILL_GEMM2, s.intermediate)
                == PREFILL_GEMM2.replace(weights_tile=128, schedule="pingpong", stages=p.gemm2.stages)
            ), spec
            assert p.gemm2.stages > PREFILL_GEMM2.stages and p.gemm2.cluster == 1
        else:
            cluster = 2 if spec == "mixtral-8x7b" else 1
            assert p.gemm2 == PREFILL_GEMM2.replace(cluster=cluster) and p.gemm2.schedule == "cooperative", spec


def test_only_a_short_bf16_normal_path_gemm2_turns_pingpong():
    """The rule of schedule.short_k_gemm2: FP8, swap-AB, a token tile under 128 and a K deeper than
    PINGPONG_MAX_K_STEPS steps keep the cooperative config."""
    k_short = PINGPONG_MAX_K_STEPS * PREFILL_GEMM2.tile_k
    assert short_k_gemm2(PREFILL_GEMM2, k_short).schedule == "pingpong"
    assert short_k_gemm2(PREFILL_GEMM2, k_short + PREFILL_GEMM2.tile_k) == PREFILL_GEMM2
    for cfg in (COOPERATIVE["swap-w128-t32"], PREFILL_GEMM2.replace(tokens_tile=64, consumer_warpgroups=1)):
        assert short_k_gemm2(cfg, 64) == cfg
    fp8 = cute_moe.choose_config(512, 7168, 256, row_scale=True, quant="fp8_tensor")
    assert short_k_gemm2(fp8, 256) == fp8


# ---- the config ---------------------------------------------------------------------------------
def test_the_twin_has_one_warpgroups_rows_of_the_cooperative_tile():
    g1, g2 = PINGPONG["gemm1-gated-gather"], PINGPONG["gemm2-row-scale"]
    assert (g1.tokens_tile, g1.weights_tile, g1.gated, g1.gather_rows, g1.schedule) == (64, 128, True, True, "pingpong")
    assert (g2.tokens_tile, g2.weights_tile, g2.row_scale) == (64, 256, True)
    swap = PINGPONG["swap-w128-t32"]
    assert (swap.weights_tile, swap.tokens_tile, swap.tile_m) == (64, 32, 64)
    for name, cfg in COOPERATIVE.items():
        twin = PINGPONG[name]
        assert twin.tile_warpgroups == 1 and twin.consumer_warpgroups == 2 and twin.threads == cfg.threads == 384
        # one warpgroup holds the whole tile: the cooperative kernel's registers per thread
        assert twin.accumulator_registers == cfg.accumulator_registers <= PINGPONG_ACCUMULATOR_REGISTERS
        # each warpgroup its own staging buffers, 64-row sub-tiles
        assert twin.epi_buffers == 2 * twin.epi_stages and twin.epi_tile == (64, cfg.epi_tile[1])
        assert twin.smem_bytes() == (
            twin.stages * twin.stage_bytes + twin.epi_buffers * 64 * twin.epi_tile[1] * twin.c_bytes + 1024
        )
        assert mma_instruction(twin) == mma_instruction(cfg)
    assert (
        pingpong_config(PINGPONG["plain-128x128-one-wg"].replace(schedule="cooperative", consumer_warpgroups=1))
        == PINGPONG["plain-128x128-one-wg"]
    )  # a one-warpgroup tile keeps its rows
    # FP8: the block and the promoted accumulator of a whole 64-row tile in one warpgroup, as the cooperative
    # kernel holds them; the gated GEMM1 keeps its epilogue's amax
    fp8 = PINGPONG["fp8-gemm1-gated-epi"]
    assert (fp8.tokens_tile, fp8.weights_tile, fp8.accumulator_registers) == (64, 64, PINGPONG_ACCUMULATOR_REGISTERS)
    assert (
        fp8.two_level
        and fp8.gated
        and fp8.epilogue_quant == "amax" == FP8_COOPERATIVE["fp8-gemm1-gated-epi"].epilogue_quant
    )
    with pytest.raises(ValueError, match=r"under schedule='pingpong' one warpgroup holds the whole 128×128 tile"):
        FP8_COOPERATIVE["fp8-gemm2-row-scale"].replace(schedule="pingpong")


def test_the_plan_names_the_schedule():
    from moe_spec.validate import MoEDims

    dims = MoEDims(T=4096, E=128, K=2048, I=768, top_k=8)
    p = cute_moe.plan(dims, configs=(PINGPONG["gemm1-gated-gather"], PINGPONG["gemm2-row-scale"]))
    assert p.describe() == (
        "G1 T64xW128 k64 s5 silu gather pingpong m64n128k16 | G2 T64xW256 k64 s5 pingpong m64n256k16"
    )
    assert p.align_tile == 64
    assert "pingpong" not in cute_moe.plan(dims).describe()


# ---- the PTX ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(PINGPONG), ids=list(PINGPONG))
def compiled(request):
    cfg = PINGPONG[request.param]
    return request.param, cfg, cute_moe.compile_ptx(cfg)


def _groups(ptx):
    """WGMMAs per commit group (one K step of one warpgroup)."""
    return Counter(n for n in (len(re.findall(_WGMMA, g)) for g in ptx.split("wgmma.commit_group")) if n)


def test_ptx_has_the_intended_wgmma_per_k_step(compiled):
    """sm_90a WGMMAs of one warpgroup's tile: tile_m/64 along M, tile_k/16 along K, twice when gated;
    the same instruction as the cooperative twin, no local memory in the PTX."""
    name, cfg, ptx = compiled
    assert ".target sm_90a" in ptx
    k, operands = (32, "e4m3.e4m3") if cfg.quant else (16, "bf16.bf16")
    assert set(re.findall(_WGMMA, ptx)) == {f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k{k}.f32.{operands}"}
    per_step = cfg.tile_m // 64 * cfg.tile_k // k * (2 if cfg.gated else 1)
    assert set(_groups(ptx)) == {per_step}
    if name in COOPERATIVE:  # the cooperative kernel: one warpgroup's 64 rows per step, the same instruction
        coop = cute_moe.compile_ptx(COOPERATIVE[name])
        assert set(re.findall(_WGMMA, coop)) == set(re.findall(_WGMMA, ptx))
        assert set(_groups(coop)) == {per_step}
    assert not re.search(r"\.local\b|\bld\.local|\bst\.local", ptx)


_BAR = re.compile(r"^bar\.(sync|arrive)\b")


def _barriers_per_warpgroup(cfg, ptx: Ptx) -> dict:
    """{warpgroup: {(bar.sync | bar.arrive, barrier id, thread count)}}, the id evaluated for every thread."""
    sites = [i for i, line in enumerate(ptx.lines) if _BAR.search(line)]
    out: dict = {}
    for tid in range(cfg.threads):
        seen, cache = ptx.reachable(tid), {}
        for i in sites:
            if i in seen:
                _, op, args = ptx._split(ptx.lines[i])
                count = int(args[1]) if len(args) > 1 else None
                out.setdefault(tid // 128, set()).add((op, ptx._operand(args[0], tid, cache), count))
    return out


def test_each_warpgroup_waits_on_its_own_order_barriers_and_opens_the_others(compiled):
    """Consumer warpgroup w (threads 128·(w+1) …): bar.sync on its epilogue barrier (1 + w, 128
    threads) and on its order barriers (main loop 3 + w, epilogue 5 + w; 256 threads), bar.arrive on
    the other warpgroup's.  The producer only joins the CTA-wide barrier 0 of the set-up."""
    _, cfg, text = compiled
    bars = _barriers_per_warpgroup(cfg, Ptx(text))
    assert bars[0] == {("bar.sync", 0, None)}
    for wg in (0, 1):
        other = 1 - wg
        assert bars[1 + wg] == {
            ("bar.sync", 0, None),
            ("bar.sync", EPILOGUE_BARRIER_ID + wg, 128),
            ("bar.sync", MMA_ORDER_BARRIER_ID + wg, 256),
            ("bar.sync", EPI_ORDER_BARRIER_ID + wg, 256),
            ("bar.arrive", MMA_ORDER_BARRIER_ID + other, 256),
            ("bar.arrive", EPI_ORDER_BARRIER_ID + other, 256),
        }, wg
    assert (EPILOGUE_BARRIER_ID + 1) < MMA_ORDER_BARRIER_ID and MMA_ORDER_BARRIER_ID + 1 < EPI_ORDER_BARRIER_ID < 15


def test_each_warpgroup_has_one_store_thread_of_its_own(compiled):
    """test_cute_store's rule per warpgroup: thread 0 of each consumer warpgroup (128 and 256) issues
    its TMA stores and commits and waits on exactly those; thread 0 issues every TMA load."""
    name, cfg, text = compiled
    ptx = Ptx(text)
    stores = set().union(*_threads_reaching(ptx, cfg.threads, STORE).values())
    assert stores == {128, 256}
    for pattern in (COMMIT, WAIT):
        for line, threads in _threads_reaching(ptx, cfg.threads, pattern).items():
            assert threads == stores, ptx.lines[line]
    assert set().union(*_threads_reaching(ptx, cfg.threads, LOAD).values()) == {0}


def test_a_stage_is_released_by_one_warpgroup(compiled):
    """The empty barriers count 4 arrivals (the warps of the one warpgroup whose tile the stage holds);
    every consumer warp's lane 0 arrives; the full barriers keep the producer's count."""
    _, cfg, text = compiled
    ptx = Ptx(text)
    counts = [ptx.value(ptx._split(line)[2][1], 0, {}) for line in ptx.lines if line.startswith("mbarrier.init")]
    full, empty = counts[: cfg.stages], counts[cfg.stages : 2 * cfg.stages]
    assert empty == [4] * cfg.stages and full == [129 if cfg.gather_rows else 1] * cfg.stages, counts
    arrive = re.compile(r"^mbarrier\.arrive\.shared")
    for threads in _threads_reaching(ptx, cfg.threads, arrive).values():
        assert threads == set(range(128, cfg.threads, 32))


@pytest.mark.parametrize(
    "name", ["gemm1-gated-gather", "gemm2-row-scale", "plain-128x128-one-wg", "gated-128x64", *FP8_COOPERATIVE]
)
def test_ptxas_reports_no_spills(name, capfd):
    """ptxas (the DSL's, ``remarks{ptx}``) on the ping-pong kernel: no stack frame, no spill stores or
    loads, at most the 232 registers the consumers ask for."""
    import cutlass.cute as cute

    from cute_moe.gemm import CONSUMER_REGISTERS
    from cute_moe.gemm_plan import GemmLaunch, fake_arguments

    cfg = PINGPONG[name]
    capfd.readouterr()
    cute.compile(GemmLaunch(cfg, 132), *fake_arguments(cfg), options="remarks{ptx}")
    text = "".join(capfd.readouterr())
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    used = re.search(r"Used (\d+) registers", text)
    assert frame and used, text[-2000:]
    assert frame.groups() == ("0", "0", "0"), frame.group(0)
    assert int(used.group(1)) <= CONSUMER_REGISTERS


@pytest.mark.parametrize("name", ["gemm2-row-scale", "plain-128x128-one-wg", "swap-w128-t64-one-wg", "gated-128x64"])
def test_the_epilogue_sub_tiles_are_runs_of_registers(name):
    """The epilogue copies sub-tile e from the accumulator registers e·n … e·n + n − 1 (n registers per
    sub-tile) and stores it to box e of the sub-tile grid (row-major).  For a 128-row ping-pong tile
    (two WGMMAs along M in one warpgroup) every thread's run e must lie in box e: checked for all 128
    threads with the kernel's own tiled MMA and stmatrix partition."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warp

    from cute_moe.gemm_plan import KernelPlan
    from cute_moe.layouts import _quietly  # the loops over threads and registers are unrolled on purpose

    cfg = PINGPONG[name]
    em, en = cfg.epi_tile
    grid_n = cfg.tile_n // en
    seen = []  # (thread, register run index, the register's (m, n), where the epilogue stores it)

    @cute.jit
    def probe():
        plan = KernelPlan(cfg)
        stmatrix = cute.make_copy_atom(
            warp.StMatrix8x8x16bOp(cfg.swap_ab, 4 if cfg.tile_n >= 16 else 2), cutlass.BFloat16
        )
        r2s = cute.make_tiled_copy_S(stmatrix, cute.make_tiled_copy_C_atom(stmatrix, plan.tiled_mma))
        sC = cute.make_tensor(
            cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.smem, assumed_align=1024), plan.epi_smem_staged.outer
        )
        n = cute.size(cute.shape(r2s.get_slice(0).partition_S(sC))[:3])
        for t in cutlass.range_constexpr(128):
            coords = plan.tiled_mma.get_slice(t).partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            # the (m, n) in the staging buffer (one box) that stmatrix gives the sub-tile's register v
            box = r2s.get_slice(t).partition_S(cute.make_identity_tensor((em, en)))
            # the register order the epilogue walks: the retiled accumulator (a layout over register offsets)
            order = r2s.retile(cute.make_rmem_tensor(coords.shape, cutlass.Float32)).layout
            for i in cutlass.range_constexpr(cute.size(order)):
                m, c = coords[order(i)]
                e, v = i // n, i % n
                bm, bn = box[v]
                seen.append((t, i, (int(m), int(c)), ((e // grid_n) * em + int(bm), (e % grid_n) * en + int(bn))))

    _quietly(probe)  # (compared out here: a Python `if` inside a jit function is traced, not evaluated)
    assert len(seen) == 128 * cfg.accumulator_registers // (2 if cfg.gated else 1)
    bad = [s for s in seen if s[2] != s[3]]
    assert not bad, bad[:8]


# ---- the study command (its GPU run is the lead's; here what it times and its refusals) -------------
def test_bench_times_the_layers_gemms_and_their_twins():
    from cute_moe.lab.bench_pingpong import variants

    g1 = variants(PREFILL_GEMM1, alt=True)
    assert g1["cooperative"] == PREFILL_GEMM1 and g1["pingpong"] == PINGPONG["gemm1-gated-gather"]
    assert (g1["pingpong-128"].tokens_tile, g1["pingpong-128"].weights_tile, g1["pingpong-128"].gather_rows) == (
        128,
        64,
        True,
    )
    g2 = variants(PREFILL_GEMM2, alt=False)
    assert list(g2) == ["cooperative", "pingpong"] and g2["pingpong"] == PINGPONG["gemm2-row-scale"]
    assert variants(PREFILL_GEMM2, alt=True)["pingpong-128"].tile_m == 128
    for cfg in (g1["pingpong-128"], variants(PREFILL_GEMM2, alt=True)["pingpong-128"]):  # they compile
        assert set(re.findall(_WGMMA, cute_moe.compile_ptx(cfg))) == {mma_instruction(cfg)}


def test_bench_report_lists_every_cell():
    from cute_moe.lab.bench_pingpong import markdown

    cell = dict(shape="qwen3-30b-a3b", gemm="gemm1", tile="T64xW128 s5", us=1.0, tflops=2.0, equal=True)
    result = dict(
        date="d",
        device="H200",
        commit="c",
        command="python -m cute_moe.lab.bench_pingpong --out x",
        wall_s=1.0,
        cells=[dict(cell, variant="cooperative"), dict(cell, variant="pingpong", speedup=1.1)],
    )
    text = markdown(result)
    assert "| qwen3-30b-a3b | gemm1 | pingpong | T64xW128 s5 | 1.0 | 2.0 | 1.1 | True |" in text
    assert "| qwen3-30b-a3b | gemm1 | cooperative | T64xW128 s5 | 1.0 | 2.0 | — | True |" in text
    assert "- commit: `c`" in text


def test_bench_refuses_a_used_out_and_a_cpu(tmp_path, capsys):
    from cute_moe.lab.bench_pingpong import main

    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "used")])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "new"), "--shapes", "nope"]) == 2
    assert "--shapes" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            main(["--out", str(tmp_path / "new")])
        assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


# ---- the protocol, modelled: ring parities and order barriers under random interleavings ------------
class _State:
    """cutlass.pipeline.PipelineState's arithmetic (index, phase; advance by n)."""

    def __init__(self, stages, phase=0):
        self.stages, self.index, self.phase = stages, 0, phase

    def advance(self, n=1):
        self.index += n
        self.phase ^= (self.index // self.stages) % 2
        self.index %= self.stages


def _run_protocol(stages, k_tiles, n_tiles, seed, ordered=True):
    """One CTA: the producer fills global stages 0 … n_tiles·k_tiles − 1 in order; consumer warpgroup w
    takes tiles w, w + 2, … with the kernel's ring states (start w·k_tiles in, skip k_tiles after each
    tile), waits on a slot's full barrier by parity (``mbarrier.try_wait.parity``: true while the
    barrier's completed-phase count has the other parity), releases a stage after its next wait, and,
    when ``ordered``, waits for its turn on the main-loop order barrier and grants the other warpgroup
    its turn after its last wait.  Returns (stages read per warpgroup, wrong reads, deadlocked)."""
    import random

    rng = random.Random(seed)
    full_done, empty_done, data = [0] * stages, [0] * stages, [None] * stages
    grants = [1, 0]  # warpgroup 1 opens warpgroup 0's first main loop

    def producer():
        st = _State(stages, phase=1)  # PipelineUserType.Producer starts at phase 1 (slots free)
        for g in range(n_tiles * k_tiles):
            while (empty_done[st.index] & 1) == st.phase:
                yield
            data[st.index] = g
            full_done[st.index] += 1
            st.advance()
            yield

    reads, wrong = ([], []), []

    def consumer(w):
        read, release = _State(stages), _State(stages)
        read.advance(w * k_tiles) if w else None
        release.advance(w * k_tiles) if w else None
        for tile in range(w, n_tiles, 2):
            if ordered:
                while grants[w] == 0:
                    yield
                grants[w] -= 1
            for k in range(k_tiles):
                while (full_done[read.index] & 1) == read.phase:
                    yield
                got, want = data[read.index], tile * k_tiles + k
                reads[w].append(got)
                if got != want:
                    wrong.append((w, tile, k, got, want))
                if k:
                    empty_done[release.index] += 1
                    release.advance()
                read.advance()
                yield
            if ordered:
                grants[1 - w] += 1
            empty_done[release.index] += 1
            release.advance()
            read.advance(k_tiles)
            release.advance(k_tiles)
            yield

    agents = [producer(), consumer(0), consumer(1)]
    for _ in range(10**5):
        if not agents:
            return reads, wrong, False
        a = rng.choice(agents)
        try:
            next(a)
        except StopIteration:
            agents.remove(a)
    return reads, wrong, True


@pytest.mark.parametrize("stages, k_tiles", [(2, 1), (3, 2), (5, 4), (4, 8), (5, 7), (6, 3), (8, 2)])
def test_the_ring_protocol_reads_every_stage_of_its_own_tiles(stages, k_tiles):
    """With the order barrier, every warpgroup reads exactly the stages of its own tiles, in order, under
    random interleavings, for rings shallower and deeper than a tile, an odd and an even tile count."""
    for n_tiles in (1, 2, 5, 6):
        for seed in range(20):
            reads, wrong, deadlocked = _run_protocol(stages, k_tiles, n_tiles, seed)
            assert not wrong and not deadlocked, wrong[:4]
            for w in (0, 1):
                assert reads[w] == [t * k_tiles + k for t in range(w, n_tiles, 2) for k in range(k_tiles)]


def test_without_the_order_barrier_a_parity_wait_can_pass_early():
    """The order barrier is what makes the parity waits safe: without it warpgroup 1 can wait on a slot
    two fills ahead of the barrier, see the parity it wants, and read warpgroup 0's data (whose
    early release then also derails the ring)."""
    runs = [
        _run_protocol(stages, k_tiles, 4, seed, ordered=False)
        for stages, k_tiles in ((2, 4), (3, 6))
        for seed in range(10)
    ]
    assert any(wrong for _, wrong, _ in runs)


def test_the_schedule_bench_variants_of_the_plan():
    """``python -m cute_moe.lab.bench_schedule``'s variants: both GEMMs' ping-pong twins (single CTAs), and the
    normal-path GEMMs on clusters of two, or either for one GEMM alone — in every format; none where the plan
    runs the one launch."""
    from cute_moe.lab.bench_schedule import variant_plan
    from cute_moe.moe import plan_switches
    from moe_spec.validate import MoEDims

    prefill, decode = MoEDims(T=4096, E=128, K=2048, I=768, top_k=8), MoEDims(T=1, E=128, K=2048, I=768, top_k=8)
    assert variant_plan(decode, None, "pingpong")[1] is None  # bf16 T = 1: the one launch
    assert variant_plan(decode, "fp8_tensor", "cluster")[1] is None  # swap-AB GEMMs: nothing to cluster
    for quant in (None, "fp8_tensor", "fp8_channel", "fp8_block"):
        p, pp = variant_plan(prefill, quant, "pingpong")
        for coop, twin in ((p.gemm1, pp.gemm1), (p.gemm2, pp.gemm2)):
            assert twin == pingpong_config(coop.replace(cluster=1)) and twin.schedule == "pingpong"
            assert twin.tile_m == 64 and twin.epilogue_quant == coop.epilogue_quant and twin.quant == coop.quant
        p, pp1 = variant_plan(prefill, quant, "pingpong1")  # GEMM1's twin alone
        assert (pp1.gemm1, pp1.gemm2) == (pingpong_config(p.gemm1.replace(cluster=1)), p.gemm2)
        p, pp2 = variant_plan(prefill, quant, "pingpong2")  # GEMM2's twin alone
        assert (pp2.gemm1, pp2.gemm2) == (p.gemm1, pingpong_config(p.gemm2.replace(cluster=1)))
        if quant is not None:  # (bf16's plan clusters already)
            p, cl = variant_plan(prefill, quant, "cluster")
            assert (cl.gemm1, cl.gemm2) == (p.gemm1.replace(cluster=2), p.gemm2.replace(cluster=2))
            p, cl1 = variant_plan(prefill, quant, "cluster1")  # GEMM1 on clusters alone
            assert (cl1.gemm1, cl1.gemm2) == (p.gemm1.replace(cluster=2), p.gemm2)
            p, cl2 = variant_plan(prefill, quant, "cluster2")  # GEMM2 on clusters alone
            assert (cl2.gemm1, cl2.gemm2) == (p.gemm1, p.gemm2.replace(cluster=2))
    assert variant_plan(prefill, None, "gather_quant")[1] is None  # bf16: no x to quantize
    small = MoEDims(T=8, E=128, K=2048, I=768, top_k=8)
    for on in (True, False):  # a switch's variant is the plan with the switch the other way
        with plan_switches(GATHER_QUANT=on, GATHER_QUANT_NORMAL_TOP_K=None, SWAP_AB_EPILOGUE_AMAX=on):
            for quant in ("fp8_tensor", "fp8_channel", "fp8_block"):
                p, gq = variant_plan(prefill, quant, "gather_quant")  # the plan's GEMMs, x quantized or not
                assert p.gather_quant == on and gq.gather_quant != on and (gq.gemm1, gq.gemm2) == (p.gemm1, p.gemm2)
                p, sa = variant_plan(small, quant, "swap_amax")  # the swap-AB GEMM1's epilogue amax, or not
                assert p.gemm1.swap_ab and p.gemm1.epilogue_quant == ("amax" if on else None)
                assert sa.gemm1 == p.gemm1.replace(epilogue_quant=None if on else "amax") and sa.gemm2 == p.gemm2
            assert variant_plan(prefill, "fp8_tensor", "swap_amax")[1] is None  # the normal path: its epilogue does

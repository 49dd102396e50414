"""CPU lane for the one-launch CuTe decode kernel (cute_moe/decode*.py): its PTX for sm_90a at three model
sizes, the host's task counts, grid and workspace sizes derived by hand, the routing tables, a model of
the dependency protocol (every interleaving finishes; a wrong numbering deadlocks), and named errors.

The kernel cannot run here (no GPU): tests/test_cute_decode_gpu.py runs it against the oracle.
"""

import os
import random
import re

import pytest
from protocol_model import schedule

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")

from cute_moe import decode_parts as dp  # noqa: E402
from cute_moe.decode import (  # noqa: E402
    check_decode_sizes,
    compile_decode,  # noqa: E402
    decode_fused_moe,
    new_workspace,
    workspace_shapes,
)
from cute_moe.decode_kernel import DecodeKernel  # noqa: E402
from moe_spec.problem import get_shape  # noqa: E402
from moe_spec.validate import MoEDims  # noqa: E402

SHAPES = {  # (E, top_k, K, I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3:tp8": (256, 8, 7168, 256),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def test_the_catalog_has_the_sizes_these_tests_derive_by_hand():
    for spec, (E, top_k, K, I) in SHAPES.items():
        s = get_shape(spec)
        assert (s.num_experts, s.top_k, s.hidden, s.intermediate) == (E, top_k, K, I)


# ---- PTX ------------------------------------------------------------------------------------------
def _static_ptx(E, top_k, K, I, ids_dtype="int32"):
    """The kernel compiled for one layer's sizes as static extents (T = 64 / top_k tokens)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    from cute_moe.cache import ptx_options
    from cute_moe.decode import IDS_DTYPES
    from cute_moe.runtime import fake_stream

    T, bf = dp.PAIR_LANES // top_k, cutlass.BFloat16
    rows = lambda dt, shape, align=16: make_fake_compact_tensor(dt, shape, stride_order=(1, 0), assumed_align=align)  # noqa: E731
    args = (
        rows(bf, (T, K)),
        make_fake_tensor(bf, (I, K, 2, E), stride=(K, 1, I * K, 2 * I * K), assumed_align=16),
        make_fake_tensor(bf, (K, I, E), stride=(I, 1, K * I), assumed_align=16),
        rows(cutlass.Float32, (T, top_k), 4),
        rows(IDS_DTYPES[ids_dtype], (T, top_k), 8),
        rows(bf, (dp.PAIR_LANES, I)),
        rows(bf, (dp.PAIR_LANES, K)),
        rows(bf, (T, K)),
        make_fake_compact_tensor(cutlass.Int32, (dp.counter_words(K),), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Float32, (dp.exchange_words(132)[0],), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int32, (dp.exchange_words(132)[1],), assumed_align=4),
        cutlass.Int32(132),
        fake_stream(),
    )
    return cute.compile(DecodeKernel(), *args, options=ptx_options(True)).__ptx__


@pytest.fixture(scope="module")
def ptx():
    """The runtime kernel (every size symbolic), int32 ids."""
    return compile_decode("int32", keep_ptx=True).__ptx__


def _set(pattern, text):
    return set(re.findall(pattern, text))


def _check_instructions(text):
    # the MMA: swap-AB, 64 weight rows × 16 token rows × K 16, bf16 in, fp32 accumulate, nothing else
    assert _set(r"wgmma\.mma_async\.sync\.aligned\.\w+\.[\w.]+", text) == {
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
    }
    # TMA: W1's boxes through its 4-D view (I, K, half, E), W2's through (K, I, E), on the ring's mbarriers
    assert _set(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes", text) == {
        "cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier::complete_tx::bytes",
        "cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes",
    }
    # the token rows: 16-byte cp.async through L2, each lane's arrival counted on the stage's barrier
    assert _set(r"cp\.async\.\w+\.shared\.global \[[^]]+\], \[[^]]+\], \d+", text) and "cp.async.ca" not in text
    assert {int(n) for n in re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (\d+)", text)} == {16}
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in text
    assert "fence.proxy.async.shared::cta" in text  # generic-proxy rows → WGMMA's async proxy
    # the protocol: acquire spins, fence + release increments, the exit count, the ticket
    assert "ld.acquire.gpu.global.b32" in text
    assert "fence.acq_rel.gpu" in text
    assert "red.release.gpu.global.add.s32" in text
    assert "atom.global.acq_rel.add.u32" in text
    assert re.search(r"atom\.global\.add\.u32\s+%r\d+, \[%rd\d+\], 1;", text)  # the ticket
    assert "atom.global.or.b32" in text  # the error word
    # deterministic: no floating-point atomics anywhere
    assert not re.search(r"(atom|red)\.[\w.]*\.(f32|f16|bf16|f64)", text)
    # one CTA shape: the consumer warpgroup and the producer warp; no register reallocation
    assert ".reqntid 160, 1, 1" in text and "setmaxnreg" not in text
    # the combine and the epilogues round once to bf16; the combine reads y in 16-byte vectors
    assert "cvt.rn.bf16.f32" in text and "ld.global.v4.b32" in text


def test_runtime_kernel_has_the_designed_instructions(ptx):
    _check_instructions(ptx)


@pytest.mark.parametrize("spec", list(SHAPES))
def test_kernel_compiles_for_sm90a_at_model_sizes(spec):
    text = _static_ptx(*SHAPES[spec])
    assert re.search(r"^\.target sm_90a", text, re.M)
    _check_instructions(text)


def test_gemm2_weights_are_on_their_way_before_the_wait(ptx):
    """B's W2 boxes are issued before the acquire spin on GEMM1's counter, the h rows after it: in the
    PTX, W2's first 3-D TMA precedes the first ld.acquire with no cp.async between them."""
    first_3d = ptx.index("cp.async.bulk.tensor.3d")
    first_acquire = ptx.index("ld.acquire.gpu")
    assert first_3d < first_acquire
    assert "cp.async.cg" not in ptx[first_3d:first_acquire]
    assert "cp.async.cg" in ptx[first_acquire:]


def test_halved_tiles_compile_with_the_exchange(monkeypatch, ptx):
    """With HALF_TASKS on: the same instructions, a half's WGMMAs (8 per stage into one accumulator) beside
    the whole tile's, the arrival as a second acquire-release add beside the exit count, the second
    token ring's cp.async; and the sums exchanged as plain fp32 stores and loads, no float atomics."""
    plain = _static_ptx(*SHAPES["deepseek-v3:tp8"])
    monkeypatch.setattr(dp, "HALF_TASKS", True)  # the one switch: the kernel and the host read it there
    halved = compile_decode("int32", keep_ptx=True).__ptx__
    _check_instructions(halved)
    wgmma = r"wgmma\.mma_async\.sync"
    assert len(re.findall(wgmma, halved)) == len(re.findall(wgmma, ptx)) + 16
    acq_rel_add = r"atom\.global\.acq_rel\.add\.u32"
    assert len(re.findall(acq_rel_add, halved)) == len(re.findall(acq_rel_add, ptx)) + 1
    assert halved.count("cp.async.cg") > ptx.count("cp.async.cg")
    text = _static_ptx(*SHAPES["deepseek-v3:tp8"])
    assert re.search(r"^\.target sm_90a", text, re.M)
    _check_instructions(text)
    assert len(re.findall(wgmma, text)) > len(re.findall(wgmma, plain))  # static sizes: unrolled differently


def test_int64_ids_compile_and_the_cache_holds_one_binary_per_dtype():
    import cute_moe

    a = compile_decode("int64")
    n = cute_moe.compile_count()
    assert compile_decode("int64") is a and cute_moe.compile_count() == n
    assert compile_decode("int32") is not a


# ---- host sizes, by hand ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, T, leaders, tasks",
    [
        # A = NL·I/64, B = K/128·NL, C = K/128·⌈T/8⌉
        ("qwen3-30b-a3b", 1, 8, (8 * 12, 16 * 8, 16 * 1)),
        ("qwen3-30b-a3b", 8, 64, (64 * 12, 16 * 64, 16 * 1)),
        ("deepseek-v3:tp8", 1, 8, (8 * 4, 56 * 8, 56 * 1)),
        ("deepseek-v3:tp8", 2, 16, (16 * 4, 56 * 16, 56 * 1)),
        ("mixtral-8x7b", 1, 2, (2 * 224, 32 * 2, 32 * 1)),
        ("mixtral-8x7b", 8, 8, (8 * 224, 32 * 8, 32 * 1)),  # 16 pairs on 8 experts: at most 8 leaders
        ("mixtral-8x7b", 9, 8, (8 * 224, 32 * 8, 32 * 2)),  # 9 tokens: two token blocks
    ],
)
def test_task_counts_and_grid(spec, T, leaders, tasks):
    E, top_k, K, I = SHAPES[spec]
    assert min(T * top_k, E) == leaders
    assert dp.task_counts(leaders, T, K, I) == tasks
    assert dp.max_tasks(T, top_k, E, K, I) == sum(tasks)
    assert dp.grid_size(T, top_k, E, K, I, 132) == min(sum(tasks), 132)
    assert dp.grid_size(T, top_k, E, K, I, 10**6) == sum(tasks)


def test_counter_and_workspace_sizes():
    # the header, done1 and FP8's doneq2 per leader lane, done2 per k-tile
    assert [dp.counter_words(K) for K in (2048, 7168, 4096)] == [8 + 128 + 16, 8 + 128 + 56, 8 + 128 + 32]
    assert [dp.pair_bucket(p) for p in (1, 2, 8, 9, 16, 17, 33, 64)] == [8, 8, 8, 16, 16, 32, 64, 64]
    off = {"part": (1,), "arrive": (1,)}  # the halves' exchange, one word each while HALF_TASKS is off
    assert workspace_shapes(1, 8, 2048, 768, 132) == {"h": (8, 768), "y": (8, 2048), "counters": (152,)} | off
    assert workspace_shapes(8, 2, 4096, 14336, 132) == {"h": (16, 14336), "y": (16, 4096), "counters": (168,)} | off
    assert workspace_shapes(8, 8, 7168, 256, 132) == {"h": (64, 256), "y": (64, 7168), "counters": (192,)} | off
    fp8 = workspace_shapes(1, 8, 2048, 768, 132, "fp8_block")
    assert fp8 == workspace_shapes(1, 8, 2048, 768, 132) | {
        "xq": (8, 2048),
        "xs": (8 * 16,),
        "hq": (8, 768),
        "hs": (8 * 6,),
        "amax": (1,),
    }
    ws8 = new_workspace(3, 2, 256, 128, "cpu", "fp8_tensor")
    assert ws8["h"].dtype == torch.float32 and ws8["xq"].dtype == ws8["hq"].dtype == torch.float8_e4m3fn
    assert float(ws8["amax"][0]) == 0.0 and int(ws8["counters"].abs().sum()) == 0
    ws = new_workspace(3, 2, 256, 128, "cpu")
    assert ws["h"].shape == (8, 128) and ws["y"].shape == (8, 256) and int(ws["counters"].abs().sum()) == 0
    assert ws["part"].dtype == torch.float32 and ws["arrive"].dtype == torch.int32 and int(ws["arrive"].sum()) == 0
    # one ring stage: two 64 × 64 bf16 boxes by TMA (the full barrier's bytes) and 16 token rows by cp.async
    assert dp.stage_tx_bytes() == 16384
    assert dp.smem_bytes() == 8 * (16384 + 2048) + 2048 <= 227 * 1024


def test_task_numbering_is_a_bijection_onto_the_phases():
    NL, nt1, nk, ntb = 5, 3, 4, 2
    b0, c0, end = dp.phase_starts(NL, nt1, nk, ntb)
    assert (b0, c0, end) == (15, 15 + 20, 35 + 8)
    seen = [("A", *dp.a_task(t, nt1)) for t in range(b0)]
    seen += [("B", *dp.b_task(t - b0, NL)) for t in range(b0, c0)]
    seen += [("C", *dp.c_task(t - c0, ntb)) for t in range(c0, end)]
    want = [("A", r, n, 0) for r in range(NL) for n in range(nt1)]
    want += [("B", kt, r) for kt in range(nk) for r in range(NL)]
    want += [("C", kt, tb) for kt in range(nk) for tb in range(ntb)]
    assert seen == want
    # halved tiles: the gate task (half 0) then the up task (half 1) of every tile, B and C moved along
    b0, c0, end = dp.phase_starts(NL, nt1, nk, ntb, 2)
    assert (b0, c0, end) == (30, 30 + 20, 50 + 8)
    assert [dp.a_task(t, nt1, 2) for t in range(b0)] == [
        (r, n, h) for r in range(NL) for n in range(nt1) for h in (0, 1)
    ]


def test_when_tiles_are_halved_and_what_their_leaders_wait_for(monkeypatch):
    assert dp.a_halves(8, 4, 132) == 1  # the switch is off: whole tiles
    monkeypatch.setattr(dp, "HALF_TASKS", True)
    assert dp.a_halves(8, 4, 132) == 2  # DeepSeek-V3 TP8, T = 1: 32 tiles, 64 halves for 132 CTAs
    assert dp.a_halves(8, 4, 128) == 2 and dp.a_halves(8, 4, 127) == 1  # the halves in at most half the grid
    assert dp.a_halves(8, 12, 132) == 1 and dp.a_halves(16, 4, 132) == 1  # Qwen3-30B-A3B T = 1, DeepSeek T = 2
    # done1[r]: whole tiles signal once per task; halves once per (n-tile, chunk), by the half finishing it
    assert [dp.done1_target(12, chunks, 1) for chunks in (1, 2, 4)] == [12, 12, 12]
    assert [dp.done1_target(12, chunks, 2) for chunks in (1, 2, 4)] == [12, 24, 48]
    # a halved launch has at most a quarter as many tiles as CTAs, so every slot is below the grid
    grid, NL, nt1 = 132, 3, 11
    assert dp.a_halves(NL, nt1, grid) == 2 and dp.a_halves(NL, nt1 + 1, grid) == 1
    slots = {dp.exchange_slot(r, n, c, nt1) for r in range(NL) for n in range(nt1) for c in range(dp.MAX_CHUNKS)}
    assert len(slots) == NL * nt1 * dp.MAX_CHUNKS and max(slots) < grid
    assert dp.exchange_words(132) == (132 * 2 * 8 * 128, 132)
    assert dp.EXCHANGE_VALUES * dp.CONSUMER_THREADS == dp.WGMMA_M * dp.TOKENS  # one m64n16 fp32 accumulator
    assert dp.smem_bytes() == 8 * (16384 + 2 * 2048) + 2048 <= 227 * 1024  # a second token ring
    assert dp.launch_summary(1, 8, 256, 7168, 256, 132)["a_halves"] == 2
    assert dp.launch_summary(1, 8, 256, 7168, 256, 132)["tasks_at_most"]["A"] == 64
    # an upper bound over the leaders a launch may have: 5 leaders halve (60 tasks), 8 do not (48)
    assert dp.launch_summary(1, 8, 256, 2048, 384, 132)["tasks_at_most"]["A"] == 60


def test_leader_tables_by_hand():
    t = dp.leader_tables([3, 5, 3, 7, 5, 3], 8)
    assert t["lead"] == [0, 1, 3] and t["n_leaders"] == 3
    assert t["order"] == [0, 2, 5, 1, 4, 3]  # grouped by leader, pair order inside
    assert t["start"] == [0, 3, 5] and t["count"] == [3, 2, 1]
    bad = dp.leader_tables([-1, 9, 7, 0], 8)  # ids clamped into [0, E): -1 joins expert 0, 9 expert 7
    assert bad["expert"] == [0, 7, 7, 0] and bad["order"] == [0, 3, 1, 2] and bad["count"] == [2, 2]


# ---- a model of the protocol ------------------------------------------------------------------------
def simulate(ids, E, T, top_k, K, I, grid, resident, seed, combine_first=False, halves=1):  # noqa: E741
    """Every CTA as two generators (producer warp, consumer warpgroup) that yield the condition they wait
    on; a random scheduler steps one whose condition holds, with at most ``resident`` CTAs started at a
    time.  The kernel's numbering, queue depth, ring depth, W2 boxes before the wait, and with ``halves`` =
    2 the halved A tiles (each chunk finished by the half that arrives second).  Returns the tasks each CTA
    finished, or raises on a deadlock.  ``combine_first`` numbers C before B (a wrong order)."""
    tab = dp.leader_tables(ids, E)
    NL = tab["n_leaders"]
    nt1, nk, ntb = dp.tile_counts(T, K, I)
    b0, c0, end = dp.phase_starts(NL, nt1, nk, ntb, halves)
    chunks = [-(-c // dp.TOKENS) for c in tab["count"]]
    target = [dp.done1_target(nt1, chunks[r], halves) for r in range(NL)]
    g = dict(ticket=0, done1=[0] * NL, done2=[0] * nk, finished=[], arrived={})

    def kind(t):
        if t < b0:
            r, n, _ = dp.a_task(t, nt1, halves)
            return "A", r, n, chunks[r] * (K // dp.TILE_K) // halves
        if combine_first:
            if t < b0 + nk * ntb:
                return ("C", *dp.c_task(t - b0, ntb), 0)
            kt, r = dp.b_task(t - b0 - nk * ntb, NL)
        elif t < c0:
            kt, r = dp.b_task(t - b0, NL)
        else:
            return ("C", *dp.c_task(t - c0, ntb), 0)
        return "B", r, kt, chunks[r] * (I // dp.TILE_K)

    def producer(c):
        while True:
            yield lambda: len(c.queue) < dp.QUEUE
            t = g["ticket"]
            g["ticket"] += 1
            c.queue.append(t)
            if t >= end:
                return
            what, r, _, steps = kind(t)
            early = min(steps, dp.STAGES) if what == "B" else 0
            for _ in range(early):  # W2's boxes take ring slots before the wait
                yield lambda: c.taken - c.consumed < dp.STAGES
                c.taken += 1
            if what == "B":
                yield lambda r=r: g["done1"][r] >= target[r]
                c.issued += early
            for _ in range(steps - early):
                yield lambda: c.taken - c.consumed < dp.STAGES
                c.taken += 1
                c.issued += 1

    def consumer(c):
        while True:
            yield lambda: len(c.queue) > 0
            t = c.queue.popleft()
            if t >= end:
                return
            what, r, kt, steps = kind(t)
            if what == "C":
                yield lambda r=r: g["done2"][r] >= NL  # (for C, r is the k-tile)
            for s in range(steps):
                yield lambda: c.issued > c.consumed
                c.consumed += 1
                if what == "A" and halves == 2 and (s + 1) % (steps // chunks[r]) == 0:  # a chunk's exchange
                    key = (r, kt, (s + 1) // (steps // chunks[r]) - 1)  # (for A, kt is the n-tile)
                    g["arrived"][key] = g["arrived"].get(key, 0) + 1
                    if g["arrived"][key] == 2:
                        g["done1"][r] += 1
            if what == "A" and halves == 1:
                g["done1"][r] += 1
            elif what == "B":
                g["done2"][kt] += 1
            g["finished"].append(t)

    schedule(producer, consumer, grid, resident, seed, g["finished"], end)
    assert g["done1"] == target and g["done2"] == [NL] * nk
    assert all(v == 2 for v in g["arrived"].values()) and len(g["arrived"]) == (halves - 1) * nt1 * sum(chunks)
    return sorted(g["finished"])


@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("grid, resident", [(1, 1), (3, 1), (5, 2), (16, 16), (40, 7)])
def test_every_interleaving_of_the_protocol_finishes(grid, resident, seed, halves):
    rng = random.Random(seed)
    E, top_k, T = 6, 2, 5 + seed
    ids = [rng.randrange(E) for _ in range(T * top_k)]
    # K = 256: 4 K steps and 2 k-tiles; I = 1152: 18 K steps of GEMM2, more than the ring holds
    finished = simulate(ids, E, T, top_k, 256, 1152, grid, resident, seed, halves=halves)
    NL = dp.leader_tables(ids, E)["n_leaders"]
    assert finished == list(range(dp.phase_starts(NL, *dp.tile_counts(T, 256, 1152), halves)[2]))


def test_halved_tiles_with_several_chunks_finish():
    """One expert in every token's first slot: 20 of 40 pairs, two chunks of 16, each exchanged and counted
    on its own; then 40 and 64 pairs on one expert (three and four chunks)."""
    ids = [0 if j % 2 == 0 else 1 + j % 7 for j in range(40)]  # expert 0 in every token's first slot
    tab = dp.leader_tables(ids, 8)
    assert tab["count"][0] == 20 and -(-tab["count"][0] // dp.TOKENS) == 2
    for grid, resident in ((6, 3), (2, 1)):
        finished = simulate(ids, 8, 20, 2, 256, 128, grid=grid, resident=resident, seed=1, halves=2)
        assert finished == list(range(dp.phase_starts(tab["n_leaders"], 2, 2, 3, 2)[2]))
    for T in (40, 64):
        finished = simulate([0] * T, 8, T, 1, 256, 128, grid=5, resident=2, seed=T, halves=2)
        assert finished == list(range(dp.phase_starts(1, 2, 2, -(-T // 8), 2)[2]))


def test_the_model_sees_a_deadlock_when_the_numbering_is_wrong():
    """Numbering the combine before GEMM2 makes a lone resident CTA wait for work nobody can claim."""
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([0, 1, 2, 3], 4, 2, 2, 256, 128, grid=2, resident=1, seed=0, combine_first=True)


# ---- named errors, before anything runs -------------------------------------------------------------
def _args(T=2, top_k=2, E=4, K=256, I=128, **over):
    a = dict(
        x=torch.randn(T, K).bfloat16(),
        w1=torch.randn(E, 2 * I, K).bfloat16(),
        w2=torch.randn(E, K, I).bfloat16(),
        topk_weights=torch.rand(T, top_k),
        topk_ids=torch.arange(T * top_k, dtype=torch.int32).view(T, top_k) % E,
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "make, error, needle",
    [
        (lambda: _args(x=torch.randn(2, 256)), TypeError, r"^x: "),
        (lambda: _args(topk_ids=torch.zeros(2, 2, dtype=torch.int16)), TypeError, r"^topk_ids: "),
        (lambda: _args(w1=torch.randn(4, 256, 128).bfloat16()), ValueError, r"^w1: expected shape"),
        (lambda: _args(T=33, top_k=2), ValueError, r"^topk_ids: the decode kernel serves at most 64"),
        (lambda: _args(K=192), ValueError, r"^x: the decode kernel needs K .* multiple of 128"),
        (lambda: _args(I=96), ValueError, r"^w2: the decode kernel needs I .* multiple of 64"),
        (lambda: {**_args(), "workspace": {"h": 1}}, TypeError, r"^workspace: "),
        (lambda: {**_args(), "workspace": new_workspace(2, 2, 256, 64, "cpu")}, ValueError, r"^workspace: h "),
        (lambda: _args(), ValueError, r"^x: cute_moe runs on a CUDA device"),  # all good but the device
    ],
)
def test_bad_arguments_are_named_before_any_launch(make, error, needle):
    with pytest.raises(error, match=needle):
        decode_fused_moe(**make())


def test_the_size_check_takes_the_largest_call_and_no_more():
    check_decode_sizes(MoEDims(T=32, E=8, K=4096, I=14336, top_k=2))
    check_decode_sizes(MoEDims(T=8, E=256, K=7168, I=256, top_k=8))
    with pytest.raises(ValueError, match="^topk_ids: "):
        check_decode_sizes(MoEDims(T=9, E=256, K=7168, I=256, top_k=8))


def test_compile_decode_names_a_bad_ids_dtype():
    with pytest.raises(ValueError, match="^topk_ids: "):
        compile_decode("int16")

"""CPU lane for FP8 in the one-launch CuTe decode kernel (cute_moe/decode_quant.py and the FP8 paths of
cute_moe/decode*.py): the PTX of every format, the FP8 task numbering and sizes, a model of its dependency
protocol (Q1 → A → Q2 → B → C; every interleaving finishes, a wrong numbering deadlocks), and named errors.

The kernel cannot run here (no GPU): tests/test_cute_decode_fp8_gpu.py runs it against the oracle and the
grouped FP8 pipeline.
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
from cute_moe.decode import check_workspace, compile_decode, decode_fused_moe, new_workspace  # noqa: E402
from moe_spec.quant import quantize_weight  # noqa: E402
from moe_spec.validate import MoEDims  # noqa: E402

VARIANTS = [("fp8_tensor", False), ("fp8_tensor", True), ("fp8_channel", False), ("fp8_block", False)]


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: v[0] + ("_static" if v[1] else ""))
def variant(request):
    quant, static = request.param
    return quant, static, compile_decode("int32", quant, static, keep_ptx=True).__ptx__


def _set(pattern, text):
    return set(re.findall(pattern, text))


def test_every_format_runs_e4m3_wgmmas_and_quantizes_as_the_reference(variant):
    quant, static, ptx = variant
    # swap-AB, 64 weight rows × 16 token rows × K 32, E4M3 in, fp32 out: the only MMA
    assert _set(r"wgmma\.mma_async\.sync\.aligned\.\w+\.[\w.]+", ptx) == {
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"
    }
    # both weights by TMA, the E4M3 token rows by 16-byte cp.async through L2 (xq for GEMM1, hq for GEMM2)
    assert "cp.async.bulk.tensor.4d" in ptx and "cp.async.bulk.tensor.3d" in ptx
    assert {int(n) for n in re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (\d+)", ptx)} == {16}
    # x and h quantized as moe_spec.quant does: IEEE division, round-to-nearest saturating cast to E4M3
    assert "div.rn.f32" in ptx and re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)
    # the amax: an integer max on the bits, only where a dynamic per-tensor scale needs the whole of h
    atomics = _set(r"(?:atom|red)\.global\.[\w.]*max[\w.]*", ptx)
    assert bool(atomics) == (quant == "fp8_tensor" and not static)
    assert not re.search(r"(atom|red)\.[\w.]*\.(f32|f16|bf16|f64)", ptx)  # deterministic: no float atomics
    # the protocol: acquire spins (with nanosleep), release increments, the exit count
    assert "ld.acquire.gpu.global.b32" in ptx and "red.release.gpu.global.add.s32" in ptx
    assert "nanosleep.u32" in ptx and "atom.global.acq_rel.add.u32" in ptx
    # a stage's WGMMAs in flight while the previous stage's sums are promoted (FP8_OVERLAP), and the last drained
    waits = _set(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", ptx)
    assert waits == ({"0", "1"} if dp.FP8_OVERLAP else {"0"})
    assert ".reqntid 160, 1, 1" in ptx and "setmaxnreg" not in ptx


def test_a_static_scale_is_checked_and_no_amax_is_taken():
    static = compile_decode("int32", "fp8_tensor", True, keep_ptx=True).__ptx__
    dynamic = compile_decode("int32", "fp8_tensor", False, keep_ptx=True).__ptx__
    # the bad-scale bit is ORed into the error word beside the routing checks' bits
    assert len(re.findall(r"atom\.global\.or\.b32", static)) > len(re.findall(r"atom\.global\.or\.b32", dynamic))


def test_the_overlap_switch_is_part_of_the_compile(monkeypatch):
    on = compile_decode("int32", "fp8_channel", False)
    monkeypatch.setattr(dp, "FP8_OVERLAP", not dp.FP8_OVERLAP)
    assert compile_decode("int32", "fp8_channel", False) is not on


# ---- numbering and sizes ----------------------------------------------------------------------------
def test_fp8_numbering_is_a_bijection_onto_five_phases():
    NL, nt1, nk, ntb = 3, 2, 4, 2
    a0, q0, b0, c0, end = dp.fp8_phase_starts(NL, nt1, nk, ntb)
    assert (a0, q0, b0, c0, end) == (2, 2 + 6, 8 + 3, 11 + 12, 23 + 8)
    seen = [("Q1", t) for t in range(a0)]
    seen += [("A", *dp.a_task(t - a0, nt1)[:2]) for t in range(a0, q0)]
    seen += [("Q2", t - q0) for t in range(q0, b0)]
    seen += [("B", *dp.b_task(t - b0, NL)) for t in range(b0, c0)]
    seen += [("C", *dp.c_task(t - c0, ntb)) for t in range(c0, end)]
    assert len(set(seen)) == end
    assert dp.quant_tasks(NL, 9) == (2, NL)


def test_fp8_grid_and_sizes():
    # Qwen3-30B-A3B T = 1: 8 leaders; Q1 1 + A 8·12 + Q2 8 + B 16·8 + C 16 = 249 tasks, the grid one per SM
    assert dp.max_tasks(1, 8, 128, 2048, 768, fp8=True) == 249 == dp.max_tasks(1, 8, 128, 2048, 768) + 1 + 8
    assert dp.grid_size(1, 8, 128, 2048, 768, 132, fp8=True) == 132
    assert dp.size_limit(1, 8, 2048, 768, fp8=True) is None
    assert dp.size_limit(1, 8, 2048, 192, fp8=False) is None  # bf16: I a multiple of 64
    argument, words = dp.size_limit(1, 8, 2048, 192, fp8=True)  # FP8: GEMM2's K steps are 128 deep
    assert argument == "w2" and "multiple of 128" in words
    assert dp.tile_k(True) == 128 and dp.tile_k(False) == 64


# ---- a model of the FP8 protocol --------------------------------------------------------------------
def simulate(ids, E, T, top_k, K, I, grid, resident, seed, dynamic, q2_after_b=False):  # noqa: E741
    """The FP8 launch as generators (a CTA's producer warp and consumer warpgroup yield the condition they
    wait on; a random scheduler steps one whose condition holds, at most ``resident`` CTAs started at a
    time): Q1 (consumer only, then doneq1), A (the producer lands up to a ring of W1 stages, waits for
    doneq1 = NQ1, then the rest; the consumer waits for doneq1 too, then done1[r]), Q2 (consumer waits for
    done1[r] — every leader's under a ``dynamic`` per-tensor scale — then doneq2[r]), B (W2 stages before
    the wait on doneq2[r]), C (waits for done2[kt] = NL).  ``q2_after_b`` numbers Q2 after B (wrong)."""
    tab = dp.leader_tables(ids, E)
    NL = tab["n_leaders"]
    nt1, nk, ntb = dp.tile_counts(T, K, I)
    a0, q0, b0, c0, end = dp.fp8_phase_starts(NL, nt1, nk, ntb)
    chunks = [-(-c // dp.TOKENS) for c in tab["count"]]
    g = dict(ticket=0, doneq1=0, done1=[0] * NL, doneq2=[0] * NL, done2=[0] * nk, finished=[])

    def kind(t):
        if q2_after_b and t >= q0:  # B first, then Q2
            if t < q0 + nk * NL:
                kt, r = dp.b_task(t - q0, NL)
                return "B", r, kt, chunks[r] * (I // dp.FP8_TILE_K)
            if t < q0 + nk * NL + NL:
                return "Q2", t - q0 - nk * NL, 0, 0
        if t < a0:
            return "Q1", 0, 0, 0
        if t < q0:
            r, n, _ = dp.a_task(t - a0, nt1)
            return "A", r, n, chunks[r] * (K // dp.FP8_TILE_K)
        if t < b0:
            return "Q2", t - q0, 0, 0
        if t < c0:
            kt, r = dp.b_task(t - b0, NL)
            return "B", r, kt, chunks[r] * (I // dp.FP8_TILE_K)
        return "C", dp.c_task(t - c0, ntb)[0], 0, 0

    def q2_ready(r):
        leaders = range(NL) if dynamic else (r,)
        return all(g["done1"][q] >= nt1 for q in leaders)

    def producer(c):
        while True:
            yield lambda: len(c.queue) < dp.QUEUE
            t = g["ticket"]
            g["ticket"] += 1
            c.queue.append(t)
            if t >= end:
                return
            what, r, _, steps = kind(t)
            early = min(steps, dp.STAGES) if what in ("A", "B") else 0
            for _ in range(early):  # weight boxes take ring slots before the wait
                yield lambda: c.taken - c.consumed < dp.STAGES
                c.taken += 1
            if what == "A":
                yield lambda: g["doneq1"] >= ntb
            elif what == "B":
                yield lambda r=r: g["doneq2"][r] >= 1
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
            if what == "A":
                yield lambda: g["doneq1"] >= ntb
            elif what == "Q2":
                yield lambda r=r: q2_ready(r)
            elif what == "B":
                yield lambda r=r: g["doneq2"][r] >= 1
            elif what == "C":
                yield lambda kt=r: g["done2"][kt] >= NL
            for _ in range(steps):
                yield lambda: c.issued > c.consumed
                c.consumed += 1
            if what == "Q1":
                g["doneq1"] += 1
            elif what == "A":
                g["done1"][r] += 1
            elif what == "Q2":
                g["doneq2"][r] += 1
            elif what == "B":
                g["done2"][kt] += 1
            g["finished"].append(t)

    schedule(producer, consumer, grid, resident, seed, g["finished"], end)
    assert g["doneq1"] == ntb and g["done1"] == [nt1] * NL and g["doneq2"] == [1] * NL and g["done2"] == [NL] * nk
    return sorted(g["finished"])


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("grid, resident", [(1, 1), (3, 1), (5, 2), (40, 7)])
def test_every_interleaving_of_the_fp8_protocol_finishes(grid, resident, seed, dynamic):
    rng = random.Random(seed)
    E, top_k, T = 6, 2, 5 + seed
    ids = [rng.randrange(E) for _ in range(T * top_k)]
    # K = 1280: 10 K steps of GEMM1, more than the ring holds; I = 256: 2 of GEMM2
    finished = simulate(ids, E, T, top_k, 1280, 256, grid, resident, seed, dynamic)
    NL = dp.leader_tables(ids, E)["n_leaders"]
    assert finished == list(range(dp.fp8_phase_starts(NL, *dp.tile_counts(T, 1280, 256))[-1]))


def test_the_model_sees_a_deadlock_when_q2_comes_after_b():
    """B waits for Q2: numbered after it, a lone resident CTA holds a B task whose Q2 nobody can claim."""
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([0, 1, 2, 3], 4, 2, 2, 256, 256, grid=2, resident=1, seed=0, dynamic=False, q2_after_b=True)


# ---- named errors, before anything runs -------------------------------------------------------------
def _args(quant="fp8_tensor", T=2, top_k=2, E=4, K=256, I=128, **over):  # noqa: E741
    w1, s1 = quantize_weight(torch.randn(E, 2 * I, K), quant)
    w2, s2 = quantize_weight(torch.randn(E, K, I), quant)
    a = dict(
        x=torch.randn(T, K).bfloat16(),
        w1=w1,
        w2=w2,
        topk_weights=torch.rand(T, top_k),
        topk_ids=torch.arange(T * top_k, dtype=torch.int32).view(T, top_k) % E,
        quant=quant,
        w1_scale=s1,
        w2_scale=s2,
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "make, error, needle",
    [
        (lambda: _args(w1_scale=None), ValueError, r"^w1_scale: required"),
        (lambda: _args(I=192), ValueError, r"^w2: the FP8 decode kernel needs I .* multiple of 128"),
        (
            lambda: _args("fp8_channel", a1_scale=torch.ones(1), a2_scale=torch.ones(1)),
            ValueError,
            r"a1_scale",
        ),
        (lambda: {**_args(), "workspace": new_workspace(2, 2, 256, 128, "cpu")}, TypeError, r"^workspace: "),
        (lambda: _args(), ValueError, r"^x: cute_moe runs on a CUDA device"),  # all good but the device
    ],
)
def test_bad_arguments_are_named_before_any_launch(make, error, needle):
    with pytest.raises(error, match=needle):
        decode_fused_moe(**make())


def test_a_workspace_of_another_format_is_named():
    dims = MoEDims(T=2, E=4, K=256, I=128, top_k=2)
    check_workspace(new_workspace(2, 2, 256, 128, "cpu", "fp8_block"), dims, torch.device("cpu"), "fp8_block")
    bf16_h = new_workspace(2, 2, 256, 128, "cpu", "fp8_block") | {"h": torch.empty(8, 128, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"^workspace: h must be a contiguous float32 \[≥ 4, 128\]"):
        check_workspace(bf16_h, dims, torch.device("cpu"), "fp8_block")
    with pytest.raises(ValueError, match=r"^workspace: amax must be a float32 \[1\] tensor on cpu, zeroed once"):
        check_workspace(
            new_workspace(2, 2, 256, 128, "cpu", "fp8_tensor") | {"amax": torch.zeros(2)},
            dims,
            torch.device("cpu"),
            "fp8_tensor",
        )


def test_compile_decode_names_a_bad_format():
    with pytest.raises(ValueError, match="^quant: "):
        compile_decode("int32", "int8")
    with pytest.raises(ValueError, match="^a1_scale: "):
        compile_decode("int32", "fp8_block", True)

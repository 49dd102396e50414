"""The pieces of the one-launch CuTe decode kernel (:mod:`cute_moe.decode_kernel`, whose docstring tells a
task's life): its constants, the task numbering, the sizes the host derives from them, the routing tables
every CTA builds in shared memory and the dependency protocol (the producer's row copy:
:class:`cute_moe.decode_producer.RowCopy`).

Task numbering (plain integer arithmetic: traced into the kernel, and callable in Python, where the CPU
tests walk it).  ``NL`` experts are hit (the *leaders*: an expert's lowest pair index), ``NT1 = I / 64``
n-tiles of the intermediate, ``NK = K / 128`` k-tiles of the output, ``NTB = ⌈T / 8⌉`` token blocks::

    A   [0, B0)      B0 = NL·NT1        a = r·NT1 + n       leader rank r, n-tile n: h[pairs of r, 64 cols]
    B   [B0, C0)     C0 = B0 + NK·NL    b = kt·NL + r       k-tile kt, leader rank r: y[pairs of r, 128 cols]
    C   [C0, END)    END = C0 + NK·NTB  c = kt·NTB + tb     k-tile kt, token block tb: out[8 tokens, 128 cols]

Only leaders are numbered (the Triton kernel numbers every pair and lets a non-leader's task only count):
an expert hit by several pairs costs one A task per n-tile and one B task per k-tile, none wasted on a
claim.  ``NL`` is read in the kernel; the host sizes the grid by its bound ``min(T·top_k, E)``.

The routing tables (:func:`build_tables`, :func:`leader_tables` is the same in Python).  For the ``P =
T·top_k ≤ 64`` pairs: the expert of each pair (its id clamped into [0, E)), the pairs grouped by leader
in leader order and pair order inside a group (``order``), each leader rank's first position in it
(``start``), its pair count (``count``) and its leader's pair (``lead``), the routing weight of each pair
(NaN for an id outside [0, E): the contract's bad id), and ``NL``.  A chunk of a task is ``TOKENS`` = 16
consecutive members of a group: WGMMA's N.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from moe_spec.hopper import WGMMA_M, wgmma_k
from moe_spec.validate import BAD_ID, BAD_WEIGHT, REPEATED_ID

PAIR_LANES = 64
"""The most (token, slot) pairs one launch serves: the routing tables hold this many."""
TOKENS = 16
"""Pairs per chunk: WGMMA's N, the token rows of the B operand (K-major)."""
TILE_K = 64
"""bf16 elements of K per ring stage: one 128-byte swizzled row."""
FP8_TILE_K = 128
"""E4M3 elements of K per ring stage under FP8: the same 128-byte row, and one 128-deep block of the scale grids
(so a stage's sums are one promotion, as in the grouped FP8 GEMM: :mod:`cute_moe.fp8_gemm`)."""


FP8_OVERLAP = True
"""Whether an FP8 chunk keeps one stage's WGMMAs in flight while the previous stage's block sums are promoted
(two register sets of block sums), as the bf16 main loop keeps one stage in flight; off, each stage is
retired and promoted before the next is issued, as the grouped FP8 GEMM does.  The same sums either way."""


def fp8_overlap() -> bool:
    """:data:`FP8_OVERLAP` as it is now (read when compiling: part of the compile key)."""
    return FP8_OVERLAP


def tile_k(fp8: bool) -> int:
    """Elements of K per ring stage: :data:`FP8_TILE_K` under FP8, :data:`TILE_K` in bf16."""
    return FP8_TILE_K if fp8 else TILE_K


H_TILE = WGMMA_M
"""Columns of h per A task: 64 gate rows and 64 up rows of W1, one WGMMA M each."""
Y_TILE = 2 * WGMMA_M
"""Columns of y (and of out) per B and C task: two 64-row boxes of W2, one WGMMA M each."""
TOKEN_BLOCK = 8
"""Tokens per C task: 8 tokens × 16 vectors of 8 bf16 = the 128 consumer threads."""
STAGES = 8
"""Depth of the TMA ring: 8 × 18 KiB (two 64×64 weight boxes, 16 token rows); read when compiling
(:func:`stages`)."""
CTAS_PER_SM = 1
"""CTAs of a launch per SM (:func:`grid_size`): more than one needs a ring small enough for them to share an
SM's shared memory (:func:`smem_bytes`), else the extra CTAs wait for a slot (never for each other)."""


def stages() -> int:
    """:data:`STAGES` as it is now (read where the kernel is traced and in its compile key)."""
    return STAGES


QUEUE = 2
"""Tasks the producer warp may hand the consumer warpgroup ahead of its work."""
HALF_TASKS = False
"""Whether an A tile may be two tasks, its gate rows and its up rows, when the halves would take at most
half the grid's CTAs (:func:`a_halves`; DeepSeek-V3 TP8 at T = 1: 32 tiles of 1.8 MB for 132 SMs).  A half
streams its 64 rows two K steps per ring stage into one accumulator, stores the fp32 sums
(:data:`EXCHANGE_VALUES` per consumer thread) to the exchange workspace and counts itself in the tile's
arrival word; the second to arrive reads both sums and runs the epilogue.  Each sum is the WGMMA sequence
of the whole tile, so h has the same bits.  Off: the bits test passes on a GPU, but halving did not shorten
DeepSeek-V3 TP8 at T = 1 (notes/decode.md, "Halved A tiles")."""


def half_tasks() -> bool:
    """:data:`HALF_TASKS` as it is now (read where it is used: the compile, the workspace, the kernel's trace)."""
    return HALF_TASKS


MAX_CHUNKS = PAIR_LANES // TOKENS
"""The most chunks of :data:`TOKENS` pairs one leader's tasks walk (every pair on one expert)."""
CONSUMER_THREADS = 128
EXCHANGE_VALUES = WGMMA_M * TOKENS // CONSUMER_THREADS
"""fp32 accumulator values per consumer thread (8): what a half task stores for its partner."""
PRODUCER_WARP = 4
"""Warps 0–3 are the consumer warpgroup (WGMMA needs an aligned warpgroup); warp 4 the producer."""
THREADS = CONSUMER_THREADS + 32
CONSUMER_BARRIER_ID = 1
"""Named barrier of the consumer warpgroup (0 is the CTA's)."""
VEC = 8
"""bf16 per 16-byte vector (cp.async copies, the combine's loads)."""
VECS = TILE_K // VEC
ROW_PASS = 32 // VECS
"""Token rows the producer warp copies at once: 4 rows of 8 vectors."""

WGMMA = f"wgmma.mma_async.sync.aligned.m{WGMMA_M}n{TOKENS}k{wgmma_k(2)}.f32.bf16.bf16"
"""The one MMA both GEMMs issue: swap-AB, 64 weight rows × TOKENS pairs, bf16 in, fp32 accumulate."""
WGMMA_FP8 = f"wgmma.mma_async.sync.aligned.m{WGMMA_M}n{TOKENS}k{wgmma_k(1)}.f32.e4m3.e4m3"
"""The same under FP8: E4M3 in (:mod:`cute_moe.decode_quant`)."""

# the counter block (int32): ticket, exit count, FP8's doneq1, reserved; done1[leader rank], FP8's
# doneq2[leader rank], done2[k-tile]
TICKET, EXIT, DONEQ1 = 0, 1, 2
HEADER = 8
DONE1 = HEADER
DONEQ2 = HEADER + PAIR_LANES
DONE2 = HEADER + 2 * PAIR_LANES


# ---- task numbering and host sizes (plain integers) -----------------------------------------------
def phase_starts(n_leaders, nt1, nk, ntb, halves=1):
    """(B0, C0, END): the first B task, the first C task and the task count (``halves``: :func:`a_halves`)."""
    b0 = n_leaders * nt1 * halves
    c0 = b0 + nk * n_leaders
    return b0, c0, c0 + nk * ntb


def fp8_phase_starts(n_leaders, nt1, nk, ntb):
    """FP8's (A0, Q0, B0, C0, END): Q1 tasks [0, A0) quantize x, one per token block (E4M3 rows and scales);
    A [A0, Q0) as in bf16 (h in fp32); Q2 tasks [Q0, B0) quantize h, one per leader; then B and C as in bf16."""
    a0 = ntb
    q0 = a0 + n_leaders * nt1
    b0 = q0 + n_leaders
    c0 = b0 + nk * n_leaders
    return a0, q0, b0, c0, c0 + nk * ntb


def a_task(a, nt1, halves=1):
    """A task ``a`` (counted from 0) → (leader rank, n-tile, half): half 0 is the gate rows and 1 the up
    rows when the tiles are halved (``halves`` = 2), 0 (both) when not."""
    tile = a // halves
    return tile // nt1, tile % nt1, a - tile * halves


def a_halves(n_leaders: int, nt1: int, grid: int) -> int:
    """Tasks per A tile (the kernel decides the same from its tables and grid): 2 — gate and up apart —
    when :data:`HALF_TASKS` is on and the halves take at most half the CTAs (the rest prefetch GEMM2's
    weights), else 1.  The bound is the modelled timeline's (:mod:`cute_moe.lab.fig_decode`): halving where
    the tiles are between a quarter and all of the grid lengthens the model's DeepSeek-V3 TP8 T = 2 and
    Qwen3-30B-A3B T = 1."""
    return 2 if HALF_TASKS and 4 * n_leaders * nt1 <= grid else 1


def done1_target(nt1, chunks, halves):
    """What ``done1[r]`` counts when leader r's h is complete: its NT1 tasks (whole tiles, one signal each
    after all its chunks) or, halved, one signal per (n-tile, chunk) from the half that finishes it."""
    return nt1 * (1 + (halves - 1) * (chunks - 1))


def exchange_slot(r, n, chunk, nt1):
    """The exchange slot of (leader rank, n-tile, chunk) in a halved launch: below the grid, as a halved launch
    has at most a quarter as many tiles as CTAs and a tile at most :data:`MAX_CHUNKS` (4) chunks."""
    return (r * nt1 + n) * MAX_CHUNKS + chunk


def b_task(b, n_leaders):
    """B task ``b`` (counted from B0) → (k-tile, leader rank)."""
    return b // n_leaders, b % n_leaders


def c_task(c, ntb):
    """C task ``c`` (counted from C0) → (k-tile, token block)."""
    return c // ntb, c % ntb


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_counts(T: int, K: int, I: int) -> tuple[int, int, int]:  # noqa: E741
    """(NT1, NK, NTB): n-tiles of I, k-tiles of K, token blocks of T."""
    return I // H_TILE, K // Y_TILE, _cdiv(T, TOKEN_BLOCK)


def task_counts(n_leaders: int, T: int, K: int, I: int, halves: int = 1) -> tuple[int, int, int]:  # noqa: E741
    """(A, B, C) tasks of a launch whose routing hits ``n_leaders`` experts."""
    nt1, nk, ntb = tile_counts(T, K, I)
    return n_leaders * nt1 * halves, nk * n_leaders, nk * ntb


def quant_tasks(n_leaders: int, T: int) -> tuple[int, int]:
    """FP8's (Q1, Q2) tasks: one per token block of x, one per leader's h rows."""
    return _cdiv(T, TOKEN_BLOCK), n_leaders


def max_tasks(T: int, top_k: int, E: int, K: int, I: int, fp8: bool = False) -> int:  # noqa: E741
    """The most tasks a launch can have: every pair on its own expert (``min(T·top_k, E)`` leaders)."""
    leaders = min(T * top_k, E)
    return sum(task_counts(leaders, T, K, I)) + (sum(quant_tasks(leaders, T)) if fp8 else 0)


def grid_size(T: int, top_k: int, E: int, K: int, I: int, sms: int, fp8: bool = False) -> int:  # noqa: E741
    """CTAs of a launch: :data:`CTAS_PER_SM` per SM, never more than there can be tasks."""
    return max(1, min(max_tasks(T, top_k, E, K, I, fp8), sms * CTAS_PER_SM))


def exchange_words(sms: int) -> tuple[int, int]:
    """(fp32 words, int32 arrival words) of the exchange workspace of a halved launch on ``sms`` SMs (the grid's
    bound, which the slots stay below: :func:`exchange_slot`): two halves' sums per slot, a word per slot; one
    word each when :data:`HALF_TASKS` is off (then the kernel, finding fewer arrival words than CTAs, never
    halves)."""
    if not HALF_TASKS:
        return 1, 1
    return sms * 2 * EXCHANGE_VALUES * CONSUMER_THREADS, sms


def counter_words(K: int) -> int:
    """int32 words of the counter block: the header, done1 and doneq2 per leader lane, done2 per k-tile."""
    return HEADER + 2 * PAIR_LANES + K // Y_TILE


def size_limit(T: int, top_k: int, K: int, I: int, fp8: bool = False) -> tuple[str, str] | None:  # noqa: E741
    """The first size limit of the kernel a call breaks — at most :data:`PAIR_LANES` (token, slot) pairs, K a
    multiple of :data:`Y_TILE`, I of :data:`H_TILE` (FP8: of :data:`FP8_TILE_K`, GEMM2's K steps) — as (the
    argument that carries it, the limit in words); None when the kernel serves these sizes."""
    pairs = T * top_k
    if pairs > PAIR_LANES:
        return (
            "topk_ids",
            f"the decode kernel serves at most {PAIR_LANES} (token, slot) pairs, got T·top_k = {T}·{top_k} = {pairs}",
        )
    if K % Y_TILE:
        return "x", f"the decode kernel needs K = x.shape[1] a multiple of {Y_TILE} (its output tiles), got {K}"
    if fp8 and I % FP8_TILE_K:
        return "w2", f"the FP8 decode kernel needs I = w2.shape[2] a multiple of {FP8_TILE_K} (its K steps), got {I}"
    if I % H_TILE:
        return "w2", f"the decode kernel needs I = w2.shape[2] a multiple of {H_TILE} (its h tiles), got {I}"
    return None


def size_error(T: int, top_k: int, K: int, I: int, fp8: bool = False) -> str | None:  # noqa: E741
    """:func:`size_limit` worded for the ValueError that names the argument
    (:func:`cute_moe.decode.check_decode_sizes`); None when the kernel serves these sizes (the plan's rule,
    :func:`cute_moe.plan.one_launch`, asks :func:`size_limit` the same)."""
    limit = size_limit(T, top_k, K, I, fp8)
    if limit is None:
        return None
    argument, words = limit
    advice = "; call cute_moe.fused_moe (the grouped pipeline)" if argument == "topk_ids" else ""
    return f"{argument}: {words}{advice}"


def pair_bucket(pairs: int) -> int:
    """Rows of the workspace's h and y: the pairs rounded up to a power of two, 8 … 64."""
    return max(8, 1 << max(pairs - 1, 0).bit_length())


def stage_tx_bytes() -> int:
    """Bytes TMA lands per ring stage (the full barrier's transaction count): two 64 × 64 bf16 boxes."""
    return 2 * WGMMA_M * TILE_K * 2


def token_rings() -> int:
    """Token-row tiles per ring stage: one K step's, and a second for a half task's second K step."""
    return 2 if HALF_TASKS else 1


def smem_bytes() -> int:
    """Shared memory of a CTA, about: the ring (weights and token rows) and ≤ 2 KiB of barriers and tables."""
    return STAGES * (stage_tx_bytes() + token_rings() * TOKENS * TILE_K * 2) + 2048


def launch_summary(T: int, top_k: int, E: int, K: int, I: int, sms: int) -> dict:  # noqa: E741
    """What one launch at these sizes is, from the kernel's constants (the explorer prints it): the grid,
    the tiles, the tasks of each phase at the most leaders (every pair on its own expert), the ring, the
    shared memory, the WGMMA, the counters and the workspace rows."""
    nt1, nk, ntb = tile_counts(T, K, I)
    leaders = min(T * top_k, E)
    grid = grid_size(T, top_k, E, K, I, sms)
    halves = a_halves(leaders, nt1, grid)
    _, b, c = task_counts(leaders, T, K, I)
    a = max(n * nt1 * a_halves(n, nt1, grid) for n in range(1, leaders + 1))  # fewer leaders may halve
    return {
        "grid": grid,
        "a_halves": halves,
        "threads": THREADS,
        "pairs": T * top_k,
        "max_leaders": leaders,
        "tiles": {"h_tile": H_TILE, "y_tile": Y_TILE, "tile_k": TILE_K, "tokens": TOKENS, "token_block": TOKEN_BLOCK}
        | {"nt1": nt1, "nk": nk, "ntb": ntb},
        "tasks_at_most": {"A": a, "B": b, "C": c},
        "ring": {
            "stages": STAGES,
            "stage_bytes": stage_tx_bytes() + token_rings() * TOKENS * TILE_K * 2,
            "tma_bytes": stage_tx_bytes(),
        },
        "smem_bytes": smem_bytes(),
        "wgmma": WGMMA,
        "counter_words": counter_words(K),
        "workspace_rows": pair_bucket(T * top_k),
    }


def leader_tables(ids: list[int], E: int) -> dict:
    """The routing tables :func:`build_tables` writes, in Python (a reference for tests and notes)."""
    expert = [min(max(int(i), 0), E - 1) for i in ids]
    first = [expert.index(e) for e in expert]
    leaders = [p for p in range(len(ids)) if first[p] == p]
    order = [q for p in leaders for q in range(len(ids)) if first[q] == p]
    count = [first.count(p) for p in leaders]
    start = [sum(count[:r]) for r in range(len(leaders))]
    return dict(expert=expert, lead=leaders, order=order, start=start, count=count, n_leaders=len(leaders))


# ---- the dependency protocol ------------------------------------------------------------------------
@cute.jit
def wait_at_least(ptr, target):
    """Spin until the int32 at ``ptr`` is at least ``target``: ``ld.acquire.gpu`` (an acquire pattern), a
    ``nanosleep`` between reads so that spinning CTAs leave L2 to the ones that stream weights."""
    seen = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
    while seen < target:
        cute.arch.inline_ptx("nanosleep.u32 64;")
        seen = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")


@cute.jit
def warp_wait_at_least(ptr, target, lane):
    """:func:`wait_at_least` for a whole warp whose every lane then reads what the counter guards: lane 0
    spins, then every lane makes its own acquire read (which sees the target at once: it comes after lane
    0's read in the warp's order)."""
    if lane == 0:
        wait_at_least(ptr, target)
    cute.arch.sync_warp()
    wait_at_least(ptr, target)


@cute.jit
def signal(ptr):
    """Count a finished task, by one thread after its group's barrier: ``fence.acq_rel.gpu`` then
    ``red.release.gpu.add`` (a release pattern, cumulative over the barrier)."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.red(ptr, cutlass.Int32(1), op="add", dtype=cutlass.Int32, sem="release", scope="gpu")


def consumer_sync():
    """The consumer warpgroup's barrier (128 threads)."""
    cute.arch.barrier(barrier_id=CONSUMER_BARRIER_ID, number_of_threads=CONSUMER_THREADS)


def ring_state(count, producer: bool):
    """The ring's pipeline state after ``count`` stages (a producer's phase starts at 1)."""
    phase = (count // STAGES) % 2
    if producer:
        phase = phase ^ 1
    return pipeline.PipelineState(STAGES, count, count % STAGES, phase)


# ---- the routing tables -------------------------------------------------------------------------------
@cute.jit
def build_tables(tables, ids: cute.Tensor, weights: cute.Tensor, word: cute.Tensor, E, tidx, checks):
    """Every CTA: the routing tables in shared memory (``tables``: expert, first, order, start, count,
    lead, scale, n_leaders), thread p for pair p, three passes between CTA barriers.  ``checks`` (CTA 0):
    also OR the contract's data-check bits into the error word ``word``."""
    s_exp, s_first, s_order, s_start, s_count, s_lead, s_scale, s_nl = tables
    top_k = ids.shape[1]
    P = ids.shape[0] * top_k
    if tidx < PAIR_LANES:
        e = cutlass.Int32(-1)
        if tidx < P:
            t, j = tidx // top_k, tidx % top_k
            raw = cutlass.Int64(ids[(t, j)])
            w = weights[(t, j)]
            in_range = (raw >= 0) & (raw < cutlass.Int64(E))
            e = cutlass.Int32(cutlass.min(cutlass.max(raw, cutlass.Int64(0)), cutlass.Int64(E - 1)))
            bits = cutlass.Int32(0)
            if in_range:
                s_scale[tidx] = w
            else:
                s_scale[tidx] = cutlass.Float32(float("nan"))  # its token's row: NaN (moe_spec.contract)
                bits = bits | BAD_ID
            if checks:
                if abs(w) < cutlass.Float32(float("inf")):
                    pass
                else:  # NaN fails the compare too
                    bits = bits | BAD_WEIGHT
                for back in range(j):  # the same id in an earlier slot of the row
                    if in_range & (cutlass.Int64(ids[(t, back)]) == raw):
                        bits = bits | REPEATED_ID
                if bits != 0:
                    cute.arch.atomic_or(word.iterator, bits)
        s_exp[tidx] = e
    cute.arch.sync_threads()
    first = cutlass.Int32(0)
    slot = cutlass.Int32(0)
    if tidx < P:
        e = s_exp[tidx]
        first = tidx
        for q in range(tidx):  # the leader is the lowest pair of the expert; slot = rank among its pairs
            if s_exp[q] == e:
                first = cutlass.min(first, q)
                slot = slot + 1
        s_first[tidx] = first
    cute.arch.sync_threads()
    if tidx < P:
        before = cutlass.Int32(0)  # pairs whose leader comes before this pair's: its group's start
        members = cutlass.Int32(0)
        rank = cutlass.Int32(0)
        leaders = cutlass.Int32(0)
        for q in range(P):
            fq = s_first[q]
            if fq < first:
                before = before + 1
            if fq == tidx:
                members = members + 1
            if fq == q:
                leaders = leaders + 1
                if q < tidx:
                    rank = rank + 1
        s_order[before + slot] = tidx
        if first == tidx:
            s_lead[rank] = tidx
            s_start[rank] = before
            s_count[rank] = members
        if tidx == 0:
            s_nl[0] = leaders
    cute.arch.sync_threads()

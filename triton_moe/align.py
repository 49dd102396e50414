"""Token alignment in Triton: the project's :class:`moe_spec.align.Alignment` in two launches, with
the checks of ``topk_ids`` folded in.

The grouped GEMM gives every program BLOCK_M rows of ONE expert. :func:`align_block_size` sorts
the (token, slot) pairs by expert and pads each expert's run to a multiple of BLOCK_M, entirely on
the device (no host synchronisation, so the whole layer can be captured in a CUDA graph), and
returns the same :class:`~moe_spec.align.Alignment` — ``sorted_ids``, ``expert_of_block``,
``expert_end``, ``num_padded`` — as the reference routine :func:`moe_spec.align.align`, bit for
bit (``tests/test_triton_align.py``). Its buffers have the reference's worst-case size
(:func:`moe_spec.align.max_rows`); the GEMM grid covers that many blocks and programs past
``num_padded`` exit at once. Every row of ``sorted_ids`` is written by a kernel (pairs, padding,
the unused tail), so nothing is zero-filled by a separate launch.

The pairs are cut into **chunks of whole token rows**, and each chunk is one program's work: a
small alignment (at most ``SCAN_ROWS`` chunks of ``SMALL_CHUNK // top_k`` rows — 1024 pairs for
top_k = 1, 2, 4, 8) takes chunks of at most SMALL_CHUNK = 64 pairs, a larger one chunks of at most
CHUNK = 256. Both widths live in the same binaries: the kernels branch on ``num_pairs`` at run
time (each width's code is compiled in), so a new T never compiles anything. Two kernels, stable
and deterministic (no atomics on the data):

1. ``_count_kernel``: each program histograms its chunk into ``counts[chunk, e]``.
2. ``_place_kernel``: each program first derives what it needs from the histograms — per expert,
   the total (→ padded run lengths and their prefix sum, ``expert_end``) and the pairs of the
   chunks before its own (→ where its chunk's pairs start inside each run). Then, if it has a
   chunk, pair i of it goes to
   ``start[e] + before[e] + #{earlier pairs of the chunk with the same expert}`` — a comparison of
   RANK_ROWS = 64 pairs with the whole chunk per step (64 × 64 once for a small chunk, 4 steps of
   64 × 256 for a large one; the whole 256 × 256 at once spilled registers). Every program then
   labels its share of the M-blocks (block b belongs to the expert whose padded run contains row
   b·BLOCK_M) and writes the sentinel P into their padding rows. A repeated expert in a token's
   row is found by comparing each pair with the earlier slots of its row (top_k − 1 loads, unrolled
   so that they are in flight together).

Why two widths: a chunk's rank costs (chunk width)² comparisons whatever the number of pairs in
it, and at decode a batch holds a few pairs (T = 1, top_k = 8: 8 pairs); 64-pair chunks make that
64² and spread T ≤ 128 (top_k = 8) over up to 16 programs. Large batches keep 256-pair chunks
because every program re-derives the scan: it reads the [chunks, E] histograms once per program
instead of once, in exchange for a launch — for the catalog shapes at T = 4096 that is 8 KB
(Mixtral) to 128 KB (DeepSeek-V3) per program, about what the single program of a separate scan
would read, and four times more chunks would read sixteen times more in all. Both kernels run at
every T, so a warm-up at any batch size compiles all there is: a single-program path for one
chunk would save a launch at decode but compile new binaries the first time a batch needs two
chunks. ``python -m triton_moe.lab.bench_align`` times the alignment on a GPU (with and without the
small chunks, and with 4 warps per place program).

The checks of ``topk_ids`` (``moe_spec.validate``): the place kernel reads every id, so it also
flags an id outside [0, E) (:data:`~moe_spec.validate.BAD_ID`) and a repeated expert in a token's
row (:data:`~moe_spec.validate.REPEATED_ID`) in the device's error word. A bad id is clamped into
[0, E) wherever it addresses memory here (the histogram, the runs), identically in both kernels,
so the alignment stays consistent and in bounds; the GEMMs then zero and poison that pair
(:mod:`triton_moe.kernels`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_spec.align import Alignment, max_rows
from moe_spec.validate import BAD_ID, REPEATED_ID, error_word
from triton_moe.jit import Bound

#: Pairs per chunk, at most (a chunk holds CHUNK // top_k whole token rows; the rank needs a
#: CHUNK² comparison). A top_k above CHUNK widens the chunk to one row.
CHUNK = 256
#: Pairs per chunk of a small alignment (at most SCAN_ROWS chunks of SMALL_CHUNK // top_k rows:
#: 1024 pairs for top_k = 1, 2, 4, 8): a 64² rank comparison instead of 256².
SMALL_CHUNK = 64
#: Pairs of a large chunk ranked per step (a RANK_ROWS × CHUNK comparison each).
RANK_ROWS = 64
#: Chunk rows of the histograms read per step when a program re-derives the scan.
SCAN_ROWS = 16
#: M-blocks labelled per step of a program.
BLOCKS_PER_PROGRAM = 64
#: Largest supported expert count (the scan keeps one lane per expert in a program).
MAX_EXPERTS = 1024
#: Warps of a place program. Compiled for sm_90a on the CPU, neither 4 nor 8 spill since the rank
#: is taken RANK_ROWS pairs per step (the whole CHUNK × CHUNK comparison spilled 192–480 bytes
#: at E = 8…1024 with 4 warps, 96–328 with 8). 4 measured faster on the H200 at every catalog
#: shape and T (notes/results/triton_align_h200_2026-12-02.md).
PLACE_WARPS = 4

_BAD_ID = tl.constexpr(BAD_ID)
_REPEATED_ID = tl.constexpr(REPEATED_ID)


def check_num_experts(num_experts: int) -> None:
    """The alignment's one limit: the scan keeps one lane per expert in a single program."""
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts: at most {MAX_EXPERTS} experts are supported, got {num_experts}")


@triton.jit
def _chunk(
    topk_ids_ptr,
    chunk,
    num_pairs,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    CHUNK: tl.constexpr,
    FIRST=0,
    WIDTH: tl.constexpr = None,
):
    """Pairs FIRST … FIRST + WIDTH − 1 (default: all CHUNK) of chunk ``chunk`` (CHUNK // TOP_K whole
    rows): (index in the chunk, pair index, valid, expert clamped into [0, E) as int32, id out of range)."""
    PAIRS: tl.constexpr = CHUNK // TOP_K * TOP_K
    idx = FIRST + tl.arange(0, CHUNK if WIDTH is None else WIDTH)
    offs = chunk * PAIRS + idx
    valid = (idx < PAIRS) & (offs < num_pairs)
    raw = tl.load(topk_ids_ptr + offs, mask=valid, other=0)  # int32 or int64, as given
    in_range = (raw >= 0) & (raw < E)
    experts = tl.minimum(tl.maximum(raw, 0), E - 1).to(tl.int32)
    return idx, offs, valid, experts, valid & ~in_range


@triton.jit
def _histogram(
    topk_ids_ptr,
    counts_ptr,
    chunk,
    num_pairs,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TOP_K: tl.constexpr,
    CHUNK: tl.constexpr,
):
    _, _, valid, experts, _ = _chunk(topk_ids_ptr, chunk, num_pairs, E, TOP_K, CHUNK)
    lanes = tl.arange(0, E_POW2)
    tl.store(counts_ptr + chunk * E + lanes, tl.histogram(experts, E_POW2, mask=valid), mask=lanes < E)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    topk_ids_ptr,
    counts_ptr,
    num_pairs,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TOP_K: tl.constexpr,
    CHUNK: tl.constexpr,
    SMALL_CHUNK: tl.constexpr,
    SMALL_PAIRS: tl.constexpr,
):
    if num_pairs <= SMALL_PAIRS:  # a run-time branch: one binary serves both chunk widths
        _histogram(topk_ids_ptr, counts_ptr, tl.program_id(0), num_pairs, E, E_POW2, TOP_K, SMALL_CHUNK)
    else:
        _histogram(topk_ids_ptr, counts_ptr, tl.program_id(0), num_pairs, E, E_POW2, TOP_K, CHUNK)


@triton.jit
def _place_chunk(
    topk_ids_ptr,
    sorted_ids_ptr,
    error_ptr,
    chunk,
    num_pairs,
    first_row,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    CHUNK: tl.constexpr,
    RANK_ROWS: tl.constexpr,
):
    """Place the pairs of chunk ``chunk``: pair i goes to row ``first_row[e] + #{earlier pairs of the
    chunk with expert e}`` (its rank, RANK_ROWS pairs against the whole chunk per step); flag bad and
    repeated ids."""
    idx, _, _, experts, _ = _chunk(topk_ids_ptr, chunk, num_pairs, E, TOP_K, CHUNK)
    any_bad = 0
    any_repeat = 0
    for r0 in range(0, CHUNK, RANK_ROWS):
        mine_idx, offs, valid, mine, bad_id = _chunk(topk_ids_ptr, chunk, num_pairs, E, TOP_K, CHUNK, r0, RANK_ROWS)
        same_before = (mine[:, None] == experts[None, :]) & (idx[None, :] < mine_idx[:, None])
        rank = tl.sum(same_before.to(tl.int32), axis=1)
        tl.store(sorted_ids_ptr + tl.gather(first_row, mine, 0) + rank, offs, mask=valid)
        # a repeat: the same id in an earlier slot j of the pair's row (rows lie whole in a chunk)
        ok = valid & ~bad_id
        raw = tl.load(topk_ids_ptr + offs, mask=ok, other=-2)
        repeated = tl.zeros([RANK_ROWS], dtype=tl.int1)
        if TOP_K <= 16:  # unrolled: the TOP_K - 1 loads are independent and in flight together
            for j in tl.static_range(1, TOP_K):
                earlier = tl.load(topk_ids_ptr + offs - j, mask=ok & (mine_idx % TOP_K >= j), other=-1)
                repeated |= earlier == raw
        else:
            for j in range(1, TOP_K):
                earlier = tl.load(topk_ids_ptr + offs - j, mask=ok & (mine_idx % TOP_K >= j), other=-1)
                repeated |= earlier == raw
        any_bad = tl.maximum(any_bad, tl.max(bad_id.to(tl.int32), axis=0))
        any_repeat = tl.maximum(any_repeat, tl.max((repeated & ok).to(tl.int32), axis=0))
    bits = tl.where(any_bad > 0, _BAD_ID, 0) | tl.where(any_repeat > 0, _REPEATED_ID, 0)
    tl.atomic_or(error_ptr, bits, mask=bits != 0)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_blocks"])
def _place_kernel(
    topk_ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    expert_of_block_ptr,
    expert_end_ptr,
    error_ptr,
    num_pairs,
    num_chunks,
    num_blocks,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SMALL_CHUNK: tl.constexpr,
    SMALL_PAIRS: tl.constexpr,
    SCAN_ROWS: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    RANK_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    lanes = tl.arange(0, E_POW2)
    lane_ok = lanes < E

    # ---- the scan: per expert, all pairs (total) and the pairs of earlier chunks (before) ----
    total = tl.zeros([E_POW2], dtype=tl.int32)
    before = tl.zeros([E_POW2], dtype=tl.int32)
    for c0 in range(0, num_chunks, SCAN_ROWS):
        rows = c0 + tl.arange(0, SCAN_ROWS)
        c = tl.load(
            counts_ptr + rows[:, None] * E + lanes[None, :],
            mask=(rows[:, None] < num_chunks) & lane_ok[None, :],
            other=0,
        )
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where(rows[:, None] < pid, c, 0), axis=0)
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    num_padded = tl.sum(padded, axis=0)
    tl.store(expert_end_ptr + lanes, end, mask=lane_ok & (pid == 0))

    # ---- place this program's chunk, if it has one (a run-time branch picks the chunk width) ----
    if pid < num_chunks:
        if num_pairs <= SMALL_PAIRS:
            _place_chunk(
                topk_ids_ptr,
                sorted_ids_ptr,
                error_ptr,
                pid,
                num_pairs,
                start + before,
                TOP_K,
                E,
                SMALL_CHUNK,
                SMALL_CHUNK,
            )
        else:
            _place_chunk(
                topk_ids_ptr, sorted_ids_ptr, error_ptr, pid, num_pairs, start + before, TOP_K, E, CHUNK, RANK_ROWS
            )

    # ---- label M-blocks and write the sentinel P into their padding rows ----
    run_end = tl.where(lane_ok, start + total, 0)  # end of each expert's pairs inside its run
    starts = tl.where(lane_ok, start, 2147483647)
    in_block = tl.arange(0, BLOCK_M)
    for b0 in range(pid * BLOCKS_PER_PROGRAM, num_blocks, tl.num_programs(0) * BLOCKS_PER_PROGRAM):
        blocks = b0 + tl.arange(0, BLOCKS_PER_PROGRAM)
        # the expert of row r is the last one whose run starts at or before r (an empty run shares
        # its start with the next expert, the later one, which wins)
        owner = tl.sum((starts[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1) - 1
        used = blocks * BLOCK_M < num_padded
        tl.store(expert_of_block_ptr + blocks, tl.where(used, owner, -1), mask=blocks < num_blocks)
        pairs_end = tl.where(used, tl.gather(run_end, tl.maximum(owner, 0), 0), 0)
        rows = blocks[:, None] * BLOCK_M + in_block[None, :]
        tl.store(
            sorted_ids_ptr + rows,
            tl.zeros_like(rows) + num_pairs,
            mask=(rows >= pairs_end[:, None]) & (blocks < num_blocks)[:, None],
        )


def _widths(top_k: int) -> tuple[int, int, int]:
    """(small chunk's width, large chunk's width, most pairs aligned in small chunks) for ``top_k``."""
    small = max(SMALL_CHUNK, 1 << (top_k - 1).bit_length())
    large = max(CHUNK, small)
    return small, large, SCAN_ROWS * (small // top_k * top_k)


def chunk_pairs(top_k: int, num_pairs: int) -> tuple[int, int]:
    """(chunk width, pairs per chunk) of an alignment of ``num_pairs`` pairs with ``top_k``: whole
    token rows, at most SMALL_CHUNK pairs (wider for a wider row) up to :func:`_widths`' limit, at
    most CHUNK above it."""
    small, large, limit = _widths(top_k)
    width = small if num_pairs <= limit else large
    return width, width // top_k * top_k


@functools.lru_cache(maxsize=1024)
def _launch_sizes(T: int, top_k: int, num_experts: int, num_blocks: int) -> tuple:
    """(pairs, chunks, the kernels' constexprs, _place_kernel's grid) of one alignment: a function
    of the sizes."""
    num_pairs = T * top_k
    small, large, limit = _widths(top_k)
    num_chunks = -(-num_pairs // chunk_pairs(top_k, num_pairs)[1])
    grid = (max(num_chunks, -(-num_blocks // BLOCKS_PER_PROGRAM), 1),)
    constexprs = dict(
        E=num_experts,
        E_POW2=1 << (num_experts - 1).bit_length(),
        TOP_K=top_k,
        CHUNK=large,
        SMALL_CHUNK=small,
        SMALL_PAIRS=limit,
    )
    return num_pairs, num_chunks, constexprs, grid


@functools.lru_cache(maxsize=1024)
def _bound(T: int, top_k: int, num_experts: int, num_blocks: int, block_m: int) -> tuple:
    """(pairs, chunks, the count launch, the place launch) of one alignment, grids and constexprs
    bound once per shape (:class:`~triton_moe.jit.Bound`)."""
    num_pairs, num_chunks, constexprs, grid = _launch_sizes(T, top_k, num_experts, num_blocks)
    return (
        num_pairs,
        num_chunks,
        Bound(_count_kernel, (num_chunks,), **constexprs),
        Bound(
            _place_kernel,
            grid,
            BLOCK_M=block_m,
            SCAN_ROWS=SCAN_ROWS,
            BLOCKS_PER_PROGRAM=BLOCKS_PER_PROGRAM,
            RANK_ROWS=RANK_ROWS,
            num_warps=PLACE_WARPS,
            **constexprs,
        ),
    )


def align_into(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    sorted_ids: torch.Tensor,
    expert_of_block: torch.Tensor,
    expert_end: torch.Tensor,
    counts: torch.Tensor,
    error: torch.Tensor,
) -> Alignment:
    """:func:`align_block_size` into given buffers (sizes as :func:`buffer_sizes` says; ``counts``
    int32 [chunks, num_experts]) — the launches only, for a caller that keeps its buffers
    (:mod:`triton_moe.moe`)."""
    T, top_k = topk_ids.shape
    num_blocks = expert_of_block.numel()
    num_pairs, num_chunks, count, place = _bound(T, top_k, num_experts, num_blocks, block_m)
    flat_ids = topk_ids.reshape(-1)
    count(flat_ids, counts, num_pairs)
    place(flat_ids, counts, sorted_ids, expert_of_block, expert_end, error, num_pairs, num_chunks, num_blocks)
    return Alignment(
        tile=block_m, num_pairs=num_pairs, sorted_ids=sorted_ids, expert_of_block=expert_of_block, expert_end=expert_end
    )


def buffer_sizes(T: int, top_k: int, num_experts: int, block_m: int) -> dict:
    """Sizes of the alignment's buffers: rows of ``sorted_ids``, M-blocks, histogram chunks."""
    num_pairs = T * top_k
    rows = max_rows(num_pairs, num_experts, block_m)
    return {
        "rows": rows,
        "blocks": rows // block_m,
        "chunks": max(-(-num_pairs // chunk_pairs(top_k, num_pairs)[1]), 1),
    }


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort pairs by expert and pad to ``block_m``: :func:`moe_spec.align.align`'s result, in Triton.

    ``topk_ids`` [T, top_k] int32 or int64 (contiguous). No host sync. Ids outside
    [0, num_experts) or repeated in a row are flagged in the device's error word
    (:func:`moe_spec.validate.error_word`) and aligned as if clamped into range. Raises ValueError
    before any launch when ``num_experts`` exceeds :data:`MAX_EXPERTS`.
    """
    check_num_experts(num_experts)
    T, top_k = topk_ids.shape
    n = buffer_sizes(T, top_k, num_experts, block_m)
    device = topk_ids.device
    new = lambda *shape: torch.empty(shape, dtype=torch.int32, device=device)  # noqa: E731
    return align_into(
        topk_ids,
        num_experts,
        block_m,
        new(n["rows"]),
        new(n["blocks"]),
        new(num_experts),
        new(n["chunks"], num_experts),
        error_word(device),
    )

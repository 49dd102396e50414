"""The two CuTe launches that align the pairs, check the routing data and write every row map.

What they compute is :func:`cute_moe.rowmaps.reference_rows` (the maps, the checks and their
meaning are in :mod:`cute_moe.rowmaps`, the host side): ``moe_spec.align.align``'s alignment of
the ids clamped into [0, E), bit for bit, the row maps and each GEMM tile's block map, and the
bits of ``moe_spec.validate.guard_routing`` ORed into the error word (an atomic OR, executed
once by a thread that found a fault).  The pairs are cut into chunks of :data:`CHUNK`; CTA ``c``
owns chunk ``c`` in both launches, and its 8 warps own consecutive slices of the chunk, walked 32
pairs (one per lane) at a time.

1. ``CountExperts`` (one CTA per chunk, only for more than one chunk): each warp counts its slice
   into its own row of a shared ``[warps, E]`` table; the rows are summed into ``counts[c, e]``.
2. ``PlacePairs`` (one CTA per chunk):

   a. every CTA reads the whole ``counts`` table: expert ``e``'s total and the pairs of ``e`` in
      the chunks before ``c`` (with a single chunk, launch 1 is skipped and the totals are the
      CTA's own counts from b); each thread checks its pairs (range, weight, the earlier slots
      of the pair's token row — raw ids, read from global memory: a row may straddle chunks);
   b. it counts its own warps' slices again (as in 1), pads every total to ``tile`` and scans
      them over the experts (a block scan) — ``expert_end`` and the block counts, written by
      CTA 0 — and turns the table into the row where each warp's next pair of ``e`` goes:
      ``start_e + (pairs of e in earlier chunks) + (pairs of e in earlier warps)``;
   c. each warp walks its slice 32 pairs at a time: ``match.any`` gives each lane the lanes that
      hold the same expert, the lane's rank among them is the popcount of those below it, and one
      lane per expert advances the table entry.  So a pair's row is its expert's start plus the
      number of earlier pairs of that expert — its index order, which no atomic would give; the
      lane writes the pair's row in every map;
   d. the rows that hold no pair (each run's padding, everything past the used rows) get the
      sentinel, the last token and weight 0, and every block (the alignment's and each GEMM's)
      its expert; each row and block is written exactly once;
   e. the grid zeroes a scratch buffer later kernels accumulate into (FP8: the amax buffers).

The sort uses no atomics (each warp owns its table row): the result is deterministic.  A ``match``
treats lanes of the same expert in one step, so a skewed routing costs no more than a uniform one.
Limits (checked in ``rowmaps``): E ≤ :data:`MAX_EXPERTS`; ids int32 or int64 (a compile per dtype).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_ptr  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

from moe_spec.validate import BAD_ID, BAD_WEIGHT, REPEATED_ID  # noqa: E402

from .ptx import compile_once  # noqa: E402

THREADS = 256  # threads of a CTA in both launches
WARP = 32
WARPS = THREADS // WARP
CHUNK = 2048
"""Pairs per CTA (a multiple of ``THREADS``): 8 per thread when the chunk is staged in shared memory."""
MAX_EXPERTS = 1024
"""Largest expert count: the shared ``[WARPS, E]`` table (32 KiB) and three ``[E]`` arrays."""
FULL_MASK = 0xFFFFFFFF
ID_DTYPES = {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}
GEMM_TILES = 2  # token tiles the place kernel writes block maps for (the layer's two GEMMs)


# ---- device helpers (traced inline into both kernels) ------------------------------------------
@cute.jit
def _padded(count, tile):
    """``count`` rounded up to a multiple of ``tile``: the rows of one expert's run."""
    return (count + tile - 1) // tile * tile


@cute.jit
def _stage_chunk(ids: cute.Tensor, s_ids: cute.Tensor, lo, n, num_experts):
    """``s_ids[i]`` = the expert of pair ``lo + i`` for ``i < n``, clamped into [0, E) (as
    ``guard_routing`` does); −1 past the chunk.  Each thread loads ``CHUNK / THREADS`` ids, all in
    flight at once."""
    tidx, _, _ = cute.arch.thread_idx()
    for k in cutlass.range_constexpr(CHUNK // THREADS):
        i = k * THREADS + tidx
        v = ids[lo + cutlass.min(i, n - 1)]  # a valid address for every thread (n >= 1)
        e = cutlass.Int32(cutlass.max(cutlass.min(v, num_experts - 1), 0))
        if i >= n:
            e = cutlass.Int32(-1)
        s_ids[i] = e


@cute.jit
def _check_chunk(ids: cute.Tensor, weights: cute.Tensor, word: cute.Tensor, lo, n, num_experts, top_k):
    """The routing data checks of the chunk's pairs (``guard_routing``'s meaning): an id outside
    [0, E), a non-finite weight (``w − w`` is not 0), an id equal to one in an earlier slot of the
    same token row (raw ids, so two equal out-of-range ids count as a repeat, as there).  A thread
    that found a fault ORs its bits into the error word, once."""
    tidx, _, _ = cute.arch.thread_idx()
    bits = cutlass.Int32(0)
    for k in cutlass.range_constexpr(CHUNK // THREADS):
        i = k * THREADS + tidx
        if i < n:
            p = lo + i
            v = ids[p]
            w = weights[p]
            if (v < 0) | (v >= num_experts):
                bits = bits | BAD_ID
            if (w - w) != cutlass.Float32(0.0):  # NaN for ±inf and NaN (an unordered compare)
                bits = bits | BAD_WEIGHT
            slot = p % top_k
            for d in cutlass.range(slot):
                if ids[p - 1 - d] == v:
                    bits = bits | REPEATED_ID
    if bits != 0:
        cute.arch.atomic_or(word.iterator, bits)


@cute.jit
def _warp_slice(n):
    """``[first, last)``: the positions of the chunk's ``n`` pairs this warp owns (whole rounds of 32
    lanes, consecutive warps own consecutive slices; trailing warps may own nothing)."""
    warp = cute.arch.warp_idx()
    span = (n + WARPS * WARP - 1) // (WARPS * WARP) * WARP
    first = warp * span
    return first, cutlass.min(first + span, n)


@cute.jit
def _count_warp_slice(s_ids: cute.Tensor, table: cute.Tensor, n, num_experts):
    """``table[w, e]`` = the pairs of expert ``e`` in warp ``w``'s slice (each warp writes only its row)."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    e = lane
    while e < num_experts:
        table[warp, e] = 0
        e += WARP
    cute.arch.sync_warp()
    first, last = _warp_slice(n)
    base = first
    while base < last:
        x = cutlass.Int32(-1)
        if base + lane < last:
            x = s_ids[base + lane]
        peers = cute.arch.match_sync(FULL_MASK, x)  # the lanes holding the same expert as this one
        if (x >= 0) & ((peers & cute.arch.lanemask_lt()) == 0):  # the lowest of them adds them all
            table[warp, x] = table[warp, x] + cutlass.Int32(cute.arch.popc(peers))
        cute.arch.sync_warp()
        base += WARP


class CountExperts:
    """Launch 1.  Arguments: ids (a pointer to P int32/int64: the routing tensor, passed as a bare
    pointer, which costs the host a tenth of a wrapped tensor), num_pairs Int32 (P ≥ 1), counts
    int32 [C·E] (out, ``counts[c·E + e]``), num_experts Int32, stream.  Grid: one CTA per chunk,
    ``C = ⌈P / CHUNK⌉``."""

    @cute.jit
    def __call__(self, ids_ptr: cute.Pointer, num_pairs: cutlass.Int32, counts: cute.Tensor,
                 num_experts: cutlass.Int32, stream):
        ids = cute.make_tensor(ids_ptr, cute.make_layout((num_pairs,)))
        chunks = (num_pairs + CHUNK - 1) // CHUNK
        self.kernel(ids, counts, num_experts).launch(grid=[chunks, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, ids: cute.Tensor, counts: cute.Tensor, num_experts: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        lo = c * CHUNK
        n = cutlass.min(CHUNK, ids.shape[0] - lo)
        smem = SmemAllocator()
        s_ids = smem.allocate_tensor(cutlass.Int32, cute.make_layout(CHUNK))
        table = smem.allocate_tensor(cutlass.Int32, cute.make_layout((WARPS, MAX_EXPERTS), stride=(MAX_EXPERTS, 1)))
        _stage_chunk(ids, s_ids, lo, n, num_experts)
        cute.arch.sync_threads()
        _count_warp_slice(s_ids, table, n, num_experts)
        cute.arch.sync_threads()
        e = tidx
        while e < num_experts:
            total = cutlass.Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                total += table[w, e]
            counts[c * num_experts + e] = total
            e += THREADS


class PlacePairs:
    """Launch 2.  Arguments (the module docstring defines the maps):

    ids and weights (pointers to P int32/int64 ids and P fp32 weights, as in launch 1), num_pairs
    Int32, counts int32 [C·E] (launch 1; not read when C = 1), sorted_ids int32 [rows],
    expert_of_block int32 [rows / tile], expert_end int32 [E], token_of_row int64 [rows],
    weight_of_row fp32 [rows], row_of_pair int64 [P], weight_of_pair fp32 [P], row_mask int32
    [rows], blocks0 / blocks1 int32 [rows / tile0] / [rows / tile1] (each GEMM tile's block
    experts), block_counts int32 [2] (used blocks of each), word int32 [1] (the error word),
    scratch fp32 [n] (zeroed), num_experts, tile, top_k, tile0, tile1 (Int32), stream.
    Grid: one CTA per chunk, as launch 1.
    """

    @cute.jit
    def __call__(self, ids_ptr: cute.Pointer, weights_ptr: cute.Pointer, num_pairs: cutlass.Int32,
                 counts: cute.Tensor, sorted_ids: cute.Tensor, expert_of_block: cute.Tensor, expert_end: cute.Tensor,
                 token_of_row: cute.Tensor, weight_of_row: cute.Tensor, row_of_pair: cute.Tensor,
                 weight_of_pair: cute.Tensor, row_mask: cute.Tensor, blocks0: cute.Tensor, blocks1: cute.Tensor,
                 block_counts: cute.Tensor, word: cute.Tensor, scratch: cute.Tensor,
                 num_experts: cutlass.Int32, tile: cutlass.Int32, top_k: cutlass.Int32, tile0: cutlass.Int32,
                 tile1: cutlass.Int32, stream):
        ids = cute.make_tensor(ids_ptr, cute.make_layout((num_pairs,)))
        weights = cute.make_tensor(weights_ptr, cute.make_layout((num_pairs,)))
        chunks = (num_pairs + CHUNK - 1) // CHUNK
        self.kernel(ids, weights, counts, sorted_ids, expert_of_block, expert_end, token_of_row, weight_of_row,
                    row_of_pair, weight_of_pair, row_mask, blocks0, blocks1, block_counts, word, scratch,
                    num_experts, tile, top_k, tile0, tile1).launch(grid=[chunks, 1, 1], block=[THREADS, 1, 1],
                                                                   stream=stream)

    @cute.kernel
    def kernel(self, ids: cute.Tensor, weights: cute.Tensor, counts: cute.Tensor, sorted_ids: cute.Tensor,
               expert_of_block: cute.Tensor, expert_end: cute.Tensor, token_of_row: cute.Tensor,
               weight_of_row: cute.Tensor, row_of_pair: cute.Tensor, weight_of_pair: cute.Tensor,
               row_mask: cute.Tensor, blocks0: cute.Tensor, blocks1: cute.Tensor, block_counts: cute.Tensor,
               word: cute.Tensor, scratch: cute.Tensor,
               num_experts: cutlass.Int32, tile: cutlass.Int32, top_k: cutlass.Int32, tile0: cutlass.Int32,
               tile1: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        chunks, _, _ = cute.arch.grid_dim()
        num_pairs = ids.shape[0]
        lo = c * CHUNK
        n = cutlass.min(CHUNK, num_pairs - lo)
        smem = SmemAllocator()
        s_ids = smem.allocate_tensor(cutlass.Int32, cute.make_layout(CHUNK))
        table = smem.allocate_tensor(cutlass.Int32, cute.make_layout((WARPS, MAX_EXPERTS), stride=(MAX_EXPERTS, 1)))
        s_total = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS))   # pairs of e
        s_before = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS))  # ... in chunks < c
        s_end = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS))     # end of e's run
        s_warp_sums = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS))

        # (a) every expert's total and its pairs in the chunks before this one: from launch 1's
        #     counts, or — a single chunk, where launch 1 is skipped — from this CTA's own table;
        #     the data checks of this chunk's pairs
        _stage_chunk(ids, s_ids, lo, n, num_experts)
        _check_chunk(ids, weights, word, lo, n, num_experts, top_k)
        if chunks > 1:
            e = tidx
            while e < num_experts:
                before = cutlass.Int32(0)
                for cc in cutlass.range(c, unroll=4):
                    before += counts[cc * num_experts + e]
                total = before
                for cc in cutlass.range(c, chunks, unroll=4):
                    total += counts[cc * num_experts + e]
                s_before[e] = before
                s_total[e] = total
                e += THREADS
        cute.arch.sync_threads()
        # (b) this chunk's per-warp counts; the padded runs scanned over the experts
        _count_warp_slice(s_ids, table, n, num_experts)
        cute.arch.sync_threads()
        if chunks == 1:
            e = tidx
            while e < num_experts:
                total = cutlass.Int32(0)
                for w in cutlass.range_constexpr(WARPS):
                    total += table[w, e]
                s_before[e] = 0
                s_total[e] = total
                e += THREADS
            cute.arch.sync_threads()
        _scan_runs(s_total, s_end, s_warp_sums, num_experts, tile)  # ends with a CTA barrier
        if c == 0:
            e = tidx
            while e < num_experts:
                expert_end[e] = s_end[e]
                e += THREADS
            if tidx == 0:
                used = s_end[num_experts - 1]
                block_counts[0] = used // tile0
                block_counts[1] = used // tile1
        e = tidx
        while e < num_experts:  # table[w, e] := the row of warp w's first pair of expert e
            row = s_end[e] - _padded(s_total[e], tile) + s_before[e]
            for w in cutlass.range_constexpr(WARPS):
                mine = table[w, e]
                table[w, e] = row
                row += mine
            e += THREADS
        cute.arch.sync_threads()
        # (c) the pairs, in index order within each expert, and their row in every map
        _place_warp_slice(ids, weights, s_ids, table, sorted_ids, token_of_row, weight_of_row, row_of_pair,
                          weight_of_pair, row_mask, lo, n, num_experts, top_k)
        # (d) the rows without a pair, and every block's expert
        _fill_padding(s_total, s_end, sorted_ids, expert_of_block, token_of_row, weight_of_row, row_mask, blocks0,
                      blocks1, num_experts, tile, tile0, tile1, num_pairs, num_pairs // top_k - 1, c, chunks)
        # (e) the layer's scratch that must start at zero (the FP8 amax buffers)
        i = c * THREADS + tidx
        while i < scratch.shape[0]:
            scratch[i] = cutlass.Float32(0.0)
            i += chunks * THREADS


@cute.jit
def _scan_runs(s_total: cute.Tensor, s_end: cute.Tensor, s_warp_sums: cute.Tensor, num_experts, tile):
    """``s_end[e]`` = Σ_{e' ≤ e} padded(s_total[e']) (inclusive).  Thread ``t`` owns ``per``
    consecutive experts; the per-thread sums are scanned in each warp by shuffles, then across
    the warps through shared memory.  Called by every thread; returns after a CTA barrier."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    per = (num_experts + THREADS - 1) // THREADS
    first = tidx * per
    mine = cutlass.Int32(0)
    for k in cutlass.range(per):
        if first + k < num_experts:
            mine += _padded(s_total[first + k], tile)
    inclusive = mine
    for j in cutlass.range_constexpr(5):  # Hillis–Steele over the 32 lanes: offsets 1, 2, 4, 8, 16
        up = cute.arch.shuffle_sync_up(inclusive, 1 << j)
        if lane >= (1 << j):
            inclusive += up
    if lane == WARP - 1:
        s_warp_sums[warp] = inclusive
    cute.arch.sync_threads()
    row = inclusive - mine
    for w in cutlass.range_constexpr(WARPS):
        if w < warp:
            row += s_warp_sums[w]
    for k in cutlass.range(per):
        if first + k < num_experts:
            row += _padded(s_total[first + k], tile)
            s_end[first + k] = row
    cute.arch.sync_threads()


@cute.jit
def _place_warp_slice(ids: cute.Tensor, weights: cute.Tensor, s_ids: cute.Tensor, table: cute.Tensor,
                      sorted_ids: cute.Tensor, token_of_row: cute.Tensor, weight_of_row: cute.Tensor,
                      row_of_pair: cute.Tensor, weight_of_pair: cute.Tensor, row_mask: cute.Tensor, lo, n, num_experts,
                      top_k):
    """Each pair of this warp's slice goes to row ``table[w, e]`` + its rank among the round's lanes
    of expert ``e`` (written to every map); then the lowest such lane advances ``table[w, e]``."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    first, last = _warp_slice(n)
    base = first
    while base < last:
        x = cutlass.Int32(-1)
        if base + lane < last:
            x = s_ids[base + lane]
        peers = cute.arch.match_sync(FULL_MASK, x)
        below = peers & cute.arch.lanemask_lt()
        if x >= 0:
            r = table[warp, x] + cutlass.Int32(cute.arch.popc(below))
            p = lo + base + lane
            sorted_ids[r] = p
            token_of_row[r] = cutlass.Int64(p // top_k)
            row_of_pair[p] = cutlass.Int64(r)
            v = ids[p]
            w = weights[p]
            in_amax = cutlass.Int32(1)
            if (v < 0) | (v >= num_experts):  # id clamped: its token comes out NaN, no FP8 amax sees it
                w, in_amax = cutlass.Float32(float("nan")), cutlass.Int32(0)
            row_mask[r] = in_amax
            weight_of_row[r] = w
            weight_of_pair[p] = w
        cute.arch.sync_warp()  # every lane has read table[w, x] before it moves
        if (x >= 0) & (below == 0):
            table[warp, x] = table[warp, x] + cutlass.Int32(cute.arch.popc(peers))
        cute.arch.sync_warp()
        base += WARP


@cute.jit
def _pad_row(sorted_ids: cute.Tensor, token_of_row: cute.Tensor, weight_of_row: cute.Tensor, row_mask: cute.Tensor,
             r, sentinel, last_token):
    """A row that holds no pair: the sentinel, a real token (finite) and weight 0."""
    sorted_ids[r] = sentinel
    token_of_row[r] = cutlass.Int64(last_token)
    weight_of_row[r] = cutlass.Float32(0.0)
    row_mask[r] = 0


@cute.jit
def _label_blocks(blocks: cute.Tensor, start, end, block_tile, e):
    """``blocks[b] = e`` for the ``block_tile``-row blocks of rows [start, end), a lane per block."""
    lane = cute.arch.lane_idx()
    b = start // block_tile + lane
    while b < end // block_tile:
        blocks[b] = e
        b += WARP


@cute.jit
def _unused_blocks(blocks: cute.Tensor, used, block_tile, first, step):
    """−1 for the blocks past the used rows (a grid-stride loop)."""
    b = used // block_tile + first
    while b < blocks.shape[0]:
        blocks[b] = -1
        b += step


@cute.jit
def _fill_padding(s_total: cute.Tensor, s_end: cute.Tensor, sorted_ids: cute.Tensor, expert_of_block: cute.Tensor,
                  token_of_row: cute.Tensor, weight_of_row: cute.Tensor, row_mask: cute.Tensor, blocks0: cute.Tensor,
                  blocks1: cute.Tensor, num_experts, tile, tile0, tile1, sentinel, last_token, c, chunks):
    """The rows that hold no pair and the expert of every block.  Warp ``w`` of CTA ``c`` takes
    experts ``c·WARPS + w``, then every ``chunks·WARPS``-th: its run's padding rows and blocks (of
    the alignment and of each GEMM tile), a lane per row / block.  The rows and blocks past the
    used ones are shared out over all threads of the grid."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    e = c * WARPS + warp
    while e < num_experts:
        end = s_end[e]
        start = end - _padded(s_total[e], tile)
        r = start + s_total[e] + lane
        while r < end:
            _pad_row(sorted_ids, token_of_row, weight_of_row, row_mask, r, sentinel, last_token)
            r += WARP
        _label_blocks(expert_of_block, start, end, tile, e)
        _label_blocks(blocks0, start, end, tile0, e)
        _label_blocks(blocks1, start, end, tile1, e)
        e += chunks * WARPS
    used = s_end[num_experts - 1]
    step = chunks * THREADS
    first = c * THREADS + tidx
    r = used + first
    while r < sorted_ids.shape[0]:
        _pad_row(sorted_ids, token_of_row, weight_of_row, row_mask, r, sentinel, last_token)
        r += step
    _unused_blocks(expert_of_block, used, tile, first, step)
    _unused_blocks(blocks0, used, tile0, first, step)
    _unused_blocks(blocks1, used, tile1, first, step)


# ---- compile ---------------------------------------------------------------------------------------
def compile_align_kernels(ids_dtype: torch.dtype = torch.int32, *, keep_ptx: bool = False) -> dict:
    """The two compiled launches (``"count"``, ``"place"``) for ids of ``ids_dtype``; every extent
    is symbolic, so one compile serves every T, top_k, E ≤ MAX_EXPERTS and tile (cached in
    ``ptx.py``; ``keep_ptx``: each one's ``.__ptx__`` holds its PTX)."""
    if ids_dtype not in ID_DTYPES:
        raise TypeError(f"ids_dtype: expected torch.int32 or torch.int64, got {ids_dtype}")

    def build(options):
        vec = lambda dt: make_fake_compact_tensor(dt, (cute.sym_int(),), assumed_align=dt.width // 8)  # noqa: E731
        i32, i64, f32, stream = cutlass.Int32, cutlass.Int64, cutlass.Float32, make_fake_stream()
        ptr = lambda dt: make_ptr(dt, 0, cute.AddressSpace.gmem, assumed_align=dt.width // 8)  # noqa: E731
        ids, counts = ptr(ID_DTYPES[ids_dtype]), vec(i32)
        return {"count": cute.compile(CountExperts(), ids, i32(1), counts, i32(1), stream, options=options),
                "place": cute.compile(PlacePairs(), ids, ptr(f32), i32(1), counts, vec(i32), vec(i32), vec(i32),
                                      vec(i64), vec(f32), vec(i64), vec(f32), vec(i32), vec(i32), vec(i32), vec(i32),
                                      vec(i32), vec(f32), i32(1), i32(1), i32(1), i32(1), i32(1), stream,
                                      options=options)}

    return compile_once(("align", str(ids_dtype)), build, keep_ptx=keep_ptx)

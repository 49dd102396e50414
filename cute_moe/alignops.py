"""The two CuTe launches that align the pairs, check the routing data and write every row map.

What they compute is :func:`cute_moe.rowmaps.reference_rows` (the maps, the checks and their
meaning are in :mod:`cute_moe.rowmaps`, the host side): ``moe_spec.align.align``'s alignment of
the ids clamped into [0, E), bit for bit, the row maps and each GEMM tile's block map, and the
bits of ``moe_spec.validate.guard_routing`` ORed into the error word (one atomic OR per thread
that found a fault).  The pairs are cut into chunks of :data:`CHUNK`; CTA ``c`` (8 warps) owns
chunk ``c`` in both launches, its warps consecutive slices of it, walked 32 pairs at a time.

1. ``CountExperts`` (only for more than one chunk): each warp counts its slice into its own row
   of a shared ``[warps, E]`` table; the rows are summed into ``counts[c, e]``.
2. ``PlacePairs`` (:func:`place_ctas` CTAs: one per chunk, or one per :data:`FILL_ROWS` rows of
   the maps up to :data:`FILL_CTAS`, whichever is more):

   a. every expert's total in every CTA: with one chunk each CTA stages the (≤ 2048) pairs and
      counts them itself (the same totals everywhere: no grid barrier), each round's count added by
      a shared-memory atomic, and apart the pairs before its own piece (c); with more chunks it
      sums launch 1's ``counts`` (a chunk's CTA also the chunks before its own);
   b. the padded totals scanned over the experts (a block scan): ``s_end``, each run's end;
      CTA 0 writes ``expert_end`` and each GEMM tile's used-block count;
   c. a CTA checks and places its pairs: with more chunks, a chunk's CTA its chunk; with a single
      chunk, every CTA the piece of whole 32-pair rounds :func:`~cute_moe.alignsteps.place_slice`
      gives it (the per-pair work spread over the grid the fill launches anyway).  The checks:
      range, weight, earlier slots of the token row (compared clamped in shared memory, confirmed
      on the raw ids in global memory, which also serves a row straddling two chunks or pieces).
      The placement: the table becomes the row of each warp's next pair of ``e`` (start + pairs of
      ``e`` in earlier chunks or pieces and warps); in a round ``match.any`` gives a lane the lanes
      of its expert, its rank is the popcount of those below it and the lowest advances the entry:
      a pair's row is its expert's start plus the number of earlier pairs of that expert (the
      stable order, no atomics); the lane writes the pair into every map;
   d. CTA ``g`` fills the slices ``g, g + grid, …`` of :data:`FILL_ROWS` rows: a thread per row
      finds its expert by a binary search of ``s_end`` and, if the row holds no pair, writes the
      sentinel, the last token and weight 0; a thread per block starting in the slice writes its
      expert or −1 (the alignment's tile and each GEMM tile).  Every element is written once;
   e. the grid zeroes a scratch buffer later kernels accumulate into (FP8: the amax buffers).

No thread loops over more than ⌈E / 256⌉ experts or a CTA over more rows than its slices.
Limits (checked in ``rowmaps``): E ≤ :data:`MAX_EXPERTS`; ids int32 or int64 (a compile per dtype).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass.memory import SmemAllocator

from .alignsteps import (  # noqa: F401
    BIG,
    CHUNK,
    FILL_CTAS,
    FILL_ROWS,
    GEMM_TILES,
    ID_DTYPES,
    THREADS,
    WARP,
    WARPS,
    _check_chunk,
    _count_totals,
    _count_warp_slice,
    _fill,
    _padded,
    _place_warp_slice,
    _scan_runs,
    _stage_chunk,
    _stage_pairs,
    place_slice,
)
from .cache import compile_once
from .limits import MAX_EXPERTS
from .runtime import fake_pointer, fake_stream, fake_vector


def place_ctas(num_pairs: int, rows: int) -> int:
    """The place launch's grid for ``num_pairs`` ≥ 1 pairs and ``rows`` rows of the maps (host-known
    sizes, no data): a CTA per chunk, or a CTA per fill slice up to :data:`FILL_CTAS`, whichever is more."""
    return max(-(-num_pairs // CHUNK), min(-(-rows // FILL_ROWS), FILL_CTAS))


# ---- the two launches ------------------------------------------------------------------------------
class CountExperts:
    """Launch 1.  Arguments: ids (a pointer to P int32/int64: the routing tensor, passed as a bare
    pointer, which costs the host a tenth of a wrapped tensor), num_pairs Int32 (P ≥ 1), counts
    int32 [C·E] (out, ``counts[c·E + e]``), num_experts Int32, stream.  Grid: one CTA per chunk,
    ``C = ⌈P / CHUNK⌉``."""

    @cute.jit
    def __call__(
        self, ids_ptr: cute.Pointer, num_pairs: cutlass.Int32, counts: cute.Tensor, num_experts: cutlass.Int32, stream
    ):
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
        _count_warp_slice(s_ids, table, 0, n, num_experts)
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
    scratch fp32 [n] (zeroed), num_experts, tile, top_k, tile0, tile1, ctas (Int32: the grid,
    at least C — :func:`place_ctas`; any such grid gives the same result), stream.
    """

    @cute.jit
    def __call__(
        self,
        ids_ptr: cute.Pointer,
        weights_ptr: cute.Pointer,
        num_pairs: cutlass.Int32,
        counts: cute.Tensor,
        sorted_ids: cute.Tensor,
        expert_of_block: cute.Tensor,
        expert_end: cute.Tensor,
        token_of_row: cute.Tensor,
        weight_of_row: cute.Tensor,
        row_of_pair: cute.Tensor,
        weight_of_pair: cute.Tensor,
        row_mask: cute.Tensor,
        blocks0: cute.Tensor,
        blocks1: cute.Tensor,
        block_counts: cute.Tensor,
        word: cute.Tensor,
        scratch: cute.Tensor,
        num_experts: cutlass.Int32,
        tile: cutlass.Int32,
        top_k: cutlass.Int32,
        tile0: cutlass.Int32,
        tile1: cutlass.Int32,
        ctas: cutlass.Int32,
        stream,
    ):
        ids = cute.make_tensor(ids_ptr, cute.make_layout((num_pairs,)))
        weights = cute.make_tensor(weights_ptr, cute.make_layout((num_pairs,)))
        self.kernel(
            ids,
            weights,
            counts,
            sorted_ids,
            expert_of_block,
            expert_end,
            token_of_row,
            weight_of_row,
            row_of_pair,
            weight_of_pair,
            row_mask,
            blocks0,
            blocks1,
            block_counts,
            word,
            scratch,
            num_experts,
            tile,
            top_k,
            tile0,
            tile1,
        ).launch(grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        ids: cute.Tensor,
        weights: cute.Tensor,
        counts: cute.Tensor,
        sorted_ids: cute.Tensor,
        expert_of_block: cute.Tensor,
        expert_end: cute.Tensor,
        token_of_row: cute.Tensor,
        weight_of_row: cute.Tensor,
        row_of_pair: cute.Tensor,
        weight_of_pair: cute.Tensor,
        row_mask: cute.Tensor,
        blocks0: cute.Tensor,
        blocks1: cute.Tensor,
        block_counts: cute.Tensor,
        word: cute.Tensor,
        scratch: cute.Tensor,
        num_experts: cutlass.Int32,
        tile: cutlass.Int32,
        top_k: cutlass.Int32,
        tile0: cutlass.Int32,
        tile1: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        num_pairs = ids.shape[0]
        chunks = (num_pairs + CHUNK - 1) // CHUNK
        lo = c * CHUNK  # the staged chunk: this CTA's (c < chunks), or with a single chunk, it in every CTA
        if chunks == 1:
            lo = cutlass.Int32(0)
        n = cutlass.min(CHUNK, num_pairs - lo)
        a = cutlass.Int32(0)  # [a, b): the staged positions this CTA checks and places
        b = n
        if chunks == 1:
            first, last = place_slice(c, grid, n)
            a = first
            b = last
        if c >= chunks:
            if chunks > 1:
                b = cutlass.Int32(0)
        smem = SmemAllocator()
        s_ids = smem.allocate_tensor(cutlass.Int32, cute.make_layout(CHUNK))
        s_w = smem.allocate_tensor(cutlass.Float32, cute.make_layout(CHUNK))
        table = smem.allocate_tensor(cutlass.Int32, cute.make_layout((WARPS, MAX_EXPERTS), stride=(MAX_EXPERTS, 1)))
        s_total = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS))  # pairs of e
        s_before = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS))  # ... in chunks < c
        s_end = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_EXPERTS))  # end of e's run
        s_warp_sums = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS))

        # (a) every expert's total (and its pairs before this CTA's): from launch 1's counts, or — a
        #     single chunk, where launch 1 is skipped — from each CTA's own count of the whole chunk
        staged = (chunks == 1) | (c < chunks)
        if staged:
            _stage_pairs(ids, weights, s_ids, s_w, lo, n, num_experts)
        if chunks > 1:
            mine = cutlass.min(c, chunks)
            e = tidx
            while e < num_experts:
                before = cutlass.Int32(0)
                for cc in cutlass.range(mine, unroll=4):
                    before += counts[cc * num_experts + e]
                total = before
                for cc in cutlass.range(mine, chunks, unroll=4):
                    total += counts[cc * num_experts + e]
                s_before[e] = before
                s_total[e] = total
                e += THREADS
        else:
            e = tidx
            while e < num_experts:
                s_before[e] = 0
                s_total[e] = 0
                e += THREADS
        cute.arch.sync_threads()
        if chunks == 1:
            _count_totals(s_ids, s_total, s_before, n, a)
        if b > a:
            _count_warp_slice(s_ids, table, a, b, num_experts)
        cute.arch.sync_threads()
        # (b) the padded runs scanned over the experts; past them, BIG up to a power of two
        _scan_runs(s_total, s_end, s_warp_sums, num_experts, tile)  # ends with a CTA barrier
        top = cutlass.Int32(1)
        while top < num_experts:
            top = top * 2
        e = num_experts + tidx
        while e < top:
            s_end[e] = BIG
            e += THREADS
        if c == 0:
            e = tidx
            while e < num_experts:
                expert_end[e] = s_end[e]
                e += THREADS
            if tidx == 0:
                used = s_end[num_experts - 1]
                block_counts[0] = used // tile0
                block_counts[1] = used // tile1
        if b > a:
            e = tidx
            while e < num_experts:  # table[w, e] := the row of warp w's first pair of expert e
                row = s_end[e] - _padded(s_total[e], tile) + s_before[e]
                for w in cutlass.range_constexpr(WARPS):
                    mine = table[w, e]
                    table[w, e] = row
                    row += mine
                e += THREADS
        cute.arch.sync_threads()
        # (c) this CTA's checks, its pairs in index order within each expert, their rows in every map
        if b > a:
            _check_chunk(ids, s_ids, s_w, word, lo, a, b, top_k)
            _place_warp_slice(
                s_ids,
                s_w,
                table,
                sorted_ids,
                token_of_row,
                weight_of_row,
                row_of_pair,
                weight_of_pair,
                row_mask,
                lo,
                a,
                b,
                top_k,
            )
        # (d) this CTA's slices: the rows without a pair, and every block's expert
        _fill(
            s_total,
            s_end,
            sorted_ids,
            expert_of_block,
            token_of_row,
            weight_of_row,
            row_mask,
            blocks0,
            blocks1,
            num_experts,
            top,
            tile,
            tile0,
            tile1,
            num_pairs,
            num_pairs // top_k - 1,
            c,
            grid,
        )
        # (e) the layer's scratch that must start at zero (the FP8 amax buffers)
        i = c * THREADS + tidx
        while i < scratch.shape[0]:
            scratch[i] = cutlass.Float32(0.0)
            i += grid * THREADS


# ---- compile ---------------------------------------------------------------------------------------
def compile_align_kernels(ids_dtype: torch.dtype = torch.int32, *, keep_ptx: bool = False) -> dict:
    """The two compiled launches (``"count"``, ``"place"``) for ids of ``ids_dtype``; every extent
    is symbolic, so one compile serves every T, top_k, E ≤ MAX_EXPERTS and tile (cached in
    :mod:`cute_moe.cache`; ``keep_ptx``: each one's ``.__ptx__`` holds its PTX)."""
    if ids_dtype not in ID_DTYPES:
        raise TypeError(f"ids_dtype: expected torch.int32 or torch.int64, got {ids_dtype}")

    def build(options):
        vec, ptr = fake_vector, fake_pointer
        i32, i64, f32, stream = cutlass.Int32, cutlass.Int64, cutlass.Float32, fake_stream()
        ids, counts = ptr(ID_DTYPES[ids_dtype]), vec(i32)
        return {
            "count": cute.compile(CountExperts(), ids, i32(1), counts, i32(1), stream, options=options),
            "place": cute.compile(
                PlacePairs(),
                ids,
                ptr(f32),
                i32(1),
                counts,
                vec(i32),
                vec(i32),
                vec(i32),
                vec(i64),
                vec(f32),
                vec(i64),
                vec(f32),
                vec(i32),
                vec(i32),
                vec(i32),
                vec(i32),
                vec(i32),
                vec(f32),
                i32(1),
                i32(1),
                i32(1),
                i32(1),
                i32(1),
                i32(1),
                stream,
                options=options,
            ),
        }

    return compile_once(("align", str(ids_dtype)), build, keep_ptx=keep_ptx)

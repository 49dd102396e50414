"""The device steps of the alignment's two launches (:mod:`cute_moe.alignops`, whose docstring
describes the scheme): staging a chunk, the routing checks, the per-warp counts, the block scan
over the experts, the placement by ``match.any`` ranks and the fill of the rows without a pair and
of the block maps.  Each is a ``@cute.jit`` function traced inline into the kernels; the sizes
they share are this module's constants.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch

from moe_spec.validate import BAD_ID, BAD_WEIGHT, REPEATED_ID

THREADS = 256  # threads of a CTA in both launches
WARP = 32
WARPS = THREADS // WARP
CHUNK = 2048
"""Pairs per CTA (a multiple of ``THREADS``): 8 per thread when the chunk is staged in shared memory."""
FILL_ROWS = 512
"""Rows of the maps (and the blocks that start in them) per fill slice: 2 per thread."""
FILL_CTAS = 128
"""Most CTAs the place launch takes for the fill alone (more chunks take one CTA each)."""
FULL_MASK = 0xFFFFFFFF
BAD = 1 << 30
"""Set in a staged expert whose raw id was outside [0, E) (``& NOT_BAD`` gives the clamped expert)."""
NOT_BAD = ~BAD
BIG = 2**31 - 1  # s_end past the last expert, so the binary search runs over a power of two
ID_DTYPES = {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}
GEMM_TILES = 2  # token tiles the place kernel writes block maps for (the layer's two GEMMs)


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
def _stage_pairs(ids: cute.Tensor, weights: cute.Tensor, s_ids: cute.Tensor, s_w: cute.Tensor, lo, n, num_experts):
    """As :func:`_stage_chunk`, with :data:`BAD` set on an expert whose raw id was out of range, and
    the raw weights in ``s_w``: ids and weights loaded together, one round trip."""
    tidx, _, _ = cute.arch.thread_idx()
    for k in cutlass.range_constexpr(CHUNK // THREADS):
        i = k * THREADS + tidx
        j = lo + cutlass.min(i, n - 1)
        v = ids[j]
        s_w[i] = weights[j]
        e = cutlass.Int32(cutlass.max(cutlass.min(v, num_experts - 1), 0))
        if (v < 0) | (v >= num_experts):
            e = e | BAD
        if i >= n:
            e = cutlass.Int32(-1)
        s_ids[i] = e


@cute.jit
def _check_chunk(ids: cute.Tensor, s_ids: cute.Tensor, s_w: cute.Tensor, word: cute.Tensor, lo, a, b, top_k):
    """The routing data checks of the staged chunk's pairs ``[a, b)`` (``guard_routing``'s meaning): an id outside
    [0, E), a non-finite weight (``w − w`` is not 0), an id equal to one in an earlier slot of the
    same token row — raw ids, so two equal out-of-range ids count as a repeat, as there: the staged
    (clamped) experts are compared first, and only a clamped match, or an earlier slot in the chunk
    before, reads the raw ids.  A thread that found a fault ORs its bits into the error word, once."""
    tidx, _, _ = cute.arch.thread_idx()
    bits = cutlass.Int32(0)
    for k in cutlass.range_constexpr(CHUNK // THREADS):
        i = a + k * THREADS + tidx
        if i < b:
            x = s_ids[i]
            w = s_w[i]
            if (x & BAD) != 0:
                bits = bits | BAD_ID
            if (w - w) != cutlass.Float32(0.0):  # NaN for ±inf and NaN (an unordered compare)
                bits = bits | BAD_WEIGHT
            p = lo + i
            for d in cutlass.range(p % top_k):
                q = p - 1 - d
                same = cutlass.Int32(1)
                if q >= lo:
                    if (s_ids[q - lo] & NOT_BAD) != (x & NOT_BAD):
                        same = cutlass.Int32(0)
                if same != 0:
                    if ids[q] == ids[p]:
                        bits = bits | REPEATED_ID
    if bits != 0:
        cute.arch.atomic_or(word.iterator, bits)


@cute.jit
def _warp_slice(start, end):
    """``[first, last)``: the positions of ``[start, end)`` this warp owns (whole rounds of 32 lanes,
    consecutive warps own consecutive slices; trailing warps may own nothing)."""
    warp = cute.arch.warp_idx()
    span = (end - start + WARPS * WARP - 1) // (WARPS * WARP) * WARP
    first = start + warp * span
    return first, cutlass.min(first + span, end)


def place_slice(c, grid, n):
    """``[a, b)``: the positions of a single chunk's ``n`` pairs that CTA ``c`` of a ``grid`` checks and
    places — consecutive pieces of whole 32-pair rounds, so that the chunk's per-pair work is spread
    over the CTAs the fill launches anyway.  Plain integer arithmetic: traced into the kernel, and
    callable in Python (the CPU model walks it)."""
    piece = ((n + grid - 1) // grid + WARP - 1) // WARP * WARP
    a = cutlass.min(c * piece, n)
    return a, cutlass.min(a + piece, n)


@cute.jit
def _count_warp_slice(s_ids: cute.Tensor, table: cute.Tensor, start, end, num_experts):
    """``table[w, e]`` = the pairs of expert ``e`` in warp ``w``'s slice of ``[start, end)`` (each warp
    writes only its row)."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    e = lane
    while e < num_experts:
        table[warp, e] = 0
        e += WARP
    cute.arch.sync_warp()
    first, last = _warp_slice(start, end)
    base = first
    while base < last:
        x = cutlass.Int32(-1)
        if base + lane < last:
            x = s_ids[base + lane] & NOT_BAD
        peers = cute.arch.match_sync(FULL_MASK, x)  # the lanes holding the same expert as this one
        if (x >= 0) & ((peers & cute.arch.lanemask_lt()) == 0):  # the lowest of them adds them all
            table[warp, x] = table[warp, x] + cutlass.Int32(cute.arch.popc(peers))
        cute.arch.sync_warp()
        base += WARP


@cute.jit
def _count_totals(s_ids: cute.Tensor, s_total: cute.Tensor, s_before: cute.Tensor, n, a):
    """``s_total[e]`` += the pairs of expert ``e`` among the chunk's ``n``, ``s_before[e]`` += those
    before position ``a`` (a multiple of 32: a round lies wholly before it or not).  The lowest lane
    of each expert in a round adds the round's count by a shared-memory atomic: a sum is the same in
    any order, and no round waits for the one before (the per-warp table's read-modify-write chains
    them)."""
    lane = cute.arch.lane_idx()
    first, last = _warp_slice(0, n)
    base = first
    while base < last:
        x = cutlass.Int32(-1)
        if base + lane < last:
            x = s_ids[base + lane] & NOT_BAD
        peers = cute.arch.match_sync(FULL_MASK, x)
        if (x >= 0) & ((peers & cute.arch.lanemask_lt()) == 0):
            k = cutlass.Int32(cute.arch.popc(peers))
            cute.arch.atomic_add(s_total.iterator + x, k)
            if base < a:
                cute.arch.atomic_add(s_before.iterator + x, k)
        base += WARP


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
def _place_warp_slice(
    s_ids: cute.Tensor,
    s_w: cute.Tensor,
    table: cute.Tensor,
    sorted_ids: cute.Tensor,
    token_of_row: cute.Tensor,
    weight_of_row: cute.Tensor,
    row_of_pair: cute.Tensor,
    weight_of_pair: cute.Tensor,
    row_mask: cute.Tensor,
    lo,
    a,
    b,
    top_k,
):
    """Each pair of this warp's slice of ``[a, b)`` goes to row ``table[w, e]`` + its rank among the round's lanes
    of expert ``e`` (written to every map); then the lowest such lane advances ``table[w, e]``."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    first, last = _warp_slice(a, b)
    base = first
    while base < last:
        raw = cutlass.Int32(-1)
        if base + lane < last:
            raw = s_ids[base + lane]
        x = raw & NOT_BAD
        peers = cute.arch.match_sync(FULL_MASK, x)
        below = peers & cute.arch.lanemask_lt()
        if x >= 0:
            r = table[warp, x] + cutlass.Int32(cute.arch.popc(below))
            p = lo + base + lane
            sorted_ids[r] = p
            token_of_row[r] = cutlass.Int64(p // top_k)
            row_of_pair[p] = cutlass.Int64(r)
            w = s_w[base + lane]
            in_amax = cutlass.Int32(1)
            if (raw & BAD) != 0:  # id clamped: its token comes out NaN, no FP8 amax sees it
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
def _owner(s_end: cute.Tensor, r, top):
    """The expert whose run holds row ``r`` (< the used rows): the first ``e`` with ``s_end[e] > r``,
    by a binary search over ``top`` (a power of two ≥ E) entries, those past E being :data:`BIG`."""
    pos = cutlass.Int32(0)
    half = top // 2
    while half > 0:
        if s_end[pos + half - 1] <= r:
            pos = pos + half
        half = half // 2
    return pos


@cute.jit
def _fill_blocks(blocks: cute.Tensor, s_end: cute.Tensor, first_row, last_row, block_tile, used, top):
    """The blocks of ``block_tile`` rows whose first row lies in [first_row, last_row), a thread per
    block: the expert of its run, or −1 past the used rows."""
    tidx, _, _ = cute.arch.thread_idx()
    b = (first_row + block_tile - 1) // block_tile + tidx
    end = cutlass.min((last_row + block_tile - 1) // block_tile, blocks.shape[0])
    while b < end:
        e = cutlass.Int32(-1)
        if b * block_tile < used:
            e = _owner(s_end, b * block_tile, top)
        blocks[b] = e
        b += THREADS


@cute.jit
def _fill(
    s_total: cute.Tensor,
    s_end: cute.Tensor,
    sorted_ids: cute.Tensor,
    expert_of_block: cute.Tensor,
    token_of_row: cute.Tensor,
    weight_of_row: cute.Tensor,
    row_mask: cute.Tensor,
    blocks0: cute.Tensor,
    blocks1: cute.Tensor,
    num_experts,
    top,
    tile,
    tile0,
    tile1,
    sentinel,
    last_token,
    c,
    grid,
):
    """CTA ``c`` takes the slices ``c, c + grid, …`` of :data:`FILL_ROWS` rows: a thread per row writes
    it if it holds no pair (a run's padding: past its expert's pairs; or past the used rows) — the
    sentinel, the last token (finite) and weight 0 — and a thread per block starting in the slice
    writes its expert, for the alignment's tile and each GEMM tile."""
    tidx, _, _ = cute.arch.thread_idx()
    rows = sorted_ids.shape[0]
    used = s_end[num_experts - 1]
    s = c
    while s * FILL_ROWS < rows:
        first = s * FILL_ROWS
        for k in cutlass.range_constexpr(FILL_ROWS // THREADS):
            r = first + k * THREADS + tidx
            if r < rows:
                pad = cutlass.Int32(1)
                if r < used:
                    e = _owner(s_end, r, top)
                    start = cutlass.Int32(0)
                    if e > 0:
                        start = s_end[e - 1]
                    if r < start + s_total[e]:
                        pad = cutlass.Int32(0)
                if pad != 0:
                    sorted_ids[r] = sentinel
                    token_of_row[r] = cutlass.Int64(last_token)
                    weight_of_row[r] = cutlass.Float32(0.0)
                    row_mask[r] = 0
        last = cutlass.min(first + FILL_ROWS, rows)
        _fill_blocks(expert_of_block, s_end, first, last, tile, used, top)
        _fill_blocks(blocks0, s_end, first, last, tile0, used, top)
        _fill_blocks(blocks1, s_end, first, last, tile1, used, top)
        s += grid

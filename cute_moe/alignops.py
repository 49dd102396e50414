"""The token alignment on the device: :func:`moe_spec.align.align`'s result in two CuTe launches.

``align_on_device(topk_ids, E, tile)`` returns the same :class:`~moe_spec.align.Alignment` as the
reference routine, bit for bit — every expert's pairs in ascending pair order (a *stable* sort),
each run padded to a multiple of ``tile`` with the sentinel ``P``, the rows past the used ones
``P``, the blocks past them −1 — without a host synchronisation and with no launch but its own
two (one when the pairs fit a single chunk: decode), so it can be captured in a CUDA graph and
replayed with new ids.

The pairs are cut into chunks of :data:`CHUNK`; CTA ``c`` owns chunk ``c`` in both launches, and
its 8 warps own consecutive slices of the chunk, walked 32 pairs (one per lane) at a time.

1. ``CountExperts`` (one CTA per chunk): each warp counts its slice into its own row of a shared
   ``[warps, E]`` table; the rows are summed into ``counts[c, e]`` (global).
2. ``PlacePairs`` (one CTA per chunk):

   a. every CTA reads the whole ``counts`` table: expert ``e``'s total and the pairs of ``e`` in
      the chunks before ``c`` (with a single chunk, launch 1 is skipped and the totals are the
      CTA's own counts from b);
   b. it counts its own warps' slices again (as in 1), pads every total to ``tile`` and scans
      them over the experts (a block scan) — ``expert_end``, written by CTA 0 — and turns the
      ``[warps, E]`` table into the row where each warp's next pair of ``e`` goes:
      ``start_e + (pairs of e in earlier chunks) + (pairs of e in earlier warps of this chunk)``;
   c. each warp walks its slice 32 pairs at a time: ``match.any`` gives each lane the lanes that
      hold the same expert, the lane's rank among them is the popcount of those below it, and one
      lane per expert advances the table entry.  So a pair's row is its expert's start plus the
      number of earlier pairs of that expert — its index order, which no atomic would give;
   d. the rows that hold no pair (each run's padding, everything past the used rows) get the
      sentinel and every block its expert; each row and block is written exactly once.

No atomics anywhere (each warp owns its table row), so the result is deterministic.  A ``match``
treats lanes of the same expert together in a single step, so a skewed routing costs no more than
a uniform one.  Limits, checked on the host by name: ``num_experts`` ≤ :data:`MAX_EXPERTS` (the
shared tables); ``topk_ids`` int32 or int64 (one compiled pair per dtype: no conversion launch).
An id outside ``[0, E)`` — which ``fused_moe`` refuses on the host when it can read the ids —
is dropped (counted nowhere, placed nowhere), never written out of bounds.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

from moe_spec.align import Alignment, align, max_rows  # noqa: E402

from .ptx import compile_once  # noqa: E402

THREADS = 256
"""Threads of a CTA in both launches."""
WARP = 32
WARPS = THREADS // WARP
CHUNK = 2048
"""Pairs per CTA (a multiple of ``THREADS``): 8 per thread when the chunk is staged in shared memory."""
MAX_EXPERTS = 1024
"""Largest expert count: the shared ``[WARPS, E]`` table (32 KiB) and three ``[E]`` arrays."""
FULL_MASK = 0xFFFFFFFF
ID_DTYPES = {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}


def check_align_args(topk_ids: torch.Tensor, num_experts: int, tile: int) -> None:
    """The host checks of :func:`align_on_device` (TypeError / ValueError naming the argument)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"topk_ids: expected int32 or int64 ids, got {topk_ids.dtype}")
    for name, v in (("num_experts", num_experts), ("tile", tile)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts: expected 1 <= num_experts <= {MAX_EXPERTS} (the alignment kernels keep "
                         f"a [{WARPS}, E] table of counts in shared memory), got {num_experts}")
    if tile < 1:
        raise ValueError(f"tile: expected a positive row tile, got {tile}")


# ---- device helpers (traced inline into both kernels) ------------------------------------------
@cute.jit
def _padded(count, tile):
    """``count`` rounded up to a multiple of ``tile``: the rows of one expert's run."""
    return (count + tile - 1) // tile * tile


@cute.jit
def _stage_chunk(ids: cute.Tensor, s_ids: cute.Tensor, lo, n, num_experts):
    """``s_ids[i]`` = the expert of pair ``lo + i`` for ``i < n``; −1 past the chunk or for an id
    outside [0, E).  Each thread loads ``CHUNK / THREADS`` ids, all in flight at once."""
    tidx, _, _ = cute.arch.thread_idx()
    for k in cutlass.range_constexpr(CHUNK // THREADS):
        i = k * THREADS + tidx
        v = ids[lo + cutlass.min(i, n - 1)]  # a valid address for every thread (n >= 1)
        e = cutlass.Int32(v)
        if (i >= n) | (v < 0) | (v >= num_experts):
            e = cutlass.Int32(-1)
        s_ids[i] = e


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
    """Launch 1.  Arguments: ids [P] int32/int64, counts int32 [C·E] (out, ``counts[c·E + e]``),
    num_experts Int32, stream.  Grid: one CTA per chunk, ``C = ⌈P / CHUNK⌉`` (P ≥ 1)."""

    @cute.jit
    def __call__(self, ids: cute.Tensor, counts: cute.Tensor, num_experts: cutlass.Int32, stream):
        chunks = (ids.shape[0] + CHUNK - 1) // CHUNK
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
    """Launch 2.  Arguments: ids [P], counts int32 [C·E] (launch 1; not read when C = 1),
    sorted_ids int32 [rows] (out), expert_of_block int32 [rows / tile] (out), expert_end int32 [E]
    (out), num_experts Int32, tile Int32, stream.  Grid: one CTA per chunk, as launch 1."""

    @cute.jit
    def __call__(self, ids: cute.Tensor, counts: cute.Tensor, sorted_ids: cute.Tensor, expert_of_block: cute.Tensor,
                 expert_end: cute.Tensor, num_experts: cutlass.Int32, tile: cutlass.Int32, stream):
        chunks = (ids.shape[0] + CHUNK - 1) // CHUNK
        self.kernel(ids, counts, sorted_ids, expert_of_block, expert_end, num_experts, tile).launch(
            grid=[chunks, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, ids: cute.Tensor, counts: cute.Tensor, sorted_ids: cute.Tensor, expert_of_block: cute.Tensor,
               expert_end: cute.Tensor, num_experts: cutlass.Int32, tile: cutlass.Int32):
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
        #     counts, or — a single chunk, where launch 1 is skipped — from this CTA's own table
        _stage_chunk(ids, s_ids, lo, n, num_experts)
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
        e = tidx
        while e < num_experts:  # table[w, e] := the row of warp w's first pair of expert e
            row = s_end[e] - _padded(s_total[e], tile) + s_before[e]
            for w in cutlass.range_constexpr(WARPS):
                mine = table[w, e]
                table[w, e] = row
                row += mine
            e += THREADS
        cute.arch.sync_threads()
        # (c) the pairs, in index order within each expert
        _place_warp_slice(s_ids, table, sorted_ids, lo, n)
        # (d) the rows without a pair, and every block's expert
        _fill_padding(s_total, s_end, sorted_ids, expert_of_block, num_experts, tile, num_pairs, c, chunks)


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
def _place_warp_slice(s_ids: cute.Tensor, table: cute.Tensor, sorted_ids: cute.Tensor, lo, n):
    """Write each pair of this warp's slice to ``sorted_ids`` at ``table[w, e]`` + its rank among the
    round's lanes of expert ``e``; then the lowest such lane advances ``table[w, e]`` past them."""
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
            sorted_ids[table[warp, x] + cutlass.Int32(cute.arch.popc(below))] = lo + base + lane
        cute.arch.sync_warp()  # every lane has read table[w, x] before it moves
        if (x >= 0) & (below == 0):
            table[warp, x] = table[warp, x] + cutlass.Int32(cute.arch.popc(peers))
        cute.arch.sync_warp()
        base += WARP


@cute.jit
def _fill_padding(s_total: cute.Tensor, s_end: cute.Tensor, sorted_ids: cute.Tensor, expert_of_block: cute.Tensor,
                  num_experts, tile, sentinel, c, chunks):
    """The sentinel on every row that holds no pair and the expert of every block.  Warp ``w`` of CTA
    ``c`` takes experts ``c·WARPS + w``, then every ``chunks·WARPS``-th: its run's padding rows
    and blocks, a lane per row / block.  The rows and blocks past the used ones are shared out
    over all threads of the grid."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    e = c * WARPS + warp
    while e < num_experts:
        end = s_end[e]
        start = end - _padded(s_total[e], tile)
        r = start + s_total[e] + lane
        while r < end:
            sorted_ids[r] = sentinel
            r += WARP
        b = start // tile + lane
        while b < end // tile:
            expert_of_block[b] = e
            b += WARP
        e += chunks * WARPS
    used = s_end[num_experts - 1]
    step = chunks * THREADS
    r = used + c * THREADS + tidx
    while r < sorted_ids.shape[0]:
        sorted_ids[r] = sentinel
        r += step
    b = used // tile + c * THREADS + tidx
    while b < expert_of_block.shape[0]:
        expert_of_block[b] = -1
        b += step


# ---- host ----------------------------------------------------------------------------------------
def compile_align_kernels(ids_dtype: torch.dtype = torch.int32, *, keep_ptx: bool = False) -> dict:
    """The two compiled launches (``"count"``, ``"place"``) for ids of ``ids_dtype``; every extent
    is symbolic, so one compile serves every T, E ≤ MAX_EXPERTS and tile (cached in ``ptx.py``;
    ``keep_ptx``: each one's ``.__ptx__`` holds its PTX)."""
    if ids_dtype not in ID_DTYPES:
        raise TypeError(f"ids_dtype: expected torch.int32 or torch.int64, got {ids_dtype}")

    def build(options):
        vec = lambda dt: make_fake_compact_tensor(dt, (cute.sym_int(),), assumed_align=dt.width // 8)  # noqa: E731
        i32, stream = cutlass.Int32, make_fake_stream()
        ids, counts = vec(ID_DTYPES[ids_dtype]), vec(i32)
        return {"count": cute.compile(CountExperts(), ids, counts, i32(1), stream, options=options),
                "place": cute.compile(PlacePairs(), ids, counts, vec(i32), vec(i32), vec(i32), i32(1), i32(1), stream,
                                      options=options)}

    return compile_once(("align", str(ids_dtype)), build, keep_ptx=keep_ptx)


def _vector(t: torch.Tensor):
    """A 1-D device array with a dynamic extent (the kernels are compiled against symbolic ones)."""
    return from_dlpack(t).mark_layout_dynamic()


def launch_align(flat_ids: torch.Tensor, num_experts: int, tile: int, sorted_ids: torch.Tensor,
                 expert_of_block: torch.Tensor, expert_end: torch.Tensor, counts: torch.Tensor) -> None:
    """The launches on the current stream (launch 1 only for more than one chunk), into the
    caller's buffers: ``flat_ids`` [P ≥ 1] on a CUDA device; int32 ``sorted_ids`` [max_rows],
    ``expert_of_block`` [max_rows / tile], ``expert_end`` [E] (every element written) and
    ``counts`` [⌈P / CHUNK⌉ · E] (scratch).  The sizes are checked (a kernel writes every element
    it is told exists), naming the argument."""
    check_align_args(flat_ids, num_experts, tile)
    num_pairs = flat_ids.numel()
    if flat_ids.dim() != 1 or num_pairs == 0 or not flat_ids.is_contiguous():
        raise ValueError(f"flat_ids: expected a non-empty contiguous 1-D tensor, got shape {tuple(flat_ids.shape)}")
    rows, chunks = max_rows(num_pairs, num_experts, tile), -(-num_pairs // CHUNK)
    for name, t, n in (("sorted_ids", sorted_ids, rows), ("expert_of_block", expert_of_block, rows // tile),
                       ("expert_end", expert_end, num_experts), ("counts", counts, chunks * num_experts)):
        if t.dtype != torch.int32 or t.shape != (n,) or t.device != flat_ids.device or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous int32 [{n}] on {flat_ids.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    if flat_ids.device.type != "cuda":
        raise ValueError(f"flat_ids: the alignment kernels run on a CUDA device, got a tensor on {flat_ids.device}")
    kernels = compile_align_kernels(flat_ids.dtype)
    with torch.cuda.device(flat_ids.device):
        stream = cuda.CUstream(torch.cuda.current_stream(flat_ids.device).cuda_stream)
        ids, scratch = _vector(flat_ids), _vector(counts)
        if chunks > 1:  # a single chunk: launch 2 counts it itself
            kernels["count"](ids, scratch, num_experts, stream)
        kernels["place"](ids, scratch, _vector(sorted_ids), _vector(expert_of_block), _vector(expert_end),
                         num_experts, tile, stream)


def align_on_device(topk_ids: torch.Tensor, num_experts: int, tile: int) -> Alignment:
    """:func:`moe_spec.align.align` computed by the two kernels of this module, bit for bit.

    ``topk_ids`` [T, top_k] int32 or int64 (any shape: its elements in order are the pairs).
    On a CUDA device: at most two launches on the current stream (:func:`launch_align`), no host
    sync, CUDA-graph capturable.  Elsewhere (the CPU has no CuTe launches) the reference routine runs
    instead.  Raises TypeError / ValueError naming a bad argument before any launch.
    """
    check_align_args(topk_ids, num_experts, tile)
    if topk_ids.device.type != "cuda":
        return align(topk_ids, num_experts, tile)
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    rows = max_rows(num_pairs, num_experts, tile)
    new = lambda n: torch.empty(n, dtype=torch.int32, device=flat.device)  # noqa: E731
    sorted_ids, expert_of_block = new(rows), new(rows // tile)
    if num_pairs == 0:  # no pairs: every run is empty and there is nothing to sort
        expert_end = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    else:
        expert_end = new(num_experts)
        launch_align(flat, num_experts, tile, sorted_ids, expert_of_block, expert_end,
                     new(-(-num_pairs // CHUNK) * num_experts))
    return Alignment(tile=tile, num_pairs=num_pairs, sorted_ids=sorted_ids, expert_of_block=expert_of_block,
                     expert_end=expert_end)

"""The pieces the grouped GEMM's kernel body (:mod:`cute_moe.gemm`) calls by name: the tile walk, the
weight copy with its cluster multicast, the gated FP8 GEMM1's up-half scales, ping-pong's named barriers
and the gathering copy's geometry.

Each is a plain function or a small frozen object, traced inline where the kernel calls it; none
overrides anything.  The kernel body is the place to read a tile's life; this module explains the
designs behind four of its steps.  Every ``cfg`` is the kernel's :class:`~cute_moe.config.GemmConfig`
(read, not imported: this module imports nothing of the package).

The tile walk
-------------
The launch is persistent: ``gridDim.x`` CTAs (one per SM), CTA ``c`` takes the tile ids ``c, c + grid,
c + 2·grid, …`` below ``num_blocks · n_weight_blocks`` (``num_blocks`` is device data).  Ids are
rasterized in groups of ``group_tokens`` token blocks (:func:`tile_coordinates`): consecutive ids walk
token blocks first, then weight blocks, so the CTAs resident at one moment touch few distinct weight
tiles and token blocks, and both are re-read from L2 instead of HBM.  The producer and the consumers
walk the same ids with the same functions, so they always agree on the tile a ring stage belongs to.

Clusters: one weight load for two CTAs (``cluster = 2``)
--------------------------------------------------------
In a prefill GEMM every weight tile ``W[e, w]`` meets each token block of expert ``e``, so CTAs on
neighbouring token blocks of one expert read the same weight bytes at about the same time.  With
``cluster = 2`` the grid is cut into clusters of two CTAs (one GPC, each able to write the other's
shared memory) and the walk goes over *pairs* of token blocks: cluster ``c`` takes the tiles ``c, c +
clusters, …`` of ``⌈num_blocks / 2⌉ · n_weight_blocks``, and CTA ``r`` of the cluster (its rank) computes
token block ``2·pair + r`` (:func:`pair_blocks`).  When the pair's two blocks are one expert's
(:func:`multicasts`), each producer loads *half* of the weight box with ``.multicast::cluster`` into the
same ring slot of both CTAs; each full barrier still counts one stage's bytes, and the L2 → SM weight
traffic halves.  A pair straddling two experts, or an odd last block, loads as without a cluster.
Both CTAs decide from the same two ``block_expert`` entries, so they agree.  An odd last block leaves
rank 1 without a block: it computes its partner's block again (its multicast half is still needed)
and skips the store, so both CTAs walk the same tiles and stages.  The ring's *empty* barriers are
cluster-wide: every consumer warp arrives on the slot's empty barrier of both CTAs (the other CTA may
be writing its half into it), and ``producer_tail`` waits for both CTAs' consumers before a CTA leaves.

Ping-pong's order (``schedule = "pingpong"``)
---------------------------------------------
As CUTLASS's ``KernelTmaWarpSpecializedPingpong``: each of the two consumer warpgroups owns whole tiles
(its tiled MMA one warpgroup wide), so every output element sees the cooperative kernel's WGMMA
sequence and the result is the same bit for bit.  The producer is unchanged; the CTA's tiles alternate
between the warpgroups (warpgroup w takes ``c + (w + 2j)·grid``), whose ring states start ``w · k_tiles``
stages in and skip the other's ``k_tiles`` after each tile.  Two pairs of named barriers order them:
warpgroup w waits (``bar.sync``, 256 threads) on ``MMA_ORDER_BARRIER_ID + w`` before its main loop and on
``EPI_ORDER_BARRIER_ID + w`` before its epilogue; the other arrives (``bar.arrive``) once it has issued
its tile's last WGMMA (FP8: once that K step is retired and promoted), resp. finished its epilogue, and
warpgroup 1 opens both of warpgroup 0's at the start.  So one warpgroup's epilogue runs under the other's
WGMMAs.  The strict alternation keeps every full-barrier wait unambiguous (a warpgroup waits on a slot
only after the other has waited on all its own stages).  Each warpgroup has its own epilogue barrier,
``epi_stages`` staging buffers and store thread.  A CTA exits with the arrivals meant for tiles it does
not have still pending.

The gathering producer (``gather_rows``)
----------------------------------------
Hopper's TMA has no row gather, so a gathering GEMM1 copies its token rows from the unsorted
``x [T, K]`` itself: the whole producer warpgroup cuts a stage's token tile into 16-byte vectors,
``tile_k / 8`` threads per row (:func:`gather_geometry`), each thread reading its rows' tokens once per
tile and issuing one ``cp.async`` per vector into the *same* swizzled layout TMA writes.  The weight
box still comes by TMA from warp 0.  A slot's full barrier expects ``1 + 128`` arrivals — the TMA
lane's ``arrive.expect_tx`` and one ``cp.async.mbarrier.arrive.noinc`` per producer thread, which fires
when that thread's copies have landed — plus the weight bytes.  cp.async writes through the generic
proxy and WGMMA reads through the async proxy, so the consumers fence after each full-barrier wait.
K must be a multiple of ``tile_k`` (the copies do not zero-fill): ``moe.grouped_gemm`` checks it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from moe_spec.hopper import WARPGROUP_THREADS

# Named barriers (0 is __syncthreads).  Cooperative: EPILOGUE_BARRIER_ID over all consumer threads.
# Ping-pong: EPILOGUE_BARRIER_ID + w (warpgroup w's own epilogue), MMA_ORDER_BARRIER_ID + w and
# EPI_ORDER_BARRIER_ID + w ("warpgroup w may start its main loop / its epilogue").
EPILOGUE_BARRIER_ID = 1
MMA_ORDER_BARRIER_ID = 3
EPI_ORDER_BARRIER_ID = 5
ORDER_THREADS = 2 * 128  # an order barrier: the waiting warpgroup and the arriving one

VEC_BYTES = 16  # one cp.async of the gathering producer moves 16 bytes: 8 bf16


# ---- the tile walk -------------------------------------------------------------------------------
def tile_coordinates(tile, n_token_blocks, n_weight_blocks, group_tokens: int):
    """Rasterization: persistent tile id → (token block, weight block), ``group_tokens`` token blocks
    (fastest) before the next weight block.  Plain integer arithmetic: traced into the kernel, and
    callable in Python (the CPU tests walk it)."""
    group_span = group_tokens * n_weight_blocks
    first_block = (tile // group_span) * group_tokens
    group_size = cutlass.min(n_token_blocks - first_block, group_tokens)
    in_group = tile % group_span
    return first_block + in_group % group_size, in_group // group_size


def pair_blocks(pair, rank, n_token_blocks):
    """(first, last, token block, stores) of cluster rank ``rank`` on pair ``pair`` of token blocks:
    the pair's blocks (equal for an odd last block), the block this CTA computes and whether it
    stores it.  Traced into the kernel, and callable in Python."""
    first = pair * 2
    last = cutlass.min(first + 1, n_token_blocks - 1)
    mine = first + rank
    return first, last, cutlass.min(mine, last), mine < n_token_blocks


@dataclass(frozen=True)
class TileWalk:
    """The persistent tile sequence of one launch, walked alike by the producer and the consumers:
    ``n_token_blocks`` (device data) × ``n_weight_blocks`` tiles, pairs of token blocks in a cluster."""

    cfg: object  # the kernel's GemmConfig
    n_token_blocks: object
    n_weight_blocks: object

    def first(self):
        """(first tile id, step) of this CTA's cluster: its cluster index and the number of clusters."""
        c = self.cfg.cluster
        return cute.arch.block_idx()[0] // c, cute.arch.grid_dim()[0] // c

    def count(self):
        """Tile ids of the launch: token blocks (pairs of them in a cluster) × weight blocks."""
        c = self.cfg.cluster
        return (self.n_token_blocks + c - 1) // c * self.n_weight_blocks

    def blocks(self, tile):
        """(token block, weight block, stores, first, last) of tile id ``tile`` for this CTA.

        ``stores``: the CTA owns the token block (False only for rank 1 past an odd last block);
        ``first``, ``last``: the pair's blocks (the token block itself without a cluster), whose experts
        decide the multicast (:meth:`multicasts`, asked by the producers only)."""
        cfg, n_token_blocks = self.cfg, self.n_token_blocks
        if cutlass.const_expr(cfg.cluster == 1):
            token_block, weight_block = tile_coordinates(tile, n_token_blocks, self.n_weight_blocks, cfg.group_tokens)
            return token_block, weight_block, cutlass.Boolean(True), token_block, token_block
        pairs = (n_token_blocks + 1) // 2
        pair, weight_block = tile_coordinates(tile, pairs, self.n_weight_blocks, max(1, cfg.group_tokens // 2))
        first, last, token_block, stores = pair_blocks(pair, cute.arch.block_idx_in_cluster(), n_token_blocks)
        return token_block, weight_block, stores, first, last

    def multicasts(self, block_expert: cute.Tensor, first, last):
        """Whether the pair's blocks are one expert's, so its weight tile is multicast (never without a
        cluster)."""
        if cutlass.const_expr(self.cfg.cluster == 1):
            return cutlass.Boolean(False)
        return block_expert[first] == block_expert[last]


# ---- the weight copy -----------------------------------------------------------------------------
def multicast_halves(cfg, tma_wm, mWm: cute.Tensor, sW: cute.Tensor, sU):
    """This CTA's share of a weight box multicast over the cluster: ``tma_partition`` over its ranks
    gives rank r the rows ``r·tW/2 …`` of W's boxes and of the ring's weight (and up) slots.
    Returns (atom, W's boxes, weight slots, up slots or None), as :func:`load_weights` takes it."""
    rank = cute.arch.block_idx_in_cluster()
    gWm = cute.local_tile(mWm, (cfg.weights_tile, cfg.tile_k), (None,) * cute.rank(mWm))
    ranks = cute.make_layout(cfg.cluster)
    tWsWm, tWgWm = cpasync.tma_partition(tma_wm, rank, ranks, cute.group_modes(sW, 0, 2), cute.group_modes(gWm, 0, 2))
    tUsUm = None
    if cutlass.const_expr(cfg.gated):
        tUsUm, _ = cpasync.tma_partition(tma_wm, rank, ranks, cute.group_modes(sU, 0, 2), cute.group_modes(gWm, 0, 2))
    return tma_wm, tWgWm, tWsWm, tUsUm


@cute.jit
def load_weights(cfg, shared, k, slot, full, own, multicast, weight_block, expert):
    """Stage ``slot``'s weight box(es) at K step ``k`` on the full barrier ``full``: this CTA's half of
    the box multicast into both CTAs when ``shared``, else the whole box into this CTA alone.  ``own``
    and ``multicast`` = (TMA atom, W's boxes, the ring's weight slots, its up slots or None)."""
    if cutlass.const_expr(cfg.cluster == 1):
        _copy_box(cfg, *own, weight_block, expert, k, slot, full, 0)
    else:
        if shared:
            _copy_box(cfg, *multicast, weight_block, expert, k, slot, full, (1 << cfg.cluster) - 1)
        else:
            _copy_box(cfg, *own, weight_block, expert, k, slot, full, 0)


def _weight_box(cfg, tWgW, weight_block, expert, half):
    """The K steps of one weight box: gated W1's gate (half 0) or up (half 1) rows, or W's."""
    if cutlass.const_expr(cfg.gated):
        return tWgW[(None, weight_block, None, half, expert)]
    return tWgW[(None, weight_block, None, expert)]


def _copy_box(cfg, atom, tWgW, tWsW, tUsU, weight_block, expert, k, slot, full, mask):
    """The TMA copy of the weight box (gated: then of the up box, on the same barrier)."""
    gate = _weight_box(cfg, tWgW, weight_block, expert, 0)
    if cutlass.const_expr(mask == 0):
        cute.copy(atom, gate[(None, k)], tWsW[(None, slot)], tma_bar_ptr=full)
        if cutlass.const_expr(cfg.gated):
            up = _weight_box(cfg, tWgW, weight_block, expert, 1)
            cute.copy(atom, up[(None, k)], tUsU[(None, slot)], tma_bar_ptr=full)
    else:
        cute.copy(atom, gate[(None, k)], tWsW[(None, slot)], tma_bar_ptr=full, mcast_mask=cutlass.Int16(mask))
        if cutlass.const_expr(cfg.gated):
            up = _weight_box(cfg, tWgW, weight_block, expert, 1)
            cute.copy(atom, up[(None, k)], tUsU[(None, slot)], tma_bar_ptr=full, mcast_mask=cutlass.Int16(mask))


# ---- the consumers' K step -----------------------------------------------------------------------
@cute.jit
def issue_k_step(cfg, tiled_mma, acc, up, tCrA, tCrB, tCrA_up, tCrB_up, slot):
    """Issue the WGMMAs of one K step from ring slot ``slot`` into ``acc``, ``tile_k / WGMMA K`` of them
    (gated: each followed by its twin on the up tile into ``up``, same tiled MMA and registers)."""
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, slot)], tCrB[(None, None, kb, slot)], acc)
        if cutlass.const_expr(cfg.gated):
            cute.gemm(tiled_mma, up, tCrA_up[(None, None, kb, slot)], tCrB_up[(None, None, kb, slot)], up)


def up_half_scales(cfg, gate):
    """The scales (:class:`~cute_moe.fp8_gemm.TileScales`) of a gated FP8 GEMM1's up accumulator, from
    its gate accumulator's (None when ``cfg`` is not gated): W1's up rows are ``I + n`` (``I = last_col
    + 1``, the gated output width), so its per-channel scales are read at ``I + n`` (clamped to
    ``2I − 1`` as the gate's are to ``I − 1``) and its 128×128 block scales at block ``(I + col0) / 128``
    (the whole tile's when I is a multiple of 128: ``limits.gated_quant_layer``); the activation scales
    (the same token rows) and a per-tensor scale are the gate's."""
    if not cfg.gated:
        return None
    n_out = gate.last_col + 1
    return dataclasses.replace(gate, col0=gate.col0 + n_out, last_col=gate.last_col + n_out)


def promote_halves(scales, up_scales, acc, blk, up, blk_up, k) -> None:
    """FP8 K step ``k``: ``acc += blk`` with ``scales`` (:meth:`~cute_moe.fp8_gemm.TileScales.promote`);
    gated (``up_scales`` not None): ``up += blk_up`` with the up half's, after it."""
    scales.promote(acc, blk, k)
    if up_scales is not None:
        up_scales.promote(up, blk_up, k)


def dequantize_halves(scales, up_scales, acc, up) -> None:
    """After the K loop: ``acc``'s per-tensor / per-channel scales (:meth:`~cute_moe.fp8_gemm.TileScales.dequantize`);
    gated: then ``up``'s, so SiLU·up takes both halves dequantized in fp32 (as the row kernel reads them)."""
    scales.dequantize(acc)
    if up_scales is not None:
        up_scales.dequantize(up)


# ---- ping-pong's order barriers ------------------------------------------------------------------
def order_wait(base: int, wg):
    """Warpgroup ``wg`` waits for its turn (``base``: MMA_ORDER_BARRIER_ID or EPI_ORDER_BARRIER_ID)."""
    cute.arch.barrier(barrier_id=base + wg, number_of_threads=ORDER_THREADS)


def order_arrive(base: int, wg):
    """Grant warpgroup ``wg`` its turn."""
    cute.arch.barrier_arrive(barrier_id=base + wg, number_of_threads=ORDER_THREADS)


# ---- the gathering copy --------------------------------------------------------------------------
def gather_geometry(cfg) -> tuple[int, int, int]:
    """(vectors per token row of a stage, rows per pass, passes per stage) of the gathering copy: a
    pass is ``128 / (tile_k/8)`` rows (fewer threads when the tile is smaller: swap-AB's 8 rows use 64)."""
    vecs = cfg.tile_k * cfg.element_bytes // VEC_BYTES
    rows = min(cfg.tokens_tile, WARPGROUP_THREADS // vecs)  # the producer warpgroup (config.GATHER_THREADS)
    return vecs, rows, cfg.tokens_tile // rows


@dataclass(frozen=True)
class RowGather:
    """One producer thread's share of the gathering copy, built once per CTA (:meth:`make`) and read in
    the tile loop: its vectors of x and of the ring's token slots, and the token of its row in each
    pass.  The tiled copy is partitioned over the staged operand tensor, so the 128-B swizzle is the
    one the WGMMA descriptors read."""

    copy_atom: object  # one 16-byte cp.async (cp.async.cg: cached in L2 only)
    copies: object  # whether this thread has a vector (all 128 threads unless the token tile is small)
    tRsX: object  # this thread's vectors of the token slots: (vector, pass, 1, stage)
    my_row: object
    my_vec: object
    gXv: object  # x in 16-byte vectors: (1, elems, token, vector along K)
    tokens: object  # registers: the token of this thread's row in each pass of the current tile
    vecs: int
    rows: int
    passes: int
    tokens_tile: int

    @classmethod
    def make(cls, cfg, dtype, mX: cute.Tensor, sX: cute.Tensor, tidx) -> RowGather:
        vecs, rows, passes = gather_geometry(cfg)
        elems = VEC_BYTES // cfg.element_bytes
        copy_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=VEC_BYTES * 8
        )
        tiled_copy = cute.make_tiled_copy_tv(
            copy_atom, cute.make_layout((rows, vecs), stride=(vecs, 1)), cute.make_layout((1, elems))
        )
        copies = tidx < rows * vecs
        lane = tidx % (rows * vecs)
        tRsX = tiled_copy.get_slice(lane).partition_D(sX)
        my_row, my_vec = lane // vecs, lane % vecs
        gXv = cute.local_tile(mX, (1, elems), (None, None))
        tokens = cute.make_rmem_tensor((passes,), cutlass.Int32)
        return cls(copy_atom, copies, tRsX, my_row, my_vec, gXv, tokens, vecs, rows, passes, cfg.tokens_tile)

    def read_tokens(self, token_of_row: cute.Tensor, token_block) -> None:
        """The token of each row this thread copies in token block ``token_block`` (once per tile)."""
        for p in range(self.passes):
            self.tokens[p] = cutlass.Int32(token_of_row[token_block * self.tokens_tile + p * self.rows + self.my_row])

    def copy(self, k, slot) -> None:
        """This thread's cp.async copies of K step ``k`` into ring slot ``slot``."""
        for p in range(self.passes):
            cute.copy(
                self.copy_atom,
                self.gXv[(0, None, self.tokens[p], k * self.vecs + self.my_vec)],
                self.tRsX[(None, p, 0, slot)],
            )

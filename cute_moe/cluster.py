"""Cluster multicast of the weight tile (``GemmConfig.cluster = 2``): two CTAs, one weight load.

In a prefill GEMM every weight tile ``W[e, w]`` is multiplied by each token block of expert ``e``,
so CTAs working on neighbouring token blocks of one expert read the same weight bytes from L2 at
about the same time.  With ``cluster = 2`` the grid is cut into clusters of two CTAs (launched
together on one GPC, each able to write the other's shared memory), and the persistent tile
sequence walks *pairs* of token blocks: cluster ``c`` takes the tiles ``c, c + clusters, …`` of
``⌈num_blocks / 2⌉ · n_weight_blocks``, rasterized as before (:func:`cute_moe.raster.tile_coordinates`
over pairs), and CTA ``r`` of the cluster (its rank, 0 or 1) computes token block ``2·pair + r``.

A K step of a pair whose two blocks belong to one expert (``block_expert`` equal) needs one weight
tile in both CTAs: each CTA's producer loads *half* of the weight box (rows ``r·tW/2 …``) with
``cp.async.bulk.tensor … .multicast::cluster`` into the same slot of both CTAs' rings.  Each CTA's
full barrier then counts its own token tile plus both halves — the same ``stage_bytes`` as without a
cluster — and the L2 → SM traffic of weights is halved.  A pair whose blocks straddle two experts
(or the run's last block, when ``num_blocks`` is odd) loads as before: each CTA its own whole box.
Both CTAs decide from the same two ``block_expert`` entries, so they always agree.

An odd last block leaves rank 1 without a block: it computes its partner's block again (same expert:
its multicast half is still needed) and skips the store, so both CTAs walk the same tile and stage
sequence — the pipeline's barriers stay in step.

The ring's *empty* barriers are cluster-wide: a slot may be refilled only when the consumers of
*both* CTAs have released it (the other CTA may be writing its half into it), so every consumer
warp arrives on the slot's empty barrier of both CTAs (``PipelineTmaAsync`` with the cluster layout
``(1, 2, 1, 1)``: lanes 0 and 1 of each warp signal ranks 0 and 1) and each empty barrier counts
twice the consumer warps.  The producer's ``producer_tail`` therefore also waits for the other
CTA's consumers: no CTA leaves while its partner may still arrive on its barriers.

:class:`ClusterTiles` is mixed into :class:`~cute_moe.gemm.GroupedGemm` (the tile walk and the
weight copy, used by both producers and the consumers); with ``cluster = 1`` every hook is the
plain persistent walk and the plain copy.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402

from .config import GemmConfig  # noqa: E402
from .raster import tile_coordinates  # noqa: E402

#: The layer plan's GEMM2 runs on clusters of two when its K (the layer's I) is at least this many
#: ``tile_k`` steps; its GEMM1 whenever it runs the normal path's cooperative 128-token tile.
#: Measured on the H200 at T = 4096 (``python -m cute_moe.bench_pingpong --cluster``,
#: notes/results/cute_cluster_h200_2026-12-03.md), cluster-2 against the same tile on single CTAs, the
#: same output bit for bit: GEMM1 (gated, gathering, 128×128) 3400.4 against 3539.4 µs (Mixtral-8x7B),
#: 464.7 against 520.5 (Qwen3-30B-A3B), 735.8 against 815.5 (DeepSeek-V3 TP8); GEMM2 (128×256)
#: 1430.8 against 1491.0 (Mixtral, K = 14 336: 224 steps of 64) but 231.3 against 226.7 (Qwen3, K = 768:
#: 12 steps); DeepSeek-V3 TP8's GEMM2 (483.3 against 519.1) keeps its ping-pong tile (459.6).  The
#: threshold lies between the 12 and 224 steps measured; nothing between was timed.
CLUSTER_GEMM2_MIN_K_STEPS = 32


def clustered(cfg: GemmConfig, k: int, gemm2: bool) -> GemmConfig:
    """The layer plan's GEMM ``cfg`` (K = ``k``) as it runs: on clusters of two where that was measured
    faster (:data:`CLUSTER_GEMM2_MIN_K_STEPS`) — bf16, the normal path's cooperative 128-token tile —
    else ``cfg`` unchanged."""
    if cfg.quant is not None or cfg.swap_ab or cfg.pingpong or cfg.tokens_tile != 128:
        return cfg
    if gemm2 and -(-k // cfg.tile_k) < CLUSTER_GEMM2_MIN_K_STEPS:
        return cfg
    return cfg.replace(cluster=2)


def pair_blocks(pair, rank, n_token_blocks):
    """(first, last, token block, stores) of cluster rank ``rank`` on pair ``pair`` of token blocks:
    the pair's blocks ``first`` and ``last`` (equal for an odd last block), the block this CTA
    computes and whether it stores it.  Plain integer arithmetic: traced into the kernel, and
    callable in Python (the CPU tests walk it)."""
    first = pair * 2
    last = cutlass.min(first + 1, n_token_blocks - 1)
    mine = first + rank
    return first, last, cutlass.min(mine, last), mine < n_token_blocks


def cluster_layout_vmnk(cluster: int):
    """The pipeline's cluster layout: ``cluster`` CTAs along GEMM M (the token blocks)."""
    return cute.make_layout((1, cluster, 1, 1))


class ClusterTiles:
    """Mixed into :class:`~cute_moe.gemm.GroupedGemm`: the cluster-aware tile walk and weight copy."""

    @cute.jit
    def _walk(self):
        """(first tile, step): this CTA's cluster's first tile id and the number of clusters."""
        c = self.cfg.cluster
        return cute.arch.block_idx()[0] // c, cute.arch.grid_dim()[0] // c

    @cute.jit
    def _num_tiles(self, n_token_blocks, n_weight_blocks):
        """Tile ids of the launch: token blocks (pairs of them in a cluster) × weight blocks."""
        c = self.cfg.cluster
        return (n_token_blocks + c - 1) // c * n_weight_blocks

    @cute.jit
    def _tile_blocks(self, tile, n_token_blocks, n_weight_blocks):
        """(token block, weight block, stores, first, last) of tile id ``tile`` for this CTA.

        ``stores``: the CTA owns the token block (False only for rank 1 past an odd last block);
        ``first``, ``last``: the pair's blocks (the token block itself without a cluster), whose
        experts decide the multicast (:meth:`_multicasts`, the producers only)."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.cluster == 1):
            token_block, weight_block = tile_coordinates(tile, n_token_blocks, n_weight_blocks, cfg.group_tokens)
            return token_block, weight_block, cutlass.Boolean(True), token_block, token_block
        pairs = (n_token_blocks + 1) // 2
        pair, weight_block = tile_coordinates(tile, pairs, n_weight_blocks, max(1, cfg.group_tokens // 2))
        first, last, token_block, stores = pair_blocks(pair, cute.arch.block_idx_in_cluster(), n_token_blocks)
        return token_block, weight_block, stores, first, last

    @cute.jit
    def _multicasts(self, block_expert, first, last):
        """Whether the pair's blocks are one expert's, so its weight tile is multicast (never without a cluster)."""
        if cutlass.const_expr(self.cfg.cluster == 1):
            return cutlass.Boolean(False)
        return block_expert[first] == block_expert[last]

    def _weight_atoms(self, w, plan):
        """Host side: the multicast TMA atom over W (and its coordinate tensor); with no cluster, None."""
        if self.cfg.cluster == 1:
            return None, None
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), w, plan.w_smem_one,
                                           (self.cfg.weights_tile, self.cfg.tile_k), num_multicast=self.cfg.cluster)

    @cute.jit
    def _weight_halves(self, tma_wm, mWm, sW, sU):
        """This CTA's share of the weight box under multicast: (its half of the ring's weight and up
        slots, the matching boxes of W) — ``tma_partition`` over the cluster's 2 ranks."""
        cfg = self.cfg
        rank = cute.arch.block_idx_in_cluster()
        gWm = cute.local_tile(mWm, (cfg.weights_tile, cfg.tile_k), (None,) * cute.rank(mWm))
        ranks = cute.make_layout(cfg.cluster)
        tWsWm, tWgWm = cpasync.tma_partition(tma_wm, rank, ranks, cute.group_modes(sW, 0, 2),
                                             cute.group_modes(gWm, 0, 2))
        tUsUm = None
        if cutlass.const_expr(cfg.gated):
            tUsUm, _ = cpasync.tma_partition(tma_wm, rank, ranks, cute.group_modes(sU, 0, 2),
                                             cute.group_modes(gWm, 0, 2))
        return tWsWm, tWgWm, tUsUm

    @cute.jit
    def _weight_box(self, tWgW, weight_block, expert, half):
        """The K steps of one weight box: gated W1's gate (half 0) or up (half 1) rows, or W's."""
        if cutlass.const_expr(self.cfg.gated):
            return tWgW[(None, weight_block, None, half, expert)]
        return tWgW[(None, weight_block, None, expert)]

    @cute.jit
    def _load_weights(self, shared, k, slot, full, tma_w, tWgW, tWsW, tUsU, multicast, weight_block, expert):
        """Stage ``slot``'s weight box(es) at K step ``k``: multicast halves when ``shared``, else the
        whole box(es) into this CTA alone.  ``multicast`` = (atom, its W boxes, weight / up slots)."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.cluster == 1):
            self._copy_box(tma_w, tWgW, tWsW, tUsU, weight_block, expert, k, slot, full, 0)
        else:
            tma_wm, tWgWm, tWsWm, tUsUm = multicast
            if shared:
                self._copy_box(tma_wm, tWgWm, tWsWm, tUsUm, weight_block, expert, k, slot, full,
                               (1 << cfg.cluster) - 1)
            else:
                self._copy_box(tma_w, tWgW, tWsW, tUsU, weight_block, expert, k, slot, full, 0)

    @cute.jit
    def _copy_box(self, atom, tWgW, tWsW, tUsU, weight_block, expert, k, slot, full, mask):
        gate = self._weight_box(tWgW, weight_block, expert, 0)
        if cutlass.const_expr(mask == 0):
            cute.copy(atom, gate[(None, k)], tWsW[(None, slot)], tma_bar_ptr=full)
            if cutlass.const_expr(self.cfg.gated):
                up = self._weight_box(tWgW, weight_block, expert, 1)
                cute.copy(atom, up[(None, k)], tUsU[(None, slot)], tma_bar_ptr=full)
        else:
            cute.copy(atom, gate[(None, k)], tWsW[(None, slot)], tma_bar_ptr=full, mcast_mask=cutlass.Int16(mask))
            if cutlass.const_expr(self.cfg.gated):
                up = self._weight_box(tWgW, weight_block, expert, 1)
                cute.copy(atom, up[(None, k)], tUsU[(None, slot)], tma_bar_ptr=full, mcast_mask=cutlass.Int16(mask))

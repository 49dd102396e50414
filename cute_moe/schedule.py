"""How the consumer warpgroups of a CTA share its tiles (``GemmConfig.schedule``): cooperative or ping-pong.

Cooperative (the default): the consumer warpgroups stack along M on one tile, run the same main loop
and reach the epilogue together (one epilogue barrier over all of them, one store thread).

Ping-pong (``"pingpong"``; bf16, two consumer warpgroups), as CUTLASS's
``KernelTmaWarpSpecializedPingpong``: each consumer warpgroup owns whole tiles — ``tile_m`` (64 or
128) rows, its tiled MMA one warpgroup wide, tile_m/64 WGMMAs per K slice — so every output element
sees the WGMMA sequence of the cooperative kernel with the same rows per warpgroup (the result is
the same bit for bit).  The producer is unchanged: it walks the CTA's tiles ``c, c + grid, …`` into
the one ring, and the tiles alternate between the warpgroups (warpgroup w takes ``c + (w + 2j)·grid``):
its pipeline states start ``w · k_tiles`` stages in and skip the other warpgroup's ``k_tiles``
after each tile; a stage is released by the 4 warps of one warpgroup (the empty barriers count 4).
Two pairs of named barriers order the warpgroups: warpgroup w waits (``bar.sync``, 256 threads) on
``MMA_ORDER_BARRIER_ID + w`` before its main loop and on ``EPI_ORDER_BARRIER_ID + w`` before its
epilogue; the other warpgroup arrives (``bar.arrive``) on them once it has issued the last WGMMA of
a tile, resp. finished its epilogue, and warpgroup 1 opens both of warpgroup 0's at the start.  So
warpgroup 0 issues tile 0's main loop, then warpgroup 1 tile 1's while warpgroup 0 runs tile 0's
epilogue, and so on: the tensor cores are not left idle during an epilogue.  The two warpgroups
strictly alternate, so no arrival overtakes the wait it is meant for; and the order also keeps
each full-barrier wait unambiguous: a warpgroup waits on a slot only after the other has waited on
all of its own stages, so the slot's previous fill has completed.  Each warpgroup has its own
epilogue barrier (``EPILOGUE_BARRIER_ID + w``, 128 threads), its own ``epi_stages`` staging buffers
and its own store thread (its thread 0), which stores, commits and waits for its own bulk
async-groups.  A CTA exits with the arrivals meant for tiles it does not have still pending.

:class:`ConsumerSchedule` is mixed into :class:`~cute_moe.gemm.GroupedGemm`: the hooks its consumer
loop calls, each a no-op under the cooperative schedule; :func:`pingpong_config` is the host side.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402

from .config import MAX_CONSUMER_WARPGROUPS, GemmConfig, max_stages  # noqa: E402

# Named barriers (0 is __syncthreads).  Cooperative: EPILOGUE_BARRIER_ID, all consumer threads.
# Ping-pong: EPILOGUE_BARRIER_ID + w (warpgroup w's own epilogue), MMA_ORDER_BARRIER_ID + w and
# EPI_ORDER_BARRIER_ID + w ("warpgroup w may start its main loop / its epilogue").
EPILOGUE_BARRIER_ID = 1
MMA_ORDER_BARRIER_ID = 3
EPI_ORDER_BARRIER_ID = 5
ORDER_THREADS = 2 * 128  # an order barrier: the waiting warpgroup and the arriving one


#: The layer's GEMM2 runs ping-pong when its K (the layer's I) is at most this many ``tile_k`` steps.
#: Measured on the H200 at T = 4096 (notes/results/cute_pingpong_h200_2026-12-02.md): a 128×128
#: ping-pong tile per warpgroup against the cooperative 128×256, bit for bit the same output —
#: DeepSeek-V3 TP8's GEMM2 (I = 256: 4 steps of 64) 459.6 against 499.2 µs; Qwen3-30B-A3B's
#: (I = 768: 12 steps) 227.2 against 221.0; Mixtral-8x7B's (I = 14 336) 1895.7 against 1450.8.  A short
#: main loop leaves the epilogue a large share of a tile's time, which ping-pong hides under the
#: other warpgroup's WGMMAs; a long one gains nothing from that and loses the 256-wide tile's reuse.
PINGPONG_MAX_K_STEPS = 4


def short_k_gemm2(cfg: GemmConfig, k: int) -> GemmConfig:
    """The layer plan's GEMM2 ``cfg`` (cooperative) as it runs: a 128 × 128 ping-pong tile per
    warpgroup when the bf16 normal path's K = ``k`` is at most :data:`PINGPONG_MAX_K_STEPS` K steps
    deep, else ``cfg`` unchanged."""
    if cfg.quant is not None or cfg.swap_ab or cfg.tokens_tile != 128 or k > PINGPONG_MAX_K_STEPS * cfg.tile_k:
        return cfg
    twin = cfg.replace(weights_tile=128, schedule="pingpong", stages=2)
    return twin.replace(stages=max_stages(twin))


def pingpong_config(cfg: GemmConfig) -> GemmConfig:
    """The ping-pong twin of a cooperative config: the same WGMMA sequence per output element.

    Each consumer warpgroup of ``cfg`` computes 64 rows of M (two warpgroups: a 128-row tile); under
    ping-pong one warpgroup owns a whole tile, so the twin's M tile is one warpgroup's share of
    ``cfg``'s (64 rows: ``tokens_tile`` on the normal path, ``weights_tile`` on swap-AB), the other
    fields are kept and the ring is as deep as the shared memory allows.  A one-warpgroup ``cfg``
    keeps its tile.  Raises ValueError (naming the field) when the twin is not buildable (FP8)."""
    rows = cfg.tile_m // cfg.tile_warpgroups
    tiles = dict(weights_tile=rows) if cfg.swap_ab else dict(tokens_tile=rows)
    twin = cfg.replace(schedule="pingpong", consumer_warpgroups=MAX_CONSUMER_WARPGROUPS, stages=2, cluster=1, **tiles)
    return twin.replace(stages=max_stages(twin))


class ConsumerSchedule:
    """Mixed into :class:`~cute_moe.gemm.GroupedGemm`: the consumer loop's schedule hooks.

    ``wg`` is the consumer warpgroup (0 or 1: warpgroup_idx − 1); under the cooperative schedule every
    hook is a no-op or the cooperative value."""

    @cute.jit
    def _tile_thread(self, tidx, warpgroup_idx):
        """The thread's index in the tiled MMA: over all consumer threads, or within its warpgroup."""
        t = tidx - 128
        if cutlass.const_expr(self.cfg.pingpong):
            t = tidx - 128 * warpgroup_idx
        return t

    @cute.jit
    def _epilogue_sync(self, wg):
        """(epilogue barrier, TMA-store ring, first staging buffer) of this warpgroup's tiles."""
        cfg = self.cfg
        threads = 128 * cfg.tile_warpgroups
        barrier_id, first_buffer = EPILOGUE_BARRIER_ID, 0
        if cutlass.const_expr(cfg.pingpong):
            barrier_id, first_buffer = EPILOGUE_BARRIER_ID + wg, wg * cfg.epi_stages
        store_ring = pipeline.PipelineTmaStore.create(
            num_stages=cfg.epi_stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, threads))
        return pipeline.NamedBarrier(barrier_id=barrier_id, num_threads=threads), store_ring, first_buffer

    @cute.jit
    def _first_tile(self, wg, read, release, k_tiles):
        """(first tile id, step) of this warpgroup; ping-pong also moves the ring states past the
        other warpgroup's first tile (warpgroup 1) and lets warpgroup 0 start."""
        tile, step = self._walk()  # the CTA's first tile and the launch's step (per cluster: cluster.py)
        if cutlass.const_expr(self.cfg.pingpong):
            tile, step = tile + wg * step, 2 * step
            read.advance(wg * k_tiles)
            release.advance(wg * k_tiles)
            if wg == 1:  # warpgroup 0 goes first: grant it its first main loop and its first epilogue
                self._order_arrive(MMA_ORDER_BARRIER_ID, 0)
                self._order_arrive(EPI_ORDER_BARRIER_ID, 0)
        return tile, step

    @cute.jit
    def _mainloop_turn(self, wg):
        """Wait for this warpgroup's turn on the tensor cores (before its first full-barrier wait)."""
        if cutlass.const_expr(self.cfg.pingpong):
            self._order_wait(MMA_ORDER_BARRIER_ID, wg)

    @cute.jit
    def _mainloop_issued(self, wg):
        """Every WGMMA of the tile is issued: the other warpgroup may issue its main loop while this
        one's last K step drains and its epilogue runs."""
        if cutlass.const_expr(self.cfg.pingpong):
            self._order_arrive(MMA_ORDER_BARRIER_ID, 1 - wg)

    @cute.jit
    def _mainloop_done(self, read, release, k_tiles):
        """After the tile's last release: skip the other warpgroup's tile in the ring."""
        if cutlass.const_expr(self.cfg.pingpong):
            read.advance(k_tiles)
            release.advance(k_tiles)

    @cute.jit
    def _epilogue_turn(self, wg):
        if cutlass.const_expr(self.cfg.pingpong):
            self._order_wait(EPI_ORDER_BARRIER_ID, wg)

    @cute.jit
    def _epilogue_done(self, wg):
        if cutlass.const_expr(self.cfg.pingpong):
            self._order_arrive(EPI_ORDER_BARRIER_ID, 1 - wg)

    @cute.jit
    def _order_wait(self, base: int, wg):
        cute.arch.barrier(barrier_id=base + wg, number_of_threads=ORDER_THREADS)

    @cute.jit
    def _order_arrive(self, base: int, wg):
        cute.arch.barrier_arrive(barrier_id=base + wg, number_of_threads=ORDER_THREADS)

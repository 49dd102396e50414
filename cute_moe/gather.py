"""The gathering producer of the grouped GEMM (``GemmConfig.gather_rows``): token rows by index.

Without it the layer first copies ``X_sorted[r] = x[token_of_row[r]]`` into a sorted buffer (the
``GatherRows`` row kernel) and GEMM1 reads that buffer back through TMA.  Hopper's TMA has no row
gather, so a gathering GEMM1 loads the token tile of a stage itself, from the unsorted ``x [T, K]``:

* the whole producer warpgroup (``GATHER_THREADS`` = 128 threads) runs the tile loop.  A stage's
  token tile (``tokens_tile`` rows × ``tile_k``) is cut into 16-byte vectors; a tiled copy spreads
  them over the threads, ``tile_k / 8`` threads per row (8 for tile_k = 64), a pass of
  ``128 / (tile_k/8)`` rows at a time (fewer threads when the tile is smaller: swap-AB's 8 rows use 64).
  Each thread reads the token of its rows once per tile (``token_of_row`` of the block's rows) and
  issues one ``cp.async.cg.shared.global`` of 16 bytes per vector, into the *same* swizzled
  shared-memory layout TMA writes (the tiled copy is partitioned over the staged operand tensor,
  so the 128-B swizzle is applied by the same layout algebra the WGMMA descriptors read);
* the weight box(es) still come by TMA, issued by warp 0 (``producer_acquire`` elects one lane:
  it waits for the free slot and arrives with the weight bytes as the transaction count);
* barrier accounting: a slot's *full* mbarrier expects ``1 + 128`` arrivals — the TMA lane's
  ``arrive.expect_tx`` and one ``cp.async.mbarrier.arrive.noinc`` from every producer thread, which
  fires when that thread's earlier cp.async copies have landed (threads without a vector this
  stage arrive too) — plus the weight bytes.  The phase completes only when every row and the
  weight tile are in shared memory, without any producer thread waiting on its copies;
* cp.async writes shared memory through the generic proxy, WGMMA reads it through the async
  proxy: the consumers issue ``fence.proxy.async.shared::cta`` after each full-barrier wait.

Every producer thread waits on the slot's *empty* barrier before it writes the slot, and waits for
its last copies before it leaves the loop.  K must be a
multiple of ``tile_k`` (no partial vector rows: the copies do not zero-fill), checked on the host
by ``moe.grouped_gemm``; the plan gathers only for such layers.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402

from .config import GATHER_THREADS, GemmConfig  # noqa: E402

VEC_BYTES = 16  # one cp.async moves 16 bytes: 8 bf16


def gather_geometry(cfg: GemmConfig) -> tuple[int, int, int]:
    """(vectors per token row of a stage, rows per pass, passes per stage) of the gathering copy."""
    vecs = cfg.tile_k * cfg.element_bytes // VEC_BYTES
    rows = min(cfg.tokens_tile, GATHER_THREADS // vecs)
    return vecs, rows, cfg.tokens_tile // rows


class GatherProducer:
    """Mixed into :class:`~cute_moe.gemm.GroupedGemm`: the entry point and producer loop of a
    ``gather_rows`` config, and the consumers' full-barrier wait."""

    @cute.kernel
    def kernel_gather(self, mX: cute.Tensor, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_wm: cute.CopyAtom,
                      mWm: cute.Tensor, tma_c: cute.CopyAtom,
                      mC: cute.Tensor, block_expert: cute.Tensor, num_blocks: cute.Tensor, row_scale: cute.Tensor,
                      token_of_row: cute.Tensor, tiled_mma: cute.TiledMma, a_smem_staged: cute.ComposedLayout,
                      b_smem_staged: cute.ComposedLayout, epi_smem_staged: cute.ComposedLayout):
        """The gathering bf16 entry point: x [T, K] read by ``token_of_row`` (no TMA descriptor for it)."""
        self._body(None, mX, tma_w, mW, tma_wm, mWm, tma_c, mC, block_expert, num_blocks, row_scale, None, None,
                   tiled_mma, a_smem_staged, b_smem_staged, epi_smem_staged, token_of_row)

    @cute.jit
    def _wait_full(self, ring, read):
        """A consumer's wait for a full slot; gathering adds the proxy fence: cp.async wrote the token
        rows through the generic proxy, WGMMA reads them through the async proxy."""
        ring.consumer_wait(read)
        if cutlass.const_expr(self.cfg.gather_rows):
            cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def _produce_gathered(self, ring, mX: cute.Tensor, sX: cute.Tensor, token_of_row: cute.Tensor,
                          block_expert: cute.Tensor, tma_w: cute.CopyAtom, tWgW: cute.Tensor, tWsW: cute.Tensor,
                          tUsU, multicast, n_token_blocks, n_weight_blocks, num_tiles, k_tiles):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()  # producer warpgroup: 0 … 127
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        vecs, rows, passes = gather_geometry(cfg)
        elems = VEC_BYTES // cfg.element_bytes
        copy_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                        num_bits_per_copy=VEC_BYTES * 8)
        tiled_copy = cute.make_tiled_copy_tv(copy_atom, cute.make_layout((rows, vecs), stride=(vecs, 1)),
                                             cute.make_layout((1, elems)))
        copies = tidx < rows * vecs  # threads with a vector (all 128 unless the token tile is small)
        lane = tidx % (rows * vecs)
        tXsX = tiled_copy.get_slice(lane).partition_D(sX)  # (vector, pass, 1, stage), swizzled like TMA's box
        my_row, my_vec = lane // vecs, lane % vecs
        gX = cute.local_tile(mX, (1, elems), (None, None))  # (1, elems, token, vector along K)
        tokens = cute.make_rmem_tensor((passes,), cutlass.Int32)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        tile, tile_step = self._walk()  # per cluster (cluster.py)
        while tile < num_tiles:
            token_block, weight_block, _, first, last = self._tile_blocks(tile, n_token_blocks, n_weight_blocks)
            shared = self._multicasts(block_expert, first, last)
            expert = block_expert[token_block]
            for p in cutlass.range_constexpr(passes):  # the token of each row this thread copies
                tokens[p] = cutlass.Int32(token_of_row[token_block * cfg.tokens_tile + p * rows + my_row])
            for k in range(k_tiles):
                if warp_idx == 0:  # one elected lane: wait for the slot, arrive with the weight bytes
                    ring.producer_acquire(state)
                    full = ring.producer_get_barrier(state)
                    self._load_weights(shared, k, state.index, full, tma_w, tWgW, tWsW, tUsU, multicast,
                                       weight_block, expert)
                else:  # the other warps only wait until the consumers have freed the slot
                    ring.sync_object_empty.wait(state.index, state.phase)
                if copies:
                    for p in cutlass.range_constexpr(passes):
                        cute.copy(copy_atom, gX[(0, None, tokens[p], k * vecs + my_vec)],
                                  tXsX[(None, p, 0, state.index)])
                # fires once this thread's copies above have landed (noinc: counted in the 1 + 128)
                cute.arch.cp_async_mbarrier_arrive_noinc(ring.producer_get_barrier(state))
                state.advance()
            tile += tile_step
        # no thread leaves with copies in flight (their arrivals are still owed to the full barriers)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        if warp_idx == 0:
            ring.producer_tail(state)

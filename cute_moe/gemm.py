"""The grouped GEMM: every expert's tiles in one persistent, warp-specialized WGMMA launch.

The MoE layer sorts the (token, expert) pairs by expert and pads every expert's run of rows to a
multiple of ``tokens_tile`` (``moe.sort_rows``), so the sorted ``X [M_pad, K]`` cuts into *token blocks*
of one expert each, ``block_expert[b]``, and the grouped GEMM is a dense GEMM whose weight tile comes
from the block's expert::

    for every token block b < num_blocks (read from device memory) and weight block w:
        C[b·tT : (b+1)·tT,  w·tW : (w+1)·tW] = X[b-th block] · W[block_expert[b], w-th block]ᵀ
                                               (· row_scale[row], optional, in fp32)

``W [E, N_out, K]`` is handed to TMA as (N_out, K, E): the expert is the third TMA coordinate, read when
the tile starts.  Nothing about the routing is a compile-time constant, so a new batch never
recompiles: one compiled kernel per :class:`~cute_moe.config.GemmConfig`.  The producer speaks MoE (the
token tile, the weight tile), the consumers speak GEMM: normal path A = tokens, B = weights, C N-major;
swap-AB A = weights, B = tokens, C M-major (Cᵀ).

One tile's life (``_body``, top to bottom): a CTA of ``128 · (1 + consumer_warpgroups)`` threads walks the
persistent tile sequence (:mod:`cute_moe.gemm_parts` explains the walk, clusters, ping-pong and gathering). The
producer warpgroup (40 registers) waits for a free ring slot per K step and loads the token and weight boxes by
TMA into 128-B-swizzled shared memory, where the slot's *full* mbarrier counts the bytes in — gated: also W1's
up box; ``gather_rows``: token rows by cp.async; ``cluster = 2``: a shared weight box loaded half by each CTA,
multicast into both. The consumer warpgroups (232 registers: the fp32 accumulators) wait on the full barrier,
issue ``tile_k/16`` WGMMAs, keep one batch in flight and release the previous slot — cooperative: stacked along
M on one tile; ping-pong: whole tiles each, taking turns; FP8: each K step promoted into the fp32 accumulator
(:mod:`cute_moe.fp8_gemm`; gated: the gate and the up chain, each with its half's weight scales). The epilogue
applies the FP8 scales, ``silu(gate)·up`` (quantized: :mod:`cute_moe.epilogue_quant`) and the routing weight in
fp32, rounds once, stages the tile in shared memory (``stmatrix``) and one thread stores it by TMA.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from .activation import silu_mul
from .config import GATHER_THREADS, GemmConfig
from .epilogue_quant import EpilogueQuant, row_fragment, staging_copy
from .fp8_gemm import TileScales
from .gemm_parts import (
    EPI_ORDER_BARRIER_ID,
    EPILOGUE_BARRIER_ID,
    MMA_ORDER_BARRIER_ID,
    RowGather,
    TileWalk,
    dequantize_halves,
    issue_k_step,
    load_weights,
    multicast_halves,
    order_arrive,
    order_wait,
    promote_halves,
    up_half_scales,
)

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


class GroupedGemm:
    """The kernel of one configuration, built by :class:`cute_moe.gemm_plan.GemmLaunch` from the config's
    :class:`~cute_moe.gemm_plan.KernelPlan`: a bf16 config launches ``kernel``, an FP8 config
    ``kernel_fp8`` (with the activation and weight scales), a ``gather_rows`` config ``kernel_gather`` (x
    read by ``token_of_row``, no TMA over x); all three run the one body, ``_body``.
    """

    def __init__(self, cfg: GemmConfig, plan):
        self.cfg = cfg
        self.dtype, self.out_dtype = plan.dtype, plan.out_dtype
        self.shared_storage = plan.shared_storage()  # barriers, the rings, the epilogue's buffers
        self.stage_bytes = plan.stage_bytes  # the ring's tx_count
        self.rows = row_fragment(cfg, plan.tiled_mma) if cfg.epilogue_quant in ("block", "amax") else None

    @cute.kernel
    def kernel(
        self,
        tma_x: cute.CopyAtom,
        mX: cute.Tensor,
        tma_w: cute.CopyAtom,
        mW: cute.Tensor,
        tma_wm: cute.CopyAtom,
        mWm: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        block_expert: cute.Tensor,
        num_blocks: cute.Tensor,
        row_scale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
    ):
        """The bf16 entry point."""
        tma = (tma_x, mX, tma_w, mW, tma_wm, mWm, tma_c, mC)
        layouts = (tiled_mma, a_smem_staged, b_smem_staged, epi_smem_staged)
        self._body(tma, block_expert, num_blocks, row_scale, None, None, None, layouts, (None, None))

    @cute.kernel
    def kernel_fp8(
        self,
        tma_x: cute.CopyAtom,
        mX: cute.Tensor,
        tma_w: cute.CopyAtom,
        mW: cute.Tensor,
        tma_wm: cute.CopyAtom,
        mWm: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        block_expert: cute.Tensor,
        num_blocks: cute.Tensor,
        row_scale: cute.Tensor,
        x_scale: cute.Tensor,
        w_scale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
        q_scale: cute.Tensor = None,
        q_aux: cute.Tensor = None,
    ):
        """The FP8 entry point: the bf16 arguments, the activation and weight scales (and EpilogueQuant's two)."""
        tma = (tma_x, mX, tma_w, mW, tma_wm, mWm, tma_c, mC)
        layouts = (tiled_mma, a_smem_staged, b_smem_staged, epi_smem_staged)
        self._body(tma, block_expert, num_blocks, row_scale, x_scale, w_scale, None, layouts, (q_scale, q_aux))

    @cute.kernel
    def kernel_gather(
        self,
        mX: cute.Tensor,
        tma_w: cute.CopyAtom,
        mW: cute.Tensor,
        tma_wm: cute.CopyAtom,
        mWm: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        block_expert: cute.Tensor,
        num_blocks: cute.Tensor,
        row_scale: cute.Tensor,
        token_of_row: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
    ):
        """The gathering bf16 entry point: x [T, K] read by ``token_of_row`` (no TMA descriptor for it)."""
        tma = (None, mX, tma_w, mW, tma_wm, mWm, tma_c, mC)
        layouts = (tiled_mma, a_smem_staged, b_smem_staged, epi_smem_staged)
        self._body(tma, block_expert, num_blocks, row_scale, None, None, token_of_row, layouts, (None, None))

    @cute.jit
    def _body(self, tma, block_expert, num_blocks, row_scale, x_scale, w_scale, token_of_row, layouts, quant):
        """The kernel, one CTA: setup, the producer warpgroup, the consumer warpgroups and their epilogue.
        ``tma``: the TMA atoms with their coordinate tensors (x's, W's, W's multicast twin, C's);
        ``layouts``: the tiled MMA, the staged smem layouts of A, B, C (KernelPlan); ``quant``: EpilogueQuant's."""
        tma_x, mX, tma_w, mW, tma_wm, mWm, tma_c, mC = tma
        tiled_mma, a_smem_staged, b_smem_staged, epi_smem_staged = layouts
        cfg = self.cfg
        swap = cfg.swap_ab
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:
            if cutlass.const_expr(not cfg.gather_rows):
                cpasync.prefetch_descriptor(tma_x)
            cpasync.prefetch_descriptor(tma_w)
            if cutlass.const_expr(cfg.cluster > 1):
                cpasync.prefetch_descriptor(tma_wm)
            cpasync.prefetch_descriptor(tma_c)

        # ---- shared memory and the mbarrier ring ------------------------------------------
        storage = SmemAllocator().allocate(self.shared_storage)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ring_barriers.data_ptr(),
            num_stages=cfg.stages,
            # the TMA lane's arrive (+ gather_rows: one cp.async arrive per producer thread)
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + GATHER_THREADS * cfg.gather_rows),
            # every consumer warp of a tile arrives once on a slot's empty barrier (ping-pong: 4, one
            # warpgroup's); in a cluster on both CTAs' (lanes 0 and 1 of each warp signal ranks 0 and 1)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * cfg.tile_warpgroups * cfg.cluster),
            tx_count=self.stage_bytes,  # KernelPlan.stage_bytes: the TMA loads of one stage
            cta_layout_vmnk=cute.make_layout((1, cfg.cluster, 1, 1)),  # the cluster's CTAs along M
            defer_sync=True,
        )
        cluster_mn = cute.make_layout((cfg.cluster, 1))
        pipeline.pipeline_init_arrive(cluster_mn, is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        sX, sW = (sB, sA) if swap else (sA, sB)
        w_smem_staged = a_smem_staged if swap else b_smem_staged
        if cutlass.const_expr(cfg.gated):
            sU = storage.sU.get_tensor(w_smem_staged.outer, swizzle=w_smem_staged.inner)

        # ---- global tiles ------------------------------------------------------------------
        # (tT, tK, token blocks, k blocks) and (tW, tK, weight blocks, k blocks, experts)
        # (gated: (tW, tK, weight blocks, k blocks, half, experts), half 0 = gate, 1 = up)
        gX = cute.local_tile(mX, (cfg.tokens_tile, cfg.tile_k), (None, None))
        gW = cute.local_tile(mW, (cfg.weights_tile, cfg.tile_k), (None,) * cute.rank(mW))
        gC = cute.local_tile(mC, (cfg.tile_m, cfg.tile_n), (None, None))
        k_tiles = cute.size(gX, mode=[3])
        n_weight_blocks = cute.size(gW, mode=[2])
        one = cute.make_layout(1)  # TMA partitions of one CTA (the multicast's over the cluster: gemm_parts)
        if cutlass.const_expr(not cfg.gather_rows):
            tXsX, tXgX = cpasync.tma_partition(tma_x, 0, one, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tWsW, tWgW = cpasync.tma_partition(tma_w, 0, one, cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        tUsU = None
        if cutlass.const_expr(cfg.gated):  # the up ring, same descriptor and boxes
            tUsU, _ = cpasync.tma_partition(tma_w, 0, one, cute.group_modes(sU, 0, 2), cute.group_modes(gW, 0, 2))
        own = (tma_w, tWgW, tWsW, tUsU)  # the whole weight box into this CTA alone
        multicast = None  # cluster = 2: this CTA's half of a weight box shared by the cluster
        if cutlass.const_expr(cfg.cluster > 1):
            multicast = multicast_halves(cfg, tma_wm, mWm, sW, sU if cfg.gated else None)

        pipeline.pipeline_init_wait(cluster_mn)

        # The tile sequence, identical in producer and consumers (gemm_parts: the tile walk).
        walk = TileWalk(cfg, num_blocks[0], n_weight_blocks)
        num_tiles = walk.count()

        # ================================ producer ==========================================
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if cutlass.const_expr(cfg.gather_rows):
                # All four warps copy the token rows by cp.async, 16 bytes a copy, into the same swizzled
                # layout TMA writes; warp 0 also issues the weight TMA (gemm_parts: the gathering producer).
                gather = RowGather.make(cfg, self.dtype, mX, sX, tidx)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
                tile, tile_step = walk.first()
                while tile < num_tiles:
                    token_block, weight_block, _, first, last = walk.blocks(tile)
                    shared = walk.multicasts(block_expert, first, last)
                    expert = block_expert[token_block]
                    gather.read_tokens(token_of_row, token_block)  # the token of each row this thread copies
                    for k in range(k_tiles):
                        if warp_idx == 0:  # one elected lane: wait for the slot, arrive with the weight bytes
                            ring.producer_acquire(state)
                            full = ring.producer_get_barrier(state)
                            load_weights(cfg, shared, k, state.index, full, own, multicast, weight_block, expert)
                        else:  # the other warps only wait until the consumers have freed the slot
                            ring.sync_object_empty.wait(state.index, state.phase)
                        if gather.copies:  # threads with a vector (all 128 unless the token tile is small)
                            gather.copy(k, state.index)
                        # fires once this thread's copies above have landed (noinc: counted in the 1 + 128)
                        cute.arch.cp_async_mbarrier_arrive_noinc(ring.producer_get_barrier(state))
                        state.advance()
                    tile += tile_step
                # no thread leaves with copies in flight (their arrivals are still owed to the full barriers)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                if warp_idx == 0:
                    ring.producer_tail(state)
            elif warp_idx == 0:  # one warp issues the TMA loads (one elected lane)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
                tile, tile_step = walk.first()
                while tile < num_tiles:
                    token_block, weight_block, _, first, last = walk.blocks(tile)
                    shared = walk.multicasts(block_expert, first, last)
                    expert = block_expert[token_block]
                    tXgX_tile = tXgX[(None, token_block, None)]
                    for k in range(k_tiles):
                        ring.producer_acquire(state)
                        full = ring.producer_get_barrier(state)
                        cute.copy(tma_x, tXgX_tile[(None, k)], tXsX[(None, state.index)], tma_bar_ptr=full)
                        # the weight box (gated: gate rows n …, up rows I + n …), multicast when shared
                        load_weights(cfg, shared, k, state.index, full, own, multicast, weight_block, expert)
                        ring.producer_commit(state)
                        state.advance()
                    tile += tile_step
                ring.producer_tail(state)

        # ================================ consumers =========================================
        if warpgroup_idx > 0:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            wg = warpgroup_idx - 1  # ping-pong: this warpgroup's tiles, barriers and staging buffers
            # the thread's index in the tiled MMA: over all consumer threads (cooperative), or in its warpgroup
            mma_tidx = tidx - 128 * (warpgroup_idx if cfg.pingpong else 1)
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            # Which (m, n) of the tile each register holds (row scale, EpilogueQuant; its I: C's columns, swap: rows)
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
            quant_epi = EpilogueQuant.make(cfg, self.rows, tCcC, *quant, mC.shape[0 if swap else 1], mma_tidx)
            if cutlass.const_expr(cfg.two_level):
                blk = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)  # FP8: one K step's WGMMA sum
            # Gated: the up tiles are the weight operand of a second WGMMA chain into `up`, whose
            # layout is acc's (same tiled MMA, same thread slice): register i of both holds the same (m, n).
            tCrA_up, tCrB_up, up, blk_up = tCrA, tCrB, None, None
            if cutlass.const_expr(cfg.gated):
                up = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                if cutlass.const_expr(cfg.two_level):
                    blk_up = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)  # FP8: the up chain's K step
                if cutlass.const_expr(swap):
                    tCrA_up = tiled_mma.make_fragment_A(thr_mma.partition_A(sU))
                else:
                    tCrB_up = tiled_mma.make_fragment_B(thr_mma.partition_B(sU))

            # Epilogue plumbing: registers → (stmatrix; fp32 / E4M3 value by value) → swizzled smem → (TMA) → global.
            r2s = staging_copy(cfg, self.out_dtype, tiled_mma)
            thr_r2s = r2s.get_slice(mma_tidx)
            tRS_sC = thr_r2s.partition_D(sC)
            tRS_acc = r2s.retile(acc)
            rD_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
            tRS_rD = cute.make_rmem_tensor(rD_shape, cutlass.Float32)
            tRS_rD_out = cute.make_rmem_tensor(rD_shape, self.out_dtype)
            rD_size = cute.size(tRS_rD)
            # The epilogue's barrier, TMA-store ring and first staging buffer: the tile's warpgroups'
            # (ping-pong: this warpgroup's own barrier and epi_stages buffers).
            epi_threads = 128 * cfg.tile_warpgroups
            epi_barrier_id, first_buffer = EPILOGUE_BARRIER_ID, 0
            if cutlass.const_expr(cfg.pingpong):
                epi_barrier_id, first_buffer = EPILOGUE_BARRIER_ID + wg, wg * cfg.epi_stages
            store_ring = pipeline.PipelineTmaStore.create(
                num_stages=cfg.epi_stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, epi_threads)
            )
            epi_barrier = pipeline.NamedBarrier(barrier_id=epi_barrier_id, num_threads=epi_threads)
            # ONE thread issues every TMA store of a tile and owns their bulk async-groups: each
            # thread that executes cp.async.bulk.tensor starts its own copy, and commit_group /
            # wait_group count the executing thread's groups only, so the thread that stores, commits,
            # waits and drains (producer_tail) must be the same one every time: consumer thread 0 (lane 0
            # of warp 4; ping-pong: of warps 4 and 8).  The loads need no such guard (one elected lane).
            is_store_thread = mma_tidx == 0

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            tiles_done = cutlass.Int32(0)
            tile, tile_step = walk.first()
            if cutlass.const_expr(cfg.pingpong):
                # warpgroup wg takes every other tile of the CTA; its ring states skip the other's first tile
                tile, tile_step = tile + wg * tile_step, 2 * tile_step
                read.advance(wg * k_tiles)
                release.advance(wg * k_tiles)
                if wg == 1:  # warpgroup 0 goes first: grant it its first main loop and its first epilogue
                    order_arrive(MMA_ORDER_BARRIER_ID, 0)
                    order_arrive(EPI_ORDER_BARRIER_ID, 0)
            while tile < num_tiles:
                # stores: False only for a cluster's rank 1 past an odd last token block
                token_block, weight_block, stores, _, _ = walk.blocks(tile)

                # ---- main loop: K steps through the ring --------------------------------
                acc.fill(0.0)
                if cutlass.const_expr(cfg.gated):
                    up.fill(0.0)
                if cutlass.const_expr(cfg.quant is not None):
                    scales = TileScales.at(
                        cfg, tCcC, x_scale, w_scale, block_expert, token_block, weight_block, cute.size(mW, mode=[0])
                    )
                    up_scales = up_half_scales(cfg, scales)  # gated: W1's up rows I + n (else None)
                if cutlass.const_expr(cfg.pingpong):  # this warpgroup's turn on the tensor cores
                    order_wait(MMA_ORDER_BARRIER_ID, wg)
                if cutlass.const_expr(not cfg.two_level):  # bf16: one accumulator (two gated) over all of K
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    # first K step: issue, do not wait (nothing older to retire)
                    ring.consumer_wait(read)
                    if cutlass.const_expr(cfg.gather_rows):  # cp.async wrote the rows via the generic proxy
                        cute.arch.fence_proxy("async.shared", space="cta")
                    issue_k_step(cfg, tiled_mma, acc, up, tCrA, tCrB, tCrA_up, tCrB_up, read.index)
                    warpgroup.commit_group()
                    read.advance()
                    for _k in range(1, k_tiles):
                        ring.consumer_wait(read)
                        if cutlass.const_expr(cfg.gather_rows):
                            cute.arch.fence_proxy("async.shared", space="cta")
                        issue_k_step(cfg, tiled_mma, acc, up, tCrA, tCrB, tCrA_up, tCrB_up, read.index)
                        warpgroup.commit_group()
                        # keep this step's WGMMAs in flight; the previous step's are done → free its slot
                        warpgroup.wait_group(1)
                        ring.consumer_release(release)
                        release.advance()
                        read.advance()
                    if cutlass.const_expr(cfg.pingpong):  # all issued: the other warpgroup may issue its tile
                        order_arrive(MMA_ORDER_BARRIER_ID, 1 - wg)
                    warpgroup.wait_group(0)
                    ring.consumer_release(release)
                    release.advance()
                else:
                    # FP8: every K step into `blk`, promoted into `acc` (scaled per block for fp8_block)
                    for k in range(k_tiles):
                        ring.consumer_wait(read)
                        warpgroup.fence()  # blk was last read by the previous promotion
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)  # the first WGMMA zeroes blk
                        slot = read.index
                        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                            cute.gemm(tiled_mma, blk, tCrA[(None, None, kb, slot)], tCrB[(None, None, kb, slot)], blk)
                            if cutlass.const_expr(cfg.gated):  # its twin on the up tile, into blk_up
                                up_a, up_b = tCrA_up[(None, None, kb, slot)], tCrB_up[(None, None, kb, slot)]
                                cute.gemm(tiled_mma, blk_up, up_a, up_b, blk_up)
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)  # blk complete: the slot is free, the sum can be read
                        ring.consumer_release(read)
                        read.advance()
                        promote_halves(scales, up_scales, acc, blk, up, blk_up, k)  # (gated: both)
                    if cutlass.const_expr(cfg.pingpong):  # its WGMMAs all retired: the other warpgroup's turn
                        order_arrive(MMA_ORDER_BARRIER_ID, 1 - wg)
                if cutlass.const_expr(cfg.pingpong):  # skip the other warpgroup's tile in the ring
                    read.advance(k_tiles)
                    release.advance(k_tiles)
                if cutlass.const_expr(cfg.quant is not None):
                    dequantize_halves(scales, up_scales, acc, up)  # gated: both halves, before SiLU·up

                # ---- epilogue -------------------------------------------------------------
                if cutlass.const_expr(cfg.gated):
                    # SiLU·up elementwise over matching registers, in fp32 (the row kernel's formula):
                    # acc becomes the activation tile, rounded to bf16 once below (FP8: written in fp32)
                    acc.store(silu_mul(acc.load(), up.load()))
                    quant_epi.apply(acc, token_block, weight_block)  # epilogue_quant: scaled for E4M3, or amax
                if cutlass.const_expr(cfg.row_scale):
                    # fp32 routing weight per token row, applied before the bf16 rounding
                    row0 = token_block * cfg.tokens_tile
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        token = tCcC[i][1] if swap else tCcC[i][0]
                        acc[i] = acc[i] * row_scale[row0 + token]

                if cutlass.const_expr(cfg.pingpong):  # this warpgroup's turn to store
                    order_wait(EPI_ORDER_BARRIER_ID, wg)
                m_block, n_block = (weight_block, token_block) if swap else (token_block, weight_block)
                gC_epi = cute.zipped_divide(gC[(None, None, m_block, n_block)], cfg.epi_tile)
                bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, one, cute.group_modes(sC, 0, 2), gC_epi)
                epi_grid = gC_epi.shape[1]
                epi_count = cute.size(gC_epi, mode=[1])
                epi_order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))
                for e in cutlass.range_constexpr(epi_count):
                    for v in cutlass.range_constexpr(rD_size):
                        tRS_rD[v] = tRS_acc[e * rD_size + v]
                    tRS_rD_out.store(tRS_rD.load().to(self.out_dtype))
                    buf = first_buffer + (tiles_done * epi_count + e) % cfg.epi_stages
                    cute.copy(r2s, tRS_rD_out, tRS_sC[(None, None, None, buf)])
                    # make the generic-proxy smem writes visible to the TMA (async proxy)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    epi_barrier.arrive_and_wait()
                    if is_store_thread:
                        if stores:
                            cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, epi_order.get_hier_coord(e))])
                        store_ring.producer_commit()  # close this sub-tile's bulk group
                        store_ring.producer_acquire()  # ≤ epi_stages−1 groups still reading smem
                    # nobody rewrites a staging buffer before the store thread has seen it read out
                    epi_barrier.arrive_and_wait()
                if cutlass.const_expr(cfg.pingpong):  # the other warpgroup may store its tile
                    order_arrive(EPI_ORDER_BARRIER_ID, 1 - wg)
                tiles_done += 1
                tile += tile_step
            quant_epi.finish()  # epilogue_quant="amax", fp8_tensor: one atomic per warp
            if is_store_thread:
                store_ring.producer_tail()  # the last stores have read their staging buffers

"""The grouped GEMM: every expert's tiles in one persistent, warp-specialized WGMMA launch.

What one launch computes
------------------------
The MoE layer first sorts the (token, expert) pairs by expert and pads every expert's run of
rows to a multiple of ``tokens_tile`` (``moe_spec.align.align``, via ``moe.sort_rows``).  After that, the sorted activations
``X [M_pad, K]`` are cut into *token blocks* of ``tokens_tile`` rows, and every block belongs to
exactly one expert, ``block_expert[b]``.  The grouped GEMM is then a dense GEMM whose weight tile
is fetched from the block's expert::

    for every token block b < num_blocks (read from device memory) and weight block w:
        C[b·tT : (b+1)·tT,  w·tW : (w+1)·tW] = X[b-th block] · W[block_expert[b], w-th block]ᵀ
                                               (· row_scale[row], optional, in fp32)

``W [E, N_out, K]`` is handed to TMA as a 3-D tensor (N_out, K, E): the expert is simply the
third TMA coordinate, read from device memory when the tile starts.  Nothing about the routing
(group sizes, T, which experts are busy) is a compile-time constant, so a new batch never
recompiles; one compiled kernel exists per :class:`~cute_moe.config.GemmConfig`.

The two paths (normal / swap-AB) differ only in which operand plays WGMMA's A (M side):

===========  =======================  =======================  ==========================
path         A (M, 64 rows per WG)    B (N, 8 … 256)           C tile in memory
===========  =======================  =======================  ==========================
normal       tokens  X[b]             weights W[e, w]          N-major (rows = tokens)
swap-AB      weights W[e, w]          tokens  X[b]             M-major (Cᵀ: transposed)
===========  =======================  =======================  ==========================

In the kernel the producer speaks MoE (it loads "the token tile" and "the weight tile"), the
consumers speak GEMM (``sA``/``sB`` are the same buffers, swapped for swap-AB).

Anatomy of a CTA (``128 · (1 + consumer_warpgroups)`` threads)
-------------------------------------------------------------
* warpgroup 0 — producer.  ``setmaxnreg`` lowers it to 40 registers per thread (it only
  computes addresses).  Its first warp walks the tile sequence and, for every K step, waits
  for a free ring slot (``producer_acquire``), then issues two TMA loads (``cp.async.bulk.tensor``)
  into 128-B-swizzled shared memory; the slot's *full* mbarrier counts the bytes in.
* warpgroups 1‥n — consumers.  ``setmaxnreg`` raises them to 232 registers (the fp32
  accumulators live in registers: tile_m·tile_n/(128·n) per thread).  For every K step they
  wait on the *full* barrier, issue ``tile_k/16`` WGMMAs (``wgmma.mma_async … m64nNk16``),
  keep one WGMMA batch in flight (``wait_group(1)``) and release the previous slot's *empty*
  barrier so the producer can refill it while the tensor cores work.
* epilogue (consumers).  Optional fp32 row scale (routing weights), bf16 down-cast, ``stmatrix``
  (the ``.trans`` form for swap-AB's M-major C) into a swizzled staging buffer, a proxy fence and
  a named barrier; then consumer thread 0 alone issues the TMA store, commits it as a bulk
  async-group and waits until at most ``epi_stages − 1`` of its groups still read shared memory,
  so a small ring of staging buffers lets stores overlap the next sub-tile (why one thread: below).

FP8 (``cfg.quant``): the same kernel with E4M3 operands (``wgmma … m64nNk32.f32.e4m3.e4m3``) and
two more arguments, the activation and weight scales.  Each K step (128 deep) accumulates into
a block accumulator that is promoted into the fp32 tile accumulator — scaled per block for
``fp8_block`` — and the epilogue applies the tensor / channel scales before the routing weight;
both pieces live in :mod:`cute_moe.fp8_gemm`.  An fp32 output (``cfg.out_dtype``) is staged with
plain shared-memory stores instead of ``stmatrix`` (which moves 16-bit values only).

Gated (``cfg.gated``, the bf16 layer's GEMM1): W1 ``[E, 2I, K]`` is handed to TMA as (I, K, 2, E), and
each stage loads the gate and the up box of the same features (one descriptor, two copies on the
*full* barrier, into the weight ring and an "up" ring).  Every WGMMA runs twice, into two
accumulators of one tiled MMA and thread slice (register i of both holds the same (m, n)), and the
epilogue computes ``silu(gate)·up`` in fp32 (``rowops.silu_mul``) before the one bf16 rounding.
Gathering (``cfg.gather_rows``, the bf16 layer's GEMM1): the token rows come by cp.async from the
unsorted x, issued by the whole producer warpgroup (:mod:`cute_moe.gather`).  The compile-time
layouts live in :mod:`cute_moe.kernel_plan`.  Ping-pong (``cfg.schedule``): two consumer warpgroups
with whole tiles of their own take turns on the tensor cores (:mod:`cute_moe.schedule`).  Clusters
(``cfg.cluster = 2``): two CTAs on neighbouring token blocks of one expert load half the weight tile
each, multicast into both (:mod:`cute_moe.cluster`).

Persistent scheduling: ``gridDim.x`` = number of SMs; CTA ``c`` processes tiles ``c, c + grid,
c + 2·grid, …`` while ``tile < num_blocks · n_weight_blocks`` (``num_blocks`` is device data).
Tile ids are rasterized in groups of ``group_tokens`` token blocks: consecutive ids walk token
blocks first, then weight blocks, so the CTAs resident at one moment touch few distinct weight
tiles and few token blocks, and both are re-read from L2 instead of HBM.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warp, warpgroup  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from .cluster import ClusterTiles, cluster_layout_vmnk  # noqa: E402  (weight multicast: cluster.py)
from .fp8_gemm import TileScales  # noqa: E402
from .config import GATHER_THREADS, GemmConfig  # noqa: E402
from .gather import GatherProducer  # noqa: E402
from .kernel_plan import DSL_DTYPES, KernelPlan  # noqa: E402  (the compile-time layouts: kernel_plan.py)
from .rowops import silu_mul  # noqa: E402
from .schedule import ConsumerSchedule  # noqa: E402  (cooperative / ping-pong consumers: schedule.py)

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


class GroupedGemm(GatherProducer, ConsumerSchedule, ClusterTiles):
    """Host side (``__call__``, jit) and device side (``kernel``) of one compiled configuration.

    Arguments of the compiled function (all device tensors; shapes are dynamic):
        x            bf16 / E4M3 [M_pad, K]     sorted, padded tokens (K-major)
        w            bf16 / E4M3 (N_out, K, E)  the expert weights [E, N_out, K] viewed N, K, E
                     gated: bf16 (I, K, 2, E), W1 [E, 2I, K] viewed as its gate (0) and up (1) halves
        c            out_dtype [M_pad, N_out] (normal) or its transpose view (N_out, M_pad) (swap-AB)
        block_expert int32 [max_blocks]        expert of every token block
        num_blocks   int32 [1]                 number of valid token blocks (device scalar)
        row_scale    fp32 [M_pad]              per-row factor (read only when cfg.row_scale)
        stream       CUstream
        x_scale      fp32, FP8 only: [1] / [M_pad] / [M_pad, ⌈K/128⌉]  (tensor / channel / block)
        w_scale      fp32, FP8 only: [E] / [E, N_out] / [E, ⌈N_out/128⌉, ⌈K/128⌉]
        token_of_row int [M_pad], gather_rows only: x is then the unsorted bf16 [T, K] (``gather.py``)

    A bf16 config launches ``kernel``, an FP8 config ``kernel_fp8`` (with the two scale tensors), a
    ``gather_rows`` config ``kernel_gather`` (``gather.py``: x by ``token_of_row``, no TMA over x);
    all run the one body (``_body``).  A gated config's weight tensor has one more mode, the half
    (gate 0, up 1): one more TMA coordinate, both boxes of a stage through one descriptor.
    """

    def __init__(self, cfg: GemmConfig, num_ctas: int):
        self.cfg = cfg.validate()
        self.num_ctas = num_ctas
        self.dtype = DSL_DTYPES[cfg.dtype]
        self.out_dtype = DSL_DTYPES[cfg.out_dtype]

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, c: cute.Tensor, block_expert: cute.Tensor,
                 num_blocks: cute.Tensor, row_scale: cute.Tensor, stream,
                 x_scale: cute.Tensor = None, w_scale: cute.Tensor = None, token_of_row: cute.Tensor = None):
        cfg = self.cfg
        plan = KernelPlan(cfg)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_x, tma_x_tensor = cpasync.make_tiled_tma_atom(
            g2s, x, plan.x_smem_one, (cfg.tokens_tile, cfg.tile_k))
        tma_w, tma_w_tensor = cpasync.make_tiled_tma_atom(
            g2s, w, plan.w_smem_one, (cfg.weights_tile, cfg.tile_k))
        tma_c, tma_c_tensor = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, plan.epi_smem_one, cfg.epi_tile)
        tma_wm, tma_wm_tensor = self._weight_atoms(w, plan)  # cluster multicast (cluster.py)
        if cutlass.const_expr(tma_wm is None):
            tma_wm, tma_wm_tensor = tma_w, tma_w_tensor

        self.shared_storage = plan.shared_storage()  # barriers, the rings, the epilogue's buffers
        self.stage_bytes = plan.stage_bytes  # the ring's tx_count (read while the kernel is traced)
        ctas = max(cfg.cluster, self.num_ctas - self.num_ctas % cfg.cluster)  # whole clusters (cluster.py)
        launch = dict(grid=[ctas, 1, 1], block=[cfg.threads, 1, 1], cluster=[cfg.cluster, 1, 1],
                      min_blocks_per_mp=1, stream=stream)
        if cutlass.const_expr(cfg.gather_rows):  # no TMA over x: the producer gathers its rows (gather.py)
            self.kernel_gather(
                x, tma_w, tma_w_tensor, tma_wm, tma_wm_tensor, tma_c, tma_c_tensor, block_expert, num_blocks,
                row_scale, token_of_row,
                plan.tiled_mma, plan.a_smem_staged, plan.b_smem_staged, plan.epi_smem_staged,
            ).launch(**launch)
        elif cutlass.const_expr(cfg.quant is None):
            self.kernel(
                tma_x, tma_x_tensor, tma_w, tma_w_tensor, tma_wm, tma_wm_tensor, tma_c, tma_c_tensor,
                block_expert, num_blocks, row_scale, plan.tiled_mma,
                plan.a_smem_staged, plan.b_smem_staged, plan.epi_smem_staged,
            ).launch(**launch)
        else:
            self.kernel_fp8(
                tma_x, tma_x_tensor, tma_w, tma_w_tensor, tma_wm, tma_wm_tensor, tma_c, tma_c_tensor,
                block_expert, num_blocks, row_scale, x_scale, w_scale, plan.tiled_mma,
                plan.a_smem_staged, plan.b_smem_staged, plan.epi_smem_staged,
            ).launch(**launch)

    @cute.kernel
    def kernel(self, tma_x: cute.CopyAtom, mX: cute.Tensor, tma_w: cute.CopyAtom, mW: cute.Tensor,
               tma_wm: cute.CopyAtom, mWm: cute.Tensor, tma_c: cute.CopyAtom, mC: cute.Tensor,
               block_expert: cute.Tensor, num_blocks: cute.Tensor, row_scale: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               epi_smem_staged: cute.ComposedLayout):
        """The bf16 entry point."""
        self._body(tma_x, mX, tma_w, mW, tma_wm, mWm, tma_c, mC, block_expert, num_blocks, row_scale, None, None,
                   tiled_mma, a_smem_staged, b_smem_staged, epi_smem_staged)

    @cute.kernel
    def kernel_fp8(self, tma_x: cute.CopyAtom, mX: cute.Tensor, tma_w: cute.CopyAtom, mW: cute.Tensor,
                   tma_wm: cute.CopyAtom, mWm: cute.Tensor, tma_c: cute.CopyAtom, mC: cute.Tensor,
                   block_expert: cute.Tensor, num_blocks: cute.Tensor, row_scale: cute.Tensor, x_scale: cute.Tensor,
                   w_scale: cute.Tensor, tiled_mma: cute.TiledMma,
                   a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
                   epi_smem_staged: cute.ComposedLayout):
        """The FP8 entry point: the bf16 arguments plus the activation and weight scales."""
        self._body(tma_x, mX, tma_w, mW, tma_wm, mWm, tma_c, mC, block_expert, num_blocks, row_scale, x_scale,
                   w_scale, tiled_mma, a_smem_staged, b_smem_staged, epi_smem_staged)

    @cute.jit
    def _body(self, tma_x: cute.CopyAtom, mX: cute.Tensor, tma_w: cute.CopyAtom, mW: cute.Tensor,
              tma_wm: cute.CopyAtom, mWm: cute.Tensor, tma_c: cute.CopyAtom, mC: cute.Tensor,
              block_expert: cute.Tensor, num_blocks: cute.Tensor, row_scale: cute.Tensor, x_scale, w_scale,
              tiled_mma: cute.TiledMma,
              a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
              epi_smem_staged: cute.ComposedLayout, token_of_row=None):
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
            # the TMA lane's arrive (+ gather_rows: one cp.async arrive per producer thread, gather.py)
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     1 + (GATHER_THREADS if cfg.gather_rows else 0)),
            # every consumer warp of a tile arrives once on a slot's empty barrier (ping-pong: 4, one warpgroup's),
            # in a cluster on both CTAs' (cluster.py)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * cfg.tile_warpgroups * cfg.cluster),
            tx_count=self.stage_bytes,  # KernelPlan.stage_bytes: both TMA loads of one stage
            cta_layout_vmnk=cluster_layout_vmnk(cfg.cluster),
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
        if cutlass.const_expr(not cfg.gather_rows):
            tXsX, tXgX = cpasync.tma_partition(tma_x, 0, cute.make_layout(1),
                                               cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tWsW, tWgW = cpasync.tma_partition(tma_w, 0, cute.make_layout(1),
                                           cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        tUsU = None
        if cutlass.const_expr(cfg.gated):  # the up ring, same descriptor and boxes
            tUsU, _ = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sU, 0, 2),
                                            cute.group_modes(gW, 0, 2))
        multicast = None  # (atom, W boxes, weight and up slots) of this CTA's half of a shared weight tile
        if cutlass.const_expr(cfg.cluster > 1):
            tWsWm, tWgWm, tUsUm = self._weight_halves(tma_wm, mWm, sW, sU if cfg.gated else None)
            multicast = (tma_wm, tWgWm, tWsWm, tUsUm)

        pipeline.pipeline_init_wait(cluster_mn)

        # The tile sequence, identical in producer and consumers.  Group-rasterized ids:
        # id → (group of `group_tokens` token blocks, weight block, token block in the group).
        n_token_blocks = num_blocks[0]
        num_tiles = self._num_tiles(n_token_blocks, n_weight_blocks)  # (pairs of token blocks in a cluster)

        # ================================ producer ==========================================
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if cutlass.const_expr(cfg.gather_rows):  # all four warps: cp.async rows + the weight TMA
                self._produce_gathered(ring, mX, sX, token_of_row, block_expert, tma_w, tWgW, tWsW, tUsU, multicast,
                                       n_token_blocks, n_weight_blocks, num_tiles, k_tiles)
            elif warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
                tile, tile_step = self._walk()
                while tile < num_tiles:
                    token_block, weight_block, _, first, last = self._tile_blocks(tile, n_token_blocks,
                                                                                  n_weight_blocks)
                    shared = self._multicasts(block_expert, first, last)
                    expert = block_expert[token_block]
                    tXgX_tile = tXgX[(None, token_block, None)]
                    for k in range(k_tiles):
                        ring.producer_acquire(state)
                        full = ring.producer_get_barrier(state)
                        cute.copy(tma_x, tXgX_tile[(None, k)], tXsX[(None, state.index)], tma_bar_ptr=full)
                        # the weight box (gated: gate rows n …, up rows I + n …), multicast when shared
                        self._load_weights(shared, k, state.index, full, tma_w, tWgW, tWsW, tUsU, multicast,
                                           weight_block, expert)
                        ring.producer_commit(state)
                        state.advance()
                    tile += tile_step
                ring.producer_tail(state)

        # ================================ consumers =========================================
        if warpgroup_idx > 0:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            wg = warpgroup_idx - 1  # ping-pong: this warpgroup's tiles, barriers and staging buffers
            mma_tidx = self._tile_thread(tidx, warpgroup_idx)
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            # Which (m, n) of the tile each accumulator register holds (used by the row scale).
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
            if cutlass.const_expr(cfg.two_level):
                blk = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)  # FP8: one K step's WGMMA sum
            # Gated: the up tiles are the weight operand of a second WGMMA chain into `up`, whose
            # layout is acc's (same tiled MMA, same thread slice): register i of both holds the same (m, n).
            tCrA_up, tCrB_up = tCrA, tCrB
            if cutlass.const_expr(cfg.gated):
                up = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                if cutlass.const_expr(swap):
                    tCrA_up = tiled_mma.make_fragment_A(thr_mma.partition_A(sU))
                else:
                    tCrB_up = tiled_mma.make_fragment_B(thr_mma.partition_B(sU))
            k_blocks = cute.size(tCrA, mode=[2])

            # Epilogue plumbing: registers → (stmatrix) → swizzled smem → (TMA) → global.
            stmatrix = cute.make_copy_atom(warp.StMatrix8x8x16bOp(swap, 4 if cfg.tile_n >= 16 else 2),
                                           self.out_dtype)
            # stmatrix moves 16-bit values; an fp32 C is stored to smem value by value (same partition)
            r2s_atom = stmatrix if cfg.out_bytes == 2 else sm90.get_smem_store_op(
                LayoutEnum.COL_MAJOR if swap else LayoutEnum.ROW_MAJOR, self.out_dtype, cutlass.Float32)
            r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
            thr_r2s = r2s.get_slice(mma_tidx)
            tRS_sC = thr_r2s.partition_D(sC)
            tRS_acc = r2s.retile(acc)
            rD_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
            tRS_rD = cute.make_rmem_tensor(rD_shape, cutlass.Float32)
            tRS_rD_out = cute.make_rmem_tensor(rD_shape, self.out_dtype)
            rD_size = cute.size(tRS_rD)
            epi_barrier, store_ring, first_buffer = self._epilogue_sync(wg)  # ping-pong: per warpgroup
            # ONE thread issues every TMA store of a tile and owns their bulk async-groups: each
            # thread that executes cp.async.bulk.tensor starts its own copy, and commit_group /
            # wait_group count the executing thread's groups only, so the thread that stores, commits,
            # waits and drains (producer_tail) must be the same one every time: consumer thread 0 (lane 0
            # of warp 4; ping-pong: of warps 4 and 8).  The loads need no such guard (one elected lane).
            is_store_thread = mma_tidx == 0

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            tiles_done = cutlass.Int32(0)
            tile, tile_step = self._first_tile(wg, read, release, k_tiles)
            while tile < num_tiles:
                # stores: False only for a cluster's rank 1 past an odd last token block (cluster.py)
                token_block, weight_block, stores, _, _ = self._tile_blocks(tile, n_token_blocks, n_weight_blocks)

                # ---- main loop: K steps through the ring --------------------------------
                acc.fill(0.0)
                if cutlass.const_expr(cfg.gated):
                    up.fill(0.0)
                if cutlass.const_expr(cfg.quant is not None):
                    scales = TileScales.at(cfg, tCcC, x_scale, w_scale, block_expert, token_block,
                                           weight_block, cute.size(mW, mode=[0]))
                self._mainloop_turn(wg)
                if cutlass.const_expr(not cfg.two_level):  # bf16 (and FP8 without promotion, for the study)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    # first K step: issue, do not wait (nothing older to retire)
                    self._wait_full(ring, read)
                    for kb in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)],
                                  tCrB[(None, None, kb, read.index)], acc)
                        if cutlass.const_expr(cfg.gated):
                            cute.gemm(tiled_mma, up, tCrA_up[(None, None, kb, read.index)],
                                      tCrB_up[(None, None, kb, read.index)], up)
                    warpgroup.commit_group()
                    read.advance()
                    for k in range(1, k_tiles):
                        self._wait_full(ring, read)
                        for kb in cutlass.range_constexpr(k_blocks):
                            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)],
                                      tCrB[(None, None, kb, read.index)], acc)
                            if cutlass.const_expr(cfg.gated):
                                cute.gemm(tiled_mma, up, tCrA_up[(None, None, kb, read.index)],
                                          tCrB_up[(None, None, kb, read.index)], up)
                        warpgroup.commit_group()
                        # keep this step's WGMMAs in flight; the previous step's are done → free its slot
                        warpgroup.wait_group(1)
                        ring.consumer_release(release)
                        release.advance()
                        read.advance()
                    self._mainloop_issued(wg)
                    warpgroup.wait_group(0)
                    ring.consumer_release(release)
                    release.advance()
                    self._mainloop_done(read, release, k_tiles)
                else:
                    # FP8: every K step into `blk`, promoted into `acc` (scaled per block for fp8_block)
                    for k in range(k_tiles):
                        ring.consumer_wait(read)
                        warpgroup.fence()  # blk was last read by the previous promotion
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)  # the first WGMMA zeroes blk
                        for kb in cutlass.range_constexpr(k_blocks):
                            cute.gemm(tiled_mma, blk, tCrA[(None, None, kb, read.index)],
                                      tCrB[(None, None, kb, read.index)], blk)
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)  # blk complete: the slot is free, the sum can be read
                        ring.consumer_release(read)
                        read.advance()
                        scales.promote(acc, blk, k)
                if cutlass.const_expr(cfg.quant is not None):
                    scales.dequantize(acc)

                # ---- epilogue -------------------------------------------------------------
                if cutlass.const_expr(cfg.gated):
                    # SiLU·up elementwise over matching registers, in fp32 (the row kernel's formula):
                    # acc becomes the activation tile, rounded to bf16 once below
                    acc.store(silu_mul(acc.load(), up.load()))
                if cutlass.const_expr(cfg.row_scale):
                    # fp32 routing weight per token row, applied before the bf16 rounding
                    row0 = token_block * cfg.tokens_tile
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        token = tCcC[i][1] if swap else tCcC[i][0]
                        acc[i] = acc[i] * row_scale[row0 + token]

                self._epilogue_turn(wg)
                m_block, n_block = (weight_block, token_block) if swap else (token_block, weight_block)
                gC_epi = cute.zipped_divide(gC[(None, None, m_block, n_block)], cfg.epi_tile)
                bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                                       cute.group_modes(sC, 0, 2), gC_epi)
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
                self._epilogue_done(wg)
                tiles_done += 1
                tile += tile_step
            if is_store_thread:
                store_ring.producer_tail()  # the last stores have read their staging buffers

"""The MoE layer at decode in ONE persistent CuTe DSL launch (bf16 and the FP8 formats): the kernel (its
compile and host side: :mod:`cute_moe.decode`; its producer warp: :mod:`cute_moe.decode_producer`; FP8's
quantize tasks and scales: :mod:`cute_moe.decode_quant`).

A CTA is 160 threads: the consumer warpgroup (warps 0–3: WGMMA, epilogues, the combine) and a producer
warp (warp 4: tickets, TMA, cp.async).  Every CTA first builds the routing tables in shared memory from
the ≤ 64 ids (:func:`~cute_moe.decode_parts.build_tables`: no sort launch), then the producer claims
tasks from the ticket counter and hands each to the consumers through a two-slot task queue (mbarriers),
so it runs ahead: it streams the next task's weights while the consumers finish this one.

One task's life (:mod:`cute_moe.decode_parts` numbers them)::

    A (leader r, n-tile n)   per chunk of 16 of r's pairs, per K step of 64: the producer lands W1's gate
                             and up boxes (64 × 64 each, TMA, 128-B swizzle) and cp.asyncs the chunk's
                             x rows into one ring stage; the consumers issue 2 × 4 WGMMAs m64n16k16
                             (swap-AB: A = the weight rows, B = the token rows, both K-major) into gate
                             and up accumulators; epilogue SiLU(gate)·up in fp32 (activation.silu_mul), rounded
                             once to bf16 → h[pair, 64 columns]; then signal done1[r]
    B (k-tile kt, leader r)  the producer lands up to STAGES of W2's boxes (rows kt·128 … +127) BEFORE it
                             waits for done1[r] = NT1 (r's h complete), then the h rows; the consumers
                             multiply, × the routing weight in fp32 (NaN for a bad id), rounded once to
                             bf16 → y[pair, 128 columns]; then signal done2[kt]
    C (k-tile kt, block tb)  a consumer thread waits for done2[kt] = NL (every leader's B task of kt);
                             out[t, 128 columns] = Σ_j y[t·top_k + j] in fp32, j = 0 … top_k − 1,
                             rounded once: deterministic, no float atomics

Protocol: a finished task's consumers pass their barrier, thread 0 runs ``fence.acq_rel.gpu;
red.release.gpu.add`` on the counter; a waiter spins on ``ld.acquire.gpu`` (every producer lane itself,
before its cp.async of h; consumer thread 0 before the barrier that lets the others read y).  A task
waits only on smaller task numbers, claimed in increasing order by running CTAs: no deadlock, whatever
the residency (notes/decode.md, "The CuTe DSL kernel").  The last CTA out (an ``atom.acq_rel`` exit
count) zeroes the counter block (FP8: and the amax word), so the next launch needs no memset.

Under FP8 (``DecodeKernel(quant, static)``) the operands are E4M3 (x and h quantized by the launch's own Q1
and Q2 tasks, :mod:`cute_moe.decode_quant`), a stage is 128 elements of K (the same 128-byte rows), its
WGMMAs m64n16k32 write fresh block sums that are promoted into fp32 each stage, and h is kept in fp32.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from moe_spec.hopper import WGMMA_M

from .decode_parts import (
    CONSUMER_THREADS,
    EXIT,
    H_TILE,
    PAIR_LANES,
    PRODUCER_WARP,
    QUEUE,
    THREADS,
    TOKEN_BLOCK,
    TOKENS,
    Y_TILE,
    build_tables,
    fp8_phase_starts,
    half_tasks,
    phase_starts,
    stage_tx_bytes,
    stages,
    tile_k,
)
from .decode_producer import ProducerSteps
from .decode_quant import Fp8Args, QuantSteps
from .decode_steps import BF16, ConsumerSteps

FP8 = cutlass.Float8E4M3FN


class DecodeKernel(ConsumerSteps, ProducerSteps, QuantSteps):
    """``cute.compile(DecodeKernel(quant, static), *fake_arguments(ids_dtype, quant, static))``: every size is
    read from the tensors.

    Arguments: x bf16 [T, K]; w1 (I, K, 2, E) — W1 [E, 2I, K] seen as its gate (0) and up (1)
    halves; w2 (K, I, E) — W2 [E, K, I] (bf16, or E4M3 under FP8); topk_weights fp32 [T, top_k]; topk_ids
    [T, top_k]; h [≥ P, I] (bf16; fp32 under FP8), y bf16 [≥ P, K] (workspace); out bf16 [T, K]; counters
    int32 (zero at entry, zero at exit); word int32 [1] (the error word); part fp32 and arrive int32 (the
    halves' exchange, :func:`~cute_moe.decode_parts.exchange_words`; arrive zero at entry and exit);
    num_ctas (the grid); the stream (TVM-FFI's).  FP8 adds :class:`~cute_moe.decode_quant.Fp8Args`'s nine:
    w1_scale, w2_scale, a1, a2, xq, xs, hq, hs, amax (None in bf16: the compiled signature has them).  Last,
    ``trace``: int64 [≥ tasks, TRACE_WORDS] for the instrumented twin (``trace=True``,
    :mod:`cute_moe.decode_trace`), None for the kernel itself.
    """

    def __init__(self, quant: str | None = None, static: bool = False, trace: bool = False):
        self.quant, self.static, self.trace = quant, static, trace
        self.ab = BF16 if quant is None else FP8  # the GEMMs' operand type
        self.tk = tile_k(quant is not None)

    @cute.jit
    def __call__(
        self,
        x,
        w1,
        w2,
        topk_weights,
        topk_ids,
        h,
        y,
        out,
        counters,
        word,
        part,
        arrive,
        num_ctas: cutlass.Int32,
        stream,
        w1_scale=None,
        w2_scale=None,
        a1=None,
        a2=None,
        xq=None,
        xs=None,
        hq=None,
        hs=None,
        amax=None,
        trace=None,
    ):
        k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        tiled_mma = sm90.make_trivial_tiled_mma(
            self.ab, self.ab, k_major, k_major, cutlass.Float32, (1, 1, 1), tiler_mn=(WGMMA_M, TOKENS)
        )
        tile_mnk = (WGMMA_M, TOKENS, self.tk)
        w_staged = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, self.ab, stages())
        x_staged = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, self.ab, stages())
        w_one = cute.slice_(w_staged, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_w1, m_w1 = cpasync.make_tiled_tma_atom(g2s, w1, w_one, (WGMMA_M, self.tk))
        tma_w2, m_w2 = cpasync.make_tiled_tma_atom(g2s, w2, w_one, (WGMMA_M, self.tk))
        self.storage = self._storage(w_staged, x_staged)
        launch = dict(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)
        if cutlass.const_expr(self.quant is None):
            self.kernel(
                tma_w1,
                m_w1,
                tma_w2,
                m_w2,
                x,
                topk_weights,
                topk_ids,
                h,
                y,
                out,
                counters,
                word,
                part,
                arrive,
                tiled_mma,
                w_staged,
                x_staged,
                trace,
            ).launch(**launch)
        else:
            self.kernel_fp8(
                tma_w1,
                m_w1,
                tma_w2,
                m_w2,
                x,
                topk_weights,
                topk_ids,
                h,
                y,
                out,
                counters,
                word,
                part,
                arrive,
                tiled_mma,
                w_staged,
                x_staged,
                w1_scale,
                w2_scale,
                a1,
                a2,
                xq,
                xs,
                hq,
                hs,
                amax,
                trace,
            ).launch(**launch)

    def _storage(self, w_staged, x_staged):
        """Shared memory: the ring's and the queue's mbarriers, the queue, the routing tables, FP8's amax
        exchange, the two weight rings (gate / up, or W2's two 64-row boxes, or one half's two K steps) and
        the token-row ring (a second one for a half task's second K step), 1024-B aligned."""
        lanes = PAIR_LANES
        ab = self.ab
        n_stages = stages()
        halved = half_tasks() and self.quant is None

        @cute.struct
        class Storage:
            ring: cute.struct.MemRange[cutlass.Int64, 2 * n_stages]
            queue_bars: cute.struct.MemRange[cutlass.Int64, 2 * QUEUE]
            queue: cute.struct.MemRange[cutlass.Int32, QUEUE]
            expert: cute.struct.MemRange[cutlass.Int32, lanes]
            first: cute.struct.MemRange[cutlass.Int32, lanes]
            order: cute.struct.MemRange[cutlass.Int32, lanes]
            start: cute.struct.MemRange[cutlass.Int32, lanes]
            count: cute.struct.MemRange[cutlass.Int32, lanes]
            lead: cute.struct.MemRange[cutlass.Int32, lanes]
            scale: cute.struct.MemRange[cutlass.Float32, lanes]
            n_leaders: cute.struct.MemRange[cutlass.Int32, 4]
            flag: cute.struct.MemRange[cutlass.Int32, 4]
            red: cute.struct.MemRange[cutlass.Float32, 4]
            s_w0: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(w_staged)], 1024]
            s_w1: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(w_staged)], 1024]
            s_x: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(x_staged)], 1024]
            if halved:
                s_x2: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(x_staged)], 1024]

        return Storage

    @cute.kernel
    def kernel(
        self,
        tma_w1: cute.CopyAtom,
        m_w1: cute.Tensor,
        tma_w2: cute.CopyAtom,
        m_w2: cute.Tensor,
        m_x: cute.Tensor,
        m_weights: cute.Tensor,
        m_ids: cute.Tensor,
        m_h: cute.Tensor,
        m_y: cute.Tensor,
        m_out: cute.Tensor,
        counters: cute.Tensor,
        word: cute.Tensor,
        m_part: cute.Tensor,
        m_arrive: cute.Tensor,
        tiled_mma: cute.TiledMma,
        w_staged: cute.ComposedLayout,
        x_staged: cute.ComposedLayout,
        trace: cute.Tensor,
    ):
        """The bf16 entry point (``trace``: the task trace of a ``trace`` kernel, else None)."""
        tma = (tma_w1, m_w1, tma_w2, m_w2)
        outs = (m_h, m_y, m_out)
        layouts = (tiled_mma, w_staged, x_staged)
        self._body(tma, m_x, m_weights, m_ids, outs, counters, word, (m_part, m_arrive), layouts, None, trace)

    @cute.kernel
    def kernel_fp8(
        self,
        tma_w1: cute.CopyAtom,
        m_w1: cute.Tensor,
        tma_w2: cute.CopyAtom,
        m_w2: cute.Tensor,
        m_x: cute.Tensor,
        m_weights: cute.Tensor,
        m_ids: cute.Tensor,
        m_h: cute.Tensor,
        m_y: cute.Tensor,
        m_out: cute.Tensor,
        counters: cute.Tensor,
        word: cute.Tensor,
        m_part: cute.Tensor,
        m_arrive: cute.Tensor,
        tiled_mma: cute.TiledMma,
        w_staged: cute.ComposedLayout,
        x_staged: cute.ComposedLayout,
        w1_scale: cute.Tensor,
        w2_scale: cute.Tensor,
        a1: cute.Tensor,
        a2: cute.Tensor,
        xq: cute.Tensor,
        xs: cute.Tensor,
        hq: cute.Tensor,
        hs: cute.Tensor,
        amax: cute.Tensor,
        trace: cute.Tensor,
    ):
        """The FP8 entry point: the bf16 one's arguments and the E4M3 rows, scales and amax word."""
        tma = (tma_w1, m_w1, tma_w2, m_w2)
        outs = (m_h, m_y, m_out)
        fp8 = Fp8Args(w1_scale, w2_scale, a1, a2, xq, xs, hq, hs, amax)
        layouts = (tiled_mma, w_staged, x_staged)
        self._body(tma, m_x, m_weights, m_ids, outs, counters, word, (m_part, m_arrive), layouts, fp8, trace)

    @cute.jit
    def _body(self, tma, m_x, m_weights, m_ids, outs, counters, word, halves_exchange, layouts, fp8, trace):
        """One CTA: the routing tables, then the producer warp and the consumer warpgroup, then the exit count.
        ``trace`` (a ``trace`` kernel's): every task's SM and times (:data:`~cute_moe.decode_parts.TRACE_WORDS`)."""
        tma_w1, m_w1, tma_w2, m_w2 = tma
        m_part, m_arrive = halves_exchange
        tiled_mma, w_staged, x_staged = layouts
        m_h = outs[0]
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        if warp == PRODUCER_WARP:
            cpasync.prefetch_descriptor(tma_w1)
            cpasync.prefetch_descriptor(tma_w2)
        storage = SmemAllocator().allocate(self.storage)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ring.data_ptr(),
            num_stages=stages(),
            # the elected lane's arrive.expect_tx, then one cp.async arrive (noinc) per producer lane
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=stage_tx_bytes(),
            defer_sync=True,
        )
        queue = pipeline.PipelineAsync.create(
            barrier_storage=storage.queue_bars.data_ptr(),
            num_stages=QUEUE,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS),
            defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        lanes = cute.make_layout(PAIR_LANES)
        tables = (
            storage.expert.get_tensor(lanes),
            storage.first.get_tensor(lanes),
            storage.order.get_tensor(lanes),
            storage.start.get_tensor(lanes),
            storage.count.get_tensor(lanes),
            storage.lead.get_tensor(lanes),
            storage.scale.get_tensor(lanes),
            storage.n_leaders.get_tensor(cute.make_layout(4)),
        )
        # CTA barriers inside: the tables (and the mbarriers' init) are visible to every thread after it
        build_tables(tables, m_ids, m_weights, word, m_w1.shape[3], tidx, cta == 0)
        s_w0 = storage.s_w0.get_tensor(w_staged.outer, swizzle=w_staged.inner)
        s_w1 = storage.s_w1.get_tensor(w_staged.outer, swizzle=w_staged.inner)
        s_x = storage.s_x.get_tensor(x_staged.outer, swizzle=x_staged.inner)
        s_x2 = s_x  # a half task's second token ring (unused without HALF_TASKS)
        halved = half_tasks() and self.quant is None
        if cutlass.const_expr(halved):
            s_x2 = storage.s_x2.get_tensor(x_staged.outer, swizzle=x_staged.inner)
        s_flag = storage.flag.get_tensor(cute.make_layout(4))
        s_red = storage.red.get_tensor(cute.make_layout(4))
        s_task = storage.queue.get_tensor(cute.make_layout(QUEUE))
        n_leaders = tables[7][0]
        T, top_k, K, I = m_ids.shape[0], m_ids.shape[1], m_x.shape[1], m_w1.shape[0]  # noqa: E741
        nt1, nk, ntb = I // H_TILE, K // Y_TILE, (T + TOKEN_BLOCK - 1) // TOKEN_BLOCK
        halves = 1  # tasks per A tile: 2 (gate, up) when halving is on and the halves fill at most half the grid
        if cutlass.const_expr(halved):
            halves = cutlass.Int32(1)
            if (4 * n_leaders * nt1 <= grid) & (m_arrive.shape[0] >= grid):  # and a workspace made for halves
                halves = cutlass.Int32(2)
        if cutlass.const_expr(self.quant is None):
            b0, c0, end = phase_starts(n_leaders, nt1, nk, ntb, halves)
            bounds = (0, b0, b0, c0, end)
        else:
            bounds = fp8_phase_starts(n_leaders, nt1, nk, ntb)
        sizes = (n_leaders, nt1, ntb, top_k, K // self.tk, I // self.tk, halves)

        if warp == PRODUCER_WARP:
            rows_src = (m_x, m_h) if cutlass.const_expr(fp8 is None) else (fp8.xq, fp8.hq)
            self.producer(
                ring, queue, s_task, tables, tma, rows_src, s_w0, s_w1, (s_x, s_x2), counters, bounds, sizes, trace
            )
        if warp < PRODUCER_WARP:
            operands = (s_w0, s_w1, s_x, s_x2)
            exchange = (m_part, m_arrive, s_flag)
            work = (m_x, word, s_red, fp8, (m_w1.shape[3], I), trace)
            self.consumer(
                ring, queue, s_task, tables, tiled_mma, operands, outs, exchange, counters, bounds, sizes, tidx, T, work
            )

        # the last CTA out zeroes the counters (and FP8's amax): every CTA has made its last claim and wait
        cute.arch.sync_threads()
        if tidx == 0:
            out_before = cute.arch.atomic_add(counters.iterator + EXIT, cutlass.Int32(1), sem="acq_rel", scope="gpu")
            if out_before == grid - 1:
                for i in range(cute.size(counters)):
                    counters[i] = cutlass.Int32(0)
                if cutlass.const_expr(fp8 is not None):
                    fp8.amax[0] = cutlass.Float32(0.0)

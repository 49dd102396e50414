"""The MoE layer at decode in ONE persistent CuTe DSL launch (bf16): the kernel (its compile and host side:
:mod:`cute_moe.decode`).

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
                             and up accumulators; epilogue SiLU(gate)·up in fp32 (rowops.silu_mul), rounded
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
count) zeroes the counter block, so the next launch needs no memset.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from moe_spec.hopper import WGMMA_M

from .decode_parts import (
    CONSUMER_THREADS,
    DONE1,
    DONE2,
    EXIT,
    H_TILE,
    PAIR_LANES,
    PRODUCER_WARP,
    QUEUE,
    STAGES,
    THREADS,
    TICKET,
    TILE_K,
    TOKEN_BLOCK,
    TOKENS,
    Y_TILE,
    RowCopy,
    a_task,
    b_task,
    build_tables,
    c_task,
    consumer_sync,
    done1_target,
    exchange_slot,
    half_tasks,
    phase_starts,
    ring_state,
    signal,
    stage_tx_bytes,
    wait_at_least,
)
from .decode_steps import BF16, ConsumerSteps
from .rowops import silu_mul


class DecodeKernel(ConsumerSteps):
    """``cute.compile(DecodeKernel(), *fake_arguments(ids_dtype))``: every size is read from the tensors.

    Arguments: x bf16 [T, K]; w1 bf16 (I, K, 2, E) — W1 [E, 2I, K] seen as its gate (0) and up (1)
    halves; w2 bf16 (K, I, E) — W2 [E, K, I]; topk_weights fp32 [T, top_k]; topk_ids [T, top_k];
    h bf16 [≥ P, I], y bf16 [≥ P, K] (workspace); out bf16 [T, K]; counters int32 (zero at entry,
    zero at exit); word int32 [1] (the error word); part fp32 and arrive int32 (the halves' exchange,
    :func:`~cute_moe.decode_parts.exchange_words`; arrive zero at entry and exit); num_ctas (the grid);
    the stream (TVM-FFI's).
    """

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
    ):
        k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        tiled_mma = sm90.make_trivial_tiled_mma(
            BF16, BF16, k_major, k_major, cutlass.Float32, (1, 1, 1), tiler_mn=(WGMMA_M, TOKENS)
        )
        tile_mnk = (WGMMA_M, TOKENS, TILE_K)
        w_staged = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, BF16, STAGES)
        x_staged = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, BF16, STAGES)
        w_one = cute.slice_(w_staged, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_w1, m_w1 = cpasync.make_tiled_tma_atom(g2s, w1, w_one, (WGMMA_M, TILE_K))
        tma_w2, m_w2 = cpasync.make_tiled_tma_atom(g2s, w2, w_one, (WGMMA_M, TILE_K))
        self.storage = self._storage(w_staged, x_staged)
        self.kernel(
            tma_w1, m_w1, tma_w2, m_w2, x, topk_weights, topk_ids, h, y, out, counters, word, part, arrive,
            tiled_mma, w_staged, x_staged,
        ).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)  # fmt: skip

    def _storage(self, w_staged, x_staged):
        """Shared memory: the ring's and the queue's mbarriers, the queue, the routing tables, the two
        weight rings (gate / up, or W2's two 64-row boxes, or one half's two K steps) and the token-row ring
        (a second one for a half task's second K step), 1024-B aligned."""
        lanes = PAIR_LANES

        @cute.struct
        class Storage:
            ring: cute.struct.MemRange[cutlass.Int64, 2 * STAGES]
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
            s_w0: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(w_staged)], 1024]
            s_w1: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(w_staged)], 1024]
            s_x: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(x_staged)], 1024]
            if half_tasks():
                s_x2: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(x_staged)], 1024]

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
    ):
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
            num_stages=STAGES,
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
        if cutlass.const_expr(half_tasks()):
            s_x2 = storage.s_x2.get_tensor(x_staged.outer, swizzle=x_staged.inner)
        s_flag = storage.flag.get_tensor(cute.make_layout(4))
        s_task = storage.queue.get_tensor(cute.make_layout(QUEUE))
        n_leaders = tables[7][0]
        T, top_k, K, I = m_ids.shape[0], m_ids.shape[1], m_x.shape[1], m_w1.shape[0]  # noqa: E741
        nt1, nk, ntb = I // H_TILE, K // Y_TILE, (T + TOKEN_BLOCK - 1) // TOKEN_BLOCK
        halves = 1  # tasks per A tile: 2 (gate, up) when halving is on and the halves fill at most half the grid
        if cutlass.const_expr(half_tasks()):
            halves = cutlass.Int32(1)
            if (4 * n_leaders * nt1 <= grid) & (m_arrive.shape[0] >= grid):  # and a workspace made for halves
                halves = cutlass.Int32(2)
        bounds = phase_starts(n_leaders, nt1, nk, ntb, halves)
        sizes = (n_leaders, nt1, ntb, top_k, K // TILE_K, I // TILE_K, halves)

        if warp == PRODUCER_WARP:
            tma = (tma_w1, m_w1, tma_w2, m_w2)
            self.producer(ring, queue, s_task, tables, tma, m_x, m_h, s_w0, s_w1, (s_x, s_x2), counters, bounds, sizes)
        if warp < PRODUCER_WARP:
            operands = (s_w0, s_w1, s_x, s_x2)
            outs = (m_h, m_y, m_out)
            exchange = (m_part, m_arrive, s_flag)
            self.consumer(
                ring, queue, s_task, tables, tiled_mma, operands, outs, exchange, counters, bounds, sizes, tidx, T
            )

        # the last CTA out zeroes the counters: every CTA has made its last claim and its last wait
        cute.arch.sync_threads()
        if tidx == 0:
            out_before = cute.arch.atomic_add(counters.iterator + EXIT, cutlass.Int32(1), sem="acq_rel", scope="gpu")
            if out_before == grid - 1:
                for i in range(cute.size(counters)):
                    counters[i] = cutlass.Int32(0)

    # ---- the producer warp -------------------------------------------------------------------------
    @cute.jit
    def producer(self, ring, queue, s_task, tables, tma, m_x, m_h, s_w0, s_w1, s_xs, counters, bounds, sizes):
        """Claim tasks, hand each to the consumers, land its operands in the ring (module docstring)."""
        tma_w1, m_w1, tma_w2, m_w2 = tma
        _, _, s_order, s_start, s_count, s_lead, _, _ = tables
        s_exp = tables[0]
        b0, c0, end = bounds
        n_leaders, nt1, _, top_k, k1_steps, k2_steps, halves = sizes
        lane = cute.arch.lane_idx()
        one = cute.make_layout(1)
        g_w1 = cute.local_tile(m_w1, (WGMMA_M, TILE_K), (None, None, None, None))  # (64, 64, I/64, K/64, 2, E)
        g_w2 = cute.local_tile(m_w2, (WGMMA_M, TILE_K), (None, None, None))  # (64, 64, K/64, I/64, E)
        ring0, ring1 = cute.group_modes(s_w0, 0, 2), cute.group_modes(s_w1, 0, 2)
        d1_0, box1 = cpasync.tma_partition(tma_w1, 0, one, ring0, cute.group_modes(g_w1, 0, 2))
        d1_1, _ = cpasync.tma_partition(tma_w1, 0, one, ring1, cute.group_modes(g_w1, 0, 2))
        d2_0, box2 = cpasync.tma_partition(tma_w2, 0, one, ring0, cute.group_modes(g_w2, 0, 2))
        d2_1, _ = cpasync.tma_partition(tma_w2, 0, one, ring1, cute.group_modes(g_w2, 0, 2))
        rows = RowCopy.make(s_xs[0], lane)
        rows2 = RowCopy.make(s_xs[1], lane)  # a half task's second K step
        tasks = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, QUEUE)
        issued = cutlass.Int32(0)  # ring stages issued so far
        task = self.claim(counters, lane)
        while task < end:
            self.hand_over(queue, tasks, s_task, task, lane)
            tasks.advance()
            # A: per stage W1's gate and up boxes of a K step (a half: its rows' boxes of two K steps) and x
            if task < b0:
                r, n, half = a_task(task, nt1, halves)
                base, count = s_start[r], s_count[r]
                e = s_exp[s_lead[r]]
                steps = k1_steps // halves
                state = ring_state(issued, True)
                for c in range((count + TOKENS - 1) // TOKENS):
                    for s in range(steps):
                        k = s * halves  # whole tile: (k, gate), (k, up); a half: (k, half), (k + 1, half)
                        ring.producer_acquire(state)
                        full = ring.producer_get_barrier(state)
                        box_0, box_1 = (
                            box1[(None, n, k, half, e)],
                            box1[(None, n, k + halves - 1, half + 2 - halves, e)],
                        )
                        cute.copy(tma_w1, box_0, d1_0[(None, state.index)], tma_bar_ptr=full)
                        cute.copy(tma_w1, box_1, d1_1[(None, state.index)], tma_bar_ptr=full)
                        rows.copy(m_x, s_order, base, c, count, top_k, k, state.index, True)
                        if halves == 2:
                            rows2.copy(m_x, s_order, base, c, count, top_k, k + 1, state.index, True)
                        cute.arch.cp_async_mbarrier_arrive_noinc(full)
                        state.advance()
                issued = issued + (count + TOKENS - 1) // TOKENS * steps
            elif task < c0:  # B: W2's two boxes first, then (after the wait) the chunk's h rows
                kt, r = b_task(task - b0, n_leaders)
                base, count = s_start[r], s_count[r]
                e = s_exp[s_lead[r]]
                steps = (count + TOKENS - 1) // TOKENS * k2_steps
                early = cutlass.min(steps, STAGES)
                state = ring_state(issued, True)
                for s in range(early):  # W2 does not depend on GEMM1: on its way before the wait
                    ring.producer_acquire(state)
                    full = ring.producer_get_barrier(state)
                    k = s % k2_steps
                    cute.copy(tma_w2, box2[(None, 2 * kt, k, e)], d2_0[(None, state.index)], tma_bar_ptr=full)
                    cute.copy(tma_w2, box2[(None, 2 * kt + 1, k, e)], d2_1[(None, state.index)], tma_bar_ptr=full)
                    state.advance()
                chunks = (count + TOKENS - 1) // TOKENS
                wait_at_least(counters.iterator + DONE1 + r, done1_target(nt1, chunks, halves))  # every lane's acquire
                rows_state = ring_state(issued, True)
                for s in range(early):
                    full = ring.producer_get_barrier(rows_state)
                    rows.copy(m_h, s_order, base, s // k2_steps, count, top_k, s % k2_steps, rows_state.index, False)
                    cute.arch.cp_async_mbarrier_arrive_noinc(full)
                    rows_state.advance()
                for s in range(early, steps):
                    ring.producer_acquire(state)
                    full = ring.producer_get_barrier(state)
                    k = s % k2_steps
                    cute.copy(tma_w2, box2[(None, 2 * kt, k, e)], d2_0[(None, state.index)], tma_bar_ptr=full)
                    cute.copy(tma_w2, box2[(None, 2 * kt + 1, k, e)], d2_1[(None, state.index)], tma_bar_ptr=full)
                    rows.copy(m_h, s_order, base, s // k2_steps, count, top_k, k, state.index, False)
                    cute.arch.cp_async_mbarrier_arrive_noinc(full)
                    state.advance()
                issued = issued + steps
            task = self.claim(counters, lane)
        self.hand_over(queue, tasks, s_task, task, lane)  # a number past the end: the consumers stop
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def claim(self, counters: cute.Tensor, lane):
        """The next task number (lane 0's atomic add on the ticket), in every lane."""
        task = cutlass.Int32(0)
        if lane == 0:
            task = cute.arch.atomic_add(counters.iterator + TICKET, cutlass.Int32(1), sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(task, 0)

    @cute.jit
    def hand_over(self, queue, tasks, s_task, task, lane):
        """Put ``task`` in the queue slot of ``tasks`` once the consumers have read its last occupant."""
        queue.producer_acquire(tasks)
        if lane == 0:
            s_task[tasks.index] = task
            queue.producer_commit(tasks)  # mbarrier.arrive: release at CTA scope

    # ---- the consumer warpgroup ----------------------------------------------------------------------
    @cute.jit
    def consumer(
        self, ring, queue, s_task, tables, tiled_mma, operands, outs, exchange, counters, bounds, sizes, tidx, T
    ):
        """Take tasks from the queue in order: the two GEMMs' main loops and epilogues, the combine."""
        _, _, s_order, s_start, s_count, _, s_scale, _ = tables
        s_w0, s_w1, s_x, s_x2 = operands
        m_h, m_y, m_out = outs
        m_arrive = exchange[1]
        b0, c0, end = bounds
        n_leaders, nt1, ntb, top_k, k1_steps, k2_steps, halves = sizes
        thr = tiled_mma.get_slice(tidx)
        frags = (
            tiled_mma.make_fragment_A(thr.partition_A(s_w0)),
            tiled_mma.make_fragment_A(thr.partition_A(s_w1)),
            tiled_mma.make_fragment_B(thr.partition_B(s_x)),
            tiled_mma.make_fragment_B(thr.partition_B(s_x2)),
        )
        coords = thr.partition_C(cute.make_identity_tensor((WGMMA_M, TOKENS)))  # (m, n) of each register
        acc0 = cute.make_rmem_tensor(coords.shape, cutlass.Float32)
        acc1 = cute.make_rmem_tensor(coords.shape, cutlass.Float32)
        h_out = cute.make_rmem_tensor(coords.shape, BF16)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # once, outside every loop: the chunks zero acc0/acc1
        tasks = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QUEUE)
        used = cutlass.Int32(0)  # ring stages consumed so far
        task = self.take(queue, tasks, s_task)
        tasks.advance()
        while task < end:
            if task < b0:
                r, n, half = a_task(task, nt1, halves)
                base, count = s_start[r], s_count[r]
                h_rows = (m_h, s_order, base, count, n)
                for c in range((count + TOKENS - 1) // TOKENS):
                    if halves == 2:  # one half's sums; the half that arrives second has both and finishes the chunk
                        used = self.mainloop(ring, tiled_mma, acc0, acc1, frags, used, k1_steps // 2, True)
                        slot = exchange_slot(r, n, c, nt1)
                        if self.exchange(acc0, acc1, exchange, slot, half, tidx) == 1:
                            self.store_h(acc0, acc1, h_out, coords, h_rows, c)
                            consumer_sync()  # every thread's h stores, then one release
                            if tidx == 0:
                                m_arrive[slot] = cutlass.Int32(0)  # the arrival word, zero for the next launch
                                signal(counters.iterator + DONE1 + r)
                    else:
                        used = self.mainloop(ring, tiled_mma, acc0, acc1, frags, used, k1_steps)
                        self.store_h(acc0, acc1, h_out, coords, h_rows, c)
                if halves == 1:
                    consumer_sync()  # every thread's h stores, then one release
                    if tidx == 0:
                        signal(counters.iterator + DONE1 + r)
            elif task < c0:
                kt, r = b_task(task - b0, n_leaders)
                base, count = s_start[r], s_count[r]
                for c in range((count + TOKENS - 1) // TOKENS):
                    used = self.mainloop(ring, tiled_mma, acc0, acc1, frags, used, k2_steps)
                    for i in cutlass.range_constexpr(cute.size(acc0)):
                        m, j = coords[i]
                        if c * TOKENS + j < count:
                            pair = s_order[base + c * TOKENS + j]
                            w = s_scale[pair]  # the routing weight in fp32 before the one rounding
                            m_y[(pair, kt * Y_TILE + m)] = (acc0[i] * w).to(BF16)
                            m_y[(pair, kt * Y_TILE + WGMMA_M + m)] = (acc1[i] * w).to(BF16)
                consumer_sync()
                if tidx == 0:
                    signal(counters.iterator + DONE2 + kt)
            else:
                kt, tb = c_task(task - c0, ntb)
                if tidx == 0:
                    wait_at_least(counters.iterator + DONE2 + kt, n_leaders)
                consumer_sync()  # thread 0's acquire, then every thread's loads of y
                self.combine(m_y, m_out, kt, tb, top_k, T, tidx)
            task = self.take(queue, tasks, s_task)
            tasks.advance()

    @cute.jit
    def store_h(self, acc0, acc1, h_out, coords, h_rows, c):
        """A's epilogue for chunk ``c``: h = SiLU(gate)·up in fp32 from the gate (acc0) and up (acc1) sums,
        rounded once to bf16, into the rows of the chunk's pairs (``h_rows``: h, order, base, count, n-tile)."""
        m_h, s_order, base, count, n = h_rows
        h_out.store(silu_mul(acc0.load(), acc1.load()).to(BF16))
        for i in cutlass.range_constexpr(cute.size(acc0)):
            m, j = coords[i]
            if c * TOKENS + j < count:
                m_h[(s_order[base + c * TOKENS + j], n * H_TILE + m)] = h_out[i]

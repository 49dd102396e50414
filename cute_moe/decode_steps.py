"""The consumer warpgroup's steps of the one-launch decode kernel (:mod:`cute_moe.decode_kernel`, whose
docstring tells a task's life): its task loop, GEMM1's and GEMM2's tasks (bf16 and FP8), a chunk's main
loop over the ring and its WGMMAs (FP8: with a promotion per stage), the halves' exchange
(:data:`~cute_moe.decode_parts.HALF_TASKS`), the task queue's read, and the combine.
:class:`~cute_moe.decode_kernel.DecodeKernel` inherits them."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import warpgroup

from moe_spec.hopper import WGMMA_M
from moe_spec.quant import FP8_BLOCK

from .activation import silu_mul
from .decode_parts import (
    CONSUMER_THREADS,
    DONE1,
    DONE2,
    DONEQ1,
    DONEQ2,
    EXCHANGE_VALUES,
    H_TILE,
    QUEUE,
    TOKEN_BLOCK,
    TOKENS,
    VEC,
    Y_TILE,
    a_task,
    b_task,
    c_task,
    consumer_sync,
    exchange_slot,
    fp8_overlap,
    ring_state,
    signal,
    wait_at_least,
)
from .decode_trace import TRACE_DONE, TRACE_SM, TRACE_TAKE, globaltimer, smid
from .quantmath import scale_of

BF16 = cutlass.BFloat16


class ConsumerSteps:
    """The consumer warpgroup's steps (methods of :class:`~cute_moe.decode_kernel.DecodeKernel`)."""

    @cute.jit
    def consumer(
        self, ring, queue, s_task, tables, tiled_mma, operands, outs, exchange, counters, bounds, sizes, tidx, T, work
    ):
        """Take tasks from the queue in order: the two GEMMs' main loops and epilogues, the combine (FP8: and
        the quantize tasks)."""
        _, _, s_order, s_start, s_count, _, s_scale, _ = tables
        s_w0, s_w1, s_x, s_x2 = operands
        m_h, m_y, m_out = outs
        m_x, word, s_red, fp8, (_, I), trace = work  # noqa: E741
        a0, q0, b0, c0, end = bounds
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
        # FP8: a K step's sums (gate / box 0, up / box 1) before their promotion, two sets (FP8_OVERLAP)
        blk = tuple(cute.make_rmem_tensor(coords.shape, cutlass.Float32) for _ in range(4))
        h_out = cute.make_rmem_tensor(coords.shape, BF16)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # once, outside every loop: the chunks zero acc0/acc1
        tasks = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QUEUE)
        used = cutlass.Int32(0)  # ring stages consumed so far
        task = self.take(queue, tasks, s_task)
        tasks.advance()
        while task < end:
            if cutlass.const_expr(self.trace):
                if tidx == 0:
                    trace[(task, TRACE_SM)] = smid()
                    trace[(task, TRACE_TAKE)] = globaltimer()
            if task < b0:
                if cutlass.const_expr(fp8 is None):
                    accs = (acc0, acc1, h_out)
                    used = self.gemm1(
                        task, ring, tiled_mma, frags, accs, coords, tables, used, outs, exchange, sizes, counters, tidx
                    )
                else:
                    if task < a0:
                        self.quantize_x(task, m_x, fp8, word, s_red, counters, tidx)
                    elif task < q0:
                        accs = (acc0, acc1, blk)
                        used = self.gemm1_fp8(
                            task - a0,
                            ring,
                            tiled_mma,
                            frags,
                            accs,
                            coords,
                            tables,
                            used,
                            outs,
                            work,
                            sizes,
                            counters,
                            tidx,
                        )
                    else:
                        self.quantize_h(task - q0, m_h, fp8, tables, word, counters, n_leaders, nt1, tidx)
            elif task < c0:
                used = self.gemm2(
                    task - b0,
                    ring,
                    tiled_mma,
                    frags,
                    (acc0, acc1, blk),
                    coords,
                    tables,
                    used,
                    outs,
                    work,
                    sizes,
                    counters,
                    tidx,
                )
            else:
                kt, tb = c_task(task - c0, ntb)
                if tidx == 0:
                    wait_at_least(counters.iterator + DONE2 + kt, n_leaders)
                consumer_sync()  # thread 0's acquire, then every thread's loads of y
                self.combine(m_y, m_out, kt, tb, top_k, T, tidx)
            if cutlass.const_expr(self.trace):
                if tidx == 0:  # after the task's signal (thread 0 made it) or, for C, its stores
                    trace[(task, TRACE_DONE)] = globaltimer()
            task = self.take(queue, tasks, s_task)
            tasks.advance()

    @cute.jit
    def gemm1(self, a, ring, tiled_mma, frags, accs, coords, tables, used, outs, exchange, sizes, counters, tidx):
        """bf16's A task ``a``: per chunk GEMM1's sums (a half task: one half's, finished by the second to
        arrive), SiLU·up → h; then done1[r].  Returns the ring stages consumed so far."""
        acc0, acc1, h_out = accs
        _, _, s_order, s_start, s_count, _, _, _ = tables
        m_arrive = exchange[1]
        _, nt1, _, _, k1_steps, _, halves = sizes
        r, n, half = a_task(a, nt1, halves)
        base, count = s_start[r], s_count[r]
        h_rows = (outs[0], s_order, base, count, n)
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
        return used

    @cute.jit
    def gemm2(self, b, ring, tiled_mma, frags, accs, coords, tables, used, outs, work, sizes, counters, tidx):
        """B task ``b`` (counted from B0): per chunk GEMM2's sums (FP8: promoted and dequantized, once r's h is
        quantized: doneq2[r]) × the routing weight in fp32, rounded once → y; then done2[kt].  Returns the
        ring stages consumed so far."""
        acc0, acc1, blk = accs
        _, _, s_order, s_start, s_count, _, s_scale, _ = tables
        m_y = outs[1]
        _, _, _, fp8, (_, I), _ = work  # noqa: E741
        n_leaders, _, _, top_k, _, k2_steps, _ = sizes
        kt, r = b_task(b, n_leaders)
        base, count = s_start[r], s_count[r]
        if cutlass.const_expr(fp8 is not None):
            if tidx == 0:
                wait_at_least(counters.iterator + DONEQ2 + r, 1)  # r's hq and hs, read below
            consumer_sync()
        for c in range((count + TOKENS - 1) // TOKENS):
            if cutlass.const_expr(fp8 is None):
                used = self.mainloop(ring, tiled_mma, acc0, acc1, frags, used, k2_steps)
            else:
                e = tables[0][tables[5][r]]
                ts = fp8.a2[0] if cutlass.const_expr(self.static) else scale_of(fp8.amax[0])
                rows = (s_order, base, count, top_k)
                wrows = (kt * Y_TILE, kt * Y_TILE + WGMMA_M)
                sc = self.chunk_scales(fp8.hs, ts, fp8.w2_scale, e, wrows, coords, rows, c, False)
                used = self.mainloop_fp8(ring, tiled_mma, acc0, acc1, blk, frags, used, k2_steps, sc, I // FP8_BLOCK)
                self.dequantize(acc0, acc1, sc, coords)
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
        return used

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

    @cute.jit
    def gemm1_fp8(self, a, ring, tiled_mma, frags, accs, coords, tables, used, outs, work, sizes, counters, tidx):
        """FP8's A task ``a`` (counted from A0): once x is quantized (doneq1), per chunk GEMM1's promoted sums,
        dequantized, SiLU·up in fp32 → h (and a dynamic fp8_tensor scale's amax); then done1[r].  Returns the
        ring stages consumed so far."""
        acc0, acc1, blk = accs
        _, _, s_order, s_start, s_count, _, _, _ = tables
        m_x, _, _, fp8, (_, I), _ = work  # noqa: E741
        _, nt1, ntb, top_k, k1_steps, _, _ = sizes
        r, n, _ = a_task(a, nt1)
        base, count = s_start[r], s_count[r]
        e = tables[0][tables[5][r]]
        if tidx == 0:
            wait_at_least(counters.iterator + DONEQ1, ntb)  # x's scales, read below
        consumer_sync()
        act, ts = fp8.xs, fp8.xs[0]
        if cutlass.const_expr(self.static):
            act, ts = fp8.a1, fp8.a1[0]
        rows = (s_order, base, count, top_k)
        groups = m_x.shape[1] // FP8_BLOCK
        for c in range((count + TOKENS - 1) // TOKENS):
            sc = self.chunk_scales(act, ts, fp8.w1_scale, e, (n * H_TILE, I + n * H_TILE), coords, rows, c, True)
            used = self.mainloop_fp8(ring, tiled_mma, acc0, acc1, blk, frags, used, k1_steps, sc, groups)
            self.dequantize(acc0, acc1, sc, coords)
            self.store_h_fp32(acc0, acc1, coords, (outs[0], s_order, base, count, n), c, fp8.amax, tidx % 32)
        consumer_sync()  # every thread's h stores (and amax atomics), then one release
        if tidx == 0:
            signal(counters.iterator + DONE1 + r)
        return used

    @cute.jit
    def exchange(self, acc0, acc1, exchange, slot, half, tidx):
        """A half task's sums (acc0) to exchange slot ``slot``, then its arrival: returns 1 in the half that
        arrives second, with the gate sums loaded into acc0 and the up sums into acc1, else 0.  The protocol
        is the tasks' own: stores, the barrier, thread 0's ``fence.acq_rel.gpu`` and acquire-release add (its
        old value is the flag), the barrier, then every thread's loads."""
        m_part, m_arrive, s_flag = exchange

        own = (slot * 2 + half) * EXCHANGE_VALUES * CONSUMER_THREADS + tidx  # value i at + i·128: coalesced
        gate = slot * 2 * EXCHANGE_VALUES * CONSUMER_THREADS + tidx
        up = gate + EXCHANGE_VALUES * CONSUMER_THREADS
        for i in cutlass.range_constexpr(cute.size(acc0)):
            m_part[own + i * CONSUMER_THREADS] = acc0[i]
        consumer_sync()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            s_flag[0] = cute.arch.atomic_add(m_arrive.iterator + slot, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        consumer_sync()
        second = s_flag[0]
        if second == 1:
            for i in cutlass.range_constexpr(cute.size(acc0)):
                acc0[i] = m_part[gate + i * CONSUMER_THREADS]
                acc1[i] = m_part[up + i * CONSUMER_THREADS]
        return second

    @cute.jit
    def take(self, queue, tasks, s_task):
        """The next task from the queue (every consumer thread reads it, then arrives on its slot)."""
        queue.consumer_wait(tasks)
        task = s_task[tasks.index]
        queue.consumer_release(tasks)
        return task

    @cute.jit
    def mainloop(self, ring, tiled_mma, acc0, acc1, frags, used, steps, half: cutlass.Constexpr = False):
        """One chunk: ``steps`` ring stages into the two accumulators (zeroed first; ``half``: both boxes of
        a stage, two K steps of one half's rows, into acc0); one stage's WGMMAs stay in flight while the
        next is issued.  Returns the stages consumed so far."""
        read = ring_state(used, False)
        release = ring_state(used, False)
        acc0.fill(0.0)
        acc1.fill(0.0)
        warpgroup.fence()
        self.issue(ring, tiled_mma, acc0, acc1, frags, read, half)  # the first stage: nothing older to retire
        read.advance()
        for _s in range(1, steps):
            self.issue(ring, tiled_mma, acc0, acc1, frags, read, half)
            warpgroup.wait_group(1)  # the previous stage's WGMMAs are done: free its slot
            ring.consumer_release(release)
            release.advance()
            read.advance()
        warpgroup.wait_group(0)
        ring.consumer_release(release)
        return used + steps

    @cute.jit
    def mainloop_fp8(self, ring, tiled_mma, acc0, acc1, blk, frags, used, steps, sc, groups):
        """FP8's chunk: per ring stage (one 128-deep K step) the WGMMAs write fresh block sums (zeroed first),
        promoted into acc0 / acc1 (zeroed first) with ``sc``'s scales
        (:meth:`~cute_moe.decode_quant.QuantSteps.promote`; ``groups``: the activation's scale groups per
        row).  With :data:`~cute_moe.decode_parts.FP8_OVERLAP` the block sums alternate between two register
        sets, so a stage's WGMMAs are in flight while the previous stage's sums are retired, its slot freed
        and its sums promoted; without it each stage is retired before the next is issued.  Returns the
        stages consumed so far."""
        p, q = blk[0:2], blk[2:4]
        acc0.fill(0.0)
        acc1.fill(0.0)
        if cutlass.const_expr(fp8_overlap()):  # stage states from counts: no state rebound inside a branch
            self.issue_fp8(ring, tiled_mma, p, frags, ring_state(used, False))
            for k in range(1, steps, 2):  # stage k into q while p (k − 1) retires, then k + 1 into p
                self.issue_fp8(ring, tiled_mma, q, frags, ring_state(used + k, False))
                self.retire_fp8(ring, ring_state(used + k - 1, False), 1, acc0, acc1, p, sc, k - 1, groups)
                if k + 1 < steps:
                    self.issue_fp8(ring, tiled_mma, p, frags, ring_state(used + k + 1, False))
                    self.retire_fp8(ring, ring_state(used + k, False), 1, acc0, acc1, q, sc, k, groups)
                else:
                    self.retire_fp8(ring, ring_state(used + k, False), 0, acc0, acc1, q, sc, k, groups)
            if steps % 2 == 1:  # the last stage went into p
                self.retire_fp8(ring, ring_state(used + steps - 1, False), 0, acc0, acc1, p, sc, steps - 1, groups)
        else:
            for k in range(steps):
                self.issue_fp8(ring, tiled_mma, p, frags, ring_state(used + k, False))
                self.retire_fp8(ring, ring_state(used + k, False), 0, acc0, acc1, p, sc, k, groups)
        return used + steps

    @cute.jit
    def issue_fp8(self, ring, tiled_mma, sums, frags, read):
        """Wait for stage ``read``, then its WGMMAs into the block sums ``sums`` (gate / box 0, up / box 1),
        zeroed first: ACCUMULATE stays on (set once; a field set inside a branch is not threaded through it),
        and 0 + the first products is those products — a −0 sum becomes +0 in the promotion either way."""
        a0, a1, b, _ = frags
        sums[0].fill(0.0)
        sums[1].fill(0.0)
        ring.consumer_wait(read)
        cute.arch.fence_proxy("async.shared", space="cta")  # cp.async wrote the token rows (generic proxy)
        warpgroup.fence()  # the zeroed sums, and their last reads by a promotion, before the WGMMAs
        i = read.index
        for kb in cutlass.range_constexpr(cute.size(a0, mode=[2])):
            cute.gemm(tiled_mma, sums[0], a0[(None, None, kb, i)], b[(None, None, kb, i)], sums[0])
            cute.gemm(tiled_mma, sums[1], a1[(None, None, kb, i)], b[(None, None, kb, i)], sums[1])
        warpgroup.commit_group()

    @cute.jit
    def retire_fp8(self, ring, release, pending: cutlass.Constexpr, acc0, acc1, sums, sc, k, groups):
        """Wait until at most ``pending`` WGMMA groups are in flight (so the sums of K step ``k`` are
        complete), free its ring slot and promote its sums."""
        warpgroup.wait_group(pending)
        ring.consumer_release(release)
        self.promote(acc0, acc1, sums[0], sums[1], sc, k, groups)

    @cute.jit
    def issue(self, ring, tiled_mma, acc0, acc1, frags, read, half: cutlass.Constexpr):
        """Wait for stage ``read``, then its WGMMAs: 4 K blocks × (weight box 0 → acc0, box 1 → acc1); a
        half: 4 K blocks of box 0 × token ring 0, then 4 of box 1 × token ring 1, all into acc0 — the
        order in which the whole tile adds them up."""
        a0, a1, b, b2 = frags
        ring.consumer_wait(read)
        cute.arch.fence_proxy("async.shared", space="cta")  # cp.async wrote the token rows (generic proxy)
        i = read.index
        if cutlass.const_expr(half):
            for kb in cutlass.range_constexpr(cute.size(a0, mode=[2])):
                cute.gemm(tiled_mma, acc0, a0[(None, None, kb, i)], b[(None, None, kb, i)], acc0)
            for kb in cutlass.range_constexpr(cute.size(a1, mode=[2])):
                cute.gemm(tiled_mma, acc0, a1[(None, None, kb, i)], b2[(None, None, kb, i)], acc0)
        else:
            for kb in cutlass.range_constexpr(cute.size(a0, mode=[2])):
                cute.gemm(tiled_mma, acc0, a0[(None, None, kb, i)], b[(None, None, kb, i)], acc0)
                cute.gemm(tiled_mma, acc1, a1[(None, None, kb, i)], b[(None, None, kb, i)], acc1)
        warpgroup.commit_group()

    @cute.jit
    def combine(self, m_y, m_out, kt, tb, top_k, T, tidx):
        """C: thread (token t of the block, vector v of the k-tile): out[t] = Σ_j y[t·top_k + j], in order."""
        vecs = Y_TILE // VEC
        token = tb * TOKEN_BLOCK + tidx // vecs
        v = kt * vecs + tidx % vecs
        vy = cute.local_tile(m_y, (1, VEC), (None, None))
        vo = cute.local_tile(m_out, (1, VEC), (None, None))
        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        if token < T:
            acc.fill(0.0)
            for j in range(top_k):
                acc.store(acc.load() + vy[(0, None, token * top_k + j, v)].load().to(cutlass.Float32))
            vo[(0, None, token, v)].store(acc.load().to(BF16))

"""The producer warp of the one-launch decode kernel (:mod:`cute_moe.decode_kernel`, whose docstring tells a
task's life): it claims tasks from the ticket counter, hands each to the consumer warpgroup through the
task queue, and lands the task's operands in the ring — W1's or W2's boxes by TMA, the token rows (x, h;
FP8: their E4M3 rows xq, hq) by cp.async.  :class:`~cute_moe.decode_kernel.DecodeKernel` inherits it.

Where a task's token rows depend on other tasks (B on its leader's h; FP8's A on x quantized), the weights
do not: up to a ring's worth of weight boxes are on their way before the producer spins on the counter,
and the rows of those stages follow the wait."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

from moe_spec.hopper import WGMMA_M

from .decode_parts import (
    DONE1,
    DONEQ1,
    DONEQ2,
    QUEUE,
    ROW_PASS,
    TICKET,
    TOKENS,
    VECS,
    a_task,
    b_task,
    done1_target,
    ring_state,
    stages,
    warp_wait_at_least,
)
from .decode_trace import TRACE_CLAIM, TRACE_READY, globaltimer


class ProducerSteps:
    """The producer warp's steps (methods of :class:`~cute_moe.decode_kernel.DecodeKernel`)."""

    @cute.jit
    def producer(self, ring, queue, s_task, tables, tma, rows_src, s_w0, s_w1, s_xs, counters, bounds, sizes, trace):
        """Claim tasks, hand each to the consumers, land its operands in the ring (module docstring).
        ``rows_src``: (GEMM1's token rows, GEMM2's): (x, h) in bf16, (xq, hq) under FP8."""
        tma_w1, m_w1, tma_w2, m_w2 = tma
        m_x, m_h = rows_src
        _, _, s_order, s_start, s_count, s_lead, _, _ = tables
        s_exp = tables[0]
        a0, q0, b0, c0, end = bounds
        n_leaders, nt1, ntb, top_k, k1_steps, k2_steps, halves = sizes
        lane = cute.arch.lane_idx()
        one = cute.make_layout(1)
        tk = cute.size(s_w0, mode=[1])  # elements of K per stage
        g_w1 = cute.local_tile(m_w1, (WGMMA_M, tk), (None, None, None, None))  # (64, tk, I/64, K/tk, 2, E)
        g_w2 = cute.local_tile(m_w2, (WGMMA_M, tk), (None, None, None))  # (64, tk, K/64, I/tk, E)
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
            if cutlass.const_expr(self.trace):
                if lane == 0:
                    trace[(task, TRACE_CLAIM)] = globaltimer()
            self.hand_over(queue, tasks, s_task, task, lane)
            tasks.advance()
            if task < b0:
                if cutlass.const_expr(self.quant is None):
                    # A: per stage W1's gate and up boxes of a K step (a half: its rows' boxes of two K steps) and x
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
                elif (task >= a0) & (task < q0):  # FP8's A: W1's boxes first, then (after x's Q1) its E4M3 rows
                    r, n, _ = a_task(task - a0, nt1)
                    base, count = s_start[r], s_count[r]
                    e = s_exp[s_lead[r]]
                    w = (tma_w1, box1, d1_0, d1_1, e, n, None)
                    wait = (counters.iterator + DONEQ1, ntb)
                    group = (s_order, base, count, top_k)
                    issued = self.stream(ring, issued, k1_steps, w, wait, rows, m_x, group, True, (trace, task))
            elif task < c0:  # B: W2's two boxes first, then (after the wait) the chunk's h rows
                kt, r = b_task(task - b0, n_leaders)
                base, count = s_start[r], s_count[r]
                e = s_exp[s_lead[r]]
                w = (tma_w2, box2, d2_0, d2_1, e, 2 * kt, 2 * kt + 1)
                wait = (counters.iterator + DONE1 + r, done1_target(nt1, (count + TOKENS - 1) // TOKENS, halves))
                if cutlass.const_expr(self.quant is not None):
                    wait = (counters.iterator + DONEQ2 + r, 1)  # r's h quantized (Q2)
                group = (s_order, base, count, top_k)
                issued = self.stream(ring, issued, k2_steps, w, wait, rows, m_h, group, False, (trace, task))
            task = self.claim(counters, lane)
        self.hand_over(queue, tasks, s_task, task, lane)  # a number past the end: the consumers stop
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def stream(self, ring, issued, k_steps, w, wait, rows, src, group, by_token: cutlass.Constexpr, stamp):
        """A task whose token rows wait on a counter: every chunk's ``k_steps`` stages of two weight boxes and
        16 token rows of ``src`` (``by_token``: x's rows by the pairs' tokens).  The boxes of the first
        :data:`STAGES` stages go before the wait (``wait``: counter, target; lane 0 spins, then every lane's
        acquire), their rows after it.  ``w`` = (atom, boxes, ring dst 0, ring dst 1, expert, box, second
        box): W2's two 64-row boxes of a k-tile, or (second box None) W1's gate and up boxes of n-tile
        ``box``.  Returns the stages issued so far."""
        s_order, base, count, top_k = group
        steps = (count + TOKENS - 1) // TOKENS * k_steps
        early = cutlass.min(steps, stages())
        state = ring_state(issued, True)
        for s in range(early):  # the weights do not depend on the wait: on their way before it
            ring.producer_acquire(state)
            self.land_boxes(ring, state, w, s % k_steps)
            state.advance()
        warp_wait_at_least(wait[0], wait[1], cute.arch.lane_idx())
        if cutlass.const_expr(self.trace):  # ``stamp``: (trace, task)
            if cute.arch.lane_idx() == 0:
                stamp[0][(stamp[1], TRACE_READY)] = globaltimer()
        rows_state = ring_state(issued, True)
        for s in range(early):
            full = ring.producer_get_barrier(rows_state)
            rows.copy(src, s_order, base, s // k_steps, count, top_k, s % k_steps, rows_state.index, by_token)
            cute.arch.cp_async_mbarrier_arrive_noinc(full)
            rows_state.advance()
        for s in range(early, steps):
            ring.producer_acquire(state)
            self.land_boxes(ring, state, w, s % k_steps)
            full = ring.producer_get_barrier(state)
            rows.copy(src, s_order, base, s // k_steps, count, top_k, s % k_steps, state.index, by_token)
            cute.arch.cp_async_mbarrier_arrive_noinc(full)
            state.advance()
        return issued + steps

    @cute.jit
    def land_boxes(self, ring, state, w, k):
        """TMA of K step ``k``'s two weight boxes (``w``: :meth:`stream`'s) into ring stage ``state``."""
        atom, boxes, dst0, dst1, e, box, second = w
        full = ring.producer_get_barrier(state)
        if cutlass.const_expr(second is None):  # W1: the gate (0) and up (1) halves of n-tile ``box``
            cute.copy(atom, boxes[(None, box, k, 0, e)], dst0[(None, state.index)], tma_bar_ptr=full)
            cute.copy(atom, boxes[(None, box, k, 1, e)], dst1[(None, state.index)], tma_bar_ptr=full)
        else:
            cute.copy(atom, boxes[(None, box, k, e)], dst0[(None, state.index)], tma_bar_ptr=full)
            cute.copy(atom, boxes[(None, second, k, e)], dst1[(None, state.index)], tma_bar_ptr=full)

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


# ---- the producer's row copy --------------------------------------------------------------------------
@dataclass(frozen=True)
class RowCopy:
    """The producer warp's cp.async copy of a stage's token rows (x rows for GEMM1, h rows for GEMM2; FP8:
    their E4M3 rows) into the swizzled B ring: 16 rows × 8 vectors of 16 bytes (a 128-byte row: 64 bf16 or
    128 E4M3), lane ``l`` copies vector ``l % 8`` of rows ``l // 8 + 4i`` (i = 0 … 3), partitioned over the
    staged smem tensor so that the swizzle is the one the WGMMA descriptors read.  cp.async.cg: through L2
    only (h is written by other SMs in this launch)."""

    atom: object
    dst: object  # this lane's vectors of the token ring: (vector, pass, 1, stage)
    row: object
    vec: object
    width: int  # elements per 16-byte vector

    @classmethod
    def make(cls, s_rows: cute.Tensor, lane) -> "RowCopy":
        dtype = s_rows.element_type
        width = 128 // dtype.width
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(
            atom, cute.make_layout((ROW_PASS, VECS), stride=(VECS, 1)), cute.make_layout((1, width))
        )
        return cls(atom, tiled.get_slice(lane).partition_D(s_rows), lane // VECS, lane % VECS, width)

    @cute.jit
    def copy(self, src: cute.Tensor, s_order, base, chunk, count, top_k, k, slot, by_token: cutlass.Constexpr):
        """Rows ``chunk·16 + j`` (j < 16, below ``count``) of the group starting at ``order[base]``: pair
        q's row of ``src`` (``by_token``: token q // top_k's), K step ``k``, into ring slot ``slot``."""
        vsrc = cute.local_tile(src, (1, self.width), (None, None))  # (1, width, rows, K / width)
        for i in cutlass.range_constexpr(TOKENS // ROW_PASS):
            j = chunk * TOKENS + i * ROW_PASS + self.row
            if j < count:
                q = s_order[base + j]
                if cutlass.const_expr(by_token):
                    q = q // top_k
                cute.copy(self.atom, vsrc[(0, None, q, k * VECS + self.vec)], self.dst[(None, i, 0, slot)])

"""The consumer warpgroup's steps of the one-launch decode kernel (:mod:`cute_moe.decode_kernel`, whose
docstring tells a task's life): a chunk's main loop over the ring and its WGMMAs, the halves' exchange
(:data:`~cute_moe.decode_parts.HALF_TASKS`), the task queue's read, and the combine.
:class:`~cute_moe.decode_kernel.DecodeKernel` inherits them."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from .decode_parts import (
    CONSUMER_THREADS,
    EXCHANGE_VALUES,
    TOKEN_BLOCK,
    VEC,
    Y_TILE,
    consumer_sync,
    ring_state,
)

BF16 = cutlass.BFloat16


class ConsumerSteps:
    """The consumer warpgroup's steps (methods of :class:`~cute_moe.decode_kernel.DecodeKernel`)."""

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

"""Step 3 — a multi-stage ring: a producer warpgroup keeps the next K steps in flight while a
consumer warpgroup multiplies.

What is new: *warp specialization* and a *ring* of ``stages`` shared-memory slots. In step 2 the
loads and the WGMMAs took turns; now they overlap:

* warpgroup 0 is the **producer**: one of its lanes issues the TMA loads of K step ``k`` into slot
  ``k mod stages``, as soon as that slot is free;
* warpgroup 1 is the **consumer**: it waits until the slot is full, issues the WGMMAs, and hands
  the slot back once those WGMMAs have retired.

Two mbarriers per slot carry the protocol: ``full[s]`` (1 arrival — the producer's
``arrive.expect_tx`` — plus the bytes the TMA loads complete) and ``empty[s]`` (one arrival from
each of the 128 consumer threads). A barrier's phase flips each time it completes, so the *k*-th
use of a slot waits on the parity of its lap ``(k / stages) mod 2`` (:func:`ring_position`, the
function the kernel itself calls):

* the consumer waits ``full[s]`` with parity ``lap mod 2`` — 0 on the first lap: the phase the
  producer's first load completes;
* the producer waits ``empty[s]`` with parity ``(lap mod 2) XOR 1`` — 1 on the first lap. A wait
  names by its parity either the current phase or the one immediately before it, and only the
  current phase is incomplete (PTX ISA, "Phase of the mbarrier object"); a fresh barrier is in phase
  0, so parity 1 names the phase before it, complete: the first lap does not wait (CUTLASS starts
  its producer's phase at 1 for this), every later lap waits for the consumers' release of the lap
  before.

The consumer keeps one batch of WGMMAs in flight: after committing step k it waits with
``wait_group 1`` (step k−1's batch has retired) and only then releases step k−1's slot.
"""

from __future__ import annotations

import _common as course
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

BF16, F32 = cutlass.BFloat16, cutlass.Float32
STEP1 = course.load("01_wgmma")
TILE_K = 64


def ring_position(k, stages: int):
    """K step ``k`` → (slot, parity of its lap): the consumer waits ``full[slot]`` on the parity,
    the producer waits ``empty[slot]`` on ``parity ^ 1``. Plain arithmetic: it runs on Python
    integers (the exercises, the figures) and on the kernel's DSL integers alike."""
    return k % stages, (k // stages) % 2


# The ring's mbarriers live in one array: full[s] at ``bars + s``, empty[s] at ``bars + stages + s``.
# (Plain functions over the pointer, inlined where they are called: a Python object would not
# survive the DSL's run-time ``if``.)
def ring_init(bars, stages: int, consumers: int):
    """Run by one thread, followed by a CTA barrier (``fence.mbarrier_init`` publishes the counts)."""
    for s in range(stages):  # a plain Python loop: unrolled as the kernel is traced
        cute.arch.mbarrier_init(bars + s, 1)  # the producer's arrive.expect_tx
        cute.arch.mbarrier_init(bars + stages + s, consumers)  # one arrival per consumer thread
    cute.arch.mbarrier_init_fence()


def ring_acquire(bars, stages: int, stage_bytes: int, k):
    """Producer (one warp): wait until K step k's slot is free, announce its bytes; returns (slot, full)."""
    slot, parity = ring_position(k, stages)
    cute.arch.mbarrier_wait(bars + stages + slot, parity ^ 1)
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(bars + slot, stage_bytes)
    return slot, bars + slot


def ring_wait_full(bars, stages: int, k):
    """Consumer: wait until K step k's bytes have landed; returns its slot."""
    slot, parity = ring_position(k, stages)
    cute.arch.mbarrier_wait(bars + slot, parity)
    return slot


def ring_release(bars, stages: int, k):
    """Consumer (every thread): K step k's WGMMAs have retired, its slot may be refilled."""
    slot, _ = ring_position(k, stages)
    cute.arch.mbarrier_arrive(bars + stages + slot)


def smem_layouts(m: int, n: int, stages: int, dtype=BF16, tile_k: int = TILE_K):
    """The staged, swizzled A (m, tile_k, stages) and B (n, tile_k, stages) layouts and one stage's box of each."""
    a = sm90.make_smem_layout_a(STEP1.K_MAJOR, (m, n, tile_k), dtype, stages)
    b = sm90.make_smem_layout_b(STEP1.K_MAJOR, (m, n, tile_k), dtype, stages)
    return a, b, cute.select(a, mode=[0, 1]), cute.select(b, mode=[0, 1])


class RingGemm:
    """``c[M, N] = a[M, K] · b[N, K]ᵀ`` (fp32 out), tiles 64 × n, a ring of ``stages`` slots."""

    def __init__(self, n: int = 128, stages: int = 4):
        course.require(n % 8 == 0 and 8 <= n <= 256, f"n={n}: WGMMA's N is 8 … 256 in steps of 8")
        course.require(2 <= stages <= 8, f"stages={stages}: 2 … 8")
        self.n, self.stages = n, stages

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream):
        tiled_mma = STEP1.make_tiled_mma(self.n)
        sa, sb, box_a, box_b = smem_layouts(64, self.n, self.stages)
        tma_a, ma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, box_a, (64, TILE_K))
        tma_b, mb = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b, box_b, (self.n, TILE_K))
        self.stage_bytes = cute.size_in_bytes(BF16, box_a) + cute.size_in_bytes(BF16, box_b)
        grid = (cute.ceil_div(cute.size(c, mode=[0]), 64), cute.ceil_div(cute.size(c, mode=[1]), self.n), 1)
        self.kernel(tma_a, ma, tma_b, mb, c, tiled_mma, sa, sb).launch(grid=grid, block=[256, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        ma: cute.Tensor,
        tma_b: cute.CopyAtom,
        mb: cute.Tensor,
        c: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sa: cute.ComposedLayout,
        sb: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = SmemAllocator()
        bars = smem.allocate_array(cutlass.Int64, 2 * self.stages)  # full[stages], empty[stages]
        sA = smem.allocate_tensor(BF16, sa.outer, byte_alignment=1024, swizzle=sa.inner)  # (64, 64, stages)
        sB = smem.allocate_tensor(BF16, sb.outer, byte_alignment=1024, swizzle=sb.inner)  # (n, 64, stages)
        if tidx == 0:
            ring_init(bars, self.stages, 128)
        cute.arch.sync_threads()
        gA = cute.local_tile(ma, (64, TILE_K), (None, None))  # (64, 64, M blocks, K blocks)
        gB = cute.local_tile(mb, (self.n, TILE_K), (None, None))
        k_tiles = cute.size(gA, mode=[3])

        if warp == 0:  # ---- producer: one warp of warpgroup 0 ---------------------------------
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )  # (box, stages), (box, M blk, K blk)
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            for k in range(k_tiles):
                slot, full = ring_acquire(bars, self.stages, self.stage_bytes, k)
                cute.copy(tma_a, tAgA[None, bm, k], tAsA[None, slot], tma_bar_ptr=full)
                cute.copy(tma_b, tBgB[None, bn, k], tBsB[None, slot], tma_bar_ptr=full)

        if tidx >= 128:  # ---- consumer: warpgroup 1 -------------------------------------------
            thr_mma = tiled_mma.get_slice(tidx - 128)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # (MMA, 1, 4, stages)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            tCgC = thr_mma.partition_C(cute.local_tile(c, (64, self.n), (bm, bn)))
            acc = cute.make_rmem_tensor(tCgC.shape, F32)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            for k in range(k_tiles):
                slot = ring_wait_full(bars, self.stages, k)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    cute.gemm(tiled_mma, acc, tCrA[None, None, kb, slot], tCrB[None, None, kb, slot], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(1)  # step k in flight, step k − 1 retired …
                if k > 0:
                    ring_release(bars, self.stages, k - 1)  # … so its slot goes back to the producer
            warpgroup.wait_group(0)
            for r in cutlass.range_constexpr(cute.size(acc)):
                tCgC[r] = acc[r]


_compiled: dict = {}


def gemm(a, b, n: int = 128, stages: int = 4):
    """Host function: torch bf16 ``a [M, K]``, ``b [N, K]`` → fp32 ``c [M, N] = a · bᵀ``."""
    import torch

    course.require(a.dtype == b.dtype == torch.bfloat16, "a, b: bfloat16")
    course.require(a.shape[1] == b.shape[1] and a.shape[1] % TILE_K == 0, f"a, b: K equal, a multiple of {TILE_K}")
    course.require(a.shape[0] % 64 == 0 and b.shape[0] % n == 0, f"a: M a multiple of 64; b: N a multiple of {n}")
    c = torch.empty(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    args = [course.to_cute(t, leading_dim=1) for t in (a, b, c)] + [course.stream()]
    if (n, stages) not in _compiled:
        _compiled[n, stages] = cute.compile(RingGemm(n, stages), *args)
    _compiled[n, stages](*args)
    return c


def ptx(n: int = 128, stages: int = 4) -> str:
    fakes = (
        course.fake_matrix(BF16, 64, TILE_K),
        course.fake_matrix(BF16, n, TILE_K),
        course.fake_matrix(F32, 64, n),
        course.fake_stream(),
    )
    return course.compile_ptx(RingGemm(n, stages), *fakes)


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        a, b = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    course.bench_main("03 ring of 4 stages, 4096^3", lambda: gemm(a, b), 2 * 4096**3)

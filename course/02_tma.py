"""Step 2 — the operands brought by TMA, under an mbarrier: a whole GEMM ``C = A · Bᵀ``.

What is new: the *Tensor Memory Accelerator*. ``cp.async.bulk.tensor.2d.shared::cta.global``
copies a whole box (here 64 rows × 64 bf16 = 8 KB) from global into shared memory on its own. It
is not a warp-wide instruction: every thread that executes it starts a copy, so the DSL elects one
lane (``elect.sync``). That thread only names a *tensor map* (built on the host by
``make_tiled_tma_atom`` from the global tensor, the box and the swizzled shared layout — so the
bytes land exactly where step 1's descriptors expect them), the box's coordinates and an
**mbarrier**.

An mbarrier is a 64-bit object in shared memory with a *phase*, a pending *arrival count* and a
*transaction count* (tx-count). Here:

* one thread initialises it for 1 arrival (``mbarrier.init``: phase 0, tx-count 0), and
  ``fence.mbarrier_init`` (a release fence for that thread's inits) plus a CTA barrier make the
  initialisation visible before anyone arrives or waits;
* per K step one thread arrives with ``mbarrier.arrive.expect_tx`` (raising the tx-count by the
  stage's bytes) and issues the two TMA loads; when a load completes, it performs a *complete-tx*
  of the bytes it copied on the barrier, lowering the tx-count;
* the phase completes when the arrival count and the tx-count both reach zero, and everyone waits
  with ``mbarrier.try_wait.parity P``: P is the parity of the phase being waited for — 0 for the
  first load, 1 for the second, 0 again …, so here ``P = k mod 2``.

The kernel is still one warpgroup per 64 × n tile of C (a grid of tiles) with a single shared
buffer: after its WGMMAs have retired (``wait_group 0``) every thread meets at a CTA barrier
before the buffer is refilled, so memory and tensor cores take turns. Step 3 removes that wait.
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
TILE_K = 64  # one 128-byte swizzled row of bf16 per operand row: 4 WGMMAs of K = 16


class TmaGemm:
    """``c[M, N] = a[M, K] · b[N, K]ᵀ`` in fp32; tiles of 64 × n; K a multiple of 64."""

    def __init__(self, n: int = 128):
        course.require(n % 8 == 0 and 8 <= n <= 256, f"n={n}: WGMMA's N is 8 … 256 in steps of 8")
        self.n = n

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream):
        tile = (64, self.n, TILE_K)
        tiled_mma = STEP1.make_tiled_mma(self.n)
        sa_layout = sm90.make_smem_layout_a(STEP1.K_MAJOR, tile, BF16, 1)  # (64, 64, 1 stage)
        sb_layout = sm90.make_smem_layout_b(STEP1.K_MAJOR, tile, BF16, 1)
        # a tensor map per operand: global tensor + box (rows × 64) + the swizzled smem layout of one box
        # (cute.select keeps modes 0, 1: slice_ of a staged layout aborts for N = 24, 40, … — FINDINGS)
        box_a, box_b = cute.select(sa_layout, mode=[0, 1]), cute.select(sb_layout, mode=[0, 1])
        tma_a, ma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, box_a, (64, TILE_K))
        tma_b, mb = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b, box_b, (self.n, TILE_K))
        self.stage_bytes = cute.size_in_bytes(BF16, box_a) + cute.size_in_bytes(BF16, box_b)
        grid = (cute.ceil_div(cute.size(c, mode=[0]), 64), cute.ceil_div(cute.size(c, mode=[1]), self.n), 1)
        self.kernel(tma_a, ma, tma_b, mb, c, tiled_mma, sa_layout, sb_layout).launch(
            grid=grid, block=[128, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        ma: cute.Tensor,
        tma_b: cute.CopyAtom,
        mb: cute.Tensor,
        c: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sa_layout: cute.ComposedLayout,
        sb_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = SmemAllocator()
        bar = smem.allocate_array(cutlass.Int64, 1)  # the mbarrier (8 bytes of shared memory)
        sA = smem.allocate_tensor(BF16, sa_layout.outer, byte_alignment=1024, swizzle=sa_layout.inner)
        sB = smem.allocate_tensor(BF16, sb_layout.outer, byte_alignment=1024, swizzle=sb_layout.inner)
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)  # one arrival per phase: the expect_tx below
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # (64, 64, M blocks, K blocks) → TMA view: (box, M blocks, K blocks); smem (box, stage)
        gA = cute.local_tile(ma, (64, TILE_K), (None, None))
        gB = cute.local_tile(mb, (self.n, TILE_K), (None, None))
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # (MMA, 1, 4, 1): 4 K16 slices, 1 stage
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        gC = cute.local_tile(c, (64, self.n), (bm, bn))
        tCgC = thr_mma.partition_C(gC)  # this thread's (m, n) of the C tile, in register order
        acc = cute.make_rmem_tensor(tCgC.shape, F32)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        for k in range(cute.size(gA, mode=[3])):
            if warp == 0:
                with cute.arch.elect_one():  # one lane arrives and announces the bytes to come
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, self.stage_bytes)
                cute.copy(tma_a, tAgA[None, bm, k], tAsA[None, 0], tma_bar_ptr=bar)  # one elected lane issues
                cute.copy(tma_b, tBgB[None, bn, k], tBsB[None, 0], tma_bar_ptr=bar)
            cute.arch.mbarrier_wait(bar, k % 2)  # parity of the phase this load completes
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb, 0], tCrB[None, None, kb, 0], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # nobody reads the buffer any more: it may be refilled

        for r in cutlass.range_constexpr(cute.size(acc)):
            tCgC[r] = acc[r]


_compiled: dict = {}


def gemm(a, b, n: int = 128):
    """Host function: torch bf16 ``a [M, K]``, ``b [N, K]`` → fp32 ``c [M, N] = a · bᵀ``."""
    import torch

    course.require(a.dtype == b.dtype == torch.bfloat16, "a, b: bfloat16")
    course.require(a.shape[1] == b.shape[1] and a.shape[1] % TILE_K == 0, f"a, b: K equal, a multiple of {TILE_K}")
    course.require(a.shape[0] % 64 == 0 and b.shape[0] % n == 0, f"a: M a multiple of 64; b: N a multiple of {n}")
    c = torch.empty(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    args = [course.to_cute(t, leading_dim=1) for t in (a, b, c)] + [course.stream()]
    if n not in _compiled:
        _compiled[n] = cute.compile(TmaGemm(n), *args)
    _compiled[n](*args)
    return c


def ptx(n: int = 128) -> str:
    fakes = (
        course.fake_matrix(BF16, 64, TILE_K),
        course.fake_matrix(BF16, n, TILE_K),
        course.fake_matrix(F32, 64, n),
        course.fake_stream(),
    )
    return course.compile_ptx(TmaGemm(n), *fakes)


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        a, b = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    course.bench_main("02 TMA + mbarrier, 4096^3", lambda: gemm(a, b), 2 * 4096**3)

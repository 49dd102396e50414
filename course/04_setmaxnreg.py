"""Step 4 — warp specialization with ``setmaxnreg``: a lean producer, fat consumers.

What is new: the register file is shared out at run time. A CTA is launched with one register
count per thread for every warp (the compiler's count: at most 255, and at most 65,536 / threads
rounded down to a multiple of 8), but the two
roles need very different amounts: the producer only computes TMA coordinates, the consumers hold
the fp32 accumulator — ``tile_m · tile_n / (128 · consumer warpgroups)`` registers per thread,
128 for a 128 × 256 tile with two consumer warpgroups. ``setmaxnreg`` moves them (PTX ISA,
"setmaxnreg"):

* ``setmaxnreg.dec.sync.aligned.u32 40`` — the producer warpgroup releases its registers down to
  40 per thread into a per-CTA pool;
* ``setmaxnreg.inc.sync.aligned.u32 232`` — each consumer warpgroup requests 232 per thread and
  **blocks until the pool has them**; the registers it gains start undefined;
* the count is an immediate in 24 … 256, a multiple of 8, and every warp of a warpgroup executes
  the same ``setmaxnreg``;
* the kernel must carry a per-thread register limit known to the compiler (a compile option or a
  directive; the DSL writes ``.reqntid 384``), or ``setmaxnreg`` may have no effect. From it ptxas
  launches every thread at 168 registers and keeps both instructions (SASS ``USETMAXREG``): a CPU
  test reads that from the cubin the compile writes.

The ISA says only that the pool is per CTA. What a CTA can hand around is what it was launched
with, R registers per thread × its threads, and CUTLASS budgets its splits that way. Here the inc
must fit ``40 · 128 + 232 · 256 = 64,512 ≤ R · 384``, so R ≥ 168 — the most 384 threads can have
(65,536 / 384 = 170.7, rounded down to a multiple of 8): the split takes the whole launch allocation.
:func:`register_budget` is that arithmetic; the exercises budget other splits with it.

The tile also doubles: two consumer warpgroups stack along M (the tiled MMA's atom layout
(2, 1, 1)), 128 × n per CTA, and the *empty* barrier now waits for 256 consumer arrivals.
"""

from __future__ import annotations

import _common as course
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

BF16, F32 = cutlass.BFloat16, cutlass.Float32
STEP3 = course.load("03_ring")
ring_init, ring_acquire, ring_wait_full, ring_release = (
    STEP3.ring_init,
    STEP3.ring_acquire,
    STEP3.ring_wait_full,
    STEP3.ring_release,
)
TILE_K = STEP3.TILE_K
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232
REGISTER_FILE = 65536  # 32-bit registers per SM (CUDA C++ Programming Guide, compute capability 9.0)


def register_budget(producer: int, consumer: int, consumer_warpgroups: int, launch: int | None = None) -> dict:
    """Does a setmaxnreg split fit? The pool is the launch count × threads; returns the numbers.

    ``launch``: registers per thread at launch (default: the most the CTA's threads can have)."""
    for name, v in (("producer", producer), ("consumer", consumer)):
        course.require(24 <= v <= 256 and v % 8 == 0, f"{name}={v}: setmaxnreg takes 24 … 256, a multiple of 8")
    threads = 128 * (1 + consumer_warpgroups)
    launch = launch if launch is not None else REGISTER_FILE // threads // 8 * 8
    pool, after = launch * threads, producer * 128 + consumer * 128 * consumer_warpgroups
    return {"threads": threads, "launch": launch, "pool": pool, "after": after, "fits": after <= pool}


class SpecializedGemm:
    """``c[M, N] = a[M, K] · b[N, K]ᵀ`` (fp32 out), tiles 128 × n: a producer and two consumer warpgroups."""

    def __init__(self, n: int = 128, stages: int = 4):
        course.require(n % 8 == 0 and 8 <= n <= 256, f"n={n}: WGMMA's N is 8 … 256 in steps of 8")
        course.require(2 <= stages <= 8, f"stages={stages}: 2 … 8")
        self.n, self.stages = n, stages

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream):
        k_major = STEP3.STEP1.K_MAJOR.sm90_mma_major_mode()
        tiled_mma = sm90.make_trivial_tiled_mma(BF16, BF16, k_major, k_major, F32, (2, 1, 1), tiler_mn=(64, self.n))
        sa, sb, box_a, box_b = STEP3.smem_layouts(128, self.n, self.stages)
        tma_a, ma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, box_a, (128, TILE_K))
        tma_b, mb = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b, box_b, (self.n, TILE_K))
        self.stage_bytes = cute.size_in_bytes(BF16, box_a) + cute.size_in_bytes(BF16, box_b)
        grid = (cute.ceil_div(cute.size(c, mode=[0]), 128), cute.ceil_div(cute.size(c, mode=[1]), self.n), 1)
        self.kernel(tma_a, ma, tma_b, mb, c, tiled_mma, sa, sb).launch(grid=grid, block=[384, 1, 1], stream=stream)

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
        sA = smem.allocate_tensor(BF16, sa.outer, byte_alignment=1024, swizzle=sa.inner)  # (128, 64, stages)
        sB = smem.allocate_tensor(BF16, sb.outer, byte_alignment=1024, swizzle=sb.inner)  # (n, 64, stages)
        if tidx == 0:
            ring_init(bars, self.stages, 256)
        cute.arch.sync_threads()
        gA = cute.local_tile(ma, (128, TILE_K), (None, None))  # (128, 64, M blocks, K blocks)
        gB = cute.local_tile(mb, (self.n, TILE_K), (None, None))
        k_tiles = cute.size(gA, mode=[3])

        if tidx < 128:  # ---- producer warpgroup: gives its registers back ----------------------
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
        if warp == 0:  # one warp issues the loads
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

        if tidx >= 128:  # ---- consumer warpgroups 1, 2: take the registers ---------------------
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma = tiled_mma.get_slice(tidx - 128)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # (MMA, 1, 4, stages)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            tCgC = thr_mma.partition_C(cute.local_tile(c, (128, self.n), (bm, bn)))
            acc = cute.make_rmem_tensor(tCgC.shape, F32)  # 128·n / 256 fp32 registers
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


def gemm(a, b, n: int = 256, stages: int = 4):
    """Host function: torch bf16 ``a [M, K]``, ``b [N, K]`` → fp32 ``c [M, N] = a · bᵀ``."""
    import torch

    course.require(a.dtype == b.dtype == torch.bfloat16, "a, b: bfloat16")
    course.require(a.shape[1] == b.shape[1] and a.shape[1] % TILE_K == 0, f"a, b: K equal, a multiple of {TILE_K}")
    course.require(a.shape[0] % 128 == 0 and b.shape[0] % n == 0, f"a: M a multiple of 128; b: N a multiple of {n}")
    c = torch.empty(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    args = [course.to_cute(t, leading_dim=1) for t in (a, b, c)] + [course.stream()]
    if (n, stages) not in _compiled:
        _compiled[n, stages] = cute.compile(SpecializedGemm(n, stages), *args)
    _compiled[n, stages](*args)
    return c


def ptx(n: int = 256, stages: int = 4) -> str:
    fakes = (
        course.fake_matrix(BF16, 128, TILE_K),
        course.fake_matrix(BF16, n, TILE_K),
        course.fake_matrix(F32, 128, n),
        course.fake_stream(),
    )
    return course.compile_ptx(SpecializedGemm(n, stages), *fakes)


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        a, b = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    course.bench_main("04 setmaxnreg, 128 x 256 tiles, 4096^3", lambda: gemm(a, b), 2 * 4096**3)

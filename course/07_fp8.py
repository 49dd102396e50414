"""Step 7 — FP8 E4M3 operands, and the two-level accumulation that keeps long K sums accurate.

What is new: ``wgmma.mma_async … m64nNk32.f32.e4m3.e4m3``. An 8-bit element is one byte, so one
instruction takes K = 32 (the same 32 bytes of each operand row as bf16's K = 16), and a ring
stage of 128-byte rows now holds 128 of K: ``tile_k = 128``, four WGMMAs per stage. Both operands
must be K-major — FP8 WGMMA has no transposed form (the DSL's ``MmaF8Op`` refuses MN-major) —
which the MoE operands already are, swapped or not (step 6).

Why two levels: the PTX ISA promises only that an ``.f32`` accumulator sums "with at least single
precision", in an unspecified order and rounding; DeepSeek-V3 (§3.3.2) measured that FP8 WGMMA on
the H800 keeps only about 14 bits of the running sum, so a sum over thousands of K elements drifts.
That is a measurement, not an ISA statement, and the remedy is built for it (DeepSeek-V3, DeepGEMM,
CUTLASS's ``fp8_2xacc``):

* each K stage accumulates into a fresh **block accumulator** ``blk`` (the first WGMMA of the
  stage runs with scale-d = 0: D = A·B, no zeroing needed);
* after the stage, ``wait_group 0`` — the block's sum is complete — and the CUDA cores *promote*
  it: ``acc += blk`` with ordinary ``add.f32``, one per register, at full fp32 precision.

The price is visible in the loop: no WGMMA of this warpgroup is in flight while it adds (step 3
kept one batch in flight with ``wait_group 1``), and ``blk`` doubles the accumulator registers.
The epilogue multiplies by the product of the two per-tensor scales (a device scalar).
"""

from __future__ import annotations

import _common as course
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

E4M3, F32 = cutlass.Float8E4M3FN, cutlass.Float32
STEP3 = course.load("03_ring")
STEP4 = course.load("04_setmaxnreg")
TILE_K = 128  # one 128-byte swizzled row of E4M3: four WGMMAs of K = 32


class Fp8Gemm:
    """``c[M, N] = (a[M, K] · b[N, K]ᵀ) · scale[0]`` with E4M3 a, b; fp32 c; tiles 128 × n."""

    def __init__(self, n: int = 128, stages: int = 4):
        course.require(n % 8 == 0 and 8 <= n <= 128, f"n={n}: 8 … 128 (two accumulators must fit the registers)")
        course.require(2 <= stages <= 8, f"stages={stages}: 2 … 8")
        self.n, self.stages = n, stages

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, scale: cute.Tensor, stream):
        k_major = STEP3.STEP1.K_MAJOR.sm90_mma_major_mode()
        tiled_mma = sm90.make_trivial_tiled_mma(E4M3, E4M3, k_major, k_major, F32, (2, 1, 1), tiler_mn=(64, self.n))
        sa, sb, box_a, box_b = STEP3.smem_layouts(128, self.n, self.stages, E4M3, TILE_K)
        tma_a, ma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, box_a, (128, TILE_K))
        tma_b, mb = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b, box_b, (self.n, TILE_K))
        self.stage_bytes = cute.size_in_bytes(E4M3, box_a) + cute.size_in_bytes(E4M3, box_b)
        grid = (cute.ceil_div(cute.size(c, mode=[0]), 128), cute.ceil_div(cute.size(c, mode=[1]), self.n), 1)
        self.kernel(tma_a, ma, tma_b, mb, c, scale, tiled_mma, sa, sb).launch(
            grid=grid, block=[384, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        ma: cute.Tensor,
        tma_b: cute.CopyAtom,
        mb: cute.Tensor,
        c: cute.Tensor,
        scale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sa: cute.ComposedLayout,
        sb: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = SmemAllocator()
        bars = smem.allocate_array(cutlass.Int64, 2 * self.stages)
        sA = smem.allocate_tensor(E4M3, sa.outer, byte_alignment=1024, swizzle=sa.inner)  # (128, 128, stages)
        sB = smem.allocate_tensor(E4M3, sb.outer, byte_alignment=1024, swizzle=sb.inner)  # (n, 128, stages)
        if tidx == 0:
            STEP3.ring_init(bars, self.stages, 256)
        cute.arch.sync_threads()
        gA = cute.local_tile(ma, (128, TILE_K), (None, None))
        gB = cute.local_tile(mb, (self.n, TILE_K), (None, None))
        k_tiles = cute.size(gA, mode=[3])

        if tidx < 128:
            cute.arch.setmaxregister_decrease(STEP4.PRODUCER_REGISTERS)
        if warp == 0:  # the producer is step 4's, with 1-byte elements
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            for k in range(k_tiles):
                slot, full = STEP3.ring_acquire(bars, self.stages, self.stage_bytes, k)
                cute.copy(tma_a, tAgA[None, bm, k], tAsA[None, slot], tma_bar_ptr=full)
                cute.copy(tma_b, tBgB[None, bn, k], tBsB[None, slot], tma_bar_ptr=full)

        if tidx >= 128:
            cute.arch.setmaxregister_increase(STEP4.CONSUMER_REGISTERS)
            thr_mma = tiled_mma.get_slice(tidx - 128)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # (MMA, 1, 4, stages): 4 K32 slices
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            tCgC = thr_mma.partition_C(cute.local_tile(c, (128, self.n), (bm, bn)))
            acc = cute.make_rmem_tensor(tCgC.shape, F32)  # level 2: the true fp32 sum
            blk = cute.make_rmem_tensor(tCgC.shape, F32)  # level 1: one K stage on the tensor core
            acc.fill(0.0)
            for k in range(k_tiles):
                slot = STEP3.ring_wait_full(bars, self.stages, k)
                warpgroup.fence()  # blk was read by the previous promotion
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)  # the stage's first WGMMA: blk = A·B
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    cute.gemm(tiled_mma, blk, tCrA[None, None, kb, slot], tCrB[None, None, kb, slot], blk)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)  # blk complete: the slot is free and the sum can be read
                STEP3.ring_release(bars, self.stages, k)
                for r in cutlass.range_constexpr(cute.size(acc)):
                    acc[r] = acc[r] + blk[r]  # the promotion: fp32 adds on the CUDA cores
            s = scale[0]
            for r in cutlass.range_constexpr(cute.size(acc)):
                tCgC[r] = acc[r] * s


_compiled: dict = {}


def gemm(a, b, scale_a: float = 1.0, scale_b: float = 1.0, n: int = 128, stages: int = 4):
    """Host function: torch E4M3 ``a [M, K]``, ``b [N, K]`` and their per-tensor scales →
    fp32 ``c = (a · bᵀ) · scale_a · scale_b``."""
    import torch

    course.require(a.dtype == b.dtype == torch.float8_e4m3fn, "a, b: float8_e4m3fn")
    course.require(a.shape[1] == b.shape[1] and a.shape[1] % TILE_K == 0, f"a, b: K equal, a multiple of {TILE_K}")
    course.require(a.shape[0] % 128 == 0 and b.shape[0] % n == 0, f"a: M a multiple of 128; b: N a multiple of {n}")
    c = torch.empty(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    scale = torch.tensor([scale_a], dtype=torch.float32, device=a.device) * scale_b
    args = [course.to_cute(t, leading_dim=1) for t in (a, b, c)] + [course.to_cute(scale, 0), course.stream()]
    if (n, stages) not in _compiled:
        _compiled[n, stages] = cute.compile(Fp8Gemm(n, stages), *args)
    _compiled[n, stages](*args)
    return c


def ptx(n: int = 128, stages: int = 4) -> str:
    from cutlass.cute.runtime import make_fake_compact_tensor

    scale = make_fake_compact_tensor(F32, (cute.sym_int(),), assumed_align=4)
    fakes = (
        course.fake_matrix(E4M3, 128, TILE_K),
        course.fake_matrix(E4M3, n, TILE_K),
        course.fake_matrix(F32, 128, n),
        scale,
        course.fake_stream(),
    )
    return course.compile_ptx(Fp8Gemm(n, stages), *fakes)


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        a, b = (torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    course.bench_main("07 FP8 two-level, 4096^3", lambda: gemm(a, b), 2 * 4096**3)

"""Step 5 — a persistent kernel: one CTA per SM walks many tiles, in a rasterized order.

What is new: the grid no longer has one CTA per output tile. It has one CTA per SM (132 on an
H200), and CTA ``c`` takes tiles ``c, c + grid, c + 2·grid, …`` until the tile count runs out —
a *static persistent tile scheduler*. Two things follow:

* **The ring runs on across tiles.** Producer and consumers count K steps over the CTA's whole
  life (``step = tiles done · k_tiles + k``), so slot and parity come from :func:`ring_position`
  of that running count, and the producer starts loading tile i+1 while the consumers are still
  storing tile i. The consumers must now release *every* slot, the last one of a tile included.
* **The order of tiles matters.** The CTAs resident at one moment work on consecutive tile ids;
  if those walked along a whole row of N blocks, every CTA would need a different B block and the
  same few A blocks. :func:`tile_coordinates` *rasterizes*: ids walk ``group`` M blocks (fastest),
  then the next N block, one group of M blocks at a time — so the tiles in flight together share
  a few A blocks and a few B blocks, re-read from L2 instead of HBM. Producer and consumers call
  the same function and so agree on every tile.

The tile count is read from the tensors at run time (their extents are dynamic), so one compiled
kernel serves every M, N and K with the right divisibility.
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
STEP4 = course.load("04_setmaxnreg")
TILE_K, PRODUCER_REGISTERS, CONSUMER_REGISTERS = STEP3.TILE_K, STEP4.PRODUCER_REGISTERS, STEP4.CONSUMER_REGISTERS
H200_SMS = 132


def tile_coordinates(tile, m_blocks, n_blocks, group: int):
    """Rasterization: tile id → (M block, N block). Ids walk ``group`` M blocks first, then the next
    N block; the last group may be shorter. Runs on Python and on the kernel's DSL integers."""
    span = group * n_blocks  # tiles of one group of M blocks
    first = (tile // span) * group
    size = cutlass.min(m_blocks - first, group)
    inside = tile % span
    return first + inside % size, inside // size


def cta_tiles(cta: int, grid: int, m_blocks: int, n_blocks: int, group: int) -> list[tuple[int, int]]:
    """The (M block, N block) tiles CTA ``cta`` computes, in order (the figures and exercises)."""
    return [tile_coordinates(t, m_blocks, n_blocks, group) for t in range(cta, m_blocks * n_blocks, grid)]


class PersistentGemm:
    """``c[M, N] = a[M, K] · b[N, K]ᵀ`` (fp32 out), tiles 128 × n, ``ctas`` persistent CTAs."""

    def __init__(self, n: int = 128, stages: int = 4, ctas: int = H200_SMS, group: int = 8):
        course.require(n % 8 == 0 and 8 <= n <= 256, f"n={n}: WGMMA's N is 8 … 256 in steps of 8")
        course.require(2 <= stages <= 8, f"stages={stages}: 2 … 8")
        course.require(ctas >= 1 and group >= 1, f"ctas={ctas}, group={group}: at least 1")
        self.n, self.stages, self.ctas, self.group = n, stages, ctas, group

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream):
        k_major = STEP3.STEP1.K_MAJOR.sm90_mma_major_mode()
        tiled_mma = sm90.make_trivial_tiled_mma(BF16, BF16, k_major, k_major, F32, (2, 1, 1), tiler_mn=(64, self.n))
        sa, sb, box_a, box_b = STEP3.smem_layouts(128, self.n, self.stages)
        tma_a, ma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, box_a, (128, TILE_K))
        tma_b, mb = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b, box_b, (self.n, TILE_K))
        self.stage_bytes = cute.size_in_bytes(BF16, box_a) + cute.size_in_bytes(BF16, box_b)
        self.kernel(tma_a, ma, tma_b, mb, c, tiled_mma, sa, sb).launch(
            grid=[self.ctas, 1, 1], block=[384, 1, 1], stream=stream
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
        sa: cute.ComposedLayout,
        sb: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
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
        m_blocks, n_blocks = cute.size(gA, mode=[2]), cute.size(gB, mode=[2])
        num_tiles = m_blocks * n_blocks

        if tidx < 128:  # ---- producer warpgroup: gives its registers back ----------------------
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
        if warp == 0:  # one warp issues the loads
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )  # (box, stages), (box, M blk, K blk)
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            step = cutlass.Int32(0)  # K steps over the CTA's life: the ring's position
            for tile in range(cta, num_tiles, self.ctas):
                bm, bn = tile_coordinates(tile, m_blocks, n_blocks, self.group)
                for k in range(k_tiles):
                    slot, full = ring_acquire(bars, self.stages, self.stage_bytes, step)
                    cute.copy(tma_a, tAgA[None, bm, k], tAsA[None, slot], tma_bar_ptr=full)
                    cute.copy(tma_b, tBgB[None, bn, k], tBsB[None, slot], tma_bar_ptr=full)
                    step += 1

        if tidx >= 128:  # ---- consumer warpgroups 1, 2: take the registers ---------------------
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma = tiled_mma.get_slice(tidx - 128)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # (MMA, 1, 4, stages)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            gC = cute.local_tile(c, (128, self.n), (None, None))  # (128, n, M blocks, N blocks)
            acc = cute.make_rmem_tensor(thr_mma.partition_C(gC[None, None, 0, 0]).shape, F32)  # 128·n/256 fp32
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            step = cutlass.Int32(0)
            for tile in range(cta, num_tiles, self.ctas):
                bm, bn = tile_coordinates(tile, m_blocks, n_blocks, self.group)
                acc.fill(0.0)
                for k in range(k_tiles):
                    slot = ring_wait_full(bars, self.stages, step + k)
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                        cute.gemm(tiled_mma, acc, tCrA[None, None, kb, slot], tCrB[None, None, kb, slot], acc)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)  # step k in flight, step k − 1 retired …
                    if k > 0:
                        ring_release(bars, self.stages, step + k - 1)  # … so its slot goes back
                warpgroup.wait_group(0)
                ring_release(bars, self.stages, step + k_tiles - 1)  # the tile's last slot too
                step += k_tiles
                # the epilogue: the producer is already loading the next tile meanwhile
                self.store_tile(acc, thr_mma, gC[None, None, bm, bn], bm, bn, c)

    @cute.jit
    def store_tile(self, acc: cute.Tensor, thr_mma: cute.ThrMma, gC_tile: cute.Tensor, bm, bn, c: cute.Tensor):
        """Registers → global memory, each register to its (m, n) of the tile (step 6 adds bounds)."""
        tCgC = thr_mma.partition_C(gC_tile)
        for r in cutlass.range_constexpr(cute.size(acc)):
            tCgC[r] = acc[r]


_compiled: dict = {}


def gemm(a, b, n: int = 256, stages: int = 4, ctas: int | None = None, group: int = 8):
    """Host function: torch bf16 ``a [M, K]``, ``b [N, K]`` → fp32 ``c [M, N] = a · bᵀ``."""
    import torch

    course.require(a.dtype == b.dtype == torch.bfloat16, "a, b: bfloat16")
    course.require(a.shape[1] == b.shape[1] and a.shape[1] % TILE_K == 0, f"a, b: K equal, a multiple of {TILE_K}")
    course.require(a.shape[0] % 128 == 0 and b.shape[0] % n == 0, f"a: M a multiple of 128; b: N a multiple of {n}")
    c = torch.empty(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    args = [course.to_cute(t, leading_dim=1) for t in (a, b, c)] + [course.stream()]
    ctas = ctas or torch.cuda.get_device_properties(a.device).multi_processor_count
    key = (n, stages, ctas, group)
    if key not in _compiled:
        _compiled[key] = cute.compile(PersistentGemm(n, stages, ctas, group), *args)
    _compiled[key](*args)
    return c


def ptx(n: int = 256, stages: int = 4, ctas: int = H200_SMS, group: int = 8) -> str:
    fakes = (
        course.fake_matrix(BF16, 128, TILE_K),
        course.fake_matrix(BF16, n, TILE_K),
        course.fake_matrix(F32, 128, n),
        course.fake_stream(),
    )
    return course.compile_ptx(PersistentGemm(n, stages, ctas, group), *fakes)


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        a, b = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    course.bench_main("05 persistent, rasterized, 4096^3", lambda: gemm(a, b), 2 * 4096**3)

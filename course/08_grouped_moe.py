"""Step 8 — grouped by expert: one persistent launch computes every expert's GEMM (the MoE GEMM).

What is new: the B operand changes from tile to tile. A mixture-of-experts layer multiplies each
token by the weights of the expert its router chose. Sort the tokens by expert and pad every
expert's run of rows to a multiple of the 128-row tile (:func:`sort_by_expert`): then every
*token block* of 128 rows belongs to exactly one expert, ``block_expert[b]``, and the grouped GEMM
is step 5's persistent GEMM with one change in the producer:

* the weights ``w [E, N, K]`` are handed to TMA as one 3-D tensor (N, K, E), and the expert is
  simply its third coordinate, read from device memory when a tile starts: no per-expert
  descriptors, and nothing about the routing is compiled in;
* the number of token blocks is device data too (``num_blocks[0]``), so a new batch with other
  group sizes runs the same compiled kernel — no recompilation, no host synchronisation.

The consumers do not know about experts at all: they multiply whatever the ring holds.

From here to the production kernel (``cute_moe/gemm.py``: one tile's life in ``GroupedGemm._body``;
``cute_moe/gemm_parts.py`` the functions it calls; ``cute_moe/gemm_plan.py`` the compile-time
layouts): swap-AB for small groups (step 6, chosen per GEMM by the layer's plan, ``cute_moe/plan.py``),
FP8 formats with per-tensor, per-channel and block scales (128 × 128 weight blocks, 1 × 128 token
groups) promoted as in step 7 (``cute_moe/fp8_gemm.py``), an epilogue through ``stmatrix`` and a
ring of TMA stores instead of register stores, the routing weight and SiLU·up fused into the
epilogue, token rows gathered by index instead of pre-sorted, ping-pong consumers (one warpgroup's
epilogue under the other's MMAs) and clusters of two CTAs sharing a weight tile by TMA multicast —
the last three drawn in notes/figures/course/ (store_ring, pingpong, cluster_multicast). The
sorting and padding run on the GPU (``moe_spec/align.py``, ``cute_moe/alignops.py``).
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
STEP5 = course.load("05_persistent")
tile_coordinates, H200_SMS = STEP5.tile_coordinates, STEP5.H200_SMS
TILE_K, PRODUCER_REGISTERS, CONSUMER_REGISTERS = STEP3.TILE_K, STEP4.PRODUCER_REGISTERS, STEP4.CONSUMER_REGISTERS


TILE_M = 128  # token rows per block: every expert's run of rows is padded to a multiple


def sort_by_expert(expert_of_token, experts: int):
    """Host bookkeeping (torch): the row of each token in the sorted, padded order, each token block's
    expert and the number of blocks. Returns (row_of_token [T], block_expert [blocks], blocks)."""
    import torch

    counts = torch.bincount(expert_of_token, minlength=experts)
    padded = (counts + TILE_M - 1) // TILE_M * TILE_M
    start = torch.cumsum(padded, 0) - padded  # first row of every expert's run
    order = torch.argsort(expert_of_token, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)  # position among all sorted tokens
    first_of_expert = torch.cumsum(counts, 0) - counts
    row_of_token = start[expert_of_token] + rank - first_of_expert[expert_of_token]
    block_expert = torch.repeat_interleave(torch.arange(experts, device=counts.device), padded // TILE_M)
    return row_of_token, block_expert.to(torch.int32), int(padded.sum()) // TILE_M


class GroupedGemm(STEP5.PersistentGemm):
    """``c[rows of block b] = x[rows of block b] · w[block_expert[b]]ᵀ`` for b < num_blocks[0] (fp32 c);
    step 5's arguments (n, stages, ctas, group) and epilogue (``store_tile``)."""

    @cute.jit
    def __call__(
        self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, block_expert: cute.Tensor, num_blocks: cute.Tensor, stream
    ):
        k_major = STEP3.STEP1.K_MAJOR.sm90_mma_major_mode()
        tiled_mma = sm90.make_trivial_tiled_mma(BF16, BF16, k_major, k_major, F32, (2, 1, 1), tiler_mn=(64, self.n))
        sa, sb, box_a, box_b = STEP3.smem_layouts(128, self.n, self.stages)
        tma_a, ma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, box_a, (128, TILE_K))
        tma_b, mb = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b, box_b, (self.n, TILE_K))
        self.stage_bytes = cute.size_in_bytes(BF16, box_a) + cute.size_in_bytes(BF16, box_b)
        self.kernel(tma_a, ma, tma_b, mb, c, block_expert, num_blocks, tiled_mma, sa, sb).launch(
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
        block_expert: cute.Tensor,
        num_blocks: cute.Tensor,
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
        gB = cute.local_tile(mb, (self.n, TILE_K), (None, None, None))  # (n, 64, N blocks, K blocks, experts)
        k_tiles = cute.size(gA, mode=[3])
        m_blocks, n_blocks = num_blocks[0], cute.size(gB, mode=[2])  # token blocks: device data
        num_tiles = m_blocks * n_blocks

        if tidx < 128:  # ---- producer warpgroup: gives its registers back ----------------------
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
        if warp == 0:  # one warp issues the loads
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )  # (box, stages), (box, token blk, K blk)
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            step = cutlass.Int32(0)  # K steps over the CTA's life: the ring's position
            for tile in range(cta, num_tiles, self.ctas):
                bm, bn = tile_coordinates(tile, m_blocks, n_blocks, self.group)
                expert = block_expert[bm]  # the one new line: the weights' third TMA coordinate
                for k in range(k_tiles):
                    slot, full = ring_acquire(bars, self.stages, self.stage_bytes, step)
                    cute.copy(tma_a, tAgA[None, bm, k], tAsA[None, slot], tma_bar_ptr=full)
                    cute.copy(tma_b, tBgB[None, bn, k, expert], tBsB[None, slot], tma_bar_ptr=full)
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


_compiled: dict = {}


def moe_gemm(x, w, expert_of_token, n: int = 256, stages: int = 4, ctas: int | None = None):
    """Host function: torch bf16 ``x [T, K]``, ``w [E, N, K]``, int ``expert_of_token [T]`` →
    fp32 ``y [T, N]``, ``y[t] = x[t] · w[expert_of_token[t]]ᵀ`` (one expert per token, for brevity)."""
    import torch

    course.require(x.dtype == w.dtype == torch.bfloat16, "x, w: bfloat16")
    course.require(
        w.dim() == 3 and x.shape[1] == w.shape[2] and x.shape[1] % TILE_K == 0,
        f"x [T, K], w [E, N, K]: K equal, a multiple of {TILE_K}",
    )
    course.require(w.shape[1] % n == 0, f"w: N a multiple of {n}, got {w.shape[1]}")
    course.require(expert_of_token.shape == (x.shape[0],), "expert_of_token: one expert per token")
    row_of_token, block_expert, blocks = sort_by_expert(expert_of_token, w.shape[0])
    xs = torch.zeros(blocks * TILE_M, x.shape[1], dtype=x.dtype, device=x.device)
    xs[row_of_token] = x
    c = torch.empty(blocks * TILE_M, w.shape[1], dtype=torch.float32, device=x.device)
    num_blocks = torch.tensor([blocks], dtype=torch.int32, device=x.device)
    args = [
        course.to_cute(xs, 1),
        course.to_cute(w.permute(1, 2, 0), 1),
        course.to_cute(c, 1),
        course.to_cute(block_expert, 0),
        course.to_cute(num_blocks, 0),
        course.stream(),
    ]
    ctas = ctas or torch.cuda.get_device_properties(x.device).multi_processor_count
    key = (n, stages, ctas)
    if key not in _compiled:
        _compiled[key] = cute.compile(GroupedGemm(n, stages, ctas), *args)
    _compiled[key](*args)
    return c[row_of_token]


def ptx(n: int = 256, stages: int = 4, ctas: int = H200_SMS) -> str:
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    k = cute.sym_int(divisibility=TILE_K)
    w = make_fake_tensor(
        BF16,
        (cute.sym_int(divisibility=n), k, cute.sym_int()),
        stride=(cute.sym_int64(divisibility=TILE_K), 1, cute.sym_int64(divisibility=TILE_K)),
        assumed_align=16,
    )  # w [E, N, K] seen as (N, K, E)
    vector = [make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4) for _ in range(2)]
    fakes = (
        course.fake_matrix(BF16, TILE_M, TILE_K),
        w,
        course.fake_matrix(F32, TILE_M, n),
        *vector,
        course.fake_stream(),
    )
    return course.compile_ptx(GroupedGemm(n, stages, ctas), *fakes)


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        x, w = torch.randn(4096, 4096, device="cuda").bfloat16(), torch.randn(8, 4096, 4096, device="cuda").bfloat16()
        experts = torch.randint(0, 8, (4096,), device="cuda")
    course.bench_main(
        "08 grouped by expert, 4096 tokens x 8 experts x 4096 x 4096", lambda: moe_gemm(x, w, experts), 2 * 4096**3
    )

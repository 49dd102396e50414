"""What a :class:`~cute_moe.config.GemmConfig` becomes at compile time: the tiled MMA, the
shared-memory layouts of the rings and of the epilogue, and the bytes of one ring stage.

:class:`KernelPlan` is built inside a jit context (``GroupedGemm.__call__`` in ``gemm.py`` compiles
the kernel from it; ``layouts.describe`` reads the same objects back as plain data).
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from .config import GemmConfig  # noqa: E402

DSL_DTYPES = {"bfloat16": cutlass.BFloat16, "float8_e4m3fn": cutlass.Float8E4M3FN, "float32": cutlass.Float32}
"""GemmConfig's dtype names → the DSL's element types."""


class KernelPlan:
    """Compile-time objects derived from a config (built inside a jit context).

    ``GroupedGemm.__call__`` and ``layouts.describe`` both construct a ``KernelPlan``, so the
    layout data the notes print is made from the very objects the kernel uses — including
    ``stage_bytes``, the transaction count of the ring's *full* barriers.
    """

    def __init__(self, cfg: GemmConfig):
        self.cfg = cfg
        self.dtype = dtype = DSL_DTYPES[cfg.dtype]  # operands A and B
        self.out_dtype = DSL_DTYPES[cfg.out_dtype]  # C
        tile_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.tile_mnk = tile_mnk
        # Both operands K-major (unit stride along K): the natural layout of X [T, K] and of
        # W [N_out, K], and the only one FP8 WGMMA accepts.  The atom is m64nNk16 for bf16 and
        # m64nNk32 for E4M3 (make_trivial_tiled_mma picks it from the dtype).
        k_major = LayoutEnum.ROW_MAJOR
        self.c_layout = LayoutEnum.COL_MAJOR if cfg.swap_ab else LayoutEnum.ROW_MAJOR
        # Cooperative: the consumer warpgroups stack along M, each warpgroup's WGMMA covers 64 rows ×
        # tile_n.  Ping-pong: one warpgroup per tile (tile_warpgroups = 1), tile_m/64 WGMMAs along M.
        self.tiled_mma = sm90.make_trivial_tiled_mma(
            dtype, dtype, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            cutlass.Float32, (cfg.tile_warpgroups, 1, 1), tiler_mn=(64, cfg.tile_n))
        # Shared memory rings: (rows, tile_k, stages), swizzled atoms tiled to the tile shape.
        self.a_smem_staged = sm90.make_smem_layout_a(k_major, tile_mnk, dtype, cfg.stages)
        self.b_smem_staged = sm90.make_smem_layout_b(k_major, tile_mnk, dtype, cfg.stages)
        # the epilogue's staging buffers (ping-pong: epi_stages per consumer warpgroup, warpgroup w's first)
        self.epi_smem_staged = sm90.make_smem_layout_epi(self.out_dtype, self.c_layout, cfg.epi_tile, cfg.epi_buffers)
        # The producer speaks MoE: which ring holds tokens, which holds weights.
        if cfg.swap_ab:
            self.x_smem_staged, self.w_smem_staged = self.b_smem_staged, self.a_smem_staged
        else:
            self.x_smem_staged, self.w_smem_staged = self.a_smem_staged, self.b_smem_staged
        self.x_smem_one = cute.slice_(self.x_smem_staged, (None, None, 0))
        self.w_smem_one = cute.slice_(self.w_smem_staged, (None, None, 0))
        self.epi_smem_one = cute.slice_(self.epi_smem_staged, (None, None, 0))
        # Bytes the TMA engine deposits per ring stage: the full barrier's transaction count
        # (gated: the gate and the up tile, two weight boxes of one layout; gather_rows: the weight
        # boxes only — the token rows arrive by cp.async, counted as thread arrivals instead).
        self.stage_bytes = ((0 if cfg.gather_rows else cute.size_in_bytes(dtype, self.x_smem_one))
                            + cute.size_in_bytes(dtype, self.w_smem_one) * (2 if cfg.gated else 1))

    def shared_storage(self):
        """The kernel's shared memory as a struct: the ring's full and empty mbarriers, the A and B
        rings, the epilogue's staging buffers and — gated — the up ring beside the weight ring (the
        same layout, filled on the same full barriers); each buffer 1024-B aligned (128-B swizzle)."""
        cfg, dtype, out_dtype = self.cfg, self.dtype, self.out_dtype

        @cute.struct
        class SharedStorage:
            ring_barriers: cute.struct.MemRange[cutlass.Int64, cfg.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.b_smem_staged)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[out_dtype, cute.cosize(self.epi_smem_staged)], 1024]

        @cute.struct
        class GatedSharedStorage:
            ring_barriers: cute.struct.MemRange[cutlass.Int64, cfg.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.b_smem_staged)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[out_dtype, cute.cosize(self.epi_smem_staged)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.w_smem_staged)], 1024]

        return GatedSharedStorage if cfg.gated else SharedStorage

"""The host side of the grouped GEMM (:mod:`cute_moe.gemm`): what a :class:`~cute_moe.config.GemmConfig`
becomes at compile time, and the launch.

:class:`KernelPlan` holds the tiled MMA, the shared-memory layouts of the operand ring and of the
epilogue's staging buffers, the bytes of one ring stage and the TMA atoms.  It is built inside a jit
context: :class:`GemmLaunch` (the function :func:`compile_gemm` compiles, below) launches the kernel from it,
and ``layouts.describe`` reads the very same objects back as plain data (the notes and tests print
those).  (No ``from __future__ import annotations`` here: ``cute.struct`` reads its field annotations
as objects.)
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
from cutlass.tensor_utils import LayoutEnum

from moe_spec.hopper import sm_count

from .cache import compile_once
from .config import GemmConfig
from .gemm import GroupedGemm
from .runtime import fake_scales, fake_stream

DSL_DTYPES = {"bfloat16": cutlass.BFloat16, "float8_e4m3fn": cutlass.Float8E4M3FN, "float32": cutlass.Float32}
"""GemmConfig's dtype names → the DSL's element types."""


class KernelPlan:
    """Compile-time objects derived from a config (built inside a jit context), including
    ``stage_bytes``, the transaction count of the ring's *full* barriers."""

    def __init__(self, cfg: GemmConfig):
        self.cfg = cfg
        self.dtype = dtype = DSL_DTYPES[cfg.dtype]  # operands A and B
        self.out_dtype = DSL_DTYPES[cfg.c_dtype]  # C as stored: out_dtype, E4M3 where the epilogue quantizes
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
            dtype,
            dtype,
            k_major.sm90_mma_major_mode(),
            k_major.sm90_mma_major_mode(),
            cutlass.Float32,
            (cfg.tile_warpgroups, 1, 1),
            tiler_mn=(64, cfg.tile_n),
        )
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
        self.stage_bytes = (0 if cfg.gather_rows else cute.size_in_bytes(dtype, self.x_smem_one)) + cute.size_in_bytes(
            dtype, self.w_smem_one
        ) * (2 if cfg.gated else 1)

    def tma_atoms(self, x: cute.Tensor, w: cute.Tensor, c: cute.Tensor) -> tuple:
        """(atom, coordinate tensor) of each TMA copy, flattened: the token load (box: one ring slot
        of x), the weight load, its multicast twin (``cluster = 2``: half the box into both CTAs of a
        cluster; else the weight load again) and the store of C (box: one epilogue sub-tile)."""
        cfg = self.cfg
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_x = cpasync.make_tiled_tma_atom(g2s, x, self.x_smem_one, (cfg.tokens_tile, cfg.tile_k))
        tma_w = cpasync.make_tiled_tma_atom(g2s, w, self.w_smem_one, (cfg.weights_tile, cfg.tile_k))
        tma_c = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c, self.epi_smem_one, cfg.epi_tile)
        tma_wm = tma_w
        if cfg.cluster > 1:
            tma_wm = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(),
                w,
                self.w_smem_one,
                (cfg.weights_tile, cfg.tile_k),
                num_multicast=cfg.cluster,
            )
        return (*tma_x, *tma_w, *tma_wm, *tma_c)

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


class GemmLaunch:
    """The compiled function of one configuration (``cute.compile(GemmLaunch(cfg, num_ctas), ...)``): its
    ``__call__`` builds the :class:`KernelPlan` and the TMA atoms and launches the kernel
    (:class:`cute_moe.gemm.GroupedGemm`) on a persistent grid of ``num_ctas`` CTAs, whole clusters.

    Arguments of the compiled function (all device tensors; shapes are dynamic):
        x            bf16 / E4M3 [M_pad, K]     sorted, padded tokens (K-major)
        w            bf16 / E4M3 (N_out, K, E)  the expert weights [E, N_out, K] viewed N, K, E
                     gated: bf16 / E4M3 (I, K, 2, E), W1 [E, 2I, K] viewed as its gate (0) and up (1) halves
        c            out_dtype [M_pad, N_out] (normal) or its transpose view (N_out, M_pad) (swap-AB)
        block_expert int32 [max_blocks]        expert of every token block
        num_blocks   int32 [1]                 number of valid token blocks (device scalar)
        row_scale    fp32 [M_pad]              per-row factor (read only when cfg.row_scale)
        stream       CUstream
        x_scale      fp32, FP8 only: [1] / [M_pad] / [M_pad, ⌈K/128⌉]  (tensor / channel / block)
        w_scale      fp32, FP8 only: [E] / [E, N_out] / [E, ⌈N_out/128⌉, ⌈K/128⌉]
        token_of_row int [M_pad], gather_rows only: x is then the unsorted bf16 [T, K]
        q_scale      fp32 flat, ``epilogue_quant`` only: the caller's a2_scale [1] (static), the
                     intermediate's scales [M_pad·⌈I/128⌉] (block, written) or amax slots (amax, zeroed)
        q_aux        int32, ``epilogue_quant`` only: the error word [1] (static), the row mask [M_pad]
                     (block, amax); with c E4M3 [M_pad, I] (static, block) or fp32 (amax)
    """

    def __init__(self, cfg: GemmConfig, num_ctas: int):
        self.cfg = cfg.validate()
        self.num_ctas = num_ctas

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        w: cute.Tensor,
        c: cute.Tensor,
        block_expert: cute.Tensor,
        num_blocks: cute.Tensor,
        row_scale: cute.Tensor,
        stream,
        x_scale: cute.Tensor = None,
        w_scale: cute.Tensor = None,
        token_of_row: cute.Tensor = None,
        q_scale: cute.Tensor = None,
        q_aux: cute.Tensor = None,
    ):
        cfg = self.cfg
        plan = KernelPlan(cfg)
        tma_x, mX, tma_w, mW, tma_wm, mWm, tma_c, mC = plan.tma_atoms(x, w, c)
        gemm = GroupedGemm(cfg, plan)
        ctas = max(cfg.cluster, self.num_ctas - self.num_ctas % cfg.cluster)  # whole clusters, at least one
        launch = dict(
            grid=[ctas, 1, 1],
            block=[cfg.threads, 1, 1],
            cluster=[cfg.cluster, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )
        layouts = (plan.tiled_mma, plan.a_smem_staged, plan.b_smem_staged, plan.epi_smem_staged)
        if cutlass.const_expr(cfg.gather_rows):  # no TMA over x: the producer gathers its rows
            gemm.kernel_gather(
                x, tma_w, mW, tma_wm, mWm, tma_c, mC, block_expert, num_blocks, row_scale, token_of_row, *layouts
            ).launch(**launch)
        elif cutlass.const_expr(cfg.quant is None):
            gemm.kernel(
                tma_x, mX, tma_w, mW, tma_wm, mWm, tma_c, mC, block_expert, num_blocks, row_scale, *layouts
            ).launch(**launch)
        else:
            gemm.kernel_fp8(
                tma_x,
                mX,
                tma_w,
                mW,
                tma_wm,
                mWm,
                tma_c,
                mC,
                block_expert,
                num_blocks,
                row_scale,
                x_scale,
                w_scale,
                *layouts,
                q_scale,
                q_aux,
            ).launch(**launch)


INDEX_DTYPES = {"int32": cutlass.Int32, "int64": cutlass.Int64}
"""The token-index dtypes a ``gather_rows`` kernel is compiled for (that of ``SortedRows.token_of_row``)."""
INDEX_DTYPE = "int64"
"""The one ``moe.sort_rows`` makes: what a warm-up (``warmup.compile_plan``) compiles a gathering GEMM1 for."""


def fake_arguments(cfg: GemmConfig, index_dtype: str = INDEX_DTYPE):
    """Symbolic stand-ins for the kernel's arguments (16-B aligned rows).

    bf16: ``(x, w, c, block_expert, num_blocks, row_scale, stream)``; an FP8 config adds
    ``(x_scale, w_scale)`` in its format's shapes (``gemm.GroupedGemm``'s docstring); a ``gather_rows``
    config adds ``(None, None, token_of_row)`` (``index_dtype``), and its x has T rows, not M_pad.
    """
    dt, out_dt = DSL_DTYPES[cfg.dtype], DSL_DTYPES[cfg.c_dtype]
    align = cfg.operand_align  # TMA needs 16-B aligned strides: 8 bf16, 16 FP8 along K
    m_pad = cute.sym_int(divisibility=cfg.tokens_tile)
    n_out = cute.sym_int(divisibility=cfg.out_align)
    k = cute.sym_int(divisibility=align)
    experts = cute.sym_int()
    x = make_fake_compact_tensor(
        dt, (cute.sym_int() if cfg.gather_rows else m_pad, k), stride_order=(1, 0), assumed_align=16
    )
    if cfg.gated:  # W1 [E, 2I, K] seen as (I, K, half, E): strides (K, 1, I·K, 2I·K); C is [M_pad, I]
        # every extent symbolic, the half's too: the call passes the view as it is (runtime.py) and the
        # compiled function reads every extent from it
        w = make_fake_tensor(
            dt,
            (n_out, k, cute.sym_int(), experts),
            stride=(
                cute.sym_int64(divisibility=align),
                1,
                cute.sym_int64(divisibility=align),
                cute.sym_int64(divisibility=align),
            ),
            assumed_align=16,
        )
    else:  # W [E, N_out, K] seen as (N_out, K, E): strides (K, 1, N_out·K)
        w = make_fake_tensor(
            dt,
            (n_out, k, experts),
            stride=(cute.sym_int64(divisibility=align), 1, cute.sym_int64(divisibility=align)),
            assumed_align=16,
        )
    c_stride = cute.sym_int64(divisibility=cfg.out_align)
    if cfg.swap_ab:  # C [M_pad, N_out] viewed as Cᵀ (N_out, M_pad), M-major
        c = make_fake_tensor(out_dt, (n_out, m_pad), stride=(1, c_stride), assumed_align=16)
    else:
        c = make_fake_tensor(out_dt, (m_pad, n_out), stride=(c_stride, 1), assumed_align=16)
    block_expert = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    num_blocks = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    row_scale = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    args = (x, w, c, block_expert, num_blocks, row_scale, fake_stream())
    if cfg.gather_rows:
        if index_dtype not in INDEX_DTYPES:
            raise ValueError(f"index_dtype={index_dtype!r}: token indices are one of {tuple(INDEX_DTYPES)}")
        return args + (
            None,
            None,
            make_fake_compact_tensor(INDEX_DTYPES[index_dtype], (cute.sym_int(),), assumed_align=4),
        )
    if cfg.quant is None:
        return args
    if cfg.epilogue_quant is None:
        return args + fake_scales(cfg.quant)
    # (…, x_scale, w_scale, token_of_row = None, q_scale, q_aux): EpilogueQuant's
    vector = lambda dt: make_fake_compact_tensor(dt, (cute.sym_int(),), assumed_align=4)  # noqa: E731
    return args + fake_scales(cfg.quant) + (None, vector(cutlass.Float32), vector(cutlass.Int32))


def compile_gemm(
    cfg: GemmConfig, num_ctas: int | None = None, *, keep_ptx: bool = False, index_dtype: str = INDEX_DTYPE
):
    """The compiled grouped GEMM for ``cfg`` (cached per config and grid size; default grid: one
    CTA per SM, :func:`moe_spec.hopper.sm_count`); a ``gather_rows`` config per ``index_dtype`` too
    ("int32" or "int64": the dtype of the token indices it reads)."""
    cfg.validate()
    num_ctas = sm_count() if num_ctas is None else num_ctas
    index_dtype = index_dtype if cfg.gather_rows else INDEX_DTYPE  # only a gathering kernel reads indices

    def build(options):
        return cute.compile(GemmLaunch(cfg, num_ctas), *fake_arguments(cfg, index_dtype), options=options)

    return compile_once(("gemm", cfg.key(), num_ctas, index_dtype), build, keep_ptx=keep_ptx)


def check_gemm_shape(n_out: int, k: int, cfg: GemmConfig | None = None) -> None:
    """The grouped GEMM's host check of its problem sizes: ``N_out`` and ``K`` positive multiples of
    the config's row alignment — TMA's 16-byte rows: ``cfg.out_align`` and ``cfg.operand_align``
    (8 bf16, 16 E4M3, 4 fp32; a bf16 config's ``ALIGN_ELEMS`` without one).  With K = 0 no stage
    would ever be loaded."""
    cfg = GemmConfig() if cfg is None else cfg
    for name, v, multiple, what in (
        ("K", k, cfg.operand_align, cfg.dtype),
        ("N_out", n_out, cfg.out_align, cfg.out_dtype),
    ):
        if v <= 0 or v % multiple:
            raise ValueError(
                f"grouped_gemm: {name}={v} must be a positive multiple of {multiple} "
                f"(TMA needs 16-byte aligned {what} rows)"
            )

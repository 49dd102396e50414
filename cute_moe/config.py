"""One frozen object that says which grouped-GEMM kernel to build: :class:`GemmConfig`.

The kernel (``gemm.py``), its layouts as data (``layouts.py``), its PTX listing (``ptx.py``) and the
plan (``plan.py``, which picks one per GEMM) all read it; no tile size lives anywhere else.  The
Hopper facts come from :mod:`moe_spec.hopper`, the tiles and register bounds each path accepts
from :mod:`cute_moe.limits`.

Two vocabularies: an expert GEMM is ``Y_e = X_e · W_eᵀ`` (tokens ``[T_e, K]`` by weights
``[N_out, K]``, both K-major); WGMMA computes ``C[M, N] = A[M, K] · B[N, K]ᵀ`` with M = 64 rows
per warpgroup.  The normal path puts the tokens in M (``tile_m = tokens_tile``); swap-AB puts the
weights there and computes ``Cᵀ = W_e · X_eᵀ`` (``tile_m = weights_tile``, the epilogue transposes
with ``stmatrix``).  The MoE names are what a user sets; the GEMM names are derived from them.

Shared memory (:meth:`GemmConfig.smem_bytes`): ``stages`` ring stages of the token tile and the
weight rows (gated: gate and up), the epilogue's staging buffers and 1024 B of barriers, within
Hopper's 227 KiB per CTA; :func:`max_stages` is the deepest ring a config's tiles fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_spec.hopper import SMEM_PER_CTA_BYTES, TMA_ALIGN_BYTES, WARPGROUP_THREADS, WGMMA_M, wgmma_k
from moe_spec.quant import QUANT_FORMATS

from .limits import (
    EPILOGUE_QUANTS,
    MAX_CONSUMER_WARPGROUPS,
    MAX_TILE_M,
    SCHEDULES,
    check_cluster,
    check_epilogue_quant,
    check_fp8,
    check_gated,
    check_pingpong,
    tokens_tiles,
    weights_tiles,
)

SMEM_BUDGET_BYTES = SMEM_PER_CTA_BYTES
"""The shared memory one CTA may use: Hopper's opt-in limit (:mod:`moe_spec.hopper`)."""

BARRIER_RESERVE_BYTES = 1024
"""mbarriers plus alignment slack reserved ahead of the 1024-B aligned operand buffers."""

DTYPE_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1}
"""Operand dtypes the kernel builds, with their element size: bf16 (``quant=None``) or E4M3 (every
FP8 ``quant`` of :data:`moe_spec.quant.QUANT_FORMATS`)."""
DTYPES = tuple(DTYPE_BYTES)

OUT_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
"""Output dtypes, with their element size.  fp32 is for an FP8 GEMM1 whose result is quantized
again: its SiLU·up must be quantized from unrounded values, as the reference does."""
OUT_DTYPES = tuple(OUT_DTYPE_BYTES)

C_DTYPE_BYTES = {**OUT_DTYPE_BYTES, "float8_e4m3fn": 1}
"""What the kernel stores (``GemmConfig.c_dtype``), with the element size: ``out_dtype``, or E4M3 where
the epilogue quantizes the tile itself (``epilogue_quant`` "static" / "block")."""

GATHER_THREADS = WARPGROUP_THREADS  # producer threads copying gathered token rows (gather_rows)

EPI_TILE_N = 32
"""Columns of one epilogue sub-tile (at most; fewer when the tile is narrower)."""


@dataclass(frozen=True)
class GemmConfig:
    """A compile-time configuration of the grouped GEMM (one compiled kernel per value).

    Every field is checked when the config is built (type first, then value; a bad one raises
    TypeError / ValueError whose message starts with the field's name), so a GemmConfig that
    exists can be compiled.

    Attributes (MoE terms):
        swap_ab: compute Cᵀ = W·Xᵀ (weights fill WGMMA M) instead of C = X·Wᵀ.
        tokens_tile: tokens per CTA tile.  normal: 64 or 128 with one consumer warpgroup, 128
            with two.  swap-AB: 8, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208,
            224, 240, 256 (:func:`tokens_tiles`).
        weights_tile: output features (weight rows) per CTA tile.  normal: a multiple of 16 in
            [16, 256].  swap-AB: 64 or 128 with one consumer warpgroup, 128 with two
            (:func:`weights_tiles`).
        tile_k: K extent of one pipeline stage in elements, a multiple of WGMMA's K (16 bf16);
            64 bf16 fill one 128-B swizzle row.  FP8: 128 E4M3 (:data:`~cute_moe.limits.FP8_TILE_K`).
        stages: depth of the TMA → WGMMA shared-memory ring (≥ 2; 3+ to hide latency), within
            the shared-memory budget.
        consumer_warpgroups: MMA warpgroups (1 or 2), stacked along GEMM M (ping-pong: a tile each).
        epi_stages: shared-memory buffers of the epilogue's TMA-store ring (≥ 1).
        dtype: operand dtype (:data:`DTYPES`): "bfloat16", or "float8_e4m3fn" with an FP8 ``quant``.
        quant: None (bf16), or the FP8 format whose scales the kernel applies in registers:
            "fp8_tensor" (s_x · s_w[e] after the K loop), "fp8_channel" (s_x[row] · s_w[e, col]
            after the K loop), "fp8_block" (s_x[row, k/128] · s_w[e, col/128, k/128] at every
            promotion of a 128-deep K block).
        out_dtype: "bfloat16", or "float32" (an FP8 GEMM1 whose result is quantized again).
        epilogue_scales: FP8 per-tensor / per-channel scales applied in the epilogue.  False — the
            unfused pipeline of ``fusion="separate"`` — writes the promoted sums unscaled and leaves
            the scales to a separate pass (``unfused.py``).
        row_scale: multiply every output row (a token slot) by a per-row fp32 factor in the
            epilogue, before the bf16 down-cast (GEMM2 applies the routing weights this way).
        group_tokens: rasterization: consecutive tile ids walk this many token blocks before
            moving to the next weight block, so CTAs resident together share tiles through L2 (≥ 1).
        gated: SiLU·up in the epilogue (GEMM1, no row scale): weights ``[E, 2I, K]`` (gate rows, then
            up rows), output ``silu(gate)·up`` ``[M_pad, I]``; ``weights_tile`` counts output features,
            a stage carries the gate and the up tile (2·weights_tile rows).  bf16 writes bf16; FP8
            writes fp32 (each half promoted and dequantized with its own weight scales first).
        gather_rows: bf16 tokens read by row index from the unsorted ``x [T, K]`` (the producer of ``gemm.py``).
        schedule: "cooperative" (the default: the consumer warpgroups split one tile along M and run
            its epilogue together) or "pingpong" (``consumer_warpgroups=2``, bf16 or FP8): each consumer
            warpgroup owns whole tiles — ``tile_m`` (64 or 128) rows handled by it alone, tile_m/64
            WGMMAs per K slice, all accumulators in its registers — and its own ``epi_stages``
            staging buffers; one issues its main loop while the other runs its epilogue.  The twin
            of a cooperative 128-row tile is the 64-row one (``pingpong_config``).
        cluster: CTAs per cluster, 1 or 2: two take consecutive token blocks of a weight block and, when
            both are one expert's, load half its weight tile each for both (multicast, ``gemm.py``).
        epilogue_quant: a gated FP8 GEMM1 quantizes its fp32 SiLU·up for GEMM2 in its epilogue
            (:mod:`cute_moe.epilogue_quant`; swap-AB: "amax" only): None (today's path: fp32 out, amax and
            quantize launches after it), "static" (fp8_tensor with the caller's ``a2_scale``: E4M3 out),
            "block" (fp8_block, tile N a multiple of 128: per (row, group) scales and E4M3 out) or
            "amax" (fp32 out, the intermediate's amax taken in the epilogue).  The plan decides
            (:func:`cute_moe.plan.epilogue_quant`).
    """

    swap_ab: bool = False
    tokens_tile: int = 128
    weights_tile: int = 128
    tile_k: int = 64
    stages: int = 4
    consumer_warpgroups: int = 2
    epi_stages: int = 2
    dtype: str = "bfloat16"
    quant: str | None = None
    row_scale: bool = False
    group_tokens: int = 8
    out_dtype: str = "bfloat16"
    epilogue_scales: bool = True
    gated: bool = False
    gather_rows: bool = False
    schedule: str = "cooperative"
    cluster: int = 1
    epilogue_quant: str | None = None

    def __post_init__(self):
        self._check()

    # ---- GEMM vocabulary (derived) -------------------------------------------------------
    @property
    def tile_m(self) -> int:
        return self.weights_tile if self.swap_ab else self.tokens_tile

    @property
    def tile_n(self) -> int:
        return self.tokens_tile if self.swap_ab else self.weights_tile

    @property
    def element_bytes(self) -> int:
        """Bytes of one operand element (A and B)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def out_bytes(self) -> int:
        """Bytes of one output element (C)."""
        return OUT_DTYPE_BYTES[self.out_dtype]

    @property
    def c_dtype(self) -> str:
        """The dtype the kernel stores: E4M3 where the epilogue quantizes the tile ("static", "block"),
        else ``out_dtype`` (the activation is computed in ``out_dtype`` either way)."""
        return "float8_e4m3fn" if self.epilogue_quant in ("static", "block") else self.out_dtype

    @property
    def c_bytes(self) -> int:
        """Bytes of one stored element of C (:attr:`c_dtype`)."""
        return C_DTYPE_BYTES[self.c_dtype]

    @property
    def operand_align(self) -> int:
        """Row alignment of the operands in elements (K must be a multiple): 8 bf16 or 16 FP8."""
        return TMA_ALIGN_BYTES // self.element_bytes

    @property
    def out_align(self) -> int:
        """Row alignment of the output in elements (N_out must be a multiple): 8 bf16, 4 fp32, 16 E4M3."""
        return TMA_ALIGN_BYTES // self.c_bytes

    @property
    def two_level(self) -> bool:
        """FP8: each K step into a block accumulator, promoted into the fp32 tile accumulator."""
        return self.quant is not None

    @property
    def pingpong(self) -> bool:
        return self.schedule == "pingpong"

    @property
    def tile_warpgroups(self) -> int:
        """Consumer warpgroups that share one tile: all of them (cooperative), one (ping-pong)."""
        return 1 if self.pingpong else self.consumer_warpgroups

    @property
    def epi_buffers(self) -> int:
        """Epilogue staging buffers: ``epi_stages``, per consumer warpgroup under ping-pong."""
        return self.epi_stages * (self.consumer_warpgroups if self.pingpong else 1)

    @property
    def accumulator_registers(self) -> int:
        """fp32 accumulator registers per consumer thread: two accumulators for FP8 (block + promoted)
        and for gated (gate + up), four for a gated FP8 GEMM1 (a block and a promoted one per half)."""
        per_acc = self.tile_m * self.tile_n // (WARPGROUP_THREADS * self.tile_warpgroups)
        return per_acc * (2 if self.two_level else 1) * (2 if self.gated else 1)

    @property
    def swizzle_bytes(self) -> int:
        """Swizzle width of the K-major operand atoms: the widest of 128/64/32 B dividing a K row."""
        row_bytes = self.tile_k * self.element_bytes
        for sw in (128, 64, 32):
            if row_bytes % sw == 0:
                return sw
        return 0

    @property
    def epi_tile(self) -> tuple[int, int]:
        """(M, N) of one epilogue sub-tile: each consumer warpgroup stores 64 rows of it.

        N is at most :data:`EPI_TILE_N` = 32 columns.  The staging buffer's swizzle follows the
        contiguous extent of C in it (``make_smem_layout_epi`` picks the widest atom that extent
        fills): the normal path's C is N-major, and 32 bf16 columns are a 64-byte row, so its
        buffer has the 64-byte swizzle ``S<2,4,3>`` (bits 4–5 of the byte address XOR bits 7–8);
        32 fp32 columns (an FP8 GEMM1's output) are a 128-byte row; swap-AB's C is M-major, 128
        rows = 256 contiguous bytes or more, so it gets the 128-byte swizzle.

        M: 64 rows per warpgroup sharing the tile, so a one-warpgroup 128-row tile (ping-pong's too)
        stores two rows of sub-tiles: its registers, retiled for ``stmatrix``, run over the N chunks
        of one WGMMA's 64 rows before the next's, so sub-tile e (row-major) is the e-th run."""
        return (WGMMA_M * self.tile_warpgroups, min(EPI_TILE_N, self.tile_n))

    @property
    def wgmma(self) -> str:
        """The ``wgmma.mma_async`` instruction the kernel issues, as PTX spells it: M = 64 rows of one
        warpgroup, N = ``tile_n``, K = 32 bytes of operands (16 bf16, 32 E4M3), fp32 accumulators.
        :func:`cute_moe.ptx.mma_instruction` reads the same from the kernel's own tiled MMA; the tests
        hold the two equal for every config a plan picks."""
        ab = "bf16" if self.dtype == "bfloat16" else "e4m3"
        return f"wgmma.mma_async.sync.aligned.m{WGMMA_M}n{self.tile_n}k{wgmma_k(self.element_bytes)}.f32.{ab}.{ab}"

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * (1 + self.consumer_warpgroups)

    @property
    def weight_rows(self) -> int:
        """Weight rows one stage loads: ``weights_tile``, twice that when gated (gate and up tiles)."""
        return self.weights_tile * (2 if self.gated else 1)

    @property
    def stage_bytes(self) -> int:
        """Bytes of one ring stage: the token tile and the weight tile(s) (what TMA brings per K step)."""
        return (self.tokens_tile + self.weight_rows) * self.tile_k * self.element_bytes

    def smem_bytes(self, stages: int | None = None) -> int:
        """Shared memory of the kernel (the budget formula above), at ``stages`` if given."""
        epi = self.epi_buffers * self.epi_tile[0] * self.epi_tile[1] * self.c_bytes
        return (self.stages if stages is None else stages) * self.stage_bytes + epi + BARRIER_RESERVE_BYTES

    def replace(self, **changes) -> GemmConfig:
        return dataclasses.replace(self, **changes)

    def key(self) -> tuple:
        """The compile-cache key (every field is compile-time)."""
        return dataclasses.astuple(self)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(
            tile_m=self.tile_m,
            tile_n=self.tile_n,
            swizzle_bytes=self.swizzle_bytes,
            epi_tile=list(self.epi_tile),
            threads=self.threads,
            smem_bytes=self.smem_bytes(),
        )
        return d

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> GemmConfig:
        """Raise TypeError / ValueError naming the field and its allowed values; else return self."""
        self._check()
        return self

    def _check(self) -> None:
        for name in ("swap_ab", "row_scale", "epilogue_scales", "gated", "gather_rows"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in (
            "tokens_tile",
            "weights_tile",
            "tile_k",
            "stages",
            "consumer_warpgroups",
            "epi_stages",
            "group_tokens",
            "cluster",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name}: expected an int, got {v!r} ({type(v).__name__})")
        if not isinstance(self.schedule, str):
            raise TypeError(f"schedule: expected a str, one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.dtype, str):
            raise TypeError(f"dtype: expected a str, one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.out_dtype, str):
            raise TypeError(f"out_dtype: expected a str, one of {OUT_DTYPES}, got {self.out_dtype!r}")
        if self.quant is not None and not isinstance(self.quant, str):
            raise TypeError(f"quant: expected None or a str, got {self.quant!r}")
        if self.epilogue_quant is not None and not isinstance(self.epilogue_quant, str):
            raise TypeError(
                f"epilogue_quant: expected None or a str, one of {EPILOGUE_QUANTS}, got {self.epilogue_quant!r}"
            )

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: supported dtypes are {DTYPES}")
        if self.quant not in QUANT_FORMATS:
            raise ValueError(f"quant={self.quant!r}: expected one of {QUANT_FORMATS}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype={self.out_dtype!r}: supported output dtypes are {OUT_DTYPES}")
        want = "float8_e4m3fn" if self.quant is not None else "bfloat16"
        if self.dtype != want:
            raise ValueError(
                f"dtype={self.dtype!r} with quant={self.quant!r}: expected dtype={want!r} "
                f"(FP8 formats take E4M3 operands, quant=None takes bf16)"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: expected one of {SCHEDULES}")
        if not 1 <= self.consumer_warpgroups <= MAX_CONSUMER_WARPGROUPS:
            raise ValueError(f"consumer_warpgroups={self.consumer_warpgroups}: must be 1 or 2")
        path = "swap-AB" if self.swap_ab else "normal"
        per_tile = self.tile_warpgroups  # warpgroups stacked on one tile's M: one under ping-pong
        for name, allowed in (
            ("tokens_tile", tokens_tiles(self.swap_ab, per_tile)),
            ("weights_tile", weights_tiles(self.swap_ab, per_tile)),
        ):
            v = getattr(self, name)
            if v not in allowed:
                if (name == "tokens_tile") != self.swap_ab:
                    role = f"GEMM M, a multiple of 64 rows per consumer warpgroup, at most {MAX_TILE_M}"
                elif self.swap_ab:
                    role = (
                        "WGMMA's N, a multiple of 8 up to 256, but not an odd multiple of 8 above 8 (the CuTe "
                        "DSL aborts slicing the staged, swizzled 16-bit shared-memory layout there)"
                    )
                else:
                    role = "WGMMA's N, here a multiple of 16 up to 256"
                with_ = (
                    "schedule='pingpong' (one consumer warpgroup per tile)"
                    if self.pingpong
                    else f"consumer_warpgroups={self.consumer_warpgroups}"
                )
                raise ValueError(
                    f"{name}={v}: on the {path} path it is {role}; allowed with "
                    f"{with_}: {', '.join(map(str, allowed))} (cute_moe.limits.{name}s)"
                )
        k_step = wgmma_k(self.element_bytes)
        if self.tile_k < k_step or self.tile_k % k_step:
            raise ValueError(
                f"tile_k={self.tile_k}: must be a positive multiple of {k_step}, WGMMA's K for "
                f"{self.dtype} (each stage feeds tile_k/{k_step} whole WGMMAs)"
            )
        if self.stages < 2:
            raise ValueError(f"stages={self.stages}: the TMA/WGMMA ring needs at least 2 stages")
        if self.epi_stages < 1:
            raise ValueError(f"epi_stages={self.epi_stages}: needs at least 1 epilogue buffer")
        if self.group_tokens < 1:
            raise ValueError(f"group_tokens={self.group_tokens}: must be ≥ 1")
        check_pingpong(self)
        check_fp8(self)
        check_gated(self)
        check_cluster(self)
        check_epilogue_quant(self)
        vecs = self.tile_k * self.element_bytes // TMA_ALIGN_BYTES  # 16-byte vectors per token row of a stage
        if self.gather_rows and (
            self.quant is not None
            or GATHER_THREADS % vecs
            or self.tokens_tile % min(self.tokens_tile, GATHER_THREADS // vecs)
        ):
            raise ValueError(
                f"gather_rows=True: takes bf16 (quant={self.quant!r}); the {vecs} vectors of a row must "
                f"divide {GATHER_THREADS} threads, whose rows per pass divide "
                f"tokens_tile={self.tokens_tile}"
            )
        need = self.smem_bytes()
        if need > SMEM_BUDGET_BYTES:
            fit = [s for s in range(2, self.stages) if self.smem_bytes(s) <= SMEM_BUDGET_BYTES]
            hint = f"at most {fit[-1]} stages fit this tile" if fit else "lower tile_k or the tiles"
            raise ValueError(
                f"stages={self.stages}: shared memory over budget: {need} B needed ({self.stages} × "
                f"({self.tokens_tile}+{self.weight_rows})×{self.tile_k}×{self.element_bytes} B + epilogue + "
                f"barriers) > "
                f"{SMEM_BUDGET_BYTES} B (227 KiB per CTA on sm_90); {hint}"
            )


def max_stages(cfg: GemmConfig, cap: int = 8) -> int:
    """The deepest operand ring that fits the shared-memory budget (at most ``cap``)."""
    return max([s for s in range(2, cap + 1) if cfg.smem_bytes(s) <= SMEM_BUDGET_BYTES], default=2)

"""One frozen object that says which grouped-GEMM kernel to build.

Every other module reads :class:`GemmConfig`: the kernel (``gemm.py``) builds its tiled MMA,
shared-memory plan and epilogue from it, ``layouts.py`` turns it into plain data, ``ptx.py``
compiles it on the CPU, ``moe.py`` picks one per GEMM with :func:`choose_config`, and the tests
and notes quote it.  There is no second place where a tile size lives.

Two vocabularies
----------------
A MoE expert GEMM multiplies a block of *tokens* ``X_e [T_e, K]`` by an expert *weight*
``W_e [N_out, K]`` (the natural ``nn.Linear`` layout, both operands K-major):
``Y_e = X_e · W_eᵀ`` of shape ``[T_e, N_out]``.  WGMMA speaks of ``C[M, N] = A[M, K] · B[N, K]ᵀ``
with M a multiple of 64 per warpgroup and N ∈ {8, 16, …, 256}.

* normal path:  A = tokens, B = weights.  ``tile_m = tokens_tile``, ``tile_n = weights_tile``.
* swap-AB path: A = weights, B = tokens, and the kernel computes ``Cᵀ = W_e · X_eᵀ``.
  ``tile_m = weights_tile`` (64 per consumer warpgroup), ``tile_n = tokens_tile`` (8, 16, …).
  The result tile is (weights × tokens); it lands in the same row-major ``[M_pad, N_out]`` output
  viewed as an M-major matrix, so the epilogue needs the transposing ``stmatrix``.

The MoE vocabulary (``tokens_tile``/``weights_tile``) is what the user sets; the GEMM vocabulary
(``tile_m``/``tile_n``) is derived, so the two can never disagree.

Shared-memory budget (bytes; an operand element is 2 B of bf16 or 1 B of FP8, an output
element 2 B of bf16 or 4 B of fp32)::

    stages · (tile_m + tile_n) · tile_k · operand bytes      operand ring (A and B per stage)
  + epi_stages · epi_tile_m · epi_tile_n · output bytes      epilogue staging for the TMA store
  + 1024                                                     mbarriers, padding to 1024-B alignment
  ≤ 227 KiB = 232 448 B                                      (Hopper's opt-in limit per CTA)

FP8 (``quant`` one of moe_spec's FP8 formats, ``dtype="float8_e4m3fn"``): both operands are E4M3,
WGMMA is ``m64nNk32`` with fp32 accumulation, and ``tile_k`` is 128 FP8 elements — one 128-B
swizzled row, and one 128-deep scale block of ``fp8_block``.  Every K step's WGMMAs accumulate
into a fresh block accumulator that is then promoted (added, scaled for ``fp8_block``) into the
fp32 tile accumulator, so an FP8 tile holds two accumulators in registers
(:data:`FP8_ACCUMULATOR_REGISTERS`).  ``cute_moe.fp8_gemm`` holds that main loop and the
dequantizing epilogue.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_spec.quant import FP8_BLOCK
from moe_spec.quant import QUANT_FORMATS

SMEM_BUDGET_BYTES = 227 * 1024
"""Opt-in dynamic shared memory per CTA on sm_90 (H100/H200)."""

BARRIER_RESERVE_BYTES = 1024
"""mbarriers plus alignment slack reserved ahead of the 1024-B aligned operand buffers."""

ALIGN_ELEMS = 8
"""Row alignment in elements: 16 bytes of bf16.  TMA needs every row stride (K of the operands,
N_out of the output) to be a multiple of 16 bytes, and the row kernels move one 16-byte vector per
thread step, so every row width the layer touches (K, I, 2I) must be a multiple of this."""

MAX_TILE_M = 128
"""The largest GEMM tile M accepted: 64 rows × 2 consumer warpgroups.  A larger M (swap-AB's
``weights_tile = 256``) would give every CTA tile two epilogue sub-tiles along M, an ordering of
accumulator registers to TMA-store boxes (``epi_order`` in gemm.py) that no GPU test has run."""

SWAP_AB_MAX_TOKENS_PER_EXPERT = 64
"""The documented path rule: swap-AB while the mean tokens per expert is at most this.

Why 64: the normal path's smallest token tile is WGMMA's M = 64 rows, so below 64 tokens per
expert most of every normal tile multiplies padding, while swap-AB's token tile can shrink to
8 (N of WGMMA) and every weight byte still feeds a full 64-row M.  Above 64 tokens per expert
both paths fill their tiles, the normal path's larger token tile (128) re-uses each weight tile
for more tokens, and its N-major epilogue needs no transpose.  notes/cute_moe.md records the
crossover measured on the H200."""

DTYPES = ("bfloat16", "float8_e4m3fn")
"""Operand dtypes: bf16 (``quant=None``) or E4M3 (an FP8 ``quant`` of :data:`moe_spec.quant.QUANT_FORMATS`)."""

OUT_DTYPES = ("bfloat16", "float32")
"""Output dtypes.  fp32 is for an FP8 GEMM1 whose result is quantized again: its SiLU·up must be
quantized from unrounded values, as the reference does."""

ELEMENT_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}

TMA_ROW_ALIGN_BYTES = 16
"""TMA needs every row stride (K of the operands, N_out of the output) to be a multiple of 16 B."""

FP8_ALIGN_ELEMS = 16
"""Row alignment of FP8 operands in elements: TMA's 16-byte rows are 16 E4M3 values, so an FP8
layer needs K and I to be multiples of this."""

FP8_TILE_K = FP8_BLOCK
"""``tile_k`` of every FP8 config: 128 E4M3 = one 128-B swizzled row, and one K block of
``fp8_block`` (moe_spec.quant.FP8_BLOCK) — so one pipeline stage is one promotion of the block
accumulator, and a block's scales are constant over it."""

FP8_ACCUMULATOR_REGISTERS = 128
"""Most fp32 registers per consumer thread for the two FP8 accumulators (block + promoted):
``2 · tile_m · tile_n / (128 · consumer_warpgroups)``.  128 leaves room for addresses, scales and
the epilogue below the 232 registers ``setmaxnreg`` grants (128×128 with two warpgroups, or
64×128 with one, is the largest FP8 tile)."""


@dataclass(frozen=True)
class GemmConfig:
    """A compile-time configuration of the grouped GEMM (one compiled kernel per value).

    Attributes (MoE terms):
        swap_ab: compute Cᵀ = W·Xᵀ (weights fill WGMMA M) instead of C = X·Wᵀ.
        tokens_tile: tokens per CTA tile (normal: 64 or 128; swap-AB: 8, 16, 24, …, 256).
        weights_tile: output features (weight rows) per CTA tile.
        tile_k: K extent of one pipeline stage in elements (one 128-B swizzle row: 64 bf16, or
            128 FP8 = :data:`FP8_TILE_K`).
        stages: depth of the TMA → WGMMA shared-memory ring (≥ 2; 3+ to hide latency).
        consumer_warpgroups: MMA warpgroups (1 or 2), stacked along GEMM M.
        epi_stages: shared-memory buffers of the epilogue's TMA-store ring.
        dtype: operand dtype: "bfloat16", or "float8_e4m3fn" with an FP8 ``quant``.
        quant: None (bf16), or the FP8 format whose scales the kernel applies in registers:
            "fp8_tensor" (s_x · s_w[e] after the K loop), "fp8_channel" (s_x[row] · s_w[e, col]
            after the K loop), "fp8_block" (s_x[row, k/128] · s_w[e, col/128, k/128] at every
            promotion of a 128-deep K block).
        out_dtype: "bfloat16", or "float32" (an FP8 GEMM1 whose result is quantized again).
        fp8_promote: FP8 two-level accumulation (every K step promoted into the fp32 accumulator).
            False — fp8_tensor / fp8_channel only — lets the WGMMA accumulate all of K, as a
            kernel without promotion does: kept for the promotion study, never the default.
        epilogue_scales: FP8 per-tensor / per-channel scales applied in the epilogue.  False — the
            unfused pipeline of ``fusion="separate"`` — writes the promoted sums unscaled and leaves
            the scales to a separate pass (``unfused.py``).
        row_scale: multiply every output row (a token slot) by a per-row fp32 factor in the
            epilogue, before the bf16 down-cast (GEMM2 applies the routing weights this way).
        group_tokens: rasterization: consecutive tile ids walk this many token blocks before
            moving to the next weight block, so CTAs resident together share tiles through L2.
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
    fp8_promote: bool = True
    epilogue_scales: bool = True

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
        return ELEMENT_BYTES[self.dtype]

    @property
    def out_bytes(self) -> int:
        """Bytes of one output element (C)."""
        return ELEMENT_BYTES[self.out_dtype]

    @property
    def operand_align(self) -> int:
        """Row alignment of the operands in elements (K must be a multiple): 8 bf16 or 16 FP8."""
        return TMA_ROW_ALIGN_BYTES // self.element_bytes

    @property
    def out_align(self) -> int:
        """Row alignment of the output in elements (N_out must be a multiple): 8 bf16 or 4 fp32."""
        return TMA_ROW_ALIGN_BYTES // self.out_bytes

    @property
    def accumulator_registers(self) -> int:
        """fp32 accumulator registers per consumer thread (two accumulators for FP8)."""
        per_acc = self.tile_m * self.tile_n // (128 * self.consumer_warpgroups)
        return per_acc * (2 if self.two_level else 1)

    @property
    def two_level(self) -> bool:
        """FP8 with promotion: a block accumulator per K step beside the fp32 tile accumulator."""
        return self.quant is not None and self.fp8_promote

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

        N is capped at 32 columns (64 B of bf16 or 128 B of fp32 for an N-major C; for swap-AB's
        M-major C the contiguous mode is M)."""
        return (64 * self.consumer_warpgroups, min(32, self.tile_n))

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumer_warpgroups)

    def smem_bytes(self) -> int:
        ab = self.stages * (self.tile_m + self.tile_n) * self.tile_k * self.element_bytes
        epi = self.epi_stages * self.epi_tile[0] * self.epi_tile[1] * self.out_bytes
        return ab + epi + BARRIER_RESERVE_BYTES

    def replace(self, **changes) -> "GemmConfig":
        return dataclasses.replace(self, **changes)

    def key(self) -> tuple:
        """The compile-cache key (every field is compile-time)."""
        return dataclasses.astuple(self)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(tile_m=self.tile_m, tile_n=self.tile_n, swizzle_bytes=self.swizzle_bytes,
                 epi_tile=list(self.epi_tile), threads=self.threads, smem_bytes=self.smem_bytes())
        return d

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> "GemmConfig":
        """Raise ValueError naming the violated limit; return self when the config is buildable."""
        if self.dtype not in DTYPES:
            raise ValueError(f"GemmConfig.dtype={self.dtype!r}: supported dtypes are {DTYPES}")
        if self.quant not in QUANT_FORMATS:
            raise ValueError(f"GemmConfig.quant={self.quant!r}: expected one of {QUANT_FORMATS}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"GemmConfig.out_dtype={self.out_dtype!r}: supported output dtypes are {OUT_DTYPES}")
        self._validate_fp8()
        if self.consumer_warpgroups not in (1, 2):
            raise ValueError(f"GemmConfig.consumer_warpgroups={self.consumer_warpgroups}: must be 1 or 2")
        wg_m = 64 * self.consumer_warpgroups
        if self.tile_m % wg_m != 0:
            raise ValueError(
                f"GEMM tile M = {self.tile_m} ({'weights' if self.swap_ab else 'tokens'}_tile) must be a multiple of "
                f"64 rows per consumer warpgroup × {self.consumer_warpgroups} = {wg_m}")
        if self.tile_m > MAX_TILE_M:
            raise ValueError(
                f"GEMM tile M = {self.tile_m} ({'weights' if self.swap_ab else 'tokens'}_tile) is above {MAX_TILE_M}: "
                f"more than one epilogue sub-tile along M is untested on the GPU (the sub-tile order in gemm.py's "
                f"epilogue was never run), so it is refused")
        if self.tile_n % 8 != 0 or not 8 <= self.tile_n <= 256:
            raise ValueError(
                f"GEMM tile N = {self.tile_n} ({'tokens' if self.swap_ab else 'weights'}_tile) must be a multiple "
                f"of 8 in [8, 256] (WGMMA's N)")
        if not self.swap_ab and self.tokens_tile not in (64, 128):
            raise ValueError(f"normal path: tokens_tile={self.tokens_tile} must be 64 or 128 (WGMMA M rows)")
        if self.swap_ab and self.tile_n > 8 and self.tile_n % 16 != 0:
            raise ValueError(
                f"swap-AB tokens_tile={self.tile_n}: odd multiples of 8 above 8 (24, 40, …) are not supported: "
                f"the 16-bit staged swizzled smem layout cannot be sliced at that N (FINDINGS); use 8 or a multiple of 16")
        if not self.swap_ab and self.tile_n % 16 != 0:
            raise ValueError(f"normal path: weights_tile={self.tile_n} must be a multiple of 16")
        if self.quant is None and (self.tile_k % 16 != 0 or self.tile_k < 16):
            raise ValueError(f"tile_k={self.tile_k}: must be a positive multiple of 16 (bf16 WGMMA K)")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages}: the TMA/WGMMA ring needs at least 2 stages")
        if self.epi_stages < 1:
            raise ValueError(f"epi_stages={self.epi_stages}: needs at least 1 epilogue buffer")
        if self.group_tokens < 1:
            raise ValueError(f"group_tokens={self.group_tokens}: must be ≥ 1")
        need = self.smem_bytes()
        if need > SMEM_BUDGET_BYTES:
            raise ValueError(
                f"shared memory over budget: {need} B needed (stages={self.stages} × "
                f"({self.tile_m}+{self.tile_n})×{self.tile_k}×{self.element_bytes} B + epilogue + barriers) > "
                f"{SMEM_BUDGET_BYTES} B (227 KiB per CTA on sm_90); lower stages or the tile")
        return self

    def _validate_fp8(self) -> None:
        """The FP8 limits: dtype and quant agree, tile_k is one 128-B row, two accumulators fit."""
        fp8 = self.quant is not None
        want = "float8_e4m3fn" if fp8 else "bfloat16"
        if self.dtype != want:
            raise ValueError(f"GemmConfig.dtype={self.dtype!r} with quant={self.quant!r}: expected dtype={want!r} "
                             f"(FP8 formats take E4M3 operands, quant=None takes bf16)")
        if not self.fp8_promote and self.quant not in ("fp8_tensor", "fp8_channel"):
            raise ValueError(f"fp8_promote=False with quant={self.quant!r}: only fp8_tensor / fp8_channel can skip the "
                             f"promotion (bf16 has none; fp8_block's scales change every K block)")
        if not self.epilogue_scales and self.quant not in ("fp8_tensor", "fp8_channel"):
            raise ValueError(f"epilogue_scales=False with quant={self.quant!r}: only fp8_tensor / fp8_channel have "
                             f"epilogue scales to leave out (fp8_block's are applied in the main loop)")
        if not fp8:
            return
        if self.tile_k != FP8_TILE_K:
            raise ValueError(f"tile_k={self.tile_k}: FP8 configs need tile_k={FP8_TILE_K} (one 128-B swizzled row of "
                             f"E4M3, and one K block of the scales: each K step is promoted on its own)")
        if self.quant == "fp8_block" and FP8_BLOCK % self.weights_tile:
            raise ValueError(f"weights_tile={self.weights_tile}: fp8_block needs a weights tile that divides the "
                             f"{FP8_BLOCK}-row scale block (one weight scale per tile and K step)")
        if self.accumulator_registers > FP8_ACCUMULATOR_REGISTERS:
            raise ValueError(
                f"FP8 tile {self.tile_m}×{self.tile_n} with {self.consumer_warpgroups} consumer warpgroup(s) needs "
                f"{self.accumulator_registers} accumulator registers per thread (block + promoted), above "
                f"{FP8_ACCUMULATOR_REGISTERS}; use a smaller tile or two warpgroups")


def max_stages(cfg: GemmConfig, cap: int = 8) -> int:
    """The deepest operand ring that fits the shared-memory budget (at most ``cap``)."""
    best = 2
    for s in range(2, cap + 1):
        if cfg.replace(stages=s).smem_bytes() <= SMEM_BUDGET_BYTES:
            best = s
    return best


def choose_config(tokens_per_expert: float, n_out: int, k: int, *, swap_ab: bool | None = None,
                  row_scale: bool = False, quant: str | None = None, out_dtype: str = "bfloat16") -> GemmConfig:
    """THE path rule.  Pick the kernel for one expert GEMM ``[T_e, k] × [n_out, k]ᵀ``.

    ``tokens_per_expert`` is the mean routed tokens per expert (``T · top_k / E``), known on the
    host without reading the routing.  ``swap_ab`` forces a path (None: follow the rule).

    * swap-AB when ``tokens_per_expert ≤ SWAP_AB_MAX_TOKENS_PER_EXPERT`` (64): weights fill M
      (128 rows = two consumer warpgroups), tokens tile = the smallest of 8/16/32/64 that covers
      the mean (rounded up), so decode (a handful of tokens per expert) multiplies almost no
      padding and streams every weight byte once per token tile.
    * normal otherwise: 128 tokens × 256 weights per tile with two consumer warpgroups (the
      compute-bound shape: 128·256 accumulators per 64-deep K step).  When the normal path is
      forced at ≤ 64 tokens per expert, the token tile drops to 64 rows (one warpgroup's M).
    * FP8 (``quant``): the same rule with ``tile_k`` = :data:`FP8_TILE_K` and weights tiles of
      128, since the promoted accumulator doubles the registers (:data:`FP8_ACCUMULATOR_REGISTERS`).
      ``out_dtype`` is the output's dtype (fp32 for an FP8 GEMM1, whose result is quantized again).
    """
    use_swap = tokens_per_expert <= SWAP_AB_MAX_TOKENS_PER_EXPERT if swap_ab is None else swap_ab
    if use_swap:
        tokens_tile = 8
        while tokens_tile < min(64, tokens_per_expert):
            tokens_tile *= 2
        cfg = GemmConfig(swap_ab=True, tokens_tile=tokens_tile, weights_tile=128,
                         consumer_warpgroups=2, row_scale=row_scale)
    else:
        small = tokens_per_expert <= SWAP_AB_MAX_TOKENS_PER_EXPERT
        cfg = GemmConfig(swap_ab=False, tokens_tile=64 if small else 128,
                         weights_tile=256 if n_out >= 256 and quant is None else 128,
                         consumer_warpgroups=1 if small else 2, row_scale=row_scale)
    if quant is not None:
        cfg = cfg.replace(dtype="float8_e4m3fn", quant=quant, tile_k=FP8_TILE_K)
    cfg = cfg.replace(out_dtype=out_dtype)
    return cfg.replace(stages=max_stages(cfg)).validate()

"""The limits of a :class:`~cute_moe.config.GemmConfig` that keep two accumulators: FP8 and gated.

Both kernels hold two fp32 accumulators per tile in the consumer's registers — FP8 a block
accumulator beside the promoted one (``cute_moe.fp8_gemm``), a gated GEMM1 the gate and the up
sums (``cute_moe.gemm``, SiLU·up in the epilogue) — so both are bound by
:data:`TWO_ACCUMULATOR_REGISTERS`.  ``GemmConfig`` calls :func:`check_fp8` and :func:`check_gated`
from its validation; this module reads the config's fields only (it imports nothing of
``config``), and ``config`` re-exports its constants.
"""

from __future__ import annotations

from moe_spec.quant import FP8_BLOCK

FP8_TILE_K = FP8_BLOCK
"""``tile_k`` of every FP8 config: 128 E4M3 = one 128-B swizzled row, and one K block of
``fp8_block`` (moe_spec.quant.FP8_BLOCK) — so one pipeline stage is one promotion of the block
accumulator, and a block's scales are constant over it."""

TWO_ACCUMULATOR_REGISTERS = 128
"""Most fp32 registers per consumer thread for two accumulators (FP8: block + promoted; gated:
gate + up): ``2 · tile_m · tile_n / (128 · consumer_warpgroups)``.  128 leaves room for addresses,
scales and the epilogue below the 232 registers ``setmaxnreg`` grants: 128×128 with two
warpgroups, or 64×128 with one, is the largest such tile — a gated 128×128 tile issues the WGMMA
work of a plain 128×256 one per K step."""

FP8_ACCUMULATOR_REGISTERS = TWO_ACCUMULATOR_REGISTERS
"""The FP8 kernel's bound (:data:`TWO_ACCUMULATOR_REGISTERS`)."""


def _check_registers(cfg, what: str, kind: str) -> None:
    if cfg.accumulator_registers > TWO_ACCUMULATOR_REGISTERS:
        raise ValueError(
            f"tokens_tile={cfg.tokens_tile}, weights_tile={cfg.weights_tile}: the {kind} tile {cfg.tile_m}×"
            f"{cfg.tile_n} with {cfg.consumer_warpgroups} consumer warpgroup(s) needs {cfg.accumulator_registers} "
            f"accumulator registers per thread ({what}), above {TWO_ACCUMULATOR_REGISTERS}; use a "
            f"smaller tile or two warpgroups")


def check_gated(cfg) -> None:
    """The gated limits: bf16 in and out, no row scale, two accumulators that fit."""
    if not cfg.gated:
        return
    if cfg.quant is not None or cfg.out_dtype != "bfloat16" or cfg.row_scale:
        raise ValueError(f"gated=True with quant={cfg.quant!r}, out_dtype={cfg.out_dtype!r}, "
                         f"row_scale={cfg.row_scale}: SiLU·up in the epilogue is the bf16 layer's GEMM1 "
                         f"(quant=None, out_dtype='bfloat16', row_scale=False)")
    _check_registers(cfg, "gate + up", "gated")


def check_fp8(cfg) -> None:
    """The FP8 limits: tile_k is one 128-B row, block scales fit the tile, two accumulators fit."""
    for name, what in (("fp8_promote", "skip the promotion"), ("epilogue_scales", "leave their scales out")):
        if not getattr(cfg, name) and cfg.quant not in ("fp8_tensor", "fp8_channel"):
            raise ValueError(f"{name}=False with quant={cfg.quant!r}: only fp8_tensor / fp8_channel can {what} "
                             f"(bf16 has neither; fp8_block's scales change every K block)")
    if cfg.quant is None:
        return
    if cfg.tile_k != FP8_TILE_K:
        raise ValueError(f"tile_k={cfg.tile_k}: FP8 configs need tile_k={FP8_TILE_K} (one 128-B swizzled row of "
                         f"E4M3, and one K block of the scales: each K step is promoted on its own)")
    if cfg.quant == "fp8_block" and FP8_BLOCK % cfg.weights_tile:
        raise ValueError(f"weights_tile={cfg.weights_tile}: fp8_block needs a weights tile that divides the "
                         f"{FP8_BLOCK}-row scale block (one weight scale per tile and K step)")
    _check_registers(cfg, "block + promoted", "FP8")

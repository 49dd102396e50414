"""FP8 without promotion: the variant the promotion study compares the product's FP8 kernel against.

The product's FP8 GEMM promotes every K step's block accumulator into the fp32 tile accumulator
(:mod:`cute_moe.fp8_gemm`), because Hopper's FP8 WGMMA adds its products into an accumulator narrower
than fp32.  The study (``tests/test_cute_fp8_gpu.py::test_promotion_study``) measures what that buys
against a kernel whose WGMMAs accumulate all of K: :class:`OneLevelConfig` is a
:class:`~cute_moe.config.GemmConfig` whose ``two_level`` is False, so the kernel (:mod:`cute_moe.gemm`)
runs its single-accumulator main loop — the bf16 one — on E4M3 operands, and applies the per-tensor or
per-channel scales after it as it always does.  ``fp8_block`` has no such variant: its scales change
every 128 of K, so each block's sum must be scaled on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import GemmConfig

ONE_LEVEL_FORMATS = ("fp8_tensor", "fp8_channel")
"""The FP8 formats whose scales can wait until after the K loop."""


@dataclass(frozen=True)
class OneLevelConfig(GemmConfig):
    """An ``fp8_tensor`` / ``fp8_channel`` :class:`~cute_moe.config.GemmConfig` compiled without promotion:
    one accumulator over all of K (half the accumulator registers of the promoted kernel).  Its compile
    key differs from the promoted config's, so both live in the compile cache side by side."""

    def __post_init__(self):
        super().__post_init__()
        if self.quant not in ONE_LEVEL_FORMATS:
            raise ValueError(
                f"quant={self.quant!r}: a kernel without promotion takes {ONE_LEVEL_FORMATS} "
                f"(bf16 has no promotion; fp8_block's scales change every K block)"
            )

    @property
    def two_level(self) -> bool:
        return False

    def key(self) -> tuple:
        return ("one-level", *super().key())


def one_level(cfg: GemmConfig) -> OneLevelConfig:
    """``cfg`` (an ``fp8_tensor`` / ``fp8_channel`` config) compiled without promotion."""
    return OneLevelConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})

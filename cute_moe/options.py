"""The options of a cute_moe call checked against this backend's limits, on the host: :func:`check_options`.

:func:`cute_moe.plan.plan` calls it first, so a call it refuses is refused before any plan is made, whatever T.
"""

from __future__ import annotations

from moe_spec.validate import STATIC_SCALE_FORMAT

from .config import GemmConfig
from .limits import ALIGN_ELEMS, check_fusion, check_quant_layer


def check_options(
    K: int,
    I: int,
    quant=None,
    *,
    swap_ab=None,
    configs=None,
    fusion="fused",  # noqa: E741
    static: bool = False,
) -> tuple[GemmConfig, GemmConfig] | None:
    """The limits of this backend beyond the shared contract, all on the host (no launch, no sync).

    * ``K`` (hidden: GEMM1's K, GEMM2's N_out, the gathered and combined rows) and ``I``
      (intermediate: GEMM2's K; GEMM1's N_out is 2I, split in two halves by SiLU·mul) must be
      multiples of ``ALIGN_ELEMS`` = 8 bf16 — TMA's 16-byte row alignment and the row kernels'
      16-byte vectors.
    * ``swap_ab``: None or a bool.
    * ``configs``: None or a ``(GEMM1, GEMM2)`` pair of :class:`GemmConfig` (valid by
      construction) — GEMM1 without and GEMM2 with ``row_scale``, GEMM2 not gated (GEMM1 may be:
      SiLU·up in its epilogue); then ``swap_ab`` must be None.
    * FP8 ``quant``: the limits of :func:`~cute_moe.limits.check_quant_layer` (K and I multiples
      of 16, ``configs`` of the call's format).
    * ``fusion``: ``"fused"`` or ``"separate"`` (:func:`~cute_moe.limits.check_fusion`).
    * ``static`` (static activation scales, fp8_tensor only): a bool; a given GEMM1's ``epilogue_quant``
      must match it — "static" exactly with static scales.

    Returns ``configs`` as a tuple, or None when the path rule will choose.
    Raises TypeError / ValueError naming the argument and the limit.
    """
    for name, v in (("x: hidden size K = x.shape[1]", K), ("w2: intermediate size I = w2.shape[2]", I)):
        if v % ALIGN_ELEMS:
            raise ValueError(
                f"{name} = {v} must be a multiple of {ALIGN_ELEMS} for cute_moe "
                f"(TMA needs 16-byte aligned bf16 rows; the row kernels move 16-byte vectors)"
            )
    if swap_ab is not None and not isinstance(swap_ab, bool):
        raise TypeError(f"swap_ab: expected None or a bool, got {type(swap_ab).__name__}")
    if configs is not None:
        if swap_ab is not None:
            raise ValueError("swap_ab and configs: pass at most one (the configs already fix the path)")
        if (
            not isinstance(configs, (tuple, list))
            or len(configs) != 2
            or not all(isinstance(c, GemmConfig) for c in configs)
        ):
            raise TypeError(f"configs: expected a (GEMM1, GEMM2) pair of cute_moe.GemmConfig, got {configs!r}")
        for i, (cfg, want) in enumerate(zip(configs, (False, True))):
            if cfg.row_scale != want:
                raise ValueError(
                    f"configs[{i}]: row_scale must be {want} (GEMM{i + 1}"
                    f"{' applies the routing weights in its epilogue' if want else ' has no row scale'})"
                )
        if configs[1].gated or configs[1].gather_rows:
            raise ValueError(
                "configs[1]: gated and gather_rows must be False (SiLU·up belongs to GEMM1's epilogue; "
                "GEMM2's operand is already in sorted-row order)"
            )
        if configs[0].gather_rows and K % configs[0].tile_k:
            raise ValueError(
                f"configs[0]: gather_rows needs x: hidden size K = {K} to be a multiple of "
                f"tile_k = {configs[0].tile_k} (whole stages of a token row)"
            )
        configs = configs[0], configs[1]
    check_quant_layer(K, I, quant, configs)
    check_fusion(fusion)
    if type(static) is not bool:
        raise TypeError(f"static: expected a bool, got {static!r}")
    if static and quant != STATIC_SCALE_FORMAT:
        raise ValueError(f"static: static activation scales need quant={STATIC_SCALE_FORMAT!r}, got quant={quant!r}")
    fused = None if configs is None else configs[0].epilogue_quant
    if fused is not None and (fused == "static") != static:
        why = "needs static activation scales (a1_scale, a2_scale)"
        if fused != "static":
            why = "quantizes with dynamic scales; with static a1_scale / a2_scale it must be 'static' or None"
        raise ValueError(f"configs[0]: epilogue_quant={fused!r} {why}")
    return configs

"""The limits of this backend: the expert count, the row alignment every layer width obeys, the tiles a
:class:`~cute_moe.config.GemmConfig` accepts, and the FP8 layer's checks.

Both two-accumulator kernels hold two fp32 accumulators per tile in the consumer's registers — FP8 a
block accumulator beside the promoted one (``cute_moe.fp8_gemm``), a gated GEMM1 the gate and the up
sums (SiLU·up in the epilogue), a gated FP8 GEMM1 both pairs, four — so all are bound by
:data:`TWO_ACCUMULATOR_REGISTERS`; the
ping-pong schedule holds a whole tile in one warpgroup, cluster multicast shares a weight tile.
``GemmConfig`` calls :func:`check_pingpong`, :func:`check_fp8`, :func:`check_gated`,
:func:`check_cluster` and :func:`check_epilogue_quant` from its validation, and the plan
:func:`check_quant_layer`; :data:`LIMITS` is what every surface of the layer checks.  This module reads a
config's fields only and imports nothing of the package, so every module can read it.
"""

from __future__ import annotations

from moe_spec.hopper import TMA_ALIGN_BYTES, WGMMA_M, WGMMA_N_MAX, WGMMA_N_STEP
from moe_spec.quant import FP8_BLOCK
from moe_spec.validate import Limits

MAX_EXPERTS = 1024
"""Largest expert count: the alignment's shared ``[WARPS, E]`` table (32 KiB) and three ``[E]`` arrays
(:mod:`cute_moe.alignsteps`)."""

LIMITS = Limits("cute_moe", MAX_EXPERTS, cpu="on a CPU, cute_moe.compile_ptx() shows the kernels")
"""What this backend adds to the contract (:class:`moe_spec.validate.Limits`): every surface checks it —
``fused_moe`` (:mod:`cute_moe.moe`), the one-launch ``decode_fused_moe`` (:mod:`cute_moe.decode`), the op."""

ALIGN_ELEMS = TMA_ALIGN_BYTES // 2
"""Row alignment in elements: 16 bytes of bf16.  TMA needs every row stride (K of the operands,
N_out of the output) to be a multiple of 16 bytes, and the row kernels move one 16-byte vector per
thread step, so every row width the layer touches (K, I, 2I) must be a multiple of this."""

FP8_ALIGN_ELEMS = TMA_ALIGN_BYTES // 1
"""Row alignment of FP8 operands: 16-byte TMA rows are 16 E4M3 values (an FP8 layer's K and I)."""

MAX_CONSUMER_WARPGROUPS = 2
"""MMA warpgroups per CTA (plus one producer warpgroup): stacked along GEMM M on one tile (cooperative),
or one tile each (ping-pong)."""

SCHEDULES = ("cooperative", "pingpong")
"""How the consumer warpgroups share the work (``GemmConfig.schedule``)."""

CLUSTER_SIZES = (1, 2)
"""CTAs per cluster (``GemmConfig.cluster``): 1, or 2 whose weight tile is loaded once and
multicast into both (:mod:`cute_moe.gemm_parts`)."""

MAX_TILE_M = WGMMA_M * MAX_CONSUMER_WARPGROUPS
"""The largest GEMM tile M accepted: 64 rows × 2 consumer warpgroups = 128.  A larger M (swap-AB's
``weights_tile = 256``) would give every CTA tile two epilogue sub-tiles along M, an ordering of
accumulator registers to TMA-store boxes (``epi_order`` in gemm.py) that no GPU test has run."""


def _m_tiles(consumer_warpgroups: int) -> tuple[int, ...]:
    rows = WGMMA_M * consumer_warpgroups
    return tuple(range(rows, MAX_TILE_M + 1, rows))


def tokens_tiles(swap_ab: bool, consumer_warpgroups: int = MAX_CONSUMER_WARPGROUPS) -> tuple[int, ...]:
    """Every ``tokens_tile`` a :class:`~cute_moe.config.GemmConfig` accepts on a path (validation reads this).

    normal: the tokens are GEMM M — a multiple of 64 rows per consumer warpgroup of a tile, at most
    :data:`MAX_TILE_M`.  swap-AB: the tokens are WGMMA's N — a multiple of 8 in [8, 256], except
    the odd multiples of 8 above 8 (24, 40, …): with 16-bit operands the CuTe DSL aborts the
    process (SIGABRT, no message) slicing the staged, swizzled shared-memory layout at such an N.
    """
    if not swap_ab:
        return _m_tiles(consumer_warpgroups)
    return tuple(
        n
        for n in range(WGMMA_N_STEP, WGMMA_N_MAX + 1, WGMMA_N_STEP)
        if n == WGMMA_N_STEP or n % (2 * WGMMA_N_STEP) == 0
    )


def weights_tiles(swap_ab: bool, consumer_warpgroups: int = MAX_CONSUMER_WARPGROUPS) -> tuple[int, ...]:
    """Every ``weights_tile`` a :class:`~cute_moe.config.GemmConfig` accepts on a path (validation reads this).

    normal: the weight rows are WGMMA's N — a multiple of 16 in [16, 256].  swap-AB: they are GEMM
    M — a multiple of 64 rows per consumer warpgroup of a tile, at most :data:`MAX_TILE_M`.
    """
    if swap_ab:
        return _m_tiles(consumer_warpgroups)
    return tuple(range(2 * WGMMA_N_STEP, WGMMA_N_MAX + 1, 2 * WGMMA_N_STEP))


FP8_TILE_K = FP8_BLOCK
"""``tile_k`` of every FP8 config: 128 E4M3 = one 128-B swizzled row, and one K block of
``fp8_block`` (moe_spec.quant.FP8_BLOCK) — so one pipeline stage is one promotion of the block
accumulator, and a block's scales are constant over it."""

TWO_ACCUMULATOR_REGISTERS = 128
"""Most fp32 registers per consumer thread for two accumulators (FP8: block + promoted; gated:
gate + up): ``2 · tile_m · tile_n / (128 · consumer_warpgroups)``.  128 leaves room for addresses,
scales and the epilogue below the 232 registers ``setmaxnreg`` grants: 128×128 with two
warpgroups, or 64×128 with one, is the largest such tile — a gated 128×128 tile issues the WGMMA
work of a plain 128×256 one per K step.  A gated FP8 GEMM1 holds four (gate and up, each a block and
a promoted accumulator), so its largest tiles are 128×64 with two warpgroups and 64×64 with one."""

FP8_ACCUMULATOR_REGISTERS = TWO_ACCUMULATOR_REGISTERS
"""The FP8 kernel's bound (:data:`TWO_ACCUMULATOR_REGISTERS`)."""


PINGPONG_ACCUMULATOR_REGISTERS = TWO_ACCUMULATOR_REGISTERS
"""Most fp32 accumulator registers per consumer thread under ``schedule="pingpong"``, every accumulator
together: ``tile_m · tile_n / 128`` × 2 for FP8 (block + promoted) × 2 gated — one warpgroup holds the
whole tile.  128 is what the cooperative kernel's largest tiles hold per thread (128×256 over two
warpgroups, or a gated 128×128), so the ping-pong tiles allowed are those whose registers the
cooperative kernel already holds: bf16 64×256, 128×128, gated 64×128 or 128×64; FP8 64×128, gated FP8
64×64.  A 128×256 bf16 tile (256 registers) cannot fit the 232 that ``setmaxnreg`` grants."""


def check_pingpong(cfg) -> None:
    """The ping-pong limits: two consumer warpgroups, a whole tile's accumulators in one warpgroup."""
    if cfg.schedule != "pingpong":
        return
    if cfg.consumer_warpgroups != 2:
        raise ValueError(
            f"schedule='pingpong' with consumer_warpgroups={cfg.consumer_warpgroups}: ping-pong needs "
            f"consumer_warpgroups=2 (two warpgroups, each with a whole tile of its own, taking turns)"
        )
    if cfg.accumulator_registers > PINGPONG_ACCUMULATOR_REGISTERS:
        raise ValueError(
            f"tokens_tile={cfg.tokens_tile}, weights_tile={cfg.weights_tile}: under schedule='pingpong' one "
            f"warpgroup holds the whole {cfg.tile_m}×{cfg.tile_n} tile{' (gate + up)' if cfg.gated else ''}"
            f"{', block and promoted' if cfg.two_level else ''}: "
            f"{cfg.accumulator_registers} accumulator registers per thread, above {PINGPONG_ACCUMULATOR_REGISTERS}; "
            f"use a smaller tile (64×256, 128×128; gated 64×128, 128×64; FP8 64×128, gated FP8 64×64)"
        )


def _check_registers(cfg, what: str, kind: str) -> None:
    if cfg.accumulator_registers > TWO_ACCUMULATOR_REGISTERS:
        raise ValueError(
            f"tokens_tile={cfg.tokens_tile}, weights_tile={cfg.weights_tile}: the {kind} tile {cfg.tile_m}×"
            f"{cfg.tile_n} with {cfg.consumer_warpgroups} consumer warpgroup(s) needs {cfg.accumulator_registers} "
            f"accumulator registers per thread ({what}), above {TWO_ACCUMULATOR_REGISTERS}; use a "
            f"smaller tile or two warpgroups"
        )


def check_cluster(cfg) -> None:
    """The multicast limits: a cluster of 2 shares the weight tile of two token blocks — built for the
    normal path's cooperative tiles, bf16 or FP8 (the weights are WGMMA's B there; ping-pong would need
    the two CTAs' warpgroups to take their turns in step)."""
    if cfg.cluster not in CLUSTER_SIZES:
        raise ValueError(f"cluster={cfg.cluster}: expected one of {CLUSTER_SIZES} (CTAs sharing a weight tile)")
    if cfg.cluster > 1 and (cfg.swap_ab or cfg.schedule != "cooperative"):
        raise ValueError(
            f"cluster={cfg.cluster} with swap_ab={cfg.swap_ab}, schedule={cfg.schedule!r}: weight multicast "
            f"is built for the normal path's cooperative tiles (swap_ab=False, schedule='cooperative')"
        )


def check_gated(cfg) -> None:
    """The gated limits: GEMM1 (no row scale) writing :func:`gemm1_out_dtype` — bf16, or fp32 under FP8,
    whose scales stay in the epilogue (SiLU takes the dequantized gate and up) — and accumulators that
    fit: two (gate + up), four under FP8 (a block and a promoted one per half)."""
    if not cfg.gated:
        return
    if cfg.row_scale or cfg.out_dtype != gemm1_out_dtype(cfg.quant):
        raise ValueError(
            f"gated=True with quant={cfg.quant!r}, out_dtype={cfg.out_dtype!r}, "
            f"row_scale={cfg.row_scale}: SiLU·up in the epilogue is GEMM1's (row_scale=False), writing "
            f"out_dtype={gemm1_out_dtype(cfg.quant)!r} under quant={cfg.quant!r} "
            f"(bf16 for bf16; fp32 for FP8, whose intermediate is quantized again)"
        )
    if not cfg.epilogue_scales:
        raise ValueError(
            f"gated=True with quant={cfg.quant!r}, epilogue_scales=False: SiLU·up takes the dequantized "
            f"gate and up, so a gated FP8 GEMM1 applies its scales in the epilogue (epilogue_scales=True)"
        )
    _check_registers(cfg, "gate + up" if cfg.quant is None else "gate + up, each block + promoted", "gated")


def check_fp8(cfg) -> None:
    """The FP8 limits: tile_k is one 128-B row, block scales fit the tile, two accumulators fit."""
    if not cfg.epilogue_scales and cfg.quant not in ("fp8_tensor", "fp8_channel"):
        raise ValueError(
            f"epilogue_scales=False with quant={cfg.quant!r}: only fp8_tensor / fp8_channel can leave "
            f"their scales out (bf16 has none; fp8_block's scales change every K block)"
        )
    if cfg.quant is None:
        return
    if cfg.tile_k != FP8_TILE_K:
        raise ValueError(
            f"tile_k={cfg.tile_k}: FP8 configs need tile_k={FP8_TILE_K} (one 128-B swizzled row of "
            f"E4M3, and one K block of the scales: each K step is promoted on its own)"
        )
    if cfg.quant == "fp8_block" and FP8_BLOCK % cfg.weights_tile:
        raise ValueError(
            f"weights_tile={cfg.weights_tile}: fp8_block needs a weights tile that divides the "
            f"{FP8_BLOCK}-row scale block (one weight scale per tile and K step)"
        )
    if not cfg.gated:  # a gated one's four accumulators: check_gated
        _check_registers(cfg, "block + promoted", "FP8")


EPILOGUE_QUANTS = ("static", "block", "amax")
"""What a gated FP8 GEMM1's epilogue can do with the intermediate it computes (``GemmConfig.epilogue_quant``,
:mod:`cute_moe.epilogue_quant`): quantize it by the caller's static scale, quantize it per (row, 128-column
group), or take its amax."""


def check_epilogue_quant(cfg) -> None:
    """The fused quantization's limits: a gated FP8 GEMM1; "static" under fp8_tensor and "block" under
    fp8_block with whole 128-column groups in the tile, both on the normal path (where a token row of the
    tile lies in one quad of lanes); "amax" under any FP8 format on either path (under swap-AB a row is an
    accumulator column: each warp adds its share by its own atomic)."""
    q = cfg.epilogue_quant
    if q is None:
        return
    if q not in EPILOGUE_QUANTS:
        raise ValueError(f"epilogue_quant={q!r}: expected None or one of {EPILOGUE_QUANTS}")
    if not cfg.gated or cfg.quant is None:
        raise ValueError(
            f"epilogue_quant={q!r} with gated={cfg.gated}, quant={cfg.quant!r}: the epilogue quantizes the "
            f"SiLU·up of a gated FP8 GEMM1 (gated=True, an FP8 quant)"
        )
    if cfg.swap_ab and q != "amax":
        raise ValueError(
            f"epilogue_quant={q!r} with swap_ab=True: under swap-AB the epilogue takes the amax only "
            f"(epilogue_quant='amax'); {q!r} quantizes on the normal path (swap_ab=False)"
        )
    want = {"static": "fp8_tensor", "block": "fp8_block"}.get(q)
    if want is not None and cfg.quant != want:
        raise ValueError(f"epilogue_quant={q!r} with quant={cfg.quant!r}: {q!r} is {want}'s (quant={want!r})")
    if q == "block" and cfg.tile_n % FP8_BLOCK:
        raise ValueError(
            f"epilogue_quant='block' with weights_tile={cfg.weights_tile}: a tile must hold whole "
            f"{FP8_BLOCK}-column scale groups of the intermediate (weights_tile a multiple of {FP8_BLOCK})"
        )


# ---- the FP8 layer ----------------------------------------------------------------------------------
def gemm1_out_dtype(quant) -> str:
    """GEMM1's output dtype: fp32 under FP8 (SiLU·up is quantized from unrounded values, as the
    reference does — a bf16-rounded copy would move values across E4M3 rounding boundaries), bf16
    otherwise."""
    return "bfloat16" if quant is None else "float32"


def gated_quant_layer(quant, I: int) -> bool:  # noqa: E741
    """Whether a gated GEMM1 of FP8 format ``quant`` takes a layer of intermediate size ``I``: always,
    but for ``fp8_block`` only when I is a multiple of :data:`~moe_spec.quant.FP8_BLOCK` — the up rows
    ``I + n`` of a weight tile then lie in one 128-row scale block, as its gate rows ``n`` do (one weight
    scale per half, tile and K step)."""
    return quant is not None and (quant != "fp8_block" or I % FP8_BLOCK == 0)


def check_quant_layer(K: int, I: int, quant, configs) -> None:  # noqa: E741
    """This backend's limits for ``quant`` beyond ``options.check_options``'s (host only, before any launch).

    * FP8: ``K`` and ``I`` multiples of :data:`FP8_ALIGN_ELEMS` = 16 — an E4M3 row (x, the
      intermediate, a weight row) must be whole 16-byte TMA rows.
    * ``configs`` (already a checked pair): both of the call's format, GEMM1 writing
      :func:`gemm1_out_dtype` and GEMM2 bf16, with their scales applied (``epilogue_scales``: the
      configs are the fused pipeline's; ``fusion="separate"`` leaves the scales out itself); a gated
      FP8 GEMM1 only where :func:`gated_quant_layer` allows it.
    """
    if quant is not None:
        for name, v in (("x: hidden size K = x.shape[1]", K), ("w2: intermediate size I = w2.shape[2]", I)):
            if v % FP8_ALIGN_ELEMS:
                raise ValueError(
                    f"{name} = {v} must be a multiple of {FP8_ALIGN_ELEMS} for cute_moe with "
                    f"quant={quant!r} (TMA needs 16-byte rows: {FP8_ALIGN_ELEMS} E4M3 values)"
                )
    if configs is None:
        return
    for i, (cfg, out_dtype) in enumerate(zip(configs, (gemm1_out_dtype(quant), "bfloat16"))):
        if cfg.quant != quant:
            raise ValueError(f"configs[{i}]: quant={cfg.quant!r}, but the call's quant={quant!r}")
        if cfg.out_dtype != out_dtype:
            raise ValueError(
                f"configs[{i}]: out_dtype must be {out_dtype!r} with quant={quant!r} "
                f"(GEMM{i + 1} {'feeds the quantized intermediate' if i == 0 else 'writes the output'})"
            )
        if not cfg.epilogue_scales:
            raise ValueError(
                f"configs[{i}]: epilogue_scales must be True (the configs are the fused pipeline's: "
                f"unscaled sums would be the output; fusion='separate' leaves the scales out itself)"
            )
    if configs[0].gated and quant is not None and not gated_quant_layer(quant, I):
        raise ValueError(
            f"configs[0]: gated=True with quant={quant!r} needs w2: intermediate size I = w2.shape[2] = {I} "
            f"to be a multiple of {FP8_BLOCK} (the up rows I + n of a weight tile in one scale block)"
        )


FUSIONS = ("fused", "separate")
"""The pipelines of ``fusion``: the fused one (SiLU·up and the routing weight in the GEMMs' epilogues) and
the unfused passes of :mod:`cute_moe.unfused`."""


def check_fusion(fusion) -> str:
    """``fusion``: one of :data:`FUSIONS` (ValueError naming the argument otherwise)."""
    if not isinstance(fusion, str) or fusion not in FUSIONS:
        raise ValueError(f"fusion: expected one of {FUSIONS}, got {fusion!r}")
    return fusion

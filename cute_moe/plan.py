"""The CuTe backend's plan for one layer call: the path rule, the two GEMM configs and what follows.

:func:`plan` is where ``cute_moe`` makes every decision of a ``fused_moe`` call on the host, before
anything runs: the (GEMM1, GEMM2) :class:`~cute_moe.config.GemmConfig` pair — by the path rule
(:func:`path_rule`, :func:`choose_config`) for the call's format, bf16 or FP8, or given — the
pipeline (fused, or the unfused passes of :mod:`cute_moe.unfused`), whether a gated FP8 GEMM1 quantizes the
intermediate in its epilogue (:func:`epilogue_quant`), the alignment tile, and the WGMMA instruction of each
GEMM — or, by :func:`one_launch`, the whole layer in the one-launch decode kernel (:mod:`cute_moe.decode`).
It checks every option and limit of this backend, so a call it
refuses is refused whatever T (the empty-batch rule of :mod:`moe_spec.plan`).  :func:`plans_for`
lists every plan a layer can get.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from moe_spec.hopper import WGMMA_M, WGMMA_N_MAX, WGMMA_N_STEP
from moe_spec.plan import bucket_starts, tokens_per_expert
from moe_spec.quant import FP8_BLOCK, check_quant
from moe_spec.validate import MoEDims

from .config import GemmConfig, max_stages
from .decode_parts import PAIR_LANES, TOKENS, WGMMA, WGMMA_FP8, size_limit, stages, tile_k
from .gemm_rules import clustered, short_k_gemm2
from .limits import FP8_TILE_K, MAX_TILE_M, gated_quant_layer, gemm1_out_dtype
from .options import check_options
from .unfused import GATED_GEMM1, GATHER_IN_PRODUCER, separate_configs

# ---- the path rule: which path and token tile a GEMM takes -----------------------------------------
SWAP_AB_MAX_TOKENS_PER_EXPERT = WGMMA_M
"""The path rule: swap-AB while the mean tokens per expert is at most this (64).

Why 64: the normal path's smallest token tile is WGMMA's M = 64 rows, so below 64 tokens per
expert most of every normal tile multiplies padding, while swap-AB's token tile can shrink to
8 (N of WGMMA) and every weight byte still feeds a full 64-row M.

Measured on GEMM1 alone, every expert the same token count (``python -m cute_moe.lab.bench``,
notes/results/cute_bench_2026-11-30.md): swap-AB's 128-weight tiles were faster than the normal
64×256 tile at 1–32 tokens per expert, even at 64, and slower at 128 and 256."""

SWAP_AB_MAX_BY_LAYER: dict[tuple[int, int], float] = {}
"""Per layer (hidden K, intermediate I): its own limit in place of the 64 above, the largest mean tokens
per expert on swap-AB (``python -m cute_moe.lab.crossover`` prints the entries it measured)."""

SWAP_TOKEN_TILES = tuple(WGMMA_N_STEP << i for i in range((WGMMA_M // WGMMA_N_STEP).bit_length()))
"""The swap-AB token tiles the path rule picks from — the powers of two from WGMMA's smallest N (8)
to its M (64): 8, 16, 32, 64; the smallest one that covers the mean tokens per expert."""


def path_rule(swap_ab: bool | None = None, layer: tuple[int, int] | None = None) -> tuple[tuple[float, bool, int], ...]:
    """THE path rule: buckets ``(upper bound on the mean tokens per expert, inclusive; swap_ab;
    tokens_tile)``; :func:`choose_config` takes the first covering the mean, ``plans_for`` lists them.
    Forced swap-AB (``swap_ab=True``): the smallest of :data:`SWAP_TOKEN_TILES` covering the mean (64
    above).  Forced normal: 64-token tiles (one warpgroup's M) up to 64 per expert, 128 above.  The rule
    (None): forced swap-AB up to the limit of ``layer`` = (K, I) in :data:`SWAP_AB_MAX_BY_LAYER` (else
    :data:`SWAP_AB_MAX_TOKENS_PER_EXPERT`), forced normal above it."""
    swap = tuple((float(t), True, t) for t in SWAP_TOKEN_TILES[:-1]) + ((math.inf, True, SWAP_TOKEN_TILES[-1]),)
    normal = ((float(SWAP_AB_MAX_TOKENS_PER_EXPERT), False, WGMMA_M), (math.inf, False, MAX_TILE_M))
    if swap_ab is not None:
        return swap if swap_ab else normal
    limit = float(SWAP_AB_MAX_BY_LAYER.get(layer, SWAP_AB_MAX_TOKENS_PER_EXPERT))
    last = (limit, True, next(b for b in swap if limit <= b[0])[2])
    below = tuple(b for b in swap if b[0] < limit and b[2] != last[2])
    return below + ((last,) if limit > 0 else ()) + tuple(b for b in normal if b[0] > limit)


GATED_FP8_GEMM1 = ("swap_ab", "normal")
"""The paths (``"swap_ab"``: the decode buckets, ``"normal"``: prefill) on which the fused FP8 layer's
GEMM1 is gated — SiLU·up in its epilogue, each half promoted and dequantized with its own weight scales,
writing the fp32 intermediate ``[M_pad, I]`` instead of ``H [M_pad, 2I]`` (:func:`gated_gemm1`).  Both
tiles hold four accumulators (a gate and an up one, each a block and a promoted one), so the weights tile
is 64 output features: swap-AB 64 × the bucket's tokens on one consumer warpgroup, normal the bucket's
tokens × 64.  Drop a path to give it back the plain GEMM1 (128 weight rows) and the SiLU·up pass
(``quantops.RowAmax``, ``silu=True``).  Both paths ship gated: the layer's outputs are the plain path's
bit for bit and its time is lower on every measured cell (notes/cute_moe.md §6)."""


def gated_gemm1(quant, fusion: str, I: int, swap_ab: bool) -> bool:  # noqa: E741
    """THE rule for SiLU·up in GEMM1's epilogue, for the fused plan's GEMM1 on the path ``swap_ab``:
    bf16 while :data:`~cute_moe.unfused.GATED_GEMM1`; FP8 on the paths of :data:`GATED_FP8_GEMM1` where
    the layer allows it (:func:`~cute_moe.limits.gated_quant_layer`: fp8_block with I a multiple of
    128); never in the unfused pipeline (``fusion="separate"``)."""
    if fusion != "fused":
        return False
    if quant is None:
        return GATED_GEMM1
    return gated_quant_layer(quant, I) and ("swap_ab" if swap_ab else "normal") in GATED_FP8_GEMM1


EPILOGUE_QUANT = True
"""Whether the fused FP8 plan quantizes the intermediate in its gated GEMM1's epilogue (:func:`epilogue_quant`,
:mod:`cute_moe.epilogue_quant`).  Set it False — then ``cute_moe.moe.forget_calls()`` — to force today's path
(GEMM1 writes the fp32 intermediate, the amax and quantize launches follow) in tests and benches; explicit
``configs`` carry their own choice (``GemmConfig.epilogue_quant``, None: today's path).  It matters only
where GEMM1 is gated (:data:`GATED_FP8_GEMM1`; notes/cute_moe.md §6)."""


SWAP_AB_EPILOGUE_AMAX = True
"""Whether a gated FP8 GEMM1 on the swap-AB path (decode) takes the intermediate's amax in its epilogue
(``epilogue_quant="amax"``: one launch fewer per call, the same bits); faster in every decode cell timed
(``python -m cute_moe.lab.bench_schedule --variants swap_amax``, notes/results/gpu_h100_2026-12-07_e27de90.md).
Set it — through ``cute_moe.moe.plan_switches`` — in tests and benches."""


def epilogue_quant(gemm1: GemmConfig, static: bool = False) -> str | None:
    """THE rule for the intermediate's quantization in GEMM1's epilogue (``GemmConfig.epilogue_quant``) of the
    fused plan's ``gemm1``, with static activation scales or not: only for a gated FP8 GEMM1 (the unfused
    pipeline keeps today's path) while :data:`EPILOGUE_QUANT` — "static" with static scales (fp8_tensor) on
    the normal path, "block" for fp8_block where a tile holds whole 128-column groups (none of today's gated
    tiles: they are 64 features wide, ``limits.TWO_ACCUMULATOR_REGISTERS``), else "amax" (the amax in the
    epilogue, the quantize launch after it) — under swap-AB "amax" only, while :data:`SWAP_AB_EPILOGUE_AMAX`
    (static scales there: today's path)."""
    if not EPILOGUE_QUANT or not gemm1.gated or gemm1.quant is None:
        return None
    if gemm1.swap_ab:
        return "amax" if SWAP_AB_EPILOGUE_AMAX and not static else None
    if static:
        return "static"
    return "block" if gemm1.quant == "fp8_block" and gemm1.tile_n % FP8_BLOCK == 0 else "amax"


GATHER_QUANT = True
"""Whether the fused FP8 plan quantizes x where its rows are gathered (``LayerPlan.gather_quant``: one
:class:`~cute_moe.quantops.GatherQuantizeRows` launch writes the E4M3 rows in sorted order and their scales
in GEMM1's order; fp8_block takes no amax launch at all; static scales: ``StaticGatherQuantizeRows``) instead
of quantizing x's T rows, then gathering the codes and the scales — where :func:`gather_quant` says.  The
same bits either way (``python -m cute_moe.lab.bench_schedule --variants gather_quant``,
notes/results/gpu_h100_2026-12-07_e27de90.md).  Set it — through ``cute_moe.moe.plan_switches`` — in tests and
benches."""

GATHER_QUANT_NORMAL_TOP_K: int | None = 2
"""The normal path (prefill) quantizes x in the gather only up to this many slots per token (None: at any
top_k).  Per sorted row the gathering quantize reads the token's bf16 row, so with more than two slots it reads
x more often than the separate path's one pass; timed neutral at Mixtral-8x7B T = 4096 (top_k 2: 0.997×,
1.000×), not at a larger top_k.  The swap-AB path (decode), where the launch it saves is most of the gain, takes
it at any top_k (0.88–1.00× on the three catalog shapes)."""


def gather_quant(quant, fusion: str, swap_ab: bool = True, top_k: int = 1) -> bool:
    """THE rule for x's quantization where its rows are gathered (:data:`GATHER_QUANT`): the fused FP8
    pipeline, with dynamic or static scales (the unfused reference keeps its separate passes), on the swap-AB
    path, and on the normal path up to :data:`GATHER_QUANT_NORMAL_TOP_K` slots per token."""
    if not GATHER_QUANT or quant is None or fusion != "fused":
        return False
    return swap_ab or GATHER_QUANT_NORMAL_TOP_K is None or top_k <= GATHER_QUANT_NORMAL_TOP_K


@functools.cache
def _rule_config(
    swap_ab: bool, tokens_tile: int, wide: bool, row_scale: bool, quant: str | None, out_dtype: str, gated: bool
) -> GemmConfig:
    operands = dict(dtype="bfloat16") if quant is None else dict(dtype="float8_e4m3fn", tile_k=FP8_TILE_K)
    common = dict(quant=quant, out_dtype=out_dtype, row_scale=row_scale, gated=gated, **operands)
    if swap_ab:  # weights fill M: 128 rows = two consumer warpgroups (gated: 64 features, gate + up = 128 rows)
        rows = WGMMA_M if gated else MAX_TILE_M
        cfg = GemmConfig(
            swap_ab=True, tokens_tile=tokens_tile, weights_tile=rows, consumer_warpgroups=rows // WGMMA_M, **common
        )
    else:  # one consumer warpgroup per 64 token rows; the widest WGMMA N when the layer is that wide (bf16)
        if gated and quant is not None:  # four accumulators: 64 features (limits.TWO_ACCUMULATOR_REGISTERS)
            weights_tile = WGMMA_M
        else:
            weights_tile = WGMMA_N_MAX if wide and quant is None and not gated else 128
        cfg = GemmConfig(
            swap_ab=False,
            tokens_tile=tokens_tile,
            weights_tile=weights_tile,
            consumer_warpgroups=tokens_tile // WGMMA_M,
            **common,
        )
    return cfg.replace(stages=max_stages(cfg))


def choose_config(
    tokens_per_expert: float,
    n_out: int,
    k: int,
    *,
    swap_ab: bool | None = None,
    row_scale: bool = False,
    quant: str | None = None,
    out_dtype: str = "bfloat16",
    gated: bool = False,
    layer: tuple | None = None,
) -> GemmConfig:
    """Pick the kernel for one expert GEMM ``[T_e, k] × [n_out, k]ᵀ`` by :func:`path_rule`.

    ``tokens_per_expert`` is the mean routed tokens per expert (``T · top_k / E``), known on the
    host without reading the routing.  ``swap_ab`` forces a path (None: the rule for ``layer`` = (K, I)).

    * swap-AB: weights fill M (128 rows = two consumer warpgroups), and the token tile is the
      rule's bucket, so decode (a handful of tokens per expert) multiplies almost no padding and
      streams every weight byte once per token tile.
    * normal: 128 tokens × 256 weights per tile with two consumer warpgroups (the compute-bound
      shape: 128·256 accumulators per 64-deep K step; 128 weights when ``n_out < 256``), or 64
      tokens with one warpgroup when the normal path is forced at ≤ 64 tokens per expert.
    * FP8 (``quant``): the same buckets, ``tile_k`` = :data:`FP8_TILE_K` and 128-weight tiles (two
      accumulators: :data:`FP8_ACCUMULATOR_REGISTERS`); ``out_dtype``: fp32 for an FP8 GEMM1.
    * ``gated`` (the bf16 GEMM1 with SiLU·up in its epilogue; ``n_out`` is then I, the output
      width): the same buckets; each stage carries the gate and the up tile, so the weights tile
      is half the plain one — 64 features with one warpgroup on swap-AB, 128 on the normal path
      (two accumulators: :data:`TWO_ACCUMULATOR_REGISTERS`) — and the stage bytes and the number
      of tiles are the plain GEMM1's.  A gated FP8 GEMM1 holds four accumulators (gate and up, each a
      block and a promoted one): 64 features on both paths.

    The deepest ring that fits the shared memory is taken; ``k`` does not change the tile.
    """
    swap, tokens_tile = _bucket(tokens_per_expert, swap_ab, layer)
    return _rule_config(swap, tokens_tile, n_out >= WGMMA_N_MAX, row_scale, quant, out_dtype, gated)


def _bucket(tokens_per_expert: float, swap_ab: bool | None, layer) -> tuple[bool, int]:
    """(swap_ab, tokens_tile) of the first :func:`path_rule` bucket covering ``tokens_per_expert``."""
    _, swap, tokens_tile = next(b for b in path_rule(swap_ab, layer) if tokens_per_expert <= b[0])
    return swap, tokens_tile


# ---- the path: the one launch or the grouped pipeline ----------------------------------------------
ONE_LAUNCH = True
"""Whether :func:`one_launch` may answer True.  Set it False — then ``cute_moe.moe.forget_calls()`` — to run
the grouped pipeline at every T (tests, benches: the same call on both paths)."""

ONE_LAUNCH_MAX_I = 2048
"""The widest intermediate I :func:`one_launch` takes: the small-expert layers where the one launch measured at
least as fast as the grouped pipeline; Mixtral-8x7B's wide I measured slower and keeps the grouped pipeline
(notes/decode.md, "The second H100 run")."""


ONE_LAUNCH_FORMATS = (None,)
"""The formats :func:`one_launch` takes: bf16 (None).  The FP8 one launch (:mod:`cute_moe.decode_quant`) computes
the grouped FP8 pipeline's bits but measured slower than it in a CUDA graph (notes/decode.md, "FP8 in the CuTe
kernel"); a format added here sends its calls there."""


def one_launch(dims: MoEDims, quant=None, fusion: str = "fused", swap_ab=None, configs=None) -> bool:
    """THE path rule: the whole layer in one launch (:func:`cute_moe.decode.decode_fused_moe`) unless
    :func:`grouped_because` finds a reason for the grouped pipeline."""
    return grouped_because(dims, quant, fusion, swap_ab, configs) is None


def grouped_because(dims: MoEDims, quant=None, fusion: str = "fused", swap_ab=None, configs=None) -> str | None:
    """Why :func:`one_launch` leaves a call to the grouped pipeline, in words, or None: :data:`ONE_LAUNCH` off, a
    ``quant`` not in :data:`ONE_LAUNCH_FORMATS`, an explicit option (``fusion``, ``swap_ab``, ``configs``), sizes
    the kernel does not serve (:func:`~cute_moe.decode_parts.size_limit`: T·top_k within its pair lanes, K and I
    whole tiles), I above :data:`ONE_LAUNCH_MAX_I`."""
    if not ONE_LAUNCH:
        return "the ONE_LAUNCH switch is off"
    if quant not in ONE_LAUNCH_FORMATS:
        return f"quant {quant!r} is not in ONE_LAUNCH_FORMATS (the one launch measured slower in that format)"
    for name, given in (
        ("fusion", fusion != "fused"),
        ("swap_ab", swap_ab is not None),
        ("configs", configs is not None),
    ):
        if given:
            return f"{name} was given: an explicit option asks for the grouped pipeline"
    limit = size_limit(dims.T, dims.top_k, dims.K, dims.I, quant is not None)
    if limit is not None:
        return limit[1]
    if dims.I > ONE_LAUNCH_MAX_I:
        return f"I = {dims.I} > ONE_LAUNCH_MAX_I = {ONE_LAUNCH_MAX_I} (not measured against the grouped pipeline)"
    return None


# ---- the plan of one call ---------------------------------------------------------------------------
#: How far :func:`plans_for` looks by default (the largest batch the harness runs, doubled).
MAX_TOKENS = 8192


def _tile_text(cfg: GemmConfig) -> str:
    w, t = cfg.weights_tile, cfg.tokens_tile
    gated = " silu" if cfg.gated else ""  # SiLU·up in the epilogue: W counts output features (I)
    gather = " gather" if cfg.gather_rows else ""  # token rows read by index from x
    epi = f" epi:{cfg.epilogue_quant}" if cfg.epilogue_quant else ""  # the intermediate quantized in it
    pingpong = " pingpong" if cfg.pingpong else ""  # each consumer warpgroup owns a whole tile (gemm.py)
    cluster = f" cluster{cfg.cluster}" if cfg.cluster > 1 else ""  # weight tiles multicast (gemm.py)
    return (
        f"{f'swap-AB W{w}xT{t}' if cfg.swap_ab else f'T{t}xW{w}'} k{cfg.tile_k} s{cfg.stages}"
        f"{gated}{gather}{epi}{pingpong}{cluster}"
    )


@dataclass(frozen=True)
class LayerPlan:
    """What ``fused_moe`` runs for one layer call (see :mod:`moe_spec.plan` for the interface).

    ``path`` "grouped": ``gemm1`` (no row scale; in the fused pipeline gated — SiLU·up in its epilogue — by
    :func:`gated_gemm1`) and ``gemm2`` (applies the routing weights in its epilogue — unless
    ``fusion`` is ``"separate"``, whose passes apply them) are the decisions; everything else is
    read from them.  Under an FP8 ``quant`` both GEMMs are E4M3 configs of that format, GEMM1
    writing fp32.  ``path`` "decode" (:func:`one_launch`): one launch of the decode kernel, no GemmConfig
    (``gemm1``, ``gemm2`` None); its GEMMs are swap-AB tiles of its own constants (:mod:`cute_moe.decode_parts`).
    """

    gemm1: GemmConfig | None
    gemm2: GemmConfig | None
    quant: str | None = None
    fusion: str = "fused"
    path: str = "grouped"
    gather_quant: bool = False  # FP8: x quantized where its rows are gathered (:func:`gather_quant`)

    @property
    def align_tile(self) -> int:
        """Every expert's run is padded to this many rows: both GEMMs' token tiles' lcm (decode: its MMA's N)."""
        return TOKENS if self.path == "decode" else math.lcm(self.gemm1.tokens_tile, self.gemm2.tokens_tile)

    @property
    def swap_ab(self) -> tuple[bool, bool]:
        return (True, True) if self.path == "decode" else (self.gemm1.swap_ab, self.gemm2.swap_ab)

    @property
    def mma(self) -> tuple[str, str]:
        """The WGMMA each GEMM issues (:attr:`GemmConfig.wgmma <cute_moe.config.GemmConfig.wgmma>`; decode: its own)."""
        if self.path == "decode":
            return (WGMMA, WGMMA) if self.quant is None else (WGMMA_FP8, WGMMA_FP8)
        return (self.gemm1.wgmma, self.gemm2.wgmma)

    def describe(self) -> str:
        """``G1 swap-AB W128xT8 k64 s6 silu m64n8k16 | G2 …``: each GEMM's tile, K step, stages, ``silu``
        for a gated GEMM1, ``gather`` for a gathering one, ``epi:static`` / ``epi:block`` / ``epi:amax`` for
        an FP8 GEMM1 that quantizes the intermediate (or takes its amax) in its epilogue, ``pingpong`` for the
        ping-pong schedule, ``cluster2`` for clusters of two CTAs, WGMMA shape (k32 is FP8), and ``| separate``
        for the unfused pipeline; ``| xq:gather`` after the GEMMs where :attr:`gather_quant`.  Decode:
        ``decode 1-launch swap-AB W64xT16 k64 s8 m64n16k16``."""
        shapes = [re.search(r"m\d+n\d+k\d+", m).group() for m in self.mma]  # "m64n8k16"
        if self.path == "decode":
            k = tile_k(self.quant is not None)
            return f"decode 1-launch swap-AB W{WGMMA_M}xT{TOKENS} k{k} s{stages()} {shapes[0]}"
        gemms = [f"G{i} {_tile_text(c)} {s}" for i, c, s in zip((1, 2), (self.gemm1, self.gemm2), shapes)]
        xq = ["xq:gather"] if self.gather_quant else []  # after the GEMMs: readers take the first two as G1, G2
        return " | ".join(gemms + xq + ([] if self.fusion == "fused" else [self.fusion]))


def plan(
    dims: MoEDims,
    quant: str | None = None,
    *,
    swap_ab: bool | None = None,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    fusion: str = "fused",
    static: bool = False,
) -> LayerPlan:
    """The plan of one ``fused_moe`` call with sizes ``dims`` (a :class:`moe_spec.validate.MoEDims`).

    ``quant``: any format of :data:`moe_spec.quant.FORMATS` — bf16, or an FP8 one (E4M3 GEMMs
    with that format's scales, GEMM1 writing fp32 for the intermediate's quantization).
    Options (those of ``fused_moe``): ``swap_ab`` forces the path (None: the rule in
    :func:`path_rule`); ``configs`` gives the (GEMM1, GEMM2) configs of the fused
    pipeline outright; ``fusion="separate"`` turns them into the unfused pipeline's
    (:func:`~cute_moe.unfused.separate_configs`, GEMM1 plain: SiLU·mul runs as its own kernel).
    The fused pipeline's GEMM1 is gated (SiLU·up in its epilogue) by :func:`gated_gemm1` (bf16 while
    :data:`~cute_moe.unfused.GATED_GEMM1`, FP8 on the paths of :data:`GATED_FP8_GEMM1`); bf16's gathers
    its token rows from x (no sorted copy) while
    :data:`~cute_moe.unfused.GATHER_IN_PRODUCER`; a gated FP8 GEMM1 quantizes the intermediate in its
    epilogue by :func:`epilogue_quant` (``static``: the call passes static activation scales).  A call
    :func:`one_launch` takes gets the one-launch plan (``path="decode"``), after the same checks.
    Raises TypeError / ValueError naming a bad option or an unsupported size.
    """
    if not isinstance(dims, MoEDims):
        raise TypeError(f"dims: expected a moe_spec.validate.MoEDims, got {type(dims).__name__}")
    check_quant(quant)
    given = check_options(dims.K, dims.I, quant, swap_ab=swap_ab, configs=configs, fusion=fusion, static=static)
    if one_launch(dims, quant, fusion, swap_ab, configs):
        return LayerPlan(None, None, quant=quant, path="decode")
    return _grouped_plan(dims, quant, given, swap_ab, fusion, static)


def _grouped_plan(dims: MoEDims, quant, given, swap_ab, fusion: str, static: bool) -> LayerPlan:
    """:func:`plan`'s grouped pipeline for checked options (``given``: :func:`check_options`' answer)."""
    if given is None:
        per_expert = tokens_per_expert(dims.T, dims.E, dims.top_k)
        gated = gated_gemm1(quant, fusion, dims.I, _bucket(per_expert, swap_ab, (dims.K, dims.I))[0])
        gemm1 = choose_config(
            per_expert,
            dims.I if gated else 2 * dims.I,
            dims.K,
            swap_ab=swap_ab,
            quant=quant,
            out_dtype=gemm1_out_dtype(quant),
            gated=gated,
            layer=(dims.K, dims.I),
        )
        if GATHER_IN_PRODUCER and quant is None and fusion == "fused" and dims.K % gemm1.tile_k == 0:
            gemm1 = gemm1.replace(gather_rows=True)  # no X_sorted: GEMM1's producer reads x by token index
        gemm2 = choose_config(
            per_expert, dims.K, dims.I, swap_ab=swap_ab, row_scale=True, quant=quant, layer=(dims.K, dims.I)
        )
        if fusion == "fused":  # ping-pong for a short GEMM2, clusters of two (gemm_rules.py)
            gemm2 = short_k_gemm2(gemm2, dims.I)
            gemm1, gemm2 = clustered(gemm1, dims.K, gemm2=False), clustered(gemm2, dims.I, gemm2=True)
            gemm1 = gemm1.replace(epilogue_quant=epilogue_quant(gemm1, static))
        given = (gemm1, gemm2)
    if fusion == "separate":  # the unfused reference: a plain GEMM1, SiLU·mul as its own kernel
        plain = given[0].replace(gated=False, gather_rows=False, epilogue_quant=None)
        given = separate_configs(plain, given[1])
    xq = gather_quant(quant, fusion, given[0].swap_ab, dims.top_k)
    return LayerPlan(*given, quant=quant, fusion=fusion, gather_quant=xq)


def plans_for(
    E: int,
    K: int,
    I: int,
    top_k: int,
    quant: str | None = None,  # noqa: E741
    max_tokens: int = MAX_TOKENS,
    **options,
) -> tuple[LayerPlan, ...]:
    """Every distinct plan this layer gets for T = 1 … ``max_tokens`` (with the same ``options``: :func:`plan`'s,
    ``static`` included), in order of T: the plan at the first T of each bucket of :func:`path_rule` and at the
    first T past the one launch's pair lanes (:func:`one_launch`)."""
    starts = (
        [1]
        if options.get("configs") is not None
        else bucket_starts([b[0] for b in path_rule(options.get("swap_ab"), (K, I))], E, top_k)
    )
    starts = sorted(set(starts + [PAIR_LANES // top_k + 1]))
    plans = [plan(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k), quant, **options) for T in starts if T <= max_tokens]
    return tuple(dict.fromkeys(plans))


def layer_configs(
    T: int,
    E: int,
    K: int,
    I: int,
    top_k: int,
    swap_ab: bool | None = None,  # noqa: E741
    quant: str | None = None,
) -> tuple[GemmConfig, GemmConfig]:
    """The (GEMM1, GEMM2) configs of :func:`plan`'s grouped pipeline (for callers that want the configs only,
    which time its steps); where the plan is the one launch (:func:`one_launch`), those it runs with it off."""
    check_quant(quant)
    given = check_options(K, I, quant, swap_ab=swap_ab)
    p = _grouped_plan(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k), quant, given, swap_ab, "fused", False)
    return p.gemm1, p.gemm2

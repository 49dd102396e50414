"""The CuTe backend's plan for one layer call: the two GEMM configs and what follows from them.

:func:`plan` is where ``cute_moe`` makes every decision of a ``fused_moe`` call on the host,
before anything runs: the (GEMM1, GEMM2) :class:`~cute_moe.config.GemmConfig` pair (by the path
rule of :func:`~cute_moe.config.choose_config` for the call's format — bf16 or FP8 — or given), the
pipeline (fused, or the unfused passes of :mod:`cute_moe.unfused`), the alignment tile, the path and
the WGMMA instruction of each GEMM.  It also checks every option and limit of this backend, so a
call it refuses is refused whatever T (the empty-batch rule of :mod:`moe_spec.plan`).
:func:`plans_for` lists every plan a layer can get, for a warm-up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from moe_spec.plan import bucket_starts, tokens_per_expert
from moe_spec.quant import check_quant
from moe_spec.validate import MoEDims

from .config import ALIGN_ELEMS, GemmConfig, choose_config, path_rule
from .fusion import GATED_GEMM1, GATHER_IN_PRODUCER
from .gemm_rules import clustered, short_k_gemm2
from .moe_fp8 import check_quant_layer, gemm1_out_dtype
from .ptx import mma_instruction
from .unfused import check_fusion, separate_configs

#: How far :func:`plans_for` looks by default (the largest batch the harness runs, doubled).
MAX_TOKENS = 8192

def _tile_text(cfg: GemmConfig) -> str:
    w, t = cfg.weights_tile, cfg.tokens_tile
    gated = " silu" if cfg.gated else ""  # SiLU·up in the epilogue: W counts output features (I)
    gather = " gather" if cfg.gather_rows else ""  # token rows read by index from x
    pingpong = " pingpong" if cfg.pingpong else ""  # each consumer warpgroup owns a whole tile (gemm.py)
    cluster = f" cluster{cfg.cluster}" if cfg.cluster > 1 else ""  # weight tiles multicast (cluster.py)
    return (f"{f'swap-AB W{w}xT{t}' if cfg.swap_ab else f'T{t}xW{w}'} k{cfg.tile_k} s{cfg.stages}"
            f"{gated}{gather}{pingpong}{cluster}")


@dataclass(frozen=True)
class LayerPlan:
    """What ``fused_moe`` runs for one layer call (see :mod:`moe_spec.plan` for the interface).

    ``gemm1`` (no row scale; in the bf16 fused pipeline gated — SiLU·up in its epilogue, see
    :data:`~cute_moe.fusion.GATED_GEMM1`) and ``gemm2`` (applies the routing weights in its epilogue — unless
    ``fusion`` is ``"separate"``, whose passes apply them) are the decisions; everything else is
    read from them.  Under an FP8 ``quant`` both GEMMs are E4M3 configs of that format, GEMM1
    writing fp32.
    """

    gemm1: GemmConfig
    gemm2: GemmConfig
    quant: str | None = None
    fusion: str = "fused"

    @property
    def align_tile(self) -> int:
        """Every expert's run is padded to this many rows: a multiple of both GEMMs' token tiles."""
        return math.lcm(self.gemm1.tokens_tile, self.gemm2.tokens_tile)

    @property
    def swap_ab(self) -> tuple[bool, bool]:
        return self.gemm1.swap_ab, self.gemm2.swap_ab

    @property
    def mma(self) -> tuple[str, str]:
        """The WGMMA each GEMM compiles to, read from its kernel's tiled MMA (:func:`~cute_moe.ptx.mma_instruction`)."""
        return mma_instruction(self.gemm1), mma_instruction(self.gemm2)

    def describe(self) -> str:
        """``G1 swap-AB W128xT8 k64 s6 silu m64n8k16 | G2 …``: each GEMM's tile, K step, stages, ``silu``
        for a gated GEMM1, ``gather`` for a gathering one, ``pingpong`` for the ping-pong schedule,
        ``cluster2`` for clusters of two CTAs, WGMMA shape (k32 is FP8), and ``| separate`` for the unfused pipeline."""
        shapes = [re.search(r"m\d+n\d+k\d+", m).group() for m in self.mma]  # "m64n8k16"
        gemms = [f"G{i} {_tile_text(c)} {s}" for i, c, s in zip((1, 2), (self.gemm1, self.gemm2), shapes)]
        return " | ".join(gemms + ([] if self.fusion == "fused" else [self.fusion]))


def check_options(K: int, I: int, quant=None, *, swap_ab=None, configs=None, fusion="fused"  # noqa: E741
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
    * FP8 ``quant``: the limits of :func:`~cute_moe.moe_fp8.check_quant_layer` (K and I multiples
      of 16, ``configs`` of the call's format).
    * ``fusion``: ``"fused"`` or ``"separate"`` (:func:`~cute_moe.unfused.check_fusion`).

    Returns ``configs`` as a tuple, or None when the path rule will choose.
    Raises TypeError / ValueError naming the argument and the limit.
    """
    for name, v in (("x: hidden size K = x.shape[1]", K), ("w2: intermediate size I = w2.shape[2]", I)):
        if v % ALIGN_ELEMS:
            raise ValueError(f"{name} = {v} must be a multiple of {ALIGN_ELEMS} for cute_moe "
                             f"(TMA needs 16-byte aligned bf16 rows; the row kernels move 16-byte vectors)")
    if swap_ab is not None and not isinstance(swap_ab, bool):
        raise TypeError(f"swap_ab: expected None or a bool, got {type(swap_ab).__name__}")
    if configs is not None:
        if swap_ab is not None:
            raise ValueError("swap_ab and configs: pass at most one (the configs already fix the path)")
        if (not isinstance(configs, (tuple, list)) or len(configs) != 2
                or not all(isinstance(c, GemmConfig) for c in configs)):
            raise TypeError(f"configs: expected a (GEMM1, GEMM2) pair of cute_moe.GemmConfig, got {configs!r}")
        for i, (cfg, want) in enumerate(zip(configs, (False, True))):
            if cfg.row_scale != want:
                raise ValueError(f"configs[{i}]: row_scale must be {want} (GEMM{i + 1}"
                                 f"{' applies the routing weights in its epilogue' if want else ' has no row scale'})")
        if configs[1].gated or configs[1].gather_rows:
            raise ValueError("configs[1]: gated and gather_rows must be False (SiLU·up belongs to GEMM1's epilogue; "
                             "GEMM2's operand is already in sorted-row order)")
        if configs[0].gather_rows and K % configs[0].tile_k:
            raise ValueError(f"configs[0]: gather_rows needs x: hidden size K = {K} to be a multiple of "
                             f"tile_k = {configs[0].tile_k} (whole stages of a token row)")
        configs = configs[0], configs[1]
    check_quant_layer(K, I, quant, configs)
    check_fusion(fusion)
    return configs


def plan(dims: MoEDims, quant: str | None = None, *, swap_ab: bool | None = None,
         configs: tuple[GemmConfig, GemmConfig] | None = None, fusion: str = "fused") -> LayerPlan:
    """The plan of one ``fused_moe`` call with sizes ``dims`` (a :class:`moe_spec.validate.MoEDims`).

    ``quant``: any format of :data:`moe_spec.quant.FORMATS` — bf16, or an FP8 one (E4M3 GEMMs
    with that format's scales, GEMM1 writing fp32 for the intermediate's quantization).
    Options (those of ``fused_moe``): ``swap_ab`` forces the path (None: the rule in
    :func:`~cute_moe.config.path_rule`); ``configs`` gives the (GEMM1, GEMM2) configs of the fused
    pipeline outright; ``fusion="separate"`` turns them into the unfused pipeline's
    (:func:`~cute_moe.unfused.separate_configs`, GEMM1 plain: SiLU·mul runs as its own kernel).
    The bf16 fused pipeline's GEMM1 is gated (SiLU·up in its epilogue) while
    :data:`~cute_moe.fusion.GATED_GEMM1`, and gathers its token rows from x (no sorted copy) while
    :data:`~cute_moe.fusion.GATHER_IN_PRODUCER`.
    Raises TypeError / ValueError naming a bad option or an unsupported size.
    """
    if not isinstance(dims, MoEDims):
        raise TypeError(f"dims: expected a moe_spec.validate.MoEDims, got {type(dims).__name__}")
    check_quant(quant)
    given = check_options(dims.K, dims.I, quant, swap_ab=swap_ab, configs=configs, fusion=fusion)
    if given is None:
        per_expert = tokens_per_expert(dims.T, dims.E, dims.top_k)
        gated = GATED_GEMM1 and quant is None and fusion == "fused"
        gemm1 = choose_config(per_expert, dims.I if gated else 2 * dims.I, dims.K, swap_ab=swap_ab, quant=quant,
                              out_dtype=gemm1_out_dtype(quant), gated=gated, layer=(dims.K, dims.I))
        if GATHER_IN_PRODUCER and quant is None and fusion == "fused" and dims.K % gemm1.tile_k == 0:
            gemm1 = gemm1.replace(gather_rows=True)  # no X_sorted: GEMM1's producer reads x by token index
        gemm2 = choose_config(per_expert, dims.K, dims.I, swap_ab=swap_ab, row_scale=True, quant=quant,
                              layer=(dims.K, dims.I))
        if fusion == "fused":  # ping-pong for a short GEMM2 (schedule.py), clusters of two (cluster.py)
            gemm2 = short_k_gemm2(gemm2, dims.I)
            gemm1, gemm2 = clustered(gemm1, dims.K, gemm2=False), clustered(gemm2, dims.I, gemm2=True)
        given = (gemm1, gemm2)
    if fusion == "separate":  # the unfused reference: a plain GEMM1, SiLU·mul as its own kernel
        given = separate_configs(given[0].replace(gated=False, gather_rows=False), given[1])
    return LayerPlan(*given, quant=quant, fusion=fusion)


def plans_for(E: int, K: int, I: int, top_k: int, quant: str | None = None,  # noqa: E741
              max_tokens: int = MAX_TOKENS, **options) -> tuple[LayerPlan, ...]:
    """Every distinct plan this layer gets for T = 1 … ``max_tokens`` (with the same ``options``),
    in order of T: the plan at the first T of each bucket of :func:`~cute_moe.config.path_rule`."""
    starts = [1] if options.get("configs") is not None else \
        bucket_starts([b[0] for b in path_rule(options.get("swap_ab"), (K, I))], E, top_k)
    plans = [plan(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k), quant, **options) for T in starts if T <= max_tokens]
    return tuple(dict.fromkeys(plans))


def layer_configs(T: int, E: int, K: int, I: int, top_k: int, swap_ab: bool | None = None,  # noqa: E741
                  quant: str | None = None) -> tuple[GemmConfig, GemmConfig]:
    """The (GEMM1, GEMM2) configs of :func:`plan` (kept for callers that want the configs only)."""
    p = plan(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k), quant, swap_ab=swap_ab)
    return p.gemm1, p.gemm2

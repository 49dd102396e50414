"""When the layer plan runs a grouped GEMM on a cluster of two or on the ping-pong schedule.

:func:`cute_moe.plan.choose_config` picks a GEMM's path and tile; the plan (:mod:`cute_moe.plan`) then
passes the cooperative config through :func:`clustered` (both GEMMs) and :func:`short_k_gemm2` (GEMM2),
each of which swaps in its variant only where a GPU measured it faster (the constants cite the runs), with
the same output bit for bit.  :func:`pingpong_config` builds the ping-pong twin of any cooperative config
(the benches and the tests compare the two).  What the variants are: :mod:`cute_moe.gemm_parts`.
"""

from __future__ import annotations

from .config import MAX_CONSUMER_WARPGROUPS, GemmConfig, max_stages

CLUSTER_GEMM2_MIN_K_STEPS = 32
"""GEMM2 runs on clusters of two when its K (the layer's I) is at least this many ``tile_k`` steps.

Measured at T = 4096 (``python -m cute_moe.lab.bench_pingpong --cluster``,
notes/results/cute_cluster_h200_2026-12-03.md), cluster-2 against the same tile on single CTAs:
GEMM1 (gated, gathering, 128×128) was faster on all three layers measured; GEMM2 (128×256) was faster
with 224 K steps (Mixtral-8x7B) and slower with 12 (Qwen3-30B-A3B).  The threshold lies between the
two; nothing between was timed.  FP8's GEMM2 follows the same rule (whole layer,
notes/results/gpu_h100_2026-12-07_e27de90.md: 0.957× / 0.966× at Mixtral-8x7B's 112 steps of 128, 0.98–1.01×
at 6 and 2 steps; timed at T = 4096 only); FP8's GEMM1 stays on single CTAs (clusters alone 0.956–1.038×
across shapes and T, no consistent gain: notes/results/cute_schedule_h100_2026-12-07_97e590f.md)."""

PINGPONG_MAX_K_STEPS = 4
"""GEMM2 runs ping-pong when its K (the layer's I) is at most this many ``tile_k`` steps.

Measured at T = 4096 (notes/results/cute_pingpong_h200_2026-12-02.md): a 128×128 ping-pong tile per
warpgroup against the cooperative 128×256 was faster for DeepSeek-V3 TP8's GEMM2 (4 steps), slower for
Qwen3-30B-A3B's (12) and Mixtral-8x7B's (224).  A short main loop leaves the epilogue a large share of
a tile's time, which ping-pong hides under the other warpgroup's WGMMAs; a long one gains nothing from
that and loses the 256-wide tile's reuse."""


def clustered(cfg: GemmConfig, k: int, gemm2: bool) -> GemmConfig:
    """The layer plan's GEMM ``cfg`` (K = ``k``) as it runs: on clusters of two — the normal path's
    cooperative 128-token tile, GEMM1 in bf16, GEMM2 (bf16 or FP8) with at least
    :data:`CLUSTER_GEMM2_MIN_K_STEPS` K steps — else ``cfg`` unchanged."""
    if cfg.swap_ab or cfg.pingpong or cfg.tokens_tile != 128 or (cfg.quant is not None and not gemm2):
        return cfg
    if gemm2 and -(-k // cfg.tile_k) < CLUSTER_GEMM2_MIN_K_STEPS:
        return cfg
    return cfg.replace(cluster=2)


def short_k_gemm2(cfg: GemmConfig, k: int) -> GemmConfig:
    """The layer plan's GEMM2 ``cfg`` (cooperative) as it runs: a 128 × 128 ping-pong tile per
    warpgroup when the bf16 normal path's K = ``k`` is at most :data:`PINGPONG_MAX_K_STEPS` K steps
    deep, else ``cfg`` unchanged."""
    if cfg.quant is not None or cfg.swap_ab or cfg.tokens_tile != 128 or k > PINGPONG_MAX_K_STEPS * cfg.tile_k:
        return cfg
    twin = cfg.replace(weights_tile=128, schedule="pingpong", stages=2)
    return twin.replace(stages=max_stages(twin))


def pingpong_config(cfg: GemmConfig) -> GemmConfig:
    """The ping-pong twin of a cooperative config: the same WGMMA sequence per output element.

    Each consumer warpgroup of ``cfg`` computes 64 rows of M (two warpgroups: a 128-row tile); under
    ping-pong one warpgroup owns a whole tile, so the twin's M tile is one warpgroup's share of
    ``cfg``'s (64 rows: ``tokens_tile`` on the normal path, ``weights_tile`` on swap-AB), on single CTAs;
    the other fields are kept and the ring is as deep as the shared memory allows.  A one-warpgroup
    ``cfg`` keeps its tile.  Raises ValueError (naming the field) when the twin is not buildable."""
    rows = cfg.tile_m // cfg.tile_warpgroups
    tiles = dict(weights_tile=rows) if cfg.swap_ab else dict(tokens_tile=rows)
    twin = cfg.replace(schedule="pingpong", consumer_warpgroups=MAX_CONSUMER_WARPGROUPS, stages=2, cluster=1, **tiles)
    return twin.replace(stages=max_stages(twin))

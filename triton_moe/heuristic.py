"""Which config a call gets: the layer's tuned table on this device, else the deterministic heuristic.

Default heuristic (:func:`default_config`, its buckets in :func:`default_tiles`)
    Deterministic in (T, E, top_k, quant): the expected tokens per expert, T·top_k / E,
    picks BLOCK_M (16, 32, 64, 128); decode tiles keep BLOCK_N = 64 so that enough programs stream
    the weights in parallel, prefill tiles grow to 128×128 with 8 warps (fp8_block: 64×128 on 4, see
    :func:`default_tiles`) and GROUP_M = 8 so that programs sharing weight tiles run
    close together in time (L2 reuse).

Tuned tables
    ``configs/E=<E>,N=<I>,K=<K>,dtype=<bf16|fp8_tensor|…>,device=<name>.json`` map a token count
    to a config; :func:`get_config` takes the entry with the nearest token count (absolute
    distance, as vLLM does) and falls back to the heuristic when no table exists. ``python -m
    triton_moe.lab.autotune`` writes them, ``python -m triton_moe.lab.bench_gemm2 --tables`` an entry's
    ``gemm2`` (:meth:`~triton_moe.config.TritonConfig.from_dict` reads it). The key has no top_k,
    although the tile really depends on the tokens per expert T·top_k / E: a table is tuned for one
    model's layer, which (E, N, K) identify and whose top_k is fixed (the table's ``"shape"`` names
    it; no two catalog shapes share E, N, K), so its T is the layer's batch size at that top_k and
    looking up T is looking up T·top_k / E. A model with the same E, N, K but another top_k would
    need its own table; it would get this one's entry for the same T.

Where each bucket of the rule (heuristic or table) starts in T is :func:`rule_starts`;
:mod:`triton_moe.plan` turns the chosen config into one call's decisions.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

from moe_spec.plan import bucket_starts, tokens_per_expert
from moe_spec.quant import get_format
from triton_moe.config import TritonConfig

CONFIG_DIR = Path(__file__).parent / "configs"


@functools.cache
def default_tiles(quant: str | None) -> tuple[tuple[float, TritonConfig], ...]:
    """The deterministic heuristic as buckets of the tokens per expert: ``(upper bound, inclusive;
    config)``. BLOCK_K is 64 for bf16, 128 for FP8 (one 128-byte row of operand either way).

    fp8_block's prefill tile is 64×128 on 4 warps, the tuned H200 tables' T = 4096 entry: its GEMM1
    scales each K step's products before adding them, so four fp32 values per output element are live
    (gate, up and both products), and 128×128 on 8 warps spills heavily (tests/test_triton_sm90.py;
    notes/triton_moe.md has the times). BLOCK_N stays 128, so GEMM1 still quantizes the intermediate
    in its epilogue (:func:`triton_moe.plan.epilogue_quant`)."""
    fmt = get_format(quant)
    bk = 128 // fmt.weight_dtype.itemsize
    prefill = TritonConfig(64, 128, bk, 8, 4, 4) if fmt.label == "fp8_block" else TritonConfig(128, 128, bk, 8, 8, 3)
    return (
        (16, TritonConfig(16, 64, bk, 1, 4, 4)),
        (32, TritonConfig(32, 64, bk, 1, 4, 4)),
        (96, TritonConfig(64, 64, bk, 8, 4, 4)),
        (math.inf, prefill),
    )


def default_config(T: int, E: int, top_k: int, quant: str | None) -> TritonConfig:
    """The deterministic fallback config (see the module docstring): a function of the tokens per
    expert and the format only — the layer's N and K do not change the tile (partial tiles are
    masked), they only select a tuned table."""
    m = tokens_per_expert(T, E, top_k)
    return next(cfg for bound, cfg in default_tiles(quant) if m <= bound).resolved()


def device_tag(name: str) -> str:
    """A device name as it appears in table file names ('NVIDIA H200' → 'NVIDIA_H200')."""
    return name.replace(" ", "_").replace("/", "_")


def table_path(E: int, N: int, K: int, quant: str | None, device_name: str) -> Path:
    dtype = get_format(quant).label
    return CONFIG_DIR / f"E={E},N={N},K={K},dtype={dtype},device={device_tag(device_name)}.json"


@functools.cache
def load_table(path: str) -> dict | None:
    """{token count: TritonConfig} from a JSON table, or None when the file does not exist."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for t, d in raw.get("configs", raw).items():
        table[int(t)] = TritonConfig.from_dict(d)
    return table


def lookup(table: dict, T: int) -> TritonConfig:
    """The entry whose token count is nearest to ``T`` (ties go to the smaller count)."""
    best = min(table, key=lambda t: (abs(t - T), t))
    return table[best]


def current_device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def tuned_table(E: int, I: int, K: int, quant: str | None, device_name: str | None = None) -> dict | None:
    """The tuned table of this layer on ``device_name`` (default: the current GPU), or None."""
    device_name = device_name or current_device_name()
    if device_name is None:
        return None
    return load_table(str(table_path(E, I, K, quant, device_name))) or None


def get_config(
    T: int, E: int, top_k: int, I: int, K: int, quant: str | None, device_name: str | None = None
) -> TritonConfig:
    """The tuned config for this shape on this device when a table exists, else the heuristic."""
    table = tuned_table(E, I, K, quant, device_name)
    if table:
        return lookup(table, T).resolved()
    return default_config(T, E, top_k, quant)


def rule_starts(E: int, top_k: int, I: int, K: int, quant: str | None, device_name: str | None = None) -> list[int]:
    """The first T ≥ 1 of every bucket of :func:`get_config`'s rule for this layer.

    With a tuned table, entry i (token counts k_0 < k_1 < …) is the nearest from the midpoint
    ``(k_{i-1} + k_i) / 2`` (a tie goes to the smaller count) up to the next midpoint, so it
    starts at ``⌊(k_{i-1} + k_i) / 2⌋ + 1``; without one, the heuristic's buckets of tokens per
    expert (:func:`default_tiles`) start where :func:`moe_spec.plan.bucket_starts` says.
    """
    table = tuned_table(E, I, K, quant, device_name)
    if not table:
        return bucket_starts([bound for bound, _ in default_tiles(quant)], E, top_k)
    keys = sorted(table)
    return [1] + [(lo + hi) // 2 + 1 for lo, hi in zip(keys, keys[1:])]

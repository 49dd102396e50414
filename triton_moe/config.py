"""Launch configurations: one tile shape for both GEMMs, the swap-AB rule, tuned tables.

A :class:`TritonConfig` fixes the tile every program of the grouped GEMM works on. ``BLOCK_M``
is also the granularity of the token alignment (each expert's run of (token, slot) pairs is padded
to a multiple of it), so GEMM1 and GEMM2 of one call share a config.

The swap-AB rule (:func:`choose_swap_ab`)
    Hopper's WGMMA multiplies a 64-row A operand per warpgroup. Without swap, A is the token tile
    [BLOCK_M, BLOCK_K]; when few tokens reach an expert the config uses BLOCK_M = 16 or 32 and
    Triton falls back to the older mma.sync path or wastes most of the 64 rows on padding. With
    swap-AB the kernel computes Cᵀ = W·Xᵀ: the expert's weight rows (BLOCK_N ≥ 64 of them) are
    the A operand and fill M = 64, the tokens become the narrow N side (8…256 in steps of 8).
    THE rule: swap exactly when ``BLOCK_M < 64`` — the token tile is too short to fill one WGMMA
    — and ``BLOCK_N ≥ 64``. It is a property of the tile, not of the dtype: bf16 and FP8 both use
    it. ``swap_ab=True/False`` in a config or in ``fused_moe(..., swap_ab=...)`` overrides it for
    comparisons; ``triton_moe.bench --swap-sweep`` measures where it pays off.

Default heuristic (:func:`default_config`)
    Deterministic in (T, E, top_k, quant): the expected tokens per expert, T·top_k / E,
    picks BLOCK_M (16, 32, 64, 128); decode tiles keep BLOCK_N = 64 so that enough programs stream
    the weights in parallel, prefill tiles grow to 128×128 with 8 warps and GROUP_M = 8 so that
    programs sharing weight tiles run close together in time (L2 reuse).

Tuned tables
    ``configs/E=<E>,N=<I>,K=<K>,dtype=<bf16|fp8_tensor|…>,device=<name>.json`` map a token count
    to a config; :func:`get_config` takes the entry with the nearest token count (absolute
    distance, as vLLM does) and falls back to the heuristic when no table exists.
    ``python -m triton_moe.autotune`` writes these tables. The key has no top_k, although the
    tile really depends on the tokens per expert T·top_k / E: a table is tuned for one model's
    layer, which (E, N, K) identify and whose top_k is fixed (the table's ``"shape"`` names it;
    no two catalog shapes share E, N, K), so its T is the layer's batch size at that top_k and
    looking up T is looking up T·top_k / E. A model with the same E, N, K but another top_k would
    need its own table; it would get this one's entry for the same T.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from moe_spec.quant import FP8_BLOCK

CONFIG_DIR = Path(__file__).parent / "configs"

#: Shared memory one program may use on Hopper (227 KiB opt-in).
SMEM_LIMIT = 227 * 1024

#: The smallest tile Triton's tl.dot accepts along M, N and K.
MIN_DOT = 16


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class TritonConfig:
    """The tile of one grouped-GEMM program, and how it is scheduled.

    ``swap_ab=None`` means "apply :func:`choose_swap_ab`"; :meth:`resolved` fixes it.
    ``fp8_imprecise_acc`` picks how the FP8 WGMMA accumulator is promoted to fp32 (see
    :mod:`triton_moe.kernels`): 0 adds each K step's product into the fp32 accumulator; n > 0 (a
    multiple of 32, at most BLOCK_K) lets Triton's WGMMA lowering promote every n elements of K.
    """

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: Optional[bool] = None
    fp8_imprecise_acc: int = 0  # FP8 promotion: 0 = fp32 add per K step; n = tl.dot's max_num_imprecise_acc

    def resolved(self) -> "TritonConfig":
        if self.swap_ab is not None:
            return self
        return replace(self, swap_ab=choose_swap_ab(self.BLOCK_M, self.BLOCK_N))

    def smem_bytes(self, quant: Optional[str]) -> int:
        """Shared memory of the pipelined operand tiles of GEMM1 (A plus gate and up weight tiles),
        the larger of the two GEMMs. Both operands are 1 byte under FP8, 2 under bf16."""
        nbytes = 2 if quant is None else 1
        per_stage = (self.BLOCK_M + 2 * self.BLOCK_N) * self.BLOCK_K * nbytes
        return per_stage * self.num_stages

    def check(self, quant: Optional[str]) -> "TritonConfig":
        """Raise ValueError (naming ``config``) when this config cannot run ``quant``; else return it.

        Every rule is a property of the tile and the format alone: the kernels mask partial tiles
        in M, N and K, so any K and I work with any valid tile (the CPU tests use K = 160, I = 80
        under 64-wide tiles); fp8_block's BLOCK_K | 128 keeps one K step inside one scale block."""
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if not _pow2(v) or v < MIN_DOT:
                raise ValueError(f"config: {name}={v} must be a power of two >= {MIN_DOT}")
        if not _pow2(self.num_warps) or not 1 <= self.num_warps <= 16:
            raise ValueError(f"config: num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.GROUP_M < 1 or self.num_stages < 1:
            raise ValueError(f"config: GROUP_M and num_stages must be >= 1, got {self.GROUP_M}, {self.num_stages}")
        if quant == "fp8_block":
            if FP8_BLOCK % self.BLOCK_K:
                raise ValueError(f"config: fp8_block needs BLOCK_K to divide {FP8_BLOCK} (one scale per K step), "
                                 f"got BLOCK_K={self.BLOCK_K}")
        if quant is not None and self.BLOCK_K < 32:
            raise ValueError(f"config: FP8 needs BLOCK_K >= 32 (one WGMMA K step), got {self.BLOCK_K}")
        n = self.fp8_imprecise_acc
        if n and (n < 0 or n % 32 or n > self.BLOCK_K):
            raise ValueError(f"config: fp8_imprecise_acc={n} must be 0 or a multiple of 32 up to BLOCK_K={self.BLOCK_K}")
        smem = self.smem_bytes(quant)
        if smem > SMEM_LIMIT:
            raise ValueError(f"config: {smem} bytes of pipelined tiles exceed the {SMEM_LIMIT}-byte shared memory "
                             f"of one Hopper SM; lower num_stages={self.num_stages} or the tile")
        return self

    def fits(self, quant: Optional[str]) -> bool:
        """Whether :meth:`check` accepts this config (False instead of the ValueError)."""
        try:
            self.check(quant)
            return True
        except ValueError:
            return False

    def as_dict(self) -> dict:
        return asdict(self)


def choose_swap_ab(block_m: int, block_n: int) -> bool:
    """THE swap-AB rule: swap when the token tile cannot fill WGMMA's M = 64 but the weight tile can."""
    return block_m < 64 and block_n >= 64


def tokens_per_expert(T: int, E: int, top_k: int) -> float:
    """Expected (token, slot) pairs per expert under uniform routing."""
    return T * top_k / E


def default_config(T: int, E: int, top_k: int, quant: Optional[str]) -> TritonConfig:
    """The deterministic fallback config (see the module docstring): a function of the tokens per
    expert and the format only — the layer's N and K do not change the tile (partial tiles are
    masked), they only select a tuned table."""
    m = tokens_per_expert(T, E, top_k)
    bk = 64 if quant is None else 128
    if m <= 16:
        cfg = TritonConfig(16, 64, bk, 1, 4, 4)
    elif m <= 32:
        cfg = TritonConfig(32, 64, bk, 1, 4, 4)
    elif m <= 96:
        cfg = TritonConfig(64, 64, bk, 8, 4, 4)
    else:
        cfg = TritonConfig(128, 128, bk, 8, 8, 3)
    return cfg.resolved()


def device_tag(name: str) -> str:
    """A device name as it appears in table file names ('NVIDIA H200' → 'NVIDIA_H200')."""
    return name.replace(" ", "_").replace("/", "_")


def table_path(E: int, N: int, K: int, quant: Optional[str], device_name: str) -> Path:
    dtype = quant or "bf16"
    return CONFIG_DIR / f"E={E},N={N},K={K},dtype={dtype},device={device_tag(device_name)}.json"


@functools.lru_cache(maxsize=None)
def load_table(path: str) -> Optional[dict]:
    """{token count: TritonConfig} from a JSON table, or None when the file does not exist."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for t, d in raw.get("configs", raw).items():
        table[int(t)] = TritonConfig(**d)
    return table


def lookup(table: dict, T: int) -> TritonConfig:
    """The entry whose token count is nearest to ``T`` (ties go to the smaller count)."""
    best = min(table, key=lambda t: (abs(t - T), t))
    return table[best]


def current_device_name() -> Optional[str]:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def get_config(T: int, E: int, top_k: int, I: int, K: int, quant: Optional[str],  # noqa: E741
               device_name: Optional[str] = None) -> TritonConfig:
    """The tuned config for this shape on this device when a table exists, else the heuristic."""
    device_name = device_name or current_device_name()
    if device_name is not None:
        table = load_table(str(table_path(E, I, K, quant, device_name)))
        if table:
            return lookup(table, T).resolved()
    return default_config(T, E, top_k, quant)

"""The MoE layer on top of the grouped GEMM: align, GEMM1, SiLU·mul, GEMM2 (+ routing weight), combine.

For ``T`` tokens routed to ``top_k`` of ``E`` experts (``topk_ids``, ``topk_weights``)::

    out[t] = Σ_j  w[t, j] · ( SiLU(x[t]·W1g[e]ᵀ) ⊙ (x[t]·W1u[e]ᵀ) ) · W2[e]ᵀ ,   e = topk_ids[t, j]

with ``W1 [E, 2I, K]`` (gate rows, then up rows) and ``W2 [E, K, I]``.

Step by step (every step is device work; nothing reads routing data back to the host, so the
whole layer can be captured in a CUDA graph and a new routing never recompiles anything):

1. ``align_tokens``: the ``P = T·top_k`` (token, slot) pairs are sorted by expert (stable
   argsort), and every expert's run is padded to a multiple of the token tile ``tT`` — the
   contract of vLLM's ``moe_align_block_size``, written with torch ops (scatter_add for the
   counts, cumsum for the offsets, searchsorted for each block's expert).  The buffers are sized
   by the host-known worst case ``P + E·(tT − 1)`` rows, so their sizes depend on T only; the
   number of *used* blocks is a device scalar the GEMM's scheduler reads.
2. gather ``X_sorted[r] = x[token(r)]`` for the used rows (a CuTe row kernel, ``rowops.py``;
   padding rows inside a block repeat token 0: finite, and weighted 0 later).
3. GEMM1 (grouped): ``H = X_sorted · W1[e]ᵀ``  → ``[M_pad, 2I]``.
4. ``A = SiLU(H[:, :I]) ⊙ H[:, I:]``: a CuTe row kernel over the used rows only,
   fp32 math, one rounding to bf16.  (Fusing it into GEMM1's epilogue is future work: it needs
   W1's gate and up rows interleaved so that one tile holds both halves.)
5. GEMM2 (grouped): ``Y = (A · W2[e]ᵀ) · w_row`` — the routing weight of each sorted row is
   applied in fp32 in the epilogue, before rounding to bf16 (padding rows get weight 0).
6. combine: ``out[t] = Σ_j Y[row(t, j)]`` (a CuTe row kernel: fp32 sum over top_k, one rounding).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

from moe_spec.quant import FP8_DTYPE  # noqa: E402

from .config import ALIGN_ELEMS, GemmConfig, choose_config  # noqa: E402
from .moe_fp8 import check_quant_layer, gemm1_out_dtype, quantize_intermediate, quantize_tokens  # noqa: E402
from .moe_fp8 import sorted_token_scales  # noqa: E402
from .runtime import cute_scale  # noqa: E402
from .unfused import check_fusion, scale_rows, separate_configs, weighted_combine  # noqa: E402
from .runtime import cute_tensor as _cute_tensor  # noqa: E402
from .runtime import cute_vector as _cute_vector  # noqa: E402
from .runtime import current_stream as _stream  # noqa: E402
from .runtime import num_sms as _num_sms  # noqa: E402


@dataclass
class Alignment:
    """Expert-contiguous, tile-padded order of the (token, slot) pairs (all device tensors).

    Attributes:
        tile: the padding multiple (token rows per block).
        sorted_token: int64 [M_pad] token feeding each sorted row (0 for padding rows).
        sorted_weight: fp32 [M_pad] routing weight of each sorted row (0 for padding rows).
        pair_row: int64 [T·top_k] sorted row of pair (t, j) (row-major over (t, j)).
        padded_end: int64 [E] end row of each expert's padded run (inclusive cumsum).
    """

    tile: int
    sorted_token: torch.Tensor
    sorted_weight: torch.Tensor
    pair_row: torch.Tensor
    padded_end: torch.Tensor

    @property
    def rows(self) -> int:
        return self.sorted_token.numel()

    def blocks(self, tokens_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_expert int32 [M_pad / tokens_tile], num_blocks int32 [1]) for a GEMM's token tile.

        ``tokens_tile`` must divide ``tile``, so each block lies inside one expert's run.  Blocks
        past the used rows get the last expert (never read: the scheduler stops at num_blocks).
        """
        if self.tile % tokens_tile:
            raise ValueError(f"tokens_tile={tokens_tile} does not divide the alignment tile {self.tile}")
        starts = torch.arange(0, self.rows, tokens_tile, device=self.padded_end.device)
        expert = torch.searchsorted(self.padded_end, starts, right=True)
        expert = expert.clamp_(max=self.padded_end.numel() - 1).to(torch.int32)
        num_blocks = (self.padded_end[-1:] // tokens_tile).to(torch.int32)
        return expert, num_blocks


def align_tokens(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, tile: int) -> Alignment:
    """Sort (token, slot) pairs by expert and pad each expert's run to a multiple of ``tile``."""
    T, k = topk_ids.shape
    pairs = T * k
    device = topk_ids.device
    rows = math.ceil((pairs + num_experts * (tile - 1)) / tile) * tile
    expert = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts + tile - 1) // tile * tile
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(expert, stable=True)  # pair ids, grouped by expert, in token order
    expert_sorted = expert[order]
    rank = torch.arange(pairs, device=device) - count_start[expert_sorted]
    row = padded_start[expert_sorted] + rank  # destination row of the i-th sorted pair
    pair_row = torch.empty(pairs, dtype=torch.int64, device=device).scatter_(0, order, row)
    sorted_token = torch.zeros(rows, dtype=torch.int64, device=device).scatter_(0, row, order // k)
    sorted_weight = torch.zeros(rows, dtype=torch.float32, device=device).scatter_(
        0, row, topk_weights.reshape(-1).to(torch.float32)[order])
    return Alignment(tile, sorted_token, sorted_weight, pair_row, padded_end)


def grouped_gemm(x_sorted: torch.Tensor, w: torch.Tensor, alignment: Alignment, cfg: GemmConfig, *,
                 row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = x_sorted[r] · w[expert(r)]ᵀ (· row_scale[r])`` for every used sorted row r.

    x_sorted: [M_pad, K]; w: [E, N_out, K] (contiguous), both bf16 or — FP8 config — E4M3 with
    ``x_scale`` (per sorted row: [1] / [M_pad] / [M_pad, ⌈K/128⌉]) and ``w_scale`` (moe_spec's
    weight scale shape), dequantized in registers.  Returns ``cfg.out_dtype`` [M_pad, N_out]
    (rows past the used blocks are left unwritten).
    """
    from .ptx import compile_gemm

    m_pad, k = x_sorted.shape
    n_experts, n_out, k_w = w.shape
    if k_w != k:
        raise ValueError(f"grouped_gemm: K of x_sorted ({k}) and w ({k_w}) differ")
    dtype = getattr(torch, cfg.dtype)
    for name, t in (("x_sorted", x_sorted), ("w", w)):
        if t.dtype != dtype:
            raise TypeError(f"grouped_gemm: {name} is {t.dtype}, the config's operands are {cfg.dtype}")
    for name, v, align, what in (("K", k, cfg.operand_align, cfg.dtype), ("N_out", n_out, cfg.out_align, cfg.out_dtype)):
        if v % align:
            raise ValueError(f"grouped_gemm: {name}={v} must be a multiple of {align} "
                             f"(TMA needs 16-byte aligned {what} rows)")
    if cfg.row_scale != (row_scale is not None):
        raise ValueError("grouped_gemm: pass row_scale exactly when cfg.row_scale is set")
    if (cfg.quant is not None) != (x_scale is not None) or (x_scale is None) != (w_scale is None):
        raise ValueError("grouped_gemm: pass x_scale and w_scale exactly when cfg.quant is set")
    if out is None:
        out = torch.empty(m_pad, n_out, dtype=getattr(torch, cfg.out_dtype), device=x_sorted.device)
    block_expert, num_blocks = alignment.blocks(cfg.tokens_tile)
    if row_scale is None:
        row_scale = alignment.sorted_weight  # a valid fp32 buffer the kernel never reads
    compiled = compile_gemm(cfg, _num_sms(x_sorted.device))
    compiled(
        _cute_tensor(x_sorted, 1),
        _cute_tensor(w.permute(1, 2, 0), 1),  # (N_out, K, E): the expert is TMA's 3rd coordinate
        _cute_tensor(out.t(), 0) if cfg.swap_ab else _cute_tensor(out, 1),
        _cute_vector(block_expert), _cute_vector(num_blocks), _cute_vector(row_scale), _stream(x_sorted),
        *(() if cfg.quant is None else (cute_scale(x_scale), cute_scale(w_scale))),
    )
    return out


def layer_configs(T: int, E: int, K: int, I: int, top_k: int, swap_ab: bool | None = None,  # noqa: E741
                  quant: str | None = None) -> tuple[GemmConfig, GemmConfig]:
    """The (GEMM1, GEMM2) configs :func:`fused_moe` uses (the documented rule of config.py)."""
    per_expert = T * top_k / E
    return (choose_config(per_expert, 2 * I, K, swap_ab=swap_ab, quant=quant, out_dtype=gemm1_out_dtype(quant)),
            choose_config(per_expert, K, I, swap_ab=swap_ab, row_scale=True, quant=quant))


def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None,
              swap_ab: bool | None = None, configs: tuple[GemmConfig, GemmConfig] | None = None,
              fusion: str = "fused") -> torch.Tensor:
    """The backend contract: bf16 ``[T, K]`` output of the MoE layer.

    Backend options: ``swap_ab`` forces the path (None: the rule in :func:`choose_config`);
    ``configs`` overrides the (GEMM1, GEMM2) configs outright (then ``swap_ab`` must be None);
    ``fusion="separate"`` runs the unfused pipeline of :mod:`cute_moe.unfused` (scales and routing
    weight in passes of their own) instead of the fused one.
    ``quant`` (an FP8 format) runs the W8A8 layer of :mod:`cute_moe.moe_fp8`.
    Every argument and every limit of this backend is checked on the host before the first
    launch (:func:`check_layer`), so bad input never leaves a half-run pipeline behind.
    """
    from moe_spec.validate import validate_moe_args

    dims = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)
    T, E, K, I, top_k = dims.T, dims.E, dims.K, dims.I, dims.top_k  # noqa: E741
    cfg1, cfg2 = check_layer(K, I, swap_ab=swap_ab, configs=configs)
    check_quant_layer(K, I, quant, configs)
    separate = check_fusion(fusion) == "separate"
    if T == 0:
        return x.new_empty((0, K))
    if x.device.type != "cuda":
        raise ValueError("cute_moe.fused_moe: x must be on a CUDA device (Hopper); the CPU path is compile_ptx()")
    if cfg1 is None:
        cfg1, cfg2 = layer_configs(T, E, K, I, top_k, swap_ab, quant)
    if separate:
        cfg1, cfg2 = separate_configs(cfg1, cfg2)
    alignment = align_tokens(topk_ids, topk_weights, E, math.lcm(cfg1.tokens_tile, cfg2.tokens_tile))
    if quant is not None:
        return _fp8_layer(x, w1, w2, w1_scale, w2_scale, topk_weights, quant, alignment, cfg1, cfg2, separate)
    x_sorted = gather_rows(x, alignment)
    h = grouped_gemm(x_sorted, w1, alignment, cfg1)
    a = silu_mul(h, alignment)
    if separate:
        y = grouped_gemm(a, w2, alignment, cfg2)
        return weighted_combine(y, alignment, topk_weights, quant, T, top_k)
    y = grouped_gemm(a, w2, alignment, cfg2, row_scale=alignment.sorted_weight)
    return combine(y, alignment, T, top_k)


def _fp8_layer(x, w1, w2, w1_scale, w2_scale, topk_weights, quant: str, alignment: Alignment, cfg1: GemmConfig,
               cfg2: GemmConfig, separate: bool) -> torch.Tensor:
    """The W8A8 layer (``moe_fp8``'s docstring): x quantized once, its E4M3 rows gathered (as bf16
    pairs: the gather moves bytes), GEMM1 to fp32, SiLU·up quantized, GEMM2 with the routing
    weight, combine — or, ``separate``, with the scale and routing-weight passes of ``unfused``."""
    T, top_k = topk_weights.shape
    used = _used_rows(alignment)
    xq, x_scale = quantize_tokens(x, quant)
    x_sorted = gather_rows(xq.view(torch.bfloat16), alignment).view(FP8_DTYPE)
    x_scale = sorted_token_scales(x_scale, alignment.sorted_token, quant)
    h = grouped_gemm(x_sorted, w1, alignment, cfg1, x_scale=x_scale, w_scale=w1_scale)
    if separate:
        scale_rows(h, alignment, used, x_scale, w1_scale, quant)
    aq, a_scale = quantize_intermediate(h, alignment.pair_row, used, quant)
    if not separate:
        y = grouped_gemm(aq, w2, alignment, cfg2, row_scale=alignment.sorted_weight, x_scale=a_scale, w_scale=w2_scale)
        return combine(y, alignment, T, top_k)
    y = grouped_gemm(aq, w2, alignment, cfg2, x_scale=a_scale, w_scale=w2_scale)
    return weighted_combine(scale_rows(y, alignment, used, a_scale, w2_scale, quant), alignment, topk_weights, quant,
                            T, top_k)


def check_layer(K: int, I: int, *, swap_ab=None, configs=None  # noqa: E741
                ) -> tuple[GemmConfig, GemmConfig] | tuple[None, None]:
    """The limits of this backend beyond the shared contract, all on the host (no launch, no sync).

    * ``K`` (hidden: GEMM1's K, GEMM2's N_out, the gathered and combined rows) and ``I``
      (intermediate: GEMM2's K; GEMM1's N_out is 2I, split in two halves by SiLU·mul) must be
      multiples of ``ALIGN_ELEMS`` = 8 bf16 — TMA's 16-byte row alignment and the row kernels'
      16-byte vectors.
    * ``swap_ab``: None or a bool.
    * ``configs``: None or a ``(GEMM1, GEMM2)`` pair of valid :class:`GemmConfig` — GEMM1 without
      and GEMM2 with ``row_scale`` (GEMM2 applies the routing weights in its epilogue).

    Returns ``configs`` as a checked pair, or ``(None, None)`` when the path rule will choose.
    Raises TypeError / ValueError naming the argument and the limit.
    """
    for name, v in (("x: hidden size K = x.shape[1]", K), ("w2: intermediate size I = w2.shape[2]", I)):
        if v % ALIGN_ELEMS:
            raise ValueError(f"{name} = {v} must be a multiple of {ALIGN_ELEMS} for cute_moe "
                             f"(TMA needs 16-byte aligned bf16 rows; the row kernels move 16-byte vectors)")
    if swap_ab is not None and not isinstance(swap_ab, bool):
        raise TypeError(f"swap_ab: expected None or a bool, got {type(swap_ab).__name__}")
    if configs is None:
        return None, None
    if swap_ab is not None:
        raise ValueError("swap_ab and configs: pass at most one (the configs already fix the path)")
    if (not isinstance(configs, (tuple, list)) or len(configs) != 2
            or not all(isinstance(c, GemmConfig) for c in configs)):
        raise TypeError(f"configs: expected a (GEMM1, GEMM2) pair of cute_moe.GemmConfig, got {configs!r}")
    for i, (cfg, want) in enumerate(zip(configs, (False, True))):
        if cfg.row_scale != want:
            raise ValueError(f"configs[{i}]: row_scale must be {want} (GEMM{i + 1}"
                             f"{' applies the routing weights in its epilogue' if want else ' has no row scale'})")
        try:
            cfg.validate()
        except ValueError as exc:
            raise ValueError(f"configs[{i}]: {exc}") from exc
    return configs[0], configs[1]


def _row_kernels(device) -> dict:
    from .ptx import compile_row_kernels

    return compile_row_kernels(_num_sms(device))


def _used_rows(alignment: Alignment) -> torch.Tensor:
    return alignment.padded_end[-1:].to(torch.int32)


def _check_row_width(fn: str, name: str, cols: int, multiple: int = ALIGN_ELEMS) -> None:
    """The row kernels walk a row in 16-byte vectors (``cols // VEC`` of them): a tail would be dropped."""
    if cols % multiple:
        raise ValueError(f"{fn}: {name} = {cols} must be a multiple of {multiple} "
                         f"(the row kernels move {ALIGN_ELEMS}-element vectors; a tail would be silently dropped)")


def gather_rows(x: torch.Tensor, alignment: Alignment) -> torch.Tensor:
    """``X_sorted[r] = x[sorted_token[r]]`` on the used rows (bf16 [M_pad, K]; other rows unwritten)."""
    _check_row_width("gather_rows", "x.shape[1]", x.shape[1])
    out = torch.empty(alignment.rows, x.shape[1], dtype=x.dtype, device=x.device)
    _row_kernels(x.device)["gather"](_cute_tensor(x, 1), _cute_tensor(out, 1), _cute_vector(alignment.sorted_token),
                                     _cute_vector(_used_rows(alignment)), _stream(x))
    return out


def silu_mul(h: torch.Tensor, alignment: Alignment) -> torch.Tensor:
    """``SiLU(h[:, :I]) ⊙ h[:, I:]`` on the used rows (bf16 [M_pad, I]; other rows unwritten)."""
    rows, two_i = h.shape
    _check_row_width("silu_mul", "h.shape[1] (2I)", two_i, 2 * ALIGN_ELEMS)  # each half whole vectors
    a = torch.empty(rows, two_i // 2, dtype=h.dtype, device=h.device)
    _row_kernels(h.device)["silu_mul"](_cute_tensor(h, 1), _cute_tensor(a, 1), _cute_vector(_used_rows(alignment)),
                                       _stream(h))
    return a


def combine(y: torch.Tensor, alignment: Alignment, T: int, top_k: int) -> torch.Tensor:
    """``out[t] = Σ_j y[row(t, j)]`` (rows already carry their routing weight): fp32 sum → bf16 [T, K]."""
    _check_row_width("combine", "y.shape[1]", y.shape[1])
    if alignment.pair_row.numel() != T * top_k:
        raise ValueError(f"combine: alignment has {alignment.pair_row.numel()} (token, slot) pairs, "
                         f"T·top_k = {T}·{top_k} = {T * top_k}")
    out = torch.empty(T, y.shape[1], dtype=y.dtype, device=y.device)
    _row_kernels(y.device)["combine"](_cute_tensor(y, 1), _cute_tensor(out, 1), _cute_vector(alignment.pair_row),
                                      _stream(y))
    return out

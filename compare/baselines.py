"""Two torch baselines behind the backend contract: what a user already has without this project.

``torch_loop``     the plain baseline: one ``torch.matmul`` per expert that received tokens (FP8: the
                   W8A8 model in fp32 matmuls — a numerics reference, slow on purpose). The host
                   reads the routing to slice each expert's tokens, so it synchronizes and cannot be
                   captured in a CUDA graph; it is timed eagerly, launch gaps included.
``torch_grouped``  ``torch._grouped_mm`` (bf16) / ``torch._scaled_grouped_mm`` (FP8 with row-wise
                   scales): one grouped GEMM per layer GEMM, all bookkeeping on the device, so it is
                   graph-capturable. ``fp8_block`` has no row-wise spelling and is not offered.

Both follow the same recipe as the kernels, in four visible steps:

1. **Group by expert.** The T·k (token, slot) pairs are sorted by expert. The grouped GEMM wants
   each expert's rows contiguous and its group sizes a multiple of ``GROUP_ALIGN`` rows (CUTLASS's
   16-row requirement for FP8; harmless for bf16), so every group is padded with zero rows: the
   project's one alignment routine, :func:`moe_spec.align.align`, on the device with a static row
   bound, so no host sync is needed.
2. **GEMM1 + SiLU·up.** ``h = x_e · W1[e]ᵀ``; ``a = SiLU(h_gate) · h_up`` in fp32, stored bf16 (or
   re-quantized to FP8 in the run's format: the W8A8 model of :mod:`moe_spec.oracle`).
3. **GEMM2.** ``y = a · W2[e]ᵀ``.
4. **Combine.** Rows go back to (token, slot) order and ``out[t] = Σ_j w[t, j] · y[t, j]`` in fp32:
   a gather and a fixed-order sum, so the result is deterministic (no atomics).

Step 1 is the "alignment/permutation" the report times separately (:func:`prepare_grouped`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_spec.align import Alignment, align
from moe_spec.quant import dequantize_activation, dequantize_weight, quantize_activation
from moe_spec.validate import validate_moe_args

GROUP_ALIGN = 16
"""Rows per expert group are padded to a multiple of this (CUTLASS grouped GEMM alignment)."""


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> Alignment:
    """Step 1: the pairs sorted by expert into groups padded to ``GROUP_ALIGN`` rows (device-only).

    The grouped GEMM reads each group's end row (``expert_end``, its ``offs``); rows fed by no pair
    (padding, and the rows past the last group) read a zero token: ``token_of_row`` is T there.
    """
    return align(topk_ids, num_experts, GROUP_ALIGN)


def _combine(y_rows: torch.Tensor, row_of_pair: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Step 4: back to (token, slot) order, routing weights, fixed-order sum in fp32 → bf16."""
    T, k = topk_weights.shape
    y = y_rows[row_of_pair].view(T, k, -1).float()
    return (y * topk_weights[..., None]).sum(dim=1).to(torch.bfloat16)


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up in fp32 from h = [gate | up]."""
    I = h.shape[-1] // 2  # noqa: E741
    h = h.float()
    return F.silu(h[..., :I]) * h[..., I:]


# --- torch_loop: the plain baseline ----------------------------------------------------------------


def loop_fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
    """One ``torch.matmul`` per expert that received tokens.

    bf16: bf16 matmuls (fp32 accumulation inside), SiLU·up in fp32, a bf16 intermediate.
    FP8: the W8A8 model itself, in fp32 — operands dequantized to fp32 (exact: an e4m3 value times
    an fp32 scale), fp32 matmuls, the fp32 intermediate re-quantized in the run's format. Rounding
    any of these through bf16 instead moves a few percent of the re-quantized intermediate by a
    whole fp8 step (1–4 % rel L2, notes/numerics.md), so the plain FP8 loop is a numerics
    reference, slow on purpose; ``torch_grouped`` is the FP8 speed reference.
    """
    d = validate_moe_args(
        x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, data_checks="sync"
    )  # torch indexing with a bad id would fault on the device
    if d.T == 0:
        return x.new_empty((0, d.K))
    grouped = align(topk_ids, d.E, 1)  # tile 1: no padding, sorted_ids is the pairs sorted by expert
    order = grouped.sorted_ids.long()
    ends = grouped.expert_end.tolist()  # the host sync of the plain loop
    counts = [b - a for a, b in zip([0] + ends[:-1], ends)]
    compute = torch.bfloat16 if quant is None else torch.float32

    def weight(w, scale, e):
        if quant is None:
            return w[e]
        return dequantize_weight(w[e : e + 1], scale[e : e + 1], quant)[0]

    xa = x if quant is None else dequantize_activation(*quantize_activation(x, quant), quant)
    inter = torch.empty(grouped.num_pairs, d.I, dtype=torch.float32, device=x.device)
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start : start + n]
            groups.append((e, pairs))
            inter[pairs] = _silu_mul(xa[pairs // d.top_k] @ weight(w1, w1_scale, e).T)
        start += n
    if quant is None:
        inter = inter.to(torch.bfloat16)
    else:
        inter = dequantize_activation(*quantize_activation(inter, quant), quant)
    y = torch.empty(grouped.num_pairs, d.K, dtype=compute, device=x.device)
    for e, pairs in groups:
        y[pairs] = inter[pairs] @ weight(w2, w2_scale, e).T
    return _combine(y, torch.arange(grouped.num_pairs, device=x.device), topk_weights)


# --- torch_grouped: the library baseline ----------------------------------------------------------

GROUPED_QUANTS = (None, "fp8_tensor", "fp8_channel")


def prepare_grouped(topk_ids: torch.Tensor, num_experts: int) -> Alignment:
    """Step 1 alone (what the report times as alignment/permutation)."""
    return group_by_expert(topk_ids, num_experts)


def _rowwise(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """An activation scale ([1] per tensor or [rows, 1] per row) as the [rows] vector the GEMM reads."""
    return scale.reshape(-1).expand(rows).contiguous() if scale.numel() == 1 else scale.reshape(-1).contiguous()


def _channelwise(scale: torch.Tensor, n_out: int) -> torch.Tensor:
    """A weight scale ([E] per tensor or [E, N] per channel) as the [E, N] matrix the GEMM reads."""
    return scale[:, None].expand(-1, n_out).contiguous() if scale.dim() == 1 else scale.contiguous()


def grouped_fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
    """``torch._grouped_mm`` for bf16, ``torch._scaled_grouped_mm`` (row-wise scales) for FP8."""
    d = validate_moe_args(
        x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, data_checks="sync"
    )  # torch indexing with a bad id would fault on the device
    if quant not in GROUPED_QUANTS:
        raise NotImplementedError(
            f"torch._scaled_grouped_mm takes row-wise scales only; {quant} needs 128x128 block scales"
        )
    if d.T == 0:
        return x.new_empty((0, d.K))
    layout = prepare_grouped(topk_ids, d.E)
    token_of_row, row_of_pair = layout.token_of_row(d.top_k), layout.row_of_pair()
    valid = layout.holds_pair()[:, None]
    offs = layout.expert_end
    zero_row = torch.zeros(1, d.K, dtype=x.dtype, device=x.device)
    w1_t, w2_t = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, K, 2I], [E, I, K]: column-major B

    if quant is None:
        a_rows = torch.cat([x, zero_row])[token_of_row]
        h = torch._grouped_mm(a_rows, w1_t, offs=offs)
        inter = torch.where(valid, _silu_mul(h), 0.0).to(torch.bfloat16)
        y = torch._grouped_mm(inter, w2_t, offs=offs)
        return _combine(y, row_of_pair, topk_weights)

    xq, xs = quantize_activation(x, quant)  # per token (or one scale), then gathered: same as per row
    xs_rows = _rowwise(xs, d.T)
    a_rows = torch.cat([xq, zero_row.to(xq.dtype)])[token_of_row]
    a_scale = torch.cat([xs_rows, xs_rows.new_ones(1)])[token_of_row]
    h = torch._scaled_grouped_mm(
        a_rows, w1_t, a_scale, _channelwise(w1_scale, 2 * d.I), offs=offs, out_dtype=torch.bfloat16
    )
    inter = torch.where(valid, _silu_mul(h), 0.0)
    iq, iscale = quantize_activation(inter, quant)
    y = torch._scaled_grouped_mm(
        iq, w2_t, _rowwise(iscale, layout.rows), _channelwise(w2_scale, d.K), offs=offs, out_dtype=torch.bfloat16
    )
    return _combine(y, row_of_pair, topk_weights)

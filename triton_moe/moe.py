"""``fused_moe``: the whole expert computation of one MoE layer in a handful of Triton launches.

::

    plan               the config, checked for the quant format (host only)
    align_block_size   topk_ids → Alignment: sorted_ids, expert_of_block, …  (3 small kernels)
    amax_kernel        global amax of x                                     (fp8_tensor only)
    quantize_kernel    x → xq E4M3 [T, K] + scales                          (FP8 only)
    moe_gemm_kernel    GEMM1 + SiLU(gate)·up (+ amax of the intermediate)   → act [P, I]
    quantize_kernel    act fp32 → E4M3 [P, I] + scales                      (FP8 only)
    moe_gemm_kernel    GEMM2 × routing weight                               → y [P, K]
    combine_kernel     out[t] = Σ_j y[t·top_k + j]                          (skipped for top_k = 1)

Nothing here reads device data on the host, so a call can be captured in a CUDA graph and
replayed for new routing; the buffer sizes depend only on T, top_k, E and the config.
See :mod:`triton_moe.kernels` for the arithmetic and :mod:`triton_moe.config` for the tile rule.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from moe_spec.align import Alignment
from moe_spec.quant import FP8_DTYPE, activation_scale_shape
from moe_spec.validate import validate_moe_args
from triton_moe.align import MAX_EXPERTS, align_block_size
from triton_moe.config import TritonConfig
from triton_moe.jit import INTERPRET, launch
from triton_moe.kernels import QUANT_MODE, amax_kernel, combine_kernel, moe_gemm_kernel, quantize_kernel
from triton_moe.plan import plan

COMBINE_BLOCK = 1024
AMAX_BLOCK = 1024
QUANT_GROUPS = 8  # quantize_kernel's step: 8 groups of 128 columns


def _amax_buffer(quant: str, rows: int, cols: int, device) -> torch.Tensor:
    """Zeroed amax storage of a [rows, cols] activation, shaped like its scales."""
    return torch.zeros(activation_scale_shape(quant, rows, cols), dtype=torch.float32, device=device)


def _quantize(a, quant: str, amax=None):
    """(q E4M3, scale fp32) of activations a [rows, cols] — moe_spec.quant.quantize_activation's
    result. ``amax``: the amax in the format's shape when already known (else found here)."""
    rows, cols = a.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=a.device)
    scale = torch.empty(activation_scale_shape(quant, rows, cols), dtype=torch.float32, device=a.device)
    if quant == "fp8_tensor" and amax is None:
        amax = torch.zeros(1, dtype=torch.float32, device=a.device)
        launch(amax_kernel, (rows,), a, amax, rows, cols, BLOCK=AMAX_BLOCK)
    launch(quantize_kernel, (rows,), a, amax if amax is not None else scale, q, scale, rows, cols,
           QUANT=QUANT_MODE[quant], AMAX_GIVEN=amax is not None, GROUPS=QUANT_GROUPS, INTERPRETER=INTERPRET)
    return q, scale


def _gemm(a, a_scale, w, w_scale, out, out_amax, topk_weights, routing: Alignment, N, K, *,
          a_row_div, fuse_silu, mul_routed_weight, quant, cfg: TritonConfig):
    grid = (routing.expert_of_block.numel() * triton.cdiv(N, cfg.BLOCK_N),)
    dummy = out  # stands in for pointers a mode does not read
    launch(moe_gemm_kernel, grid,
           a, a_scale if a_scale is not None else dummy, w, w_scale if w_scale is not None else dummy,
           out, out_amax if out_amax is not None else dummy,
           topk_weights if topk_weights is not None else dummy,
           routing.sorted_ids, routing.expert_of_block, routing.num_padded, routing.num_pairs, N, K,
           A_ROW_DIV=a_row_div, FUSE_SILU=fuse_silu, MUL_ROUTED_WEIGHT=mul_routed_weight,
           QUANT=QUANT_MODE[quant], FP8_IMPRECISE_ACC=cfg.fp8_imprecise_acc, SWAP_AB=bool(cfg.swap_ab), INTERPRETER=INTERPRET,
           BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None,
              config: Optional[TritonConfig] = None, swap_ab: Optional[bool] = None) -> torch.Tensor:
    """The MoE expert computation (see :mod:`moe_spec.contract`) with Triton kernels → [T, K] bf16.

    Backend options:
      ``config``   a :class:`~triton_moe.config.TritonConfig`; default: the tuned table for this
                   shape and device, else the heuristic (:func:`~triton_moe.config.get_config`).
      ``swap_ab``  force swap-AB on (True) or off (False); default: the config's rule.

    The arguments, then the options and this backend's limits (:func:`~triton_moe.plan.plan`), are
    checked before any launch — T = 0 included: an empty batch returns the empty [0, K] tensor only
    when the call would run at T = 1.
    """
    d = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale,
                          w2_scale=w2_scale, max_experts=MAX_EXPERTS)
    p = plan(d, quant, config=config, swap_ab=swap_ab)
    if d.T == 0:
        return x.new_empty((0, d.K))
    routing = align_block_size(topk_ids, d.E, p.align_tile)
    return expert_computation(x, w1, w2, topk_weights, routing, d.top_k, quant=quant, w1_scale=w1_scale,
                              w2_scale=w2_scale, config=p.config)


def expert_computation(x, w1, w2, topk_weights, routing, top_k: int, *, quant, w1_scale, w2_scale,
                       config: TritonConfig) -> torch.Tensor:
    """Everything after the alignment: quantize x, GEMM1 + SiLU·up, quantize the intermediate,
    GEMM2 × routing weight, combine.

    ``routing`` is the :class:`~moe_spec.align.Alignment` for ``config.BLOCK_M``
    (:func:`~triton_moe.align.align_block_size`); ``config`` must be resolved and checked (a plan's). :func:`fused_moe` is the validated entry point; the
    benchmark times this part alone (the alignment is timed separately).
    """
    T, K = x.shape
    I = w2.shape[2]  # noqa: E741
    P = T * top_k
    device = x.device
    a1 = x
    a1_scale = act_amax = None
    if quant is not None:
        a1, a1_scale = _quantize(x, quant)
        act_amax = _amax_buffer(quant, P, I, device)

    # GEMM1 + SiLU(gate)·up: bf16 intermediate, or fp32 with its amax, quantized once for GEMM2
    act = torch.empty((P, I), dtype=torch.bfloat16 if quant is None else torch.float32, device=device)
    _gemm(a1, a1_scale, w1, w1_scale, act, act_amax, None, routing, I, K, a_row_div=top_k,
          fuse_silu=True, mul_routed_weight=False, quant=quant, cfg=config)
    a2, a2_scale = (act, None) if quant is None else _quantize(act, quant, act_amax)

    # GEMM2 × routing weight; with top_k = 1 its rows are already the output
    out = torch.empty((T, K), dtype=torch.bfloat16, device=device)
    y = out if top_k == 1 else torch.empty((P, K), dtype=torch.bfloat16, device=device)
    _gemm(a2, a2_scale, w2, w2_scale, y, None, topk_weights, routing, K, I, a_row_div=1,
          fuse_silu=False, mul_routed_weight=True, quant=quant, cfg=config)
    if top_k > 1:
        launch(combine_kernel, (T, triton.cdiv(K, COMBINE_BLOCK)), y, out, T, K, TOP_K=top_k,
               BLOCK=COMBINE_BLOCK, INTERPRETER=INTERPRET)
    return out

"""The backend contract, and its vLLM-compatible spelling.

Both backends implement::

    fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None,
              **backend_options) -> Tensor[T, K] (bf16)

with the tensors of :mod:`moe_spec.problem`, weight scales as in :mod:`moe_spec.quant`, activations
quantized inside the backend when ``quant`` is an fp8 format, and every argument checked by
:func:`moe_spec.validate.validate_moe_args` before a kernel runs.

:func:`make_fused_experts` wraps such a function into vLLM's ``fused_experts`` signature so that a
serving stack can swap either backend in. Options of vLLM that this project does not implement
(int8/int4 weights, static activation scales, expert maps, other activations) raise ValueError
instead of being ignored.
"""

from __future__ import annotations

import functools

import torch

from moe_spec.quant import FP8_BLOCK


def quant_from_vllm(use_fp8_w8a8=False, per_channel_quant=False, block_shape=None):
    """vLLM's quantization flags → one of this project's quant formats."""
    if not use_fp8_w8a8:
        if per_channel_quant or block_shape is not None:
            raise ValueError("per_channel_quant/block_shape: only meaningful with use_fp8_w8a8=True")
        return None
    if block_shape is not None:
        if list(block_shape) != [FP8_BLOCK, FP8_BLOCK]:
            raise ValueError(f"block_shape: only [{FP8_BLOCK}, {FP8_BLOCK}] is supported, got {block_shape}")
        return "fp8_block"
    return "fp8_channel" if per_channel_quant else "fp8_tensor"


def _vllm_scale(s, quant):
    """vLLM stores per-channel scales as [E, N, 1] and per-tensor ones as [E] or [E, 1, 1]."""
    if not isinstance(s, torch.Tensor):
        return s  # None, or a wrong type that validation will name
    if quant == "fp8_channel" and s.dim() == 3 and s.shape[-1] == 1:
        return s.squeeze(-1)
    if quant == "fp8_tensor" and s.dim() > 1:
        return s.reshape(-1)
    return s


def make_fused_experts(fused_moe):
    """Return ``fused_experts`` with vLLM's signature, calling ``fused_moe``."""

    @functools.wraps(fused_moe, assigned=("__module__",))
    def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, activation="silu",
                      apply_router_weight_on_input=False, use_fp8_w8a8=False, use_int8_w8a8=False,
                      use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
                      global_num_experts=-1, expert_map=None, w1_scale=None, w2_scale=None,
                      w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None, block_shape=None,
                      **backend_options):
        unsupported = {
            "activation": activation != "silu",
            "apply_router_weight_on_input": apply_router_weight_on_input,
            "use_int8_w8a8": use_int8_w8a8,
            "use_int8_w8a16": use_int8_w8a16,
            "use_int4_w4a16": use_int4_w4a16,
            "expert_map": expert_map is not None,
            "w1_zp": w1_zp is not None,
            "w2_zp": w2_zp is not None,
            "a1_scale": a1_scale is not None,
            "a2_scale": a2_scale is not None,
        }
        bad = [name for name, hit in unsupported.items() if hit]
        if bad:
            raise ValueError(f"{bad[0]}: not supported by this backend (SiLU-gated experts, fp8 W8A8 with "
                             "dynamic activation scales, no expert map)")
        if global_num_experts != -1 and not (isinstance(w1, torch.Tensor) and global_num_experts == w1.shape[0]):
            raise ValueError(f"global_num_experts: expected -1 or E (w1.shape[0]), got {global_num_experts}")
        quant = quant_from_vllm(use_fp8_w8a8, per_channel_quant, block_shape)
        out = fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, quant=quant,
                        w1_scale=_vllm_scale(w1_scale, quant), w2_scale=_vllm_scale(w2_scale, quant),
                        **backend_options)
        if inplace:
            hidden_states.copy_(out)
            return hidden_states
        return out

    fused_experts.__name__ = "fused_experts"
    fused_experts.__qualname__ = "fused_experts"
    fused_experts.__doc__ = (
        "vLLM-compatible spelling of this backend's fused_moe (see moe_spec.contract).\n\n"
        + (fused_moe.__doc__ or "")
    )
    return fused_experts

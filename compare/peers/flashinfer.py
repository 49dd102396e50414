"""FlashInfer's ``cutlass_fused_moe`` (TensorRT-LLM's CUTLASS MoE) behind the contract.

Its conventions, read from ``flashinfer/fused_moe/core.py``, its binding
(``csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu``) and its tests
(``tests/moe/test_trtllm_cutlass_fused_moe.py``), and what the adapter converts:

* ``fc1_expert_weights`` is TensorRT-LLM's w31: [E, 2I, K] with the **up** rows (w3) first and the
  **gate** rows (w1) second — the reverse of the contract's [gate; up]. The adapter swaps the two
  halves once per weight tensor (a copy of W1; for fp8_block the block scales' row blocks swap with
  them, which needs I to be a multiple of 128). ``fc2_expert_weights`` is the contract's w2 [E, K, I].
* ``token_selected_experts`` int32 [T, top_k] and ``token_final_scales`` fp32 [T, top_k]: the
  contract's routing (int64 ids are converted to int32 once).
* ``output``: the adapter allocates the [T, K] bf16 output on each call and passes it as
  ``output=`` (some releases return a list); ``output_dtype`` is bf16.
* bf16: ``quant_scales=None``.
* fp8_tensor: the input must be FP8 already, and the four ``quant_scales`` are static — fc1
  dequant ``w1_scale·a1`` [E], fc2 activation quant ``1/a2`` (a scalar), fc2 dequant ``w2_scale·a2``
  [E], fc1 input dequant ``a1`` (a scalar). FlashInfer has no dynamic activation scale here: a
  serving stack loads a1 and a2 from a calibrated checkpoint. The adapter calibrates both on the
  batch it is given (:func:`moe_spec.oracle.calibrate_static_scales`: the scales the contract's
  dynamic fp8_tensor uses on that batch), once per input set, outside the timed region, so the
  peer computes the same function as the oracle; quantizing x with a1 is done in every call and
  timed (one torch cast), as a layer must do it per batch.
* fp8_block: ``use_deepseek_fp8_block_scale=True`` (Hopper only), ``quant_scales=[w31 block scales
  [E, 2I/128, K/128], w2 block scales [E, K/128, I/128]]``; x is given in bf16 and quantized inside
  per 1×128 group, as the contract's fp8_block.
* fp8_channel: FlashInfer's FP8 path takes one weight scale per expert matrix; declined.

``use_fused_finalize`` is left at its default (True): the top-k sum is fused into GEMM2's epilogue
with atomics, which FlashInfer documents as not bitwise deterministic run to run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compare.peers import Converted, Peer, empty_output, entry_point, split_gate_up, takes
from compare.peers.vllm import Adapted
from moe_spec.oracle import calibrate_static_scales
from moe_spec.quant import FP8_BLOCK, quantize_activation_static

PEER = Peer(
    "flashinfer", "flashinfer-python", "flashinfer.fused_moe:cutlass_fused_moe", (None, "fp8_tensor", "fp8_block")
)


def load() -> Callable:
    return entry_point(PEER)


def up_gate(w1: torch.Tensor) -> torch.Tensor:
    """The contract's W1 [E, 2I, K] (gate; up) as TensorRT-LLM's w31 (up; gate)."""
    gate, up = split_gate_up(w1)
    return torch.cat([up, gate], dim=1).contiguous()


def up_gate_block_scales(scale: torch.Tensor, I: int) -> torch.Tensor:  # noqa: E741
    """W1's 128×128 block scales [E, 2I/128, K/128] with the gate and up row blocks swapped."""
    if I % FP8_BLOCK:
        raise NotImplementedError(
            f"fp8_block: I = {I} is not a multiple of {FP8_BLOCK}, so a block of W1's scales "
            "straddles gate and up rows and cannot follow their swap into w31 order"
        )
    half = I // FP8_BLOCK
    return torch.cat([scale[:, half:], scale[:, :half]], dim=1).contiguous()


def fp8_tensor_scales(w1_scale, w2_scale, a1, a2) -> list:
    """FlashInfer's four FP8 per-tensor ``quant_scales`` from the weight and static activation scales."""
    a1, a2 = a1.float().reshape(()), a2.float().reshape(())
    return [(w1_scale.float() * a1).contiguous(), (1.0 / a2).reshape(()), (w2_scale.float() * a2).contiguous(), a1]


def make(entry: Callable) -> Adapted:
    cache = Converted()

    def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        declined = PEER.declines(quant)
        if declined:
            raise NotImplementedError(declined)
        if x.shape[0] == 0:
            return empty_output(x)
        I = w2.shape[2]  # noqa: E741
        w31 = cache.get("w31", (w1,), lambda: up_gate(w1))
        ids = cache.get("ids", (topk_ids,), lambda: topk_ids if topk_ids.dtype == torch.int32 else topk_ids.int())
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        options: dict = dict(quant_scales=None)
        if quant == "fp8_block":
            s31 = cache.get("w31_scale", (w1_scale,), lambda: up_gate_block_scales(w1_scale, I))
            options = dict(quant_scales=[s31, w2_scale.contiguous()], use_deepseek_fp8_block_scale=True)
        elif quant == "fp8_tensor":
            key = (x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale)
            a1, a2 = cache.get(
                "calibration",
                key,
                lambda: calibrate_static_scales(
                    x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale
                ),
            )
            scales = cache.get("quant_scales", key, lambda: fp8_tensor_scales(w1_scale, w2_scale, a1, a2))
            x = quantize_activation_static(x, a1)  # per batch: timed
            options = dict(quant_scales=scales)
        entry(x, ids, topk_weights, w31, w2, torch.bfloat16, **takes(entry, output=out, **options))
        return out

    fused_moe.__name__ = "flashinfer_fused_moe"

    def converted(quant) -> str:
        note = "w1 [gate; up] → w31 [up; gate] (one copy per weight); output buffer allocated per call"
        if quant == "fp8_block":
            note += "; W1's block scales' row blocks swapped with it; use_deepseek_fp8_block_scale"
        elif quant == "fp8_tensor":
            note += (
                "; static activation scales a1, a2 calibrated on this batch outside the timed region "
                "(= the dynamic scales); x quantized with a1 in the call (timed); quant_scales "
                "[w1_scale·a1, 1/a2, w2_scale·a2, a1]"
            )
        return note

    return Adapted(fused_moe, converted)

"""SonicMoE's CuTe-DSL MoE forward (``sonicmoe.moe_general_routing_inputs``) behind the contract, bf16.

SonicMoE takes routing it did not compute through ``moe_general_routing_inputs(x, router_scores,
token_indices, expert_indices, w1, b1, w2, b2, E, stream_id, activation_type,
is_inference_mode_enabled)``: the routing as flat (token, expert, score) triples with the token
indices sorted ascending, and the weights in its module's layout, read from ``sonicmoe/moe.py`` and
the comment above that function in ``sonicmoe/functional/__init__.py``:

* ``w1``: shape (2I, K, E), stride order (2, 0, 1) — its ``Experts.weight`` [E, 2I, K] permuted
  ``(1, 2, 0)`` — with the gate and up rows **interleaved** (gate₀, up₀, gate₁, up₁, …; SwiGLU is
  ``up · SiLU(gate)`` of the odd and even rows). The contract's W1 is [E, 2I, K] with the gate
  rows first: the adapter interleaves the two halves once per weight tensor (a copy) and views it
  permuted, no further copy.
* ``w2``: shape (K, I, E), stride order (2, 0, 1): the contract's W2 [E, K, I] permuted ``(1, 2, 0)``,
  a view.
* routing: ``token_indices`` = 0, 0, …, 1, 1, … (top_k times each, int32), ``expert_indices`` =
  ``topk_ids`` flattened (int32), ``router_scores`` = ``topk_weights`` flattened (fp32); made once per
  routing tensor. ``is_inference_mode_enabled=True`` (no pre-activation kept for a backward pass),
  no biases, ``stream_id`` the current CUDA stream's handle. It returns ``(output, expert_frequency)``.

SonicMoE implements bf16 only; the FP8 formats are declined.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from compare.peers import Converted, Peer, empty_output, entry_point, parameters, split_gate_up, takes
from compare.peers.vllm import Adapted

PEER = Peer("sonicmoe", "sonic-moe", "sonicmoe:moe_general_routing_inputs", (None,))
ENUMS_MODULE = "sonicmoe.enums"  # ActivationType


def load() -> Callable:
    return entry_point(PEER)


def interleaved_w1(w1: torch.Tensor) -> torch.Tensor:
    """The contract's W1 [E, 2I, K] (gate; up) with rows interleaved gate₀, up₀, gate₁, …, viewed as
    SonicMoE's (2I, K, E)."""
    gate, up = split_gate_up(w1)
    E, I, K = gate.shape  # noqa: E741
    return torch.stack([gate, up], dim=2).reshape(E, 2 * I, K).permute(1, 2, 0)


def flat_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple:
    """(token_indices, expert_indices, router_scores): one triple per (token, slot), tokens ascending."""
    T, k = topk_ids.shape
    tokens = torch.arange(T, dtype=torch.int32, device=topk_ids.device).repeat_interleave(k)
    return (
        tokens,
        topk_ids.reshape(-1).to(torch.int32, copy=True),
        topk_weights.reshape(-1).to(torch.float32, copy=True),
    )


def make(entry: Callable) -> Adapted:
    cache = Converted()
    swiglu = importlib.import_module(ENUMS_MODULE).ActivationType.SWIGLU
    has_stream = "stream_id" in parameters(entry)

    def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        declined = PEER.declines(quant)
        if declined:
            raise NotImplementedError(declined)
        if x.shape[0] == 0:
            return empty_output(x)
        w1s = cache.get("w1", (w1,), lambda: interleaved_w1(w1))
        tokens, experts, scores = cache.get(
            "routing", (topk_weights, topk_ids), lambda: flat_routing(topk_weights, topk_ids)
        )
        stream = {}
        if has_stream:
            stream["stream_id"] = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        out = entry(
            **takes(
                entry,
                x=x,
                router_scores=scores,
                token_indices=tokens,
                expert_indices=experts,
                w1=w1s,
                b1=None,
                w2=w2.permute(1, 2, 0),
                b2=None,
                E=w1.shape[0],
                activation_type=swiglu,
                is_inference_mode_enabled=True,
                **stream,
            )
        )
        return out[0] if isinstance(out, (tuple, list)) else out

    fused_moe.__name__ = "sonicmoe_fused_moe"

    def converted(quant) -> str:
        return (
            "w1 [E, 2I, K] gate|up halves → rows interleaved (g₀, u₀, g₁, …) (one copy per weight), viewed "
            "(2I, K, E); w2 viewed (K, I, E), no copy; routing flattened to (token, expert, score) triples, "
            "tokens ascending, once per routing tensor"
        )

    return Adapted(fused_moe, converted)

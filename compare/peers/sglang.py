"""SGLang's Triton ``fused_experts`` behind the contract.

SGLang's Triton MoE is vLLM's, forked: the same weight layout as the contract (``w1`` = w13 [E, 2I, K],
gate rows then up rows; ``w2`` [E, K, I]), the same quantization flags (``use_fp8_w8a8``,
``per_channel_quant``, ``block_shape``) and scale layouts (per-tensor [E], per-channel [E, N, 1],
block [E, ⌈N/128⌉, ⌈K/128⌉]), dynamic activation scales. Its current entry point takes the routing
as a ``StandardTopKOutput`` (topk_weights, topk_ids, router_logits — the logits unused here) and the
runner's options as a ``MoeRunnerConfig``; the adapter builds both (``inplace=False``,
``activation="silu"``, and ``gate_up_interleaved=False`` where that field exists: the contract's w13
is not interleaved). Releases before that API take ``topk_weights, topk_ids`` directly; the adapter
reads the signature and uses the spelling it has.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

from compare.peers import Converted, Peer, empty_output, entry_point, parameters, takes
from compare.peers.vllm import Adapted, flags, vllm_scale

PEER = Peer(
    "sglang",
    "sglang",
    "sglang.srt.layers.moe.fused_moe_triton.fused_moe:fused_experts",
    (None, "fp8_tensor", "fp8_channel", "fp8_block"),
)
TOPK_MODULE = "sglang.srt.layers.moe.topk"  # StandardTopKOutput
RUNNER_MODULE = "sglang.srt.layers.moe.moe_runner"  # MoeRunnerConfig


def load() -> Callable:
    return entry_point(PEER)


def _by_fields(cls, **values):
    """``cls(**values)`` with only the fields ``cls`` has (a dataclass or a NamedTuple); a NamedTuple
    field not given is None."""
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
    return cls(**{name: values.get(name) for name in cls._fields})


def runner_config(cls, E: int, K: int, I: int, top_k: int):  # noqa: E741
    """SGLang's MoeRunnerConfig for one layer of the contract, called out of place."""
    return _by_fields(
        cls,
        num_experts=E,
        num_local_experts=E,
        hidden_size=K,
        intermediate_size_per_partition=I,
        intermediate_size=I,
        top_k=top_k,
        params_dtype=torch.bfloat16,
        activation="silu",
        is_gated=True,
        inplace=False,
        no_combine=False,
        gate_up_interleaved=False,
    )


def make(entry: Callable) -> Adapted:
    cache = Converted()
    current = "topk_output" in parameters(entry)
    if current:
        topk_output = importlib.import_module(TOPK_MODULE).StandardTopKOutput
        config_cls = importlib.import_module(RUNNER_MODULE).MoeRunnerConfig
    configs: dict = {}

    def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        declined = PEER.declines(quant)
        if declined:
            raise NotImplementedError(declined)
        if x.shape[0] == 0:
            return empty_output(x)
        s1 = cache.get(f"w1_scale {quant}", (w1_scale,), lambda: vllm_scale(w1_scale, quant))
        s2 = cache.get(f"w2_scale {quant}", (w2_scale,), lambda: vllm_scale(w2_scale, quant))
        quantization = dict(**flags(quant), w1_scale=s1, w2_scale=s2)
        if not current:
            return entry(x, w1, w2, topk_weights, topk_ids, **takes(entry, inplace=False, **quantization))
        routing = cache.get(
            "topk_output",
            (topk_weights, topk_ids),
            lambda: _by_fields(topk_output, topk_weights=topk_weights, topk_ids=topk_ids),
        )
        shape = (w1.shape[0], x.shape[1], w2.shape[2], topk_ids.shape[1])
        if shape not in configs:
            configs[shape] = runner_config(config_cls, *shape)
        return entry(x, w1, w2, routing, configs[shape], **takes(entry, **quantization))

    fused_moe.__name__ = "sglang_fused_moe"

    def converted(quant) -> str:
        api = (
            "routing wrapped in StandardTopKOutput; MoeRunnerConfig(inplace=False, activation='silu', "
            "gate_up_interleaved=False where it has the field)"
            if current
            else "topk_weights, topk_ids as given"
        )
        scales = "; weight scales [E, N] → [E, N, 1]" if flags(quant)["per_channel_quant"] else ""
        return f"w1 [E, 2I, K] gate rows then up rows is SGLang's w13, no copy; {api}{scales}"

    return Adapted(fused_moe, converted)

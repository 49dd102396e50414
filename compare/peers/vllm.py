"""vLLM's ``fused_experts`` (its Triton fused-MoE path) behind the contract.

vLLM's layout is the contract's (``moe_spec.contract``): ``hidden_states`` [T, K], ``w1`` = its w13
[E, 2I, K] with the gate rows (w1) first and the up rows (w3) after them — ``silu_and_mul`` computes
SiLU of the first half times the second — ``w2`` [E, K, I], ``topk_weights`` fp32 and ``topk_ids``
int32 [T, top_k]. The adapter converts only the quantization's spelling and one scale shape:

========== ============================================================ ==========================
format     vLLM's spelling                                              weight scales
========== ============================================================ ==========================
bf16       ``quant_config=None`` (flags: ``use_fp8_w8a8=False``)        —
fp8_tensor ``fp8_w8a8_moe_quant_config(w1_scale, w2_scale)``            [E], as given
fp8_channel ... ``per_act_token_quant=True, per_out_ch_quant=True``     [E, N] → [E, N, 1]
fp8_block  ... ``block_shape=[128, 128]``                               [E, ⌈N/128⌉, ⌈K/128⌉]
========== ============================================================ ==========================

The activation scales are dynamic in every format (``a1_scale``/``a2_scale`` left None): per tensor,
per token, or per 1×128 group, as the contract's formats are. vLLM releases before its
``FusedMoEQuantConfig`` take the same information as flags (``use_fp8_w8a8``,
``per_channel_quant``, ``block_shape``, ``w1_scale``, ``w2_scale``); the adapter reads the entry
point's signature and uses the spelling it has. A user kernel with vLLM's signature
(``--backends file.py:fn@vllm``, :mod:`compare.userkernel`) goes through :func:`make` too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

from compare.peers import Converted, Peer, empty_output, entry_point, parameters, per_channel_3d, takes
from moe_spec.quant import FP8_BLOCK, WHOLE, get_format

PEER = Peer(
    "vllm",
    "vllm",
    "vllm.model_executor.layers.fused_moe:fused_experts",
    (None, "fp8_tensor", "fp8_channel", "fp8_block"),
)
CONFIG_MODULE = "vllm.model_executor.layers.fused_moe.config"


class Adapted(NamedTuple):
    fused_moe: Callable  # the contract's signature
    converted: Callable[[str | None], str]  # quant -> what the adapter converts


def load() -> Callable:
    return entry_point(PEER)


def flags(quant) -> dict:
    """The contract's format as vLLM's three quantization flags."""
    fmt = get_format(quant)
    if not fmt.quantized:
        return dict(use_fp8_w8a8=False, per_channel_quant=False, block_shape=None)
    return dict(
        use_fp8_w8a8=True,
        per_channel_quant=fmt.weight_group == (1, WHOLE),
        block_shape=list(fmt.weight_group) if WHOLE not in fmt.weight_group else None,
    )


def vllm_scale(scale, quant):
    """A copy of a weight scale in vLLM's layout: per-channel [E, N] → [E, N, 1]; the others' shapes as
    given. A copy (scales are small), so that what is built from it can be kept between calls."""
    if scale is None:
        return None
    return (per_channel_3d(scale) if flags(quant)["per_channel_quant"] else scale).clone()


def quant_config(quant, w1_scale, w2_scale):
    """vLLM's FusedMoEQuantConfig for the format (None for bf16); needs vLLM."""
    if quant is None:
        return None
    f = flags(quant)
    try:
        config = importlib.import_module(CONFIG_MODULE)
    except ImportError as exc:
        raise NotImplementedError(
            f"quant_config: an FP8 call in this spelling needs vLLM's FusedMoEQuantConfig ({type(exc).__name__}: {exc})"
        ) from None
    return config.fp8_w8a8_moe_quant_config(
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        per_act_token_quant=f["per_channel_quant"],
        per_out_ch_quant=f["per_channel_quant"],
        block_shape=f["block_shape"],
    )


def spelling(entry) -> str:
    """ "quant_config" (vLLM's current fused_experts) or "flags" (earlier releases, moe_spec.contract's)."""
    return "quant_config" if "quant_config" in parameters(entry) else "flags"


def _note(quant, how: str) -> str:
    f = flags(quant)
    if not f["use_fp8_w8a8"]:
        layout = "none: w1 [E, 2I, K] gate rows then up rows is vLLM's w13; w2 [E, K, I]; routing as given"
    elif f["per_channel_quant"]:
        layout = "weight scales [E, N] → [E, N, 1]; per-token dynamic activation scales"
    elif f["block_shape"]:
        layout = f"block_shape [{FP8_BLOCK}, {FP8_BLOCK}], scales as given; 1×{FP8_BLOCK} dynamic activation groups"
    else:
        layout = "weight scales [E] as given; dynamic per-tensor activation scales"
    return f"{layout}; format passed as {how}"


def make(entry: Callable, peer: Peer = PEER, empty_batch: bool = True) -> Adapted:
    """The contract around ``entry`` (vLLM's fused_experts signature). ``empty_batch``: answer T = 0
    without calling ``entry`` (a peer); False calls it (a user's kernel declines a format there)."""
    cache = Converted()
    how = spelling(entry)

    def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        declined = peer.declines(quant)
        if declined:
            raise NotImplementedError(declined)
        if x.shape[0] == 0 and empty_batch:
            return empty_output(x)
        s1 = cache.get(f"w1_scale {quant}", (w1_scale,), lambda: vllm_scale(w1_scale, quant))
        s2 = cache.get(f"w2_scale {quant}", (w2_scale,), lambda: vllm_scale(w2_scale, quant))
        if how == "quant_config":
            config = cache.get(f"quant_config {quant}", (w1_scale, w2_scale), lambda: quant_config(quant, s1, s2))
            kwargs = dict(quant_config=config)
        else:
            kwargs = dict(**flags(quant), w1_scale=s1, w2_scale=s2)
        return entry(x, w1, w2, topk_weights, topk_ids, **takes(entry, **kwargs))

    fused_moe.__name__ = f"{peer.name}_fused_moe"
    return Adapted(
        fused_moe,
        lambda quant: _note(
            quant, "quant_config" if how == "quant_config" else "use_fp8_w8a8 / per_channel_quant / block_shape"
        ),
    )

"""Helpers of the two studies of a quantization fused into triton_moe's GEMM1 (tests/test_triton_x_quant.py:
x in its A load; tests/test_triton_epilogue_quant.py: the intermediate in its epilogue): one expert
computation on the plan of a given config, the same with the fused path's switch off, and a bitwise
comparison."""

import contextlib

import torch

from moe_spec.validate import MoEDims, error_word


def same_bits(a, b) -> bool:
    """Equal shapes and equal bytes (NaNs and signed zeros included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_layer(kw, quant, cfg, a1=None, a2=None, ws=None):
    """One expert computation with the plan of ``cfg`` and both GEMM1 rules as they stand (x quantized in
    the A load: ``plan.x_quant_in_gemm1``; the intermediate in the epilogue: ``plan.epilogue_quant``)
    → (output, workspace — ``ws`` or fresh —, x quantized in GEMM1, intermediate quantized in GEMM1)."""
    from triton_moe import moe
    from triton_moe.align import align_block_size
    from triton_moe.plan import plan

    x, w2 = kw["x"], kw["w2"]
    (T, K), (E, _, I), top_k = x.shape, w2.shape, kw["topk_ids"].shape[1]  # noqa: E741
    p = plan(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k), quant, config=cfg)
    x_in_gemm1, epilogue = p.x_quant_in_gemm1(a1 is not None), p.epilogue_quant(a2 is not None)
    tile = p.config.BLOCK_M
    if ws is None:
        ws = moe._buffers(T, top_k, E, K, I, quant, tile, x.device, moe._split(p.config), epilogue, x_in_gemm1)
    out = moe.expert_computation(
        **{k: kw[k] for k in ("x", "w1", "w2", "topk_weights", "topk_ids", "w1_scale", "w2_scale")},
        routing=align_block_size(kw["topk_ids"], E, tile),
        quant=quant,
        config=p.config,
        workspace=ws,
        a1_scale=a1,
        a2_scale=a2,
    )
    return out, ws, x_in_gemm1, epilogue


def fused_and_separate(kw, quant, cfg, switch: str, a1=None, a2=None) -> list:
    """:func:`run_layer` as the rules stand, then with the plan switch ``switch`` off
    (``triton_moe.moe.rule_set``): two tuples of its answer plus the error word that run left (the word
    zeroed before each run and after both)."""
    from triton_moe import moe

    word = error_word(kw["x"].device)
    runs = []
    for fused in (True, False):
        word.zero_()
        with contextlib.nullcontext() if fused else moe.rule_set(switch, False):
            runs.append((*run_layer(kw, quant, cfg, a1, a2), int(word)))
    word.zero_()
    return runs

"""GPU lane (H200): weights of more than 2³¹ − 1 elements through both backends.

DeepSeek-V2's full MoE layer on one GPU — E = 160, I = 1536, K = 5120: W1 [160, 3072, 5120] holds
2.5 G elements (5 GB in bf16) — at T = 64, top_k = 6, with half the tokens routed to experts
150…159, whose weights start past element 2³¹ of W1. Each backend and format against the fp64
oracle at the usual tolerances. One bf16 weight pair stays resident (7.5 GB); the FP8 copies of a
case are freed before the next.

Run on the device: ``source .ci/on-device && python3 -m pytest -m gpu tests/test_offsets64_gpu.py``.
"""

import dataclasses
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from moe_spec.oracle import oracle, rel_l2  # noqa: E402
from moe_spec.problem import MoEShape, draw_weights, make_inputs, route  # noqa: E402
from moe_spec.validate import INT32_MAX  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_exclusive]

SHAPE = MoEShape("deepseek-v2-full", 160, 6, 5120, 1536, "DeepSeek-V2: 160 routed experts, I = 1536, one GPU")
T = 64
TOL = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_block": 1e-2}


@pytest.fixture(scope="module")
def weights():
    w1, w2 = draw_weights(SHAPE, 11, device="cuda")
    assert w1.numel() > INT32_MAX
    yield w1, w2
    del w1, w2
    torch.cuda.empty_cache()


def _inputs(weights, quant):
    inp = make_inputs(SHAPE, T, quant, seed=5, device="cuda", weights_bf16=weights)
    # half the tokens prefer the last ten experts: their bases in W1 are past 2³¹ elements
    logits = torch.randn(T, SHAPE.num_experts, generator=torch.Generator().manual_seed(6))
    logits[::2, 150:] += 8.0
    topk_weights, topk_ids = route(logits, SHAPE.top_k)
    assert int(topk_ids.max()) * 2 * SHAPE.intermediate * SHAPE.hidden > INT32_MAX
    return dataclasses.replace(inp, topk_weights=topk_weights.cuda(), topk_ids=topk_ids.cuda())


def _check(fused_moe, weights, quant):
    inp = _inputs(weights, quant)
    out = fused_moe(**inp.kwargs())
    torch.cuda.synchronize()
    ref = oracle(**inp.kwargs())
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    err = rel_l2(out, ref)
    del inp
    torch.cuda.empty_cache()
    assert err <= TOL[quant], f"rel L2 {err:.2e} > {TOL[quant]:.0e}"


@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_block"], ids=lambda q: q or "bf16")
def test_triton_full_deepseek_v2_layer(weights, quant):
    import triton_moe

    _check(triton_moe.fused_moe, weights, quant)


@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
def test_cute_full_deepseek_v2_layer(weights, quant):
    import cute_moe

    _check(cute_moe.fused_moe, weights, quant)

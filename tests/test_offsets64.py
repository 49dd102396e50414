"""64-bit element offsets on the CPU: weights of more than 2³¹ − 1 elements (triton_moe in the
interpreter) and the host limits that remain (:func:`moe_spec.validate.validate_moe_args`).

The big weights are ``torch.empty`` [E = 1024, …] tensors of which only the routed experts are
written: Linux commits the pages written, so 8 GB of W1 costs a few MB of memory, and the
interpreter hands a CPU tensor's storage to the kernel without copying it. The routed experts
include ones past 2³¹ elements (expert ≥ 512 of W1 [1024, 2048, 2048]), where a 32-bit
``expert · 2I · K`` wraps — the load then reads outside the tensor. The reference is the fp64
oracle of the same problem with the routed experts packed into a small tensor (the oracle reads
only the experts it is routed to, so the two problems are the same layer).
"""

import pytest
import torch

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEInputs, MoEShape, make_inputs
from moe_spec.validate import INT32_MAX, validate_moe_args
from triton_moe import TritonConfig, fused_moe

TOL = {None: 5e-3, "fp8_block": 1e-2}
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

E_BIG, K, I = 1024, 2048, 1024  # noqa: E741  (W1: 1024·2048·2048 = 2³² elements, W2: 2³¹)
EXPERTS = torch.tensor([0, 511, 512, 1023])  # 512 · 2I · K = 2³¹: the first expert past the int32 range


def _embed(small: torch.Tensor, experts: torch.Tensor, n: int) -> torch.Tensor:
    """[n, …] tensor holding ``small[j]`` at expert ``experts[j]``; the other experts never written."""
    big = torch.empty((n, *small.shape[1:]), dtype=small.dtype)
    big[experts] = small
    return big


def _scale_embed(small: torch.Tensor, experts: torch.Tensor, n: int) -> torch.Tensor:
    big = torch.ones((n, *small.shape[1:]), dtype=small.dtype)  # scales are small: all of them valid
    big[experts] = small
    return big


def _big_problem(quant) -> tuple[MoEInputs, MoEInputs]:
    small = make_inputs(MoEShape("packed", len(EXPERTS), 2, K, I, "test: the routed experts"), 3, quant, seed=7)
    big = MoEInputs(
        small.x,
        _embed(small.w1, EXPERTS, E_BIG),
        _embed(small.w2, EXPERTS, E_BIG),
        small.topk_weights,
        EXPERTS[small.topk_ids.long()].to(torch.int32),
        quant,
        None if small.w1_scale is None else _scale_embed(small.w1_scale, EXPERTS, E_BIG),
        None if small.w2_scale is None else _scale_embed(small.w2_scale, EXPERTS, E_BIG),
    )
    return small, big


@pytest.mark.parametrize("quant", [None, "fp8_block"], ids=lambda q: q or "bf16")  # fp8_block: scale indexes too
def test_triton_weights_past_int32_match_oracle(quant):
    small, big = _big_problem(quant)
    assert big.w1.numel() > INT32_MAX and big.w2.numel() > INT32_MAX
    assert int(big.topk_ids.max()) * 2 * I * K > INT32_MAX  # a routed expert's base needs 64 bits
    cfg = TritonConfig(16, 128, 128, 1, 4, 2, False)
    out = fused_moe(**big.kwargs(), config=cfg)
    err = rel_l2(out, oracle(**small.kwargs()))
    assert err <= TOL[quant], f"rel L2 {err:.2e} > {TOL[quant]:.0e}"


def _meta_kwargs(T, E, I, K, top_k):  # noqa: E741
    meta = dict(device="meta")
    return dict(
        x=torch.empty(T, K, dtype=torch.bfloat16, **meta),
        w1=torch.empty(E, 2 * I, K, dtype=torch.bfloat16, **meta),
        w2=torch.empty(E, K, I, dtype=torch.bfloat16, **meta),
        topk_weights=torch.empty(T, top_k, **meta),
        topk_ids=torch.empty(T, top_k, dtype=torch.int32, **meta),
    )


@pytest.mark.parametrize(
    "E, I, K, top_k",
    [(160, 1536, 5120, 6), (256, 2048, 7168, 8)],  # noqa: E741
    ids=["deepseek-v2", "deepseek-v3"],
)
def test_full_layer_weights_pass_the_host_checks(E, I, K, top_k):  # noqa: E741
    """W1 of 2.5 G / 7.5 G elements is no longer refused: the checks run through to the meta
    tensor (checked after every size limit), which is refused by name."""
    kw = _meta_kwargs(64, E, I, K, top_k)
    assert kw["w1"].numel() > INT32_MAX
    with pytest.raises(ValueError, match=r"^x: expected a tensor with data, got a meta tensor"):
        validate_moe_args(**kw)


def test_one_expert_past_int32_is_refused():
    """Offsets inside one expert's matrix stay 32-bit: 2I·K > 2³¹ − 1 is refused, naming w1."""
    kw = _meta_kwargs(4, 2, 65536, 16384, 1)  # 2I·K = 2³¹
    with pytest.raises(ValueError, match=r"^w1: one expert's matrix holds 2I·K = .*int32"):
        validate_moe_args(**kw)


def test_activation_copies_past_int32_are_refused():
    """The sorted activation copies (T·top_k rows of max(K, 2I)) keep their int32 limit, naming x."""
    kw = _meta_kwargs(65536, 8, 1024, 4096, 8)  # 65536 · 8 · 4096 = 2³¹
    with pytest.raises(ValueError, match=r"^x: the sorted activation copies hold .*int32"):
        validate_moe_args(**kw)
    kw = _meta_kwargs(65535, 8, 1024, 4096, 8)  # one token fewer fits: refused only as meta
    with pytest.raises(ValueError, match=r"^x: expected a tensor with data, got a meta tensor"):
        validate_moe_args(**kw)

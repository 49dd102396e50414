"""triton_moe on the CPU (Triton interpreter): every quant format, swap-AB on and off, edge routings.

The interpreter runs the same kernels as the GPU with ``INTERPRETER=True`` (see
:mod:`triton_moe.kernels`): bf16 tiles are widened to fp32 before ``tl.dot`` (its bf16 dot is
wrong) and bf16 / e4m3 casts are rounded explicitly (its casts truncate or mis-round). The checks
are the GPU's: relative L2 to the fp64 oracle ≤ 5e-3 (bf16) and ≤ 1e-2 (fp8). Shapes are tiny
(K = 160, I = 80: neither a multiple of the 64-wide tiles used) so the file runs in about a minute.
"""

import pytest
import torch

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from triton_moe import TritonConfig, fused_experts, fused_moe

TOL = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_channel": 1e-2, "fp8_block": 1e-2}
QUANTS = [None, "fp8_tensor", "fp8_channel", "fp8_block"]
# the interpreter's own numpy use (int() of a 1-element array) warns on every scalar load
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

SMALL = MoEShape("tiny", 8, 2, 160, 80, "test shape: K, I not multiples of the tiles")


def _config(quant, swap_ab):
    # swap: 64 weight rows × 16 tokens; no swap: 16 tokens × 32 columns; BLOCK_K 64 does not divide K=160
    return TritonConfig(16, 64 if swap_ab else 32, 64, 1, 4, 2, swap_ab)


def _check(inp, **options):
    out = fused_moe(**inp.kwargs(), **options)
    assert out.dtype == torch.bfloat16 and out.shape == inp.x.shape
    err = rel_l2(out, oracle(**inp.kwargs()))
    assert err <= TOL[inp.quant], f"rel L2 {err:.2e} > {TOL[inp.quant]:.0e}"
    return out


@pytest.mark.parametrize("swap_ab", [False, True], ids=["noswap", "swap"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_matches_oracle(quant, swap_ab):
    # T = 11: not a multiple of BLOCK_M; 22 pairs over 8 experts leave some experts empty
    inp = make_inputs(SMALL, 11, quant, seed=1)
    _check(inp, config=_config(quant, swap_ab))


@pytest.mark.parametrize("quant", [None, "fp8_block"], ids=lambda q: q or "bf16")
@pytest.mark.parametrize("swap_ab", [False, True], ids=["noswap", "swap"])
def test_single_token_top8(quant, swap_ab):
    shape = MoEShape("top8", 8, 8, 96, 48, "test: T=1, top_k=8 hits every expert once")
    _check(make_inputs(shape, 1, quant, seed=2), config=_config(quant, swap_ab))


@pytest.mark.parametrize("quant", [None, "fp8_channel"], ids=lambda q: q or "bf16")
def test_all_tokens_on_one_expert_top1(quant):
    # 40 tokens, top_k = 1, all on expert 3: three M-blocks of one expert, seven empty experts,
    # and GEMM2 writes the output directly (no combine)
    inp = make_inputs(MoEShape("one", 8, 1, 64, 48, "test"), 40, quant, seed=3)
    inp.topk_ids.fill_(3)
    _check(inp, config=_config(quant, True))


@pytest.mark.parametrize("quant", ["fp8_tensor", "fp8_channel"])
def test_imprecise_accumulation_variant(quant):
    # the promotion choice of tl.dot (max_num_imprecise_acc); the interpreter sums in fp32 either
    # way, so this checks the code path, not the GPU's accuracy (tests/test_triton_gpu.py does)
    inp = make_inputs(SMALL, 11, quant, seed=1)
    _check(inp, config=TritonConfig(16, 32, 64, 1, 4, 2, False, fp8_imprecise_acc=32))


def test_default_config_and_determinism():
    inp = make_inputs(SMALL, 5, "fp8_tensor", seed=4)
    a = _check(inp)  # heuristic config (swap-AB at 1.25 tokens per expert)
    b = fused_moe(**inp.kwargs())
    assert torch.equal(a, b)


def test_swap_ab_is_forcible_and_equivalent():
    inp = make_inputs(SMALL, 6, None, seed=5)
    on = fused_moe(**inp.kwargs(), swap_ab=True)
    off = fused_moe(**inp.kwargs(), swap_ab=False)
    assert rel_l2(on, off.double()) < 2e-3  # same products, different summation tiles


def test_empty_batch():
    inp = make_inputs(SMALL, 0, None)
    out = fused_moe(**inp.kwargs())
    assert out.shape == (0, SMALL.hidden) and out.dtype == torch.bfloat16


def test_vllm_spelling_per_channel():
    inp = make_inputs(SMALL, 3, "fp8_channel", seed=6)
    out = fused_experts(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, use_fp8_w8a8=True,
                        per_channel_quant=True, w1_scale=inp.w1_scale[..., None],
                        w2_scale=inp.w2_scale[..., None])
    assert rel_l2(out, oracle(**inp.kwargs())) <= 1e-2


def test_bad_input_is_named():
    inp = make_inputs(SMALL, 2, None)
    with pytest.raises(TypeError, match="^x:"):
        fused_moe(inp.x.float(), inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)


@pytest.mark.parametrize("T", [2, 0])  # refused whatever T (moe_spec.plan: the empty batch)
@pytest.mark.parametrize("config, quant, match", [
    (TritonConfig(16, 64, 256, swap_ab=True), "fp8_block", "BLOCK_K to divide 128"),
    (TritonConfig(128, 256, 128, num_stages=6), None, "shared memory"),
])
def test_config_that_does_not_fit_is_rejected(config, quant, match, T):
    inp = make_inputs(SMALL, T, quant)
    with pytest.raises(ValueError, match=match):
        fused_moe(**inp.kwargs(), config=config)


@pytest.mark.parametrize("quant", QUANTS[1:])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantize_kernel_is_the_reference(quant, dtype):
    """x (bf16) and the intermediate (fp32) are quantized once, before their GEMM: the E4M3 values
    and the scales equal moe_spec.quant's. K = 300: a partial 128-group; a zero row (floor scale);
    a row 100× larger than the rest (per-channel and per-group scales must not mix). Values are
    compared, not bits: the interpreter's e4m3 cast turns −0 into +0 (the GPU's keeps the sign)."""
    from moe_spec.quant import quantize_activation
    from triton_moe.moe import _quantize

    g = torch.Generator().manual_seed(7)
    a = (torch.randn(6, 300, generator=g) * 3).to(dtype)
    a[1, :200] *= 100
    a[2] = 0
    q_ref, s_ref = quantize_activation(a, quant)
    q, s = _quantize(a, quant)
    assert torch.equal(q.float(), q_ref.float())
    assert torch.equal(s, s_ref)
    if quant != "fp8_tensor":  # the amax a GEMM1 epilogue would hand over gives the same result
        amax = s_ref * 448.0
        q2, s2 = _quantize(a, quant, amax.reshape(s_ref.shape))
        assert torch.equal(q2.float(), q_ref.float())


@pytest.mark.parametrize("options, match", [
    ({"config": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}}, "^config: expected a triton_moe.TritonConfig"),
    ({"config": (16, 64, 64)}, "^config:"),
    ({"swap_ab": "no"}, "^swap_ab: expected True, False or None, got 'no'"),
    ({"swap_ab": 1}, "^swap_ab:"),
])
def test_backend_option_of_wrong_type_is_named_before_any_launch(options, match):
    from triton_moe.jit import count_compilations

    inp = make_inputs(SMALL, 2, None)
    with count_compilations(dry_run=True) as counter, pytest.raises(TypeError, match=match):
        fused_moe(**inp.kwargs(), **options)
    assert counter.total() == 0  # nothing was launched


def test_kernels_take_fp8_constants_from_compare():
    """448, 1e-12 and 128 are defined once (moe_spec.problem / moe_spec.quant): no kernel spells
    them as literals, and the constexprs the kernels read are those values."""
    import ast
    import inspect

    import moe_spec.problem
    import moe_spec.quant
    from triton_moe import kernels

    assert (kernels.FP8_MAX.value, kernels.AMAX_FLOOR.value, kernels.FP8_BLOCK.value) == (
        moe_spec.quant.FP8_MAX, moe_spec.quant.AMAX_FLOOR, moe_spec.quant.FP8_BLOCK)
    tree = ast.parse(inspect.getsource(kernels))
    literals = [(n.value, n.lineno) for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and type(n.value) in (int, float)
                and n.value in (448, 448.0, 1e-12, 128)]
    assert not literals, f"FP8 constants spelled as literals (value, line): {literals}"

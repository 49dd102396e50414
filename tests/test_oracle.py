"""The fp64 oracle against an independent dense formulation, on random problems of every format.

The second formulation shares no code with moe_spec.oracle / moe_spec.quant: it dequantizes with its
own index arithmetic, quantizes activations with its own scale code, and evaluates every expert on
every token through one-hot routing einsums, masking the pairs that were not routed.
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_spec.oracle import oracle, oracle_breakdown, rel_l2
from moe_spec.problem import CATALOG, MoEShape, make_inputs
from moe_spec.quant import FP8_MAX

F64 = torch.float64


def _scales_per_element(scale, quant, n, k):
    """[E, n, k] scale of each weight element, by direct indexing."""
    E = scale.shape[0]
    if quant == "fp8_tensor":
        return scale.to(F64).view(E, 1, 1).expand(E, n, k)
    if quant == "fp8_channel":
        return scale.to(F64).view(E, n, 1).expand(E, n, k)
    rows = torch.arange(n) // 128
    cols = torch.arange(k) // 128
    return scale.to(F64)[:, rows][:, :, cols]


def _fake_quant_rows(v, quant, valid):
    """Independent dynamic activation quantization of v [R, C] (fp64) over the rows in ``valid``."""
    if quant is None:
        return v
    v32 = v.float()
    R, C = v.shape
    if quant == "fp8_tensor":
        amax = v32[valid].abs().max() if bool(valid.any()) else torch.tensor(0.0)
        s = torch.full((R, C), max(float(amax), 1e-12) / FP8_MAX)
    elif quant == "fp8_channel":
        amax = v32.abs().amax(dim=1, keepdim=True)
        s = (amax.clamp_min(1e-12) / FP8_MAX).expand(R, C)
    else:
        s = torch.empty(R, C)
        for g in range(math.ceil(C / 128)):
            sl = slice(128 * g, 128 * (g + 1))
            s[:, sl] = v32[:, sl].abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    s = s.float()
    q = (v32 / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(F64) * s.to(F64)


def dense_reference(inp):
    """out[t] = Σ_e R[t, e] · y_e(x[t]) with R the dense routing matrix — every expert on every token."""
    x, ids, wts, quant = inp.x, inp.topk_ids.long(), inp.topk_weights, inp.quant
    T, K = x.shape
    E, two_i, _ = inp.w1.shape
    I = two_i // 2
    w1, w2 = inp.w1.to(F64), inp.w2.to(F64)
    if quant is not None:
        w1 = w1 * _scales_per_element(inp.w1_scale, quant, two_i, K)
        w2 = w2 * _scales_per_element(inp.w2_scale, quant, K, I)
    routed = torch.zeros(T, E, dtype=torch.bool)
    routed[torch.arange(T)[:, None].expand_as(ids), ids] = True
    R = torch.zeros(T, E, dtype=F64)
    R.index_put_((torch.arange(T)[:, None].expand_as(ids), ids), wts.to(F64), accumulate=True)
    xa = _fake_quant_rows(x.to(F64), quant, torch.ones(T, dtype=torch.bool))
    h = torch.einsum("tk,enk->ten", xa, w1)
    a = torch.nn.functional.silu(h[..., :I]) * h[..., I:]  # [T, E, I]
    a = _fake_quant_rows(a.reshape(T * E, I), quant, routed.reshape(-1)).reshape(T, E, I)
    y = torch.einsum("tei,eki->tek", a, w2)
    return torch.einsum("te,tek->tk", R, y)


FORMATS = [None, "fp8_tensor", "fp8_channel", "fp8_block"]


def _shape(E, top_k, K, I):
    return MoEShape("random", E, top_k, K, I, "test")


@st.composite
def problems(draw):
    E = draw(st.integers(1, 9))
    top_k = draw(st.integers(1, min(E, 4)))
    K = draw(st.integers(1, 300))
    I = draw(st.integers(1, 200))
    T = draw(st.sampled_from([1, 2, 3, 7, 16, 33]))
    quant = draw(st.sampled_from(FORMATS))
    skew = draw(st.sampled_from([0.0, 0.0, 6.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_inputs(_shape(E, top_k, K, I), T, quant, seed=seed, skew=skew)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_oracle_matches_dense_formulation(inp):
    ref = dense_reference(inp)
    out = oracle(**inp.kwargs())
    assert out.dtype == F64 and out.shape == ref.shape
    assert rel_l2(out, ref) <= 1e-12


@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("case", ["T=1", "empty experts", "one expert takes all", "T=0"])
def test_oracle_edge_cases(quant, case):
    shape = _shape(6, 2, 160, 136)
    if case == "T=1":
        inp = make_inputs(shape, 1, quant, seed=3)
    elif case == "T=0":
        inp = make_inputs(shape, 0, quant, seed=3)
    else:
        inp = make_inputs(shape, 12, quant, seed=4)
        ids = torch.tensor([[0, 3]] * 12, dtype=torch.int32) if case == "empty experts" else None
        if case == "one expert takes all":
            inp = make_inputs(dataclasses.replace(shape, top_k=1), 12, quant, seed=4)
            ids = torch.full((12, 1), 5, dtype=torch.int32)
            inp.topk_weights = torch.ones(12, 1)
        inp.topk_ids = ids
    out = oracle(**inp.kwargs())
    assert out.shape == (inp.x.shape[0], 160)
    if inp.x.shape[0]:
        assert rel_l2(out, dense_reference(inp)) <= 1e-12
        assert out.abs().sum() > 0


def test_breakdown_sums_to_output_and_isolates_experts():
    inp = make_inputs(_shape(5, 2, 64, 48), 9, "fp8_channel", seed=11)
    r = oracle_breakdown(**inp.kwargs())
    total = sum(r.expert_contribution(e) for e in r.experts())
    assert rel_l2(total, r.out) <= 1e-14
    for e in r.experts():
        untouched = ~(inp.topk_ids == e).any(dim=1)
        assert torch.all(r.expert_contribution(e)[untouched] == 0)
        assert torch.equal(r.expert_tokens(e), (~untouched).nonzero().squeeze(1))


def test_oracle_quantized_differs_from_bf16_by_fp8_error():
    """The fp8 oracle sees the quantized problem: close to the bf16 one, but not equal."""
    shape = _shape(4, 2, 256, 128)
    base = make_inputs(shape, 16, None, seed=5)
    q = make_inputs(shape, 16, "fp8_tensor", seed=5)
    err = rel_l2(oracle(**q.kwargs()), oracle(**base.kwargs()))
    assert 1e-3 < err < 0.1


def test_catalog_is_sane():
    for s in CATALOG.values():
        assert s.intermediate % 8 == 0 and s.hidden % 128 == 0 and s.source
    assert CATALOG["deepseek-v3"].with_tp(8).intermediate == 256


# --- NaN: where the math puts it -------------------------------------------------------------------


def _poison(inp, where):
    """A NaN in x[2, 5], or in W1 of the expert of token 0's first slot (the byte 0x7F under FP8)."""
    if where == "x":
        inp.x[2, 5] = float("nan")
        return torch.arange(inp.x.shape[0]) == 2
    e = int(inp.topk_ids[0, 0])
    if inp.quant is None:
        inp.w1[e, 3, 7] = float("nan")
    else:
        inp.w1.view(torch.uint8)[e, 3, 7] = 0x7F
    return (inp.topk_ids == e).any(dim=1)


@pytest.mark.parametrize("where", ["x", "w1"])
@pytest.mark.parametrize("quant", FORMATS)
def test_a_nan_reaches_exactly_the_rows_the_math_says(quant, where):
    """bf16, fp8_channel, fp8_block: the tokens that meet the NaN (its row of x; the tokens routed
    to its expert) — through GEMM1 every column of their intermediate, so every output column.
    fp8_tensor: every row, because the NaN makes the one intermediate scale NaN."""
    inp = make_inputs(_shape(6, 2, 160, 136), 9, quant, seed=8)
    rows = _poison(inp, where)
    assert 0 < int(rows.sum()) < 9
    out = oracle(**inp.kwargs())
    expected = torch.ones_like(rows) if quant == "fp8_tensor" else rows
    assert torch.equal(out.isnan(), expected[:, None].expand_as(out))

"""The backend contract, fuzzed: random valid problems against the oracle, and one fault at a time.

1. Random valid sizes (E ≤ 8, K and I multiples of 16 up to 128, T ≤ 16, top_k ≤ min(E, 4)), every
   format of the registry, random routing skew and tile configs, through ``triton_moe.fused_moe``
   (the interpreter here, the same kernels as the GPU): within the format's registry tolerance of
   the fp64 oracle.
2. A valid problem with exactly one thing wrong — a dtype, a shape, a device (meta included), a
   stride, an id out of range or repeated, a NaN/inf routing weight, a scale — handed to BOTH
   backends' ``fused_moe``: the contract's exception type, a message that starts with the
   argument's name, and (Triton) no kernel launched — in the ``"sync"`` check mode, which reads the
   data before any launch (``moe_spec.validate``). ``cute_moe.fused_moe`` validates on the host
   before its first launch, so its refusals run on the CPU too.

Hypothesis runs derandomized (the examples are a function of the test, so CI is reproducible),
without a deadline (the interpreter is slow) and without an example database.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.quant import FORMATS, FP8_DTYPE, get_format
from moe_spec.validate import checks

# the interpreter's numpy use (int() of a 1-element array) warns on every scalar load
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

CI = settings(derandomize=True, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def problems(draw, quants=tuple(FORMATS), min_tokens=0):
    E = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, min(E, 4)))
    K = 16 * draw(st.integers(1, 8))
    I = 16 * draw(st.integers(1, 8))  # noqa: E741
    T = draw(st.integers(min_tokens, 16))
    quant = draw(st.sampled_from(quants))
    skew = draw(st.sampled_from([0.0, 0.0, 4.0]))
    seed = draw(st.integers(0, 2**16))
    return make_inputs(MoEShape("fuzz", E, top_k, K, I, "hypothesis"), T, quant, seed=seed, skew=skew)


@st.composite
def triton_configs(draw, quant):
    """None (the heuristic) or a small tile: partial tiles, both swap-AB paths, grouped rasterization."""
    from triton_moe import TritonConfig

    if draw(st.booleans()):
        return None
    block_k = draw(st.sampled_from([32, 64] if get_format(quant).quantized else [16, 32, 64]))
    return TritonConfig(draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32, 64])), block_k,
                        GROUP_M=draw(st.sampled_from([1, 2, 8])), num_warps=4, num_stages=2,
                        swap_ab=draw(st.booleans()))


@pytest.mark.parametrize("quant", list(FORMATS), ids=lambda q: get_format(q).label)
@settings(CI, max_examples=8)
@given(data=st.data())
def test_random_valid_problems_match_the_oracle(quant, data):
    from triton_moe import fused_moe

    inp = data.draw(problems((quant,)), label="problem")
    config = data.draw(triton_configs(quant), label="config")
    event(f"{'heuristic' if config is None else 'swap' if config.swap_ab else 'no swap'}"
          f"{', T=0' if not inp.x.shape[0] else ''}")  # coverage: pytest --hypothesis-show-statistics
    out = fused_moe(**inp.kwargs(), config=config)
    assert out.dtype == torch.bfloat16 and out.shape == inp.x.shape
    err = rel_l2(out, oracle(**inp.kwargs()))
    assert err <= get_format(inp.quant).tolerance, f"rel L2 {err:.2e}"


# --- one fault at a time ----------------------------------------------------------------------------


def _other_weight_dtype(quant):
    return torch.bfloat16 if get_format(quant).quantized else FP8_DTYPE


def _with(kw, **changes):
    return {**kw, **changes}


def _one_element(t, value, data):
    """A copy of ``t`` with one element (drawn) set to ``value``."""
    t = t.clone()
    index = tuple(data.draw(st.integers(0, n - 1), label=f"index{d}") for d, n in enumerate(t.shape))
    t[index] = value
    return t


def _meta(kw):
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _strided(t):
    """The same values in a non-contiguous view (every other element of a wider tensor)."""
    return torch.stack([t, t], dim=-1)[..., 0]


# name: (what the problem needs, the mutation (kw, inputs, data) -> kw, exception, argument named)
FAULTS = {
    "x float32": (None, lambda kw, i, d: _with(kw, x=i.x.float()), TypeError, "x"),
    "x a list": (None, lambda kw, i, d: _with(kw, x=i.x.tolist()), TypeError, "x"),
    "x 3-D": (None, lambda kw, i, d: _with(kw, x=i.x[None]), ValueError, "x"),
    "x strided": ("T>0", lambda kw, i, d: _with(kw, x=_strided(i.x)), ValueError, "x"),
    "x on meta": (None, lambda kw, i, d: _with(kw, x=i.x.to("meta")), ValueError, "x"),
    "all on meta": (None, lambda kw, i, d: _meta(kw), ValueError, "x"),
    "w1 other dtype": (None, lambda kw, i, d: _with(kw, w1=i.w1.to(_other_weight_dtype(i.quant))), TypeError, "w1"),
    "w1 wrong K": (None, lambda kw, i, d: _with(kw, w1=i.w1[:, :, :-8].contiguous()), ValueError, "w1"),
    "w1 odd 2I": (None, lambda kw, i, d: _with(kw, w1=i.w1[:, :-1].contiguous()), ValueError, "w1"),
    "w1 on meta": (None, lambda kw, i, d: _with(kw, w1=i.w1.to("meta")), ValueError, "w1"),
    "w2 wrong E": ("E>1", lambda kw, i, d: _with(kw, w2=i.w2[1:].contiguous()), ValueError, "w2"),
    "w2 transposed view": (None, lambda kw, i, d: _with(kw, w2=i.w2.transpose(1, 2).contiguous().transpose(1, 2)),
                           ValueError, "w2"),
    "topk_weights float64": (None, lambda kw, i, d: _with(kw, topk_weights=i.topk_weights.double()),
                             TypeError, "topk_weights"),
    "topk_weights one row short": ("T>0", lambda kw, i, d: _with(kw, topk_weights=i.topk_weights[1:]),
                                   ValueError, "topk_weights"),
    "topk_weights NaN": ("T>0", lambda kw, i, d: _with(kw, topk_weights=_one_element(i.topk_weights, float("nan"), d)),
                         ValueError, "topk_weights"),
    "topk_weights inf": ("T>0", lambda kw, i, d: _with(kw, topk_weights=_one_element(i.topk_weights, -float("inf"), d)),
                         ValueError, "topk_weights"),
    "topk_ids float": (None, lambda kw, i, d: _with(kw, topk_ids=i.topk_ids.float()), TypeError, "topk_ids"),
    "topk_ids one id = E": ("T>0", lambda kw, i, d: _with(kw, topk_ids=_one_element(i.topk_ids, i.w1.shape[0], d)),
                            ValueError, "topk_ids"),
    "topk_ids one id < 0": ("T>0", lambda kw, i, d: _with(kw, topk_ids=_one_element(i.topk_ids, -1, d)),
                            ValueError, "topk_ids"),
    "topk_ids repeated": ("top_k>1", lambda kw, i, d: _with(kw, topk_ids=_repeat_in_a_row(i.topk_ids, d)),
                          ValueError, "topk_ids"),
    "topk_ids on meta": (None, lambda kw, i, d: _with(kw, topk_ids=i.topk_ids.to("meta")), ValueError, "topk_ids"),
    "quant unknown": (None, lambda kw, i, d: _with(kw, quant="fp8_row"), ValueError, "quant"),
    "w1_scale missing": ("fp8", lambda kw, i, d: _with(kw, w1_scale=None), ValueError, "w1_scale"),
    "w2_scale under bf16": ("bf16", lambda kw, i, d: _with(kw, w2_scale=torch.ones(i.w1.shape[0])),
                            ValueError, "w2_scale"),
    "w1_scale wrong shape": ("fp8", lambda kw, i, d: _with(kw, w1_scale=torch.cat([i.w1_scale, i.w1_scale])),
                             ValueError, "w1_scale"),
    "w2_scale float64": ("fp8", lambda kw, i, d: _with(kw, w2_scale=i.w2_scale.double()), TypeError, "w2_scale"),
    "w2_scale strided": ("fp8 scale>1", lambda kw, i, d: _with(kw, w2_scale=_strided(i.w2_scale)), ValueError, "w2_scale"),
    "w1_scale NaN": ("fp8", lambda kw, i, d: _with(kw, w1_scale=_one_element(i.w1_scale, float("nan"), d)),
                     ValueError, "w1_scale"),
    "w2_scale zero": ("fp8", lambda kw, i, d: _with(kw, w2_scale=_one_element(i.w2_scale, 0.0, d)),
                      ValueError, "w2_scale"),
    "w1_scale on meta": ("fp8", lambda kw, i, d: _with(kw, w1_scale=i.w1_scale.to("meta")), ValueError, "w1_scale"),
}


def _repeat_in_a_row(ids, data):
    """Copy one slot's expert onto another slot of the same (drawn) row."""
    ids = ids.clone()
    t = data.draw(st.integers(0, ids.shape[0] - 1), label="row")
    a, b = data.draw(st.lists(st.integers(0, ids.shape[1] - 1), min_size=2, max_size=2, unique=True), label="slots")
    ids[t, b] = ids[t, a]
    return ids


NEEDS = {
    None: lambda i: True,
    "T>0": lambda i: i.x.shape[0] > 0,
    "E>1": lambda i: i.w1.shape[0] > 1,
    "top_k>1": lambda i: i.topk_ids.shape[1] > 1 and i.x.shape[0] > 0,
    "fp8": lambda i: get_format(i.quant).quantized,
    "fp8 scale>1": lambda i: get_format(i.quant).quantized and i.w2_scale.numel() > 1,
    "bf16": lambda i: not get_format(i.quant).quantized,
}


def _backend(name):
    if name == "triton_moe":
        from triton_moe import fused_moe
    else:
        from cute_moe import fused_moe
    return fused_moe


@pytest.mark.parametrize("backend", ["triton_moe", "cute_moe"])
@pytest.mark.parametrize("fault", list(FAULTS))
@settings(CI, max_examples=6)
@given(data=st.data())
def test_one_fault_is_named_before_any_launch(backend, fault, data):
    from triton_moe.jit import count_compilations

    needs, mutate, exc, name = FAULTS[fault]
    quants = tuple(q for q, f in FORMATS.items()
                   if needs not in ("fp8", "fp8 scale>1", "bf16") or f.quantized == (needs != "bf16"))
    inp = data.draw(problems(quants, min_tokens=1 if needs in ("T>0", "top_k>1") else 0), label="problem")
    assume(NEEDS[needs](inp))
    kw = mutate(inp.kwargs(), inp, data)
    # the "sync" check mode reads the data (ids, routing weights, scales) before any launch; the
    # default mode checks it in the kernels (tests/test_triton_moe.py, tests/test_validate.py)
    with checks("sync"), count_compilations(dry_run=True) as counter, pytest.raises(exc) as info:
        _backend(backend)(**kw)
    assert str(info.value).startswith(f"{name}: "), str(info.value)
    assert counter.total() == 0  # no Triton kernel was launched (cute_moe would fail on the CPU)

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

3. Every other surface of the backends (:data:`SURFACES`): ``fused_experts`` in vLLM's arguments (its
   quant flags, its [E, N, 1] / [E, 1, 1] scale shapes), the warm-ups, the transformers experts
   forward, and the sharded layers on gloo. Random sizes — valid ones and ones past every limit —
   are refused by each exactly when ``moe_spec.validate.check_sizes`` refuses them, in its words
   after the surface's own name for the argument, before anything is allocated; the faults of 2
   are named by each surface in its own names; random valid problems through each match the
   oracle (``rel_l2_terms``, the contract's metric). A public callable of a backend or of the
   harness that takes the layer's weights and is not in :data:`SURFACES` fails
   :func:`test_every_surface_is_fuzzed`: a new surface is fuzzed by default.

Hypothesis runs derandomized (the examples are a function of the test, so CI is reproducible),
without a deadline (the interpreter is slow) and without an example database.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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

CI = settings(
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


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
    return TritonConfig(
        draw(st.sampled_from([16, 32])),
        draw(st.sampled_from([16, 32, 64])),
        block_k,
        GROUP_M=draw(st.sampled_from([1, 2, 8])),
        num_warps=4,
        num_stages=2,
        swap_ab=draw(st.booleans()),
    )


@pytest.mark.parametrize("quant", list(FORMATS), ids=lambda q: get_format(q).label)
@settings(CI, max_examples=8)
@given(data=st.data())
def test_random_valid_problems_match_the_oracle(quant, data):
    from triton_moe import fused_moe

    inp = data.draw(problems((quant,)), label="problem")
    config = data.draw(triton_configs(quant), label="config")
    event(
        f"{'heuristic' if config is None else 'swap' if config.swap_ab else 'no swap'}"
        f"{', T=0' if not inp.x.shape[0] else ''}"
    )  # coverage: pytest --hypothesis-show-statistics
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
    "w2 transposed view": (
        None,
        lambda kw, i, d: _with(kw, w2=i.w2.transpose(1, 2).contiguous().transpose(1, 2)),
        ValueError,
        "w2",
    ),
    "topk_weights float64": (
        None,
        lambda kw, i, d: _with(kw, topk_weights=i.topk_weights.double()),
        TypeError,
        "topk_weights",
    ),
    "topk_weights one row short": (
        "T>0",
        lambda kw, i, d: _with(kw, topk_weights=i.topk_weights[1:]),
        ValueError,
        "topk_weights",
    ),
    "topk_weights NaN": (
        "T>0",
        lambda kw, i, d: _with(kw, topk_weights=_one_element(i.topk_weights, float("nan"), d)),
        ValueError,
        "topk_weights",
    ),
    "topk_weights inf": (
        "T>0",
        lambda kw, i, d: _with(kw, topk_weights=_one_element(i.topk_weights, -float("inf"), d)),
        ValueError,
        "topk_weights",
    ),
    "topk_ids float": (None, lambda kw, i, d: _with(kw, topk_ids=i.topk_ids.float()), TypeError, "topk_ids"),
    "topk_ids one id = E": (
        "T>0",
        lambda kw, i, d: _with(kw, topk_ids=_one_element(i.topk_ids, i.w1.shape[0], d)),
        ValueError,
        "topk_ids",
    ),
    "topk_ids one id < 0": (
        "T>0",
        lambda kw, i, d: _with(kw, topk_ids=_one_element(i.topk_ids, -1, d)),
        ValueError,
        "topk_ids",
    ),
    "topk_ids repeated": (
        "top_k>1",
        lambda kw, i, d: _with(kw, topk_ids=_repeat_in_a_row(i.topk_ids, d)),
        ValueError,
        "topk_ids",
    ),
    "topk_ids on meta": (None, lambda kw, i, d: _with(kw, topk_ids=i.topk_ids.to("meta")), ValueError, "topk_ids"),
    "quant unknown": (None, lambda kw, i, d: _with(kw, quant="fp8_row"), ValueError, "quant"),
    "w1_scale missing": ("fp8", lambda kw, i, d: _with(kw, w1_scale=None), ValueError, "w1_scale"),
    "w2_scale under bf16": (
        "bf16",
        lambda kw, i, d: _with(kw, w2_scale=torch.ones(i.w1.shape[0])),
        ValueError,
        "w2_scale",
    ),
    "w1_scale wrong shape": (
        "fp8",
        lambda kw, i, d: _with(kw, w1_scale=torch.cat([i.w1_scale, i.w1_scale])),
        ValueError,
        "w1_scale",
    ),
    "w2_scale float64": ("fp8", lambda kw, i, d: _with(kw, w2_scale=i.w2_scale.double()), TypeError, "w2_scale"),
    "w2_scale strided": (
        "fp8 scale>1",
        lambda kw, i, d: _with(kw, w2_scale=_strided(i.w2_scale)),
        ValueError,
        "w2_scale",
    ),
    "w1_scale NaN": (
        "fp8",
        lambda kw, i, d: _with(kw, w1_scale=_one_element(i.w1_scale, float("nan"), d)),
        ValueError,
        "w1_scale",
    ),
    "w2_scale zero": (
        "fp8",
        lambda kw, i, d: _with(kw, w2_scale=_one_element(i.w2_scale, 0.0, d)),
        ValueError,
        "w2_scale",
    ),
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
    quants = tuple(
        q for q, f in FORMATS.items() if needs not in ("fp8", "fp8 scale>1", "bf16") or f.quantized == (needs != "bf16")
    )
    inp = data.draw(problems(quants, min_tokens=1 if needs in ("T>0", "top_k>1") else 0), label="problem")
    assume(NEEDS[needs](inp))
    kw = mutate(inp.kwargs(), inp, data)
    # the "sync" check mode reads the data (ids, routing weights, scales) before any launch; the
    # default mode checks it in the kernels (tests/test_triton_moe.py, tests/test_validate.py)
    with checks("sync"), count_compilations(dry_run=True) as counter, pytest.raises(exc) as info:
        _backend(backend)(**kw)
    assert str(info.value).startswith(f"{name}: "), str(info.value)
    assert counter.total() == 0  # no Triton kernel was launched (cute_moe would fail on the CPU)


# --- 3. every surface --------------------------------------------------------------------------------------


def _vllm_flags(quant):
    """vLLM's spelling of a format: (use_fp8_w8a8, per_channel_quant, block_shape)."""
    if quant is None:
        return dict()
    if quant == "fp8_block":
        return dict(use_fp8_w8a8=True, block_shape=[128, 128])
    return dict(use_fp8_w8a8=True, per_channel_quant=quant == "fp8_channel")


def _vllm_scale(s, data):
    """A contract scale in a shape vLLM keeps (a trailing 1 for per-channel / per-tensor), or as is."""
    if s is None or s.dim() != 2 or not data.draw(st.booleans(), label="vllm scale shape"):
        return s
    return s[..., None]  # [E, N] -> [E, N, 1]; [E, 1]-like per-tensor scales likewise


def _fused_experts(backend):
    def call(kw, data):
        fused_experts = _module(backend).fused_experts
        kw = dict(kw)
        quant = kw.pop("quant")
        args = [kw.pop(k) for k in ("x", "w1", "w2", "topk_weights", "topk_ids")]
        scales = {k: _vllm_scale(kw.pop(k), data) for k in ("w1_scale", "w2_scale")}
        return fused_experts(*args, **_vllm_flags(quant), **scales, **kw)

    return call


def _module(name):
    import importlib

    return importlib.import_module(name)


def _hf_forward(kw, data):
    """The transformers experts forward (triton_moe) on a Mixtral experts module holding w1 / w2."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    import compare.hf_experts as hx

    w1, w2 = kw["w1"], kw["w2"]
    E, two_i, H = w1.shape
    config = MixtralConfig(
        hidden_size=H, num_experts_per_tok=1, hidden_act="silu", num_local_experts=E, intermediate_size=two_i // 2
    )
    with torch.device("meta"):
        module = MixtralExperts(config)
    module.gate_up_proj = torch.nn.Parameter(w1, requires_grad=False)
    module.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    with torch.no_grad():
        return hx._FORWARDS["triton_moe"](module, kw["x"], kw["topk_ids"], kw["topk_weights"])


def _layer(parallel):
    def call(kw, data):
        from compare.distributed import EPMoE, TPMoE

        assert torch.distributed.is_initialized()  # the module's one-rank gloo group (fixture)
        layer = (TPMoE if parallel == "tp" else EPMoE)("triton_moe")
        kw = dict(kw)
        return layer(*[kw.pop(k) for k in ("x", "w1", "w2", "topk_weights", "topk_ids")], **kw)

    return call


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    """A one-rank gloo process group for the sharded layers (in this process: no spawn)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path_factory.mktemp('gloo') / 'rv'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    yield
    dist.destroy_process_group()


#: The contract's argument names as the transformers forward calls them.
HF_NAMES = {
    "x": "hidden_states",
    "topk_ids": "top_k_index",
    "topk_weights": "top_k_weights",
    "w1": "gate_up_proj",
    "w2": "down_proj",
}


@dataclass(frozen=True)
class Surface:
    """How one surface takes a contract problem (``call(kwargs, data)``), what it calls the contract's
    arguments, which of :data:`FAULTS` it can be handed (None: all) and which formats it takes."""

    call: Callable
    names: dict = field(default_factory=dict)
    faults: frozenset | None = None
    quants: tuple = tuple(FORMATS)
    group: bool = False  # needs the one-rank gloo group


#: Faults the transformers forward's arguments can carry (its weights come from a module, its x may be
#: [B, S, H] and is made contiguous, its routing weights are converted to float32).
HF_FAULTS = frozenset(
    {
        "x float32",
        "x a list",
        "x on meta",
        "topk_weights one row short",
        "topk_weights NaN",
        "topk_weights inf",
        "topk_ids float",
        "topk_ids one id = E",
        "topk_ids one id < 0",
        "topk_ids repeated",
        "topk_ids on meta",
    }
)

#: Every surface of the backends that takes a layer's arguments, but fused_moe (part 2) and the
#: warm-ups (sizes only, :func:`test_random_sizes_are_refused_alike_on_every_surface`).
SURFACES = {
    "triton_moe.fused_experts": Surface(
        _fused_experts("triton_moe"), {"x": "hidden_states"}, frozenset(FAULTS) - {"quant unknown"}
    ),
    "cute_moe.fused_experts": Surface(
        _fused_experts("cute_moe"), {"x": "hidden_states"}, frozenset(FAULTS) - {"quant unknown"}
    ),
    "compare.hf_experts forward": Surface(_hf_forward, HF_NAMES, HF_FAULTS, quants=(None,)),
    "compare.distributed.TPMoE": Surface(_layer("tp"), group=True),
    # EP reads x through a gather (a strided x is fine) and checks its routing itself
    "compare.distributed.EPMoE": Surface(_layer("ep"), faults=frozenset(FAULTS) - {"x strided"}, group=True),
}
#: The public callables of the backends and of the harness that take a layer (a warm-up takes its sizes).
FUZZED = {"triton_moe.fused_moe", "cute_moe.fused_moe", "triton_moe.warmup", "cute_moe.warmup", *SURFACES}
#: Public callables with layer-shaped arguments that are not surfaces: the CuTe pipeline's steps, and
#: the planning queries (a plan or a config for given sizes: no allocation, no compile; the warm-up
#: that calls them checks the sizes first).
PIECES = {
    "cute_moe.grouped_gemm",
    "cute_moe.gather_rows",
    "cute_moe.silu_mul",
    "cute_moe.combine",
    "cute_moe.sort_rows",
    "cute_moe.plans_for",
    "cute_moe.layer_configs",
    "triton_moe.plans_for",
    "triton_moe.get_config",
}


def test_every_surface_is_fuzzed():
    """A public callable that takes the layer's weights (w1 and w2, or gate_up_proj) or its sizes (E, K,
    I), in the backends' ``__all__`` or the harness's surfaces, must be in SURFACES / FUZZED."""
    import inspect

    import compare.distributed as distributed

    found = set()
    for package in ("triton_moe", "cute_moe"):
        mod = _module(package)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj) and not isinstance(obj, type):
                params = set(inspect.signature(obj).parameters)
                if {"w1", "w2"} <= params or {"hidden_states", "w1"} <= params or {"E", "K", "I"} <= params:
                    found.add(f"{package}.{name}")
    found |= {
        f"compare.distributed.{name}"
        for name in distributed.__all__
        if isinstance(getattr(distributed, name), type)
        and callable(getattr(distributed, name))
        and {"w1", "w2"} <= set(inspect.signature(getattr(distributed, name).__call__).parameters)
    }
    hx = pytest.importorskip("compare.hf_experts")
    if hx._FORWARDS:
        found.add("compare.hf_experts forward")
    assert found - PIECES <= FUZZED, f"not fuzzed: {sorted(found - PIECES - FUZZED)}"
    assert FUZZED <= found, f"gone: {sorted(FUZZED - found)}"


@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("fault", list(FAULTS))
@settings(CI, max_examples=2)
@given(data=st.data())
def test_one_fault_is_named_by_every_surface(surface, fault, data, request):
    """Part 2's faults through every other surface: the same exception type, the surface's name for the
    argument, nothing launched (the ``"sync"`` mode, as in part 2)."""
    from triton_moe.jit import count_compilations

    s = SURFACES[surface]
    if s.faults is not None and fault not in s.faults:
        pytest.skip(f"{surface} cannot be handed '{fault}'")
    if s.group:
        request.getfixturevalue("gloo")
    needs, mutate, exc, name = FAULTS[fault]
    quants = tuple(
        q
        for q, f in FORMATS.items()
        if q in s.quants and (needs not in ("fp8", "fp8 scale>1", "bf16") or f.quantized == (needs != "bf16"))
    )
    if not quants:
        pytest.skip(f"{surface} takes no format this fault needs")
    inp = data.draw(problems(quants, min_tokens=1 if needs in ("T>0", "top_k>1") else 0), label="problem")
    assume(NEEDS[needs](inp))
    kw = mutate(inp.kwargs(), inp, data)
    with checks("sync"), count_compilations(dry_run=True) as counter, pytest.raises(exc) as info:
        s.call(kw, data)
    assert str(info.value).startswith(f"{s.names.get(name, name)}: "), str(info.value)
    assert counter.total() == 0


@st.composite
def layer_sizes(draw):
    """(E, K, I, top_k, T): each small and valid, or past a limit (experts, int32 offsets, top_k > E)."""
    E = draw(st.one_of(st.integers(1, 8), st.sampled_from([1025, 10**6, 0])), label="E")
    K = draw(st.one_of(st.sampled_from([16, 32, 64]), st.sampled_from([2**20, 10**9, 0])), label="K")
    I = draw(st.one_of(st.sampled_from([16, 32, 48]), st.sampled_from([2**11, 10**9])), label="I")  # noqa: E741
    top_k = draw(st.one_of(st.integers(1, 4), st.integers(5, 9)), label="top_k")
    T = draw(st.one_of(st.integers(0, 8), st.sampled_from([10**8, 10**9, 10**12])), label="T")
    return E, K, I, top_k, T


def _huge(*shape, dtype=torch.bfloat16):
    """``shape`` as an expanded view of one element: any size, no memory (and not contiguous)."""
    return torch.zeros(1, dtype=dtype).expand(*shape)


def _refusal(fn):
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return None


@settings(CI, max_examples=60)
@given(sizes=layer_sizes())
def test_random_sizes_are_refused_alike_on_every_surface(sizes, gloo):
    """Every surface refuses a layer exactly when check_sizes does, in its words after the surface's own
    name, before it allocates anything (the tensors are expanded views: a copy of one would not fit)."""
    from moe_spec.validate import CALL_NAMES, WARMUP_NAMES, check_sizes

    E, K, I, top_k, T = sizes  # noqa: E741
    assume(E * 2 * I * K < 2**62 and T * max(K, top_k) < 2**62)  # a tensor's size is an int64, even a view's
    event("refused" if _refusal(lambda: check_sizes(E, K, I, top_k, T)) else "valid sizes")
    kw = dict(
        x=_huge(T, K),
        w1=_huge(E, 2 * I, K),
        w2=_huge(E, K, I),
        quant=None,
        w1_scale=None,
        w2_scale=None,
        topk_weights=_huge(T, top_k, dtype=torch.float32),
        topk_ids=_huge(T, top_k, dtype=torch.int64),
    )
    for backend in ("triton_moe", "cute_moe"):
        limits = _module(backend).fused_moe.limits
        verdict = _refusal(lambda: check_sizes(E, K, I, top_k, T, limits=limits, names=CALL_NAMES))
        calls = {f"{backend}.fused_moe": lambda: _module(backend).fused_moe(**kw)}
        if backend == "triton_moe":  # the transformers forward and the sharded layers, through triton_moe
            calls.update(
                {name: (lambda s=s: s.call(kw, None)) for name, s in SURFACES.items() if name.startswith("compare.")}
            )
        calls[f"{backend}.fused_experts"] = lambda: _module(backend).fused_experts(
            *[kw[k] for k in ("x", "w1", "w2", "topk_weights", "topk_ids")]
        )
        for name, call in calls.items():
            got = _refusal(call)
            names = HF_NAMES if "hf_experts" in name else {"x": "hidden_states"} if "fused_experts" in name else {}
            if verdict is None:  # valid sizes: the views are refused for what else they are
                assert got is not None and _rule(got[1]) != "", (name, got)
                assert not any(p in got[1] for p in ("int32", "experts (E) are supported", "<= top_k <=")), (name, got)
            else:
                arg = verdict[1].partition(": ")[0]
                assert got == (verdict[0], f"{names.get(arg, arg)}: {_rule(verdict[1])}"), (name, got, verdict)
        warm = _refusal(lambda: check_sizes(E, K, I, top_k, T, limits=limits, names=WARMUP_NAMES, min_tokens=1))
        got = _refusal(lambda: _module(backend).warmup(E, K, I, top_k, max_tokens=T, device="cpu", dry_run=True))
        if warm is None:
            assert got is None or not any(p in got[1] for p in ("int32", "experts (E)", "<= top_k <=")), got
        else:
            assert got[0] is warm[0] and _rule(got[1]) == _rule(warm[1]), (backend, got, warm)


def _rule(message):
    return message.partition(": ")[2]


@pytest.mark.parametrize("surface", list(SURFACES))
@settings(CI, max_examples=3)
@given(data=st.data())
def test_random_valid_problems_match_the_oracle_on_every_surface(surface, data, request):
    """Valid problems through each surface (triton_moe; cute_moe's surfaces need a GPU) against the oracle,
    by the contract's metric."""
    from moe_spec.oracle import oracle_breakdown, rel_l2_terms

    s = SURFACES[surface]
    if surface.startswith("cute_moe"):
        pytest.skip("cute_moe runs on a CUDA device (tests/test_cute_gpu.py)")
    if s.group:
        request.getfixturevalue("gloo")
    inp = data.draw(problems(s.quants), label="problem")
    out = s.call(inp.kwargs(), data)
    assert out.dtype == torch.bfloat16 and out.shape == inp.x.shape
    err = rel_l2_terms(out, oracle_breakdown(**inp.kwargs(), term_scales=True))
    assert err <= get_format(inp.quant).tolerance, f"{surface}: {err:.2e}"


def _sharded_batch(rank, world, problems_, parallel):
    from compare.distributed import SHARDERS, layer_for

    return [layer_for(parallel)("triton_moe")(**SHARDERS[parallel](p, rank, world).kwargs()) for p in problems_]


@pytest.mark.parametrize("parallel", ["tp", "ep"])
@settings(CI, max_examples=1)
@given(batch=st.lists(problems(min_tokens=1), min_size=3, max_size=3))
def test_random_problems_on_two_gloo_ranks(parallel, batch):
    """The sharded layers on two ranks (one spawn for a batch of problems), against the oracle of each
    layer's own function (compare.distributed, Numerics)."""
    from compare.distributed import SIMULATORS
    from compare.launch import run_ranks
    from moe_spec.oracle import oracle

    # two ranks: E even (EP), fp8_block's 128-blocks not split (TP: I/2 would not be a multiple of 128)
    batch = [p for p in batch if p.w1.shape[0] % 2 == 0 and p.quant != "fp8_block"]
    assume(batch)
    per_rank = run_ranks(_sharded_batch, 2, (batch, parallel), backend="gloo", timeout_s=240)
    for i, p in enumerate(batch):
        out = per_rank[0][i] if parallel == "tp" else torch.cat([r[i] for r in per_rank])
        want = SIMULATORS[parallel](p, 2, oracle)
        assert rel_l2(out, want) <= get_format(p.quant).tolerance, f"{parallel} problem {i}"

"""Both backends as torch operators (moe_spec.ops): ``torch.ops.triton_moe.fused_moe`` and
``torch.ops.cute_moe.fused_moe``.

CPU: ``torch.library.opcheck`` on triton_moe's op (the Triton interpreter) for bf16, each FP8
format and fp8_tensor's static scales; the fake implementations' shapes (T = 0 and symbolic T
included) and errors (the eager call's, word for word); the public ``fused_moe`` routes a traced call
to the op and an eager one to the backend function; ``torch.compile(fullgraph=True)`` of a tiny
transformers Mixtral whose experts run triton_moe (aot_eager: the op is a node of the graph, the
logits are eager's bit for bit, a new length does not recompile under ``dynamic=True``), and of
vLLM's ``fused_experts``; cute_moe, which cannot run on a CPU, traced through its fake
implementation on fake CUDA tensors (a Mixtral MoE block, fullgraph).

GPU (``-m gpu``): the same model at Qwen3-30B-A3B's layer shape compiled with inductor, fullgraph,
default mode and ``mode="reduce-overhead"`` (CUDA graphs), for both backends: logits within the bf16
bound of eager, for a prefill and a decode step.
"""

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

import cute_moe
import triton_moe
from moe_spec import ops
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.quant import FP8_DTYPE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

TINY = MoEShape("tiny", 4, 2, 128, 64, "test")  # E, top_k, K, I: one 128×128 block per FP8 half
TENSORS = ("x", "w1", "w2", "topk_weights", "topk_ids")


def arguments(T=3, quant=None, seed=0):
    inp = make_inputs(TINY, T, quant, seed=seed)
    return dict(
        x=inp.x,
        w1=inp.w1,
        w2=inp.w2,
        topk_weights=inp.topk_weights,
        topk_ids=inp.topk_ids,
        quant=quant,
        w1_scale=inp.w1_scale,
        w2_scale=inp.w2_scale,
    )


def positional(kw):
    return tuple(kw[n] for n in TENSORS), {k: v for k, v in kw.items() if k not in TENSORS}


def fp8_bytes_allclose(monkeypatch):
    """torch's schema check compares every tensor an op touched before and after with allclose,
    which has no CPU kernel for float8_e4m3fn; compare those by their bytes (exact: stricter)."""
    allclose = torch.allclose

    def fp8_aware(a, b, *args, **kw):
        if a.dtype == FP8_DTYPE:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kw)

    monkeypatch.setattr(torch, "allclose", fp8_aware)


# --- opcheck and the op's kernel -------------------------------------------------------------------


@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_channel", "fp8_block", "fp8_tensor static"])
def test_opcheck_triton_moe(quant, monkeypatch, word):
    kw = arguments(quant=quant and quant.split()[0])
    if quant == "fp8_tensor static":
        kw.update(a1_scale=torch.tensor([0.02]), a2_scale=torch.tensor(0.01))
    fp8_bytes_allclose(monkeypatch)
    args, options = positional(kw)
    result = torch.library.opcheck(triton_moe.ops.OP, args, options)
    assert set(result.values()) == {"SUCCESS"}, result
    assert torch.equal(triton_moe.ops.OP(*args, **options), triton_moe.moe.fused_moe(*args, **options))
    assert int(word) == 0


def test_op_raises_the_backends_errors():
    kw = arguments()
    for bad, error in (
        (dict(x=kw["x"].float()), "x: expected dtype bfloat16"),
        (dict(topk_ids=kw["topk_ids"][:, :1]), "topk_ids: expected shape (3, 2)"),
        (dict(quant="fp8_tensor"), "w1: expected dtype float8_e4m3fn"),
    ):
        for fn in (triton_moe.ops.OP, triton_moe.moe.fused_moe):
            with pytest.raises((TypeError, ValueError), match="^" + re.escape(error)):
                fn(**{**kw, **bad})


# --- fake implementations ------------------------------------------------------------------------------


def on(t, device):
    """A fake tensor like the fake ``t`` on ``device`` (a fake CUDA tensor needs no GPU; inside the mode)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def fake_arguments(mode, kw, device):
    return {k: (on(mode.from_tensor(v), device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


@pytest.mark.parametrize("backend,device", [(triton_moe, "cpu"), (triton_moe, "cuda"), (cute_moe, "cuda")])
@pytest.mark.parametrize("T", [0, 1, 5])
@pytest.mark.parametrize("quant", [None, "fp8_block"])
def test_fake_shapes(backend, device, T, quant):
    with FakeTensorMode() as mode:
        kw = fake_arguments(mode, arguments(T, quant), device)
        for fn in (backend.ops.OP, backend.fused_moe):
            out = fn(**kw)
            assert isinstance(out, FakeTensor) and out.dtype == torch.bfloat16 and out.device == kw["x"].device
            assert out.shape == (T, TINY.hidden) and out.is_contiguous()


def test_the_fake_makes_the_device_state_outside_the_fake_mode(monkeypatch):
    """The fake implementation makes the error word of a CUDA device (ops.make_device_state) with
    no dispatch mode active — a real tensor made at trace time, not inside the first compiled run
    (a CUDA-graph tree's warm-up, whose private pool must not keep it) — and nothing for a CPU one.
    (cute_moe's op on fake CUDA tensors, CUDA said present; triton_moe's on CPU ones.)"""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    made = []
    monkeypatch.setattr(ops, "error_word", lambda device: made.append((device, _get_current_dispatch_mode_stack())))
    with FakeTensorMode() as mode:
        triton_moe.ops.OP(**fake_arguments(mode, arguments(3), "cpu"))
    assert made == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with FakeTensorMode() as mode:
        cute_moe.ops.OP(**fake_arguments(mode, arguments(3), "cuda"))
    assert len(made) == 1 and made[0][0].type == "cuda" and made[0][1] == [], made


@pytest.mark.parametrize("backend", [triton_moe, cute_moe])
def test_fake_takes_a_symbolic_token_count(backend):
    mode = FakeTensorMode(shape_env=ShapeEnv())
    kw = arguments(T=6)
    with mode:
        fake = {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)}
        for k, v in kw.items():
            if isinstance(v, torch.Tensor):
                # x and the routing get a symbolic T; the weights stay static, as dynamo keeps parameters
                t = mode.from_tensor(v, static_shapes=k not in ("x", "topk_weights", "topk_ids"))
                fake[k] = on(t, "cuda")
        out = backend.ops.OP(**fake)
    assert isinstance(out.shape[0], torch.SymInt) and out.shape[0].node.expr == fake["x"].shape[0].node.expr
    assert out.shape[1] == TINY.hidden


def eager_error(fn, kw):
    try:
        fn(**kw)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize("backend", [triton_moe, cute_moe])
def test_fake_refuses_what_the_eager_call_refuses(backend):
    """Word for word, on CPU tensors (where both backends check their arguments before the device)."""
    kw = arguments()
    cases = [
        dict(x=kw["x"].float()),
        dict(w2=kw["w2"][:, :, :32]),
        dict(topk_weights=kw["topk_weights"].double()),
        dict(quant="fp8_channel"),
        dict(w1_scale=torch.ones(4, 128)),
    ]
    if backend is cute_moe:  # static scales (refused first) and the device rule
        cases += [dict(a1_scale=torch.ones(1), a2_scale=torch.ones(1)), {}]
    for bad in cases:
        call = {**kw, **bad}
        expected = eager_error(backend.moe.fused_moe, call)
        assert expected is not None, bad
        with FakeTensorMode() as mode:
            got = eager_error(backend.ops.OP, fake_arguments(mode, call, "cpu"))
        assert got == expected, bad


# --- the public function: the op while tracing, the backend eager ----------------------------------------


def test_entry_routes_traced_calls_to_the_op():
    seen = []
    op = lambda *a: seen.append("op") or a[0]  # noqa: E731
    impl = lambda *a, **kw: seen.append(("impl", tuple(sorted(k for k, v in kw.items() if v is not None)))) or a[0]  # noqa: E731
    fn = ops.entry(op, impl, {"config": None, "fusion": "fused"})
    kw = arguments()
    args, options = positional(kw)
    fn(*args)
    assert seen.pop() == ("impl", ())  # eager: no dispatcher
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in args]
        fn(*fake)
        assert seen.pop() == "op"
        fn(*fake, config=None, fusion="fused")  # the defaults, spelled out: still the op
        assert seen.pop() == "op"
        fn(*fake, fusion="separate")  # a backend option: the backend's function, traced into
        assert seen.pop() == ("impl", ("fusion",))
        fn(list(fake[0]), *fake[1:])  # not a tensor: the backend names it
        assert seen.pop() == ("impl", ())
        fn(*fake, quant=1)
        assert seen.pop() == ("impl", ("quant",))
    fn(mode.from_tensor(args[0]), *args[1:])  # a FakeTensor outside its mode
    assert seen.pop() == "op"

    class Watch(TorchDispatchMode):  # a mode that only watches the aten ops (a counter, a logger)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        fn(*args)
    assert seen.pop() == ("impl", ())  # it sees the backend's own ops, as before the op existed


def test_public_functions_keep_the_backends_signature_and_limits():
    import inspect

    for backend in (triton_moe, cute_moe):
        assert backend.fused_moe.impl is backend.moe.fused_moe and backend.fused_moe.op is backend.ops.OP
        assert inspect.signature(backend.fused_moe) == inspect.signature(backend.moe.fused_moe)
        assert backend.fused_moe.limits is backend.moe.LIMITS and backend.fused_experts.limits is backend.moe.LIMITS
    with pytest.raises(RuntimeError, match="^namespace: triton_moe::fused_moe is defined already"):
        ops.define_fused_moe_op("triton_moe", cute_moe.moe.fused_moe)
    assert ops.define_fused_moe_op("triton_moe", triton_moe.moe.fused_moe) is triton_moe.ops.OP


# --- torch.compile ------------------------------------------------------------------------------------------

MIXTRAL = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    num_experts_per_tok=2,
    intermediate_size=32,
    num_local_experts=8,
)


def op_nodes(graphs, namespace):
    return sum(1 for g in graphs for n in g.graph.nodes if n.target is getattr(torch.ops, namespace).fused_moe.default)


def recording(inner):
    """A torch.compile backend that keeps the graphs dynamo hands it, then compiles with ``inner``."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs) if inner is not None else gm.forward

    return backend, graphs


def tiny_mixtral(device="cpu", **kw):
    from transformers import AutoModelForCausalLM, MixtralConfig

    import compare.hf_experts as hx

    hx.register()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            MixtralConfig(**{**MIXTRAL, **kw}), dtype=torch.bfloat16, attn_implementation="eager"
        )
    return model.eval()


@torch.no_grad()
def test_compiled_model_with_triton_moe_experts_is_eager_bit_for_bit():
    from torch._dynamo.backends.registry import lookup_backend

    torch._dynamo.reset()
    model = tiny_mixtral()
    model.set_experts_implementation("triton_moe")
    backend, graphs = recording(lookup_backend("aot_eager"))
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for length in (12, 7):
        ids = torch.randint(0, MIXTRAL["vocab_size"], (2, length), generator=g)
        ref = model(ids).logits
        assert torch.equal(compiled(ids).logits, ref), length
    assert sum(1 for g in graphs if len(g.graph.nodes)) == 1  # one dynamic graph: a new length does not recompile
    assert op_nodes(graphs, "triton_moe") == MIXTRAL["num_hidden_layers"]


@torch.no_grad()
def test_compiled_fused_experts():
    torch._dynamo.reset()
    kw = arguments(T=5, quant="fp8_channel")
    backend, graphs = recording(None)
    fn = torch.compile(triton_moe.fused_experts, fullgraph=True, backend=backend)
    args = (kw["x"], kw["w1"], kw["w2"], kw["topk_weights"], kw["topk_ids"])
    scales = dict(w1_scale=kw["w1_scale"][..., None], w2_scale=kw["w2_scale"][..., None])  # vLLM's [E, N, 1]
    out = fn(*args, use_fp8_w8a8=True, per_channel_quant=True, **scales)
    assert torch.equal(out, triton_moe.fused_experts(*args, use_fp8_w8a8=True, per_channel_quant=True, **scales))
    assert op_nodes(graphs, "triton_moe") == 1


@torch.no_grad()
def test_cute_moe_block_traces_on_fake_cuda_tensors():
    """cute_moe cannot run here: a Mixtral MoE block (router, top-k, experts) on fake CUDA tensors is
    traced by dynamo, fullgraph, and its graph holds the op (the fake implementation ran)."""
    torch._dynamo.reset()
    model = tiny_mixtral("meta", num_hidden_layers=1)
    model.set_experts_implementation("cute_moe")
    backend, graphs = recording(None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        block = model.model.layers[0].mlp.to_empty(device="cuda")
        out = torch.compile(block, fullgraph=True, backend=backend)(
            torch.empty(2, 12, 64, dtype=torch.bfloat16, device="cuda")
        )
    out = out[0] if isinstance(out, tuple) else out
    assert isinstance(out, FakeTensor) and out.shape == (2, 12, 64) and out.device.type == "cuda"
    assert op_nodes(graphs, "cute_moe") == 1


# --- GPU: inductor, fullgraph, CUDA graphs ----------------------------------------------------------------------

QWEN3_LAYER = dict(
    vocab_size=4096,
    hidden_size=2048,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton_moe", "cute_moe"])
@torch.no_grad()
def test_gpu_reduce_overhead_as_the_first_call_of_the_process(implementation, monkeypatch):
    """A compiled block whose first call of our op is the CUDA-graph tree's warm-up (no eager call
    before: the device's error word not yet made) records and replays: the error word is made while
    the graph is traced (ops.make_device_state), not inside the tree's private pool, which would
    refuse to record ("tensors in the cudagraph pool not tracked as outputs")."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import compare.hf_experts as hx
    from compare.metrics import tolerance_for
    from moe_spec import errorword
    from moe_spec.oracle import rel_l2

    hx.register()
    monkeypatch.setattr(errorword, "_words", {})  # this process's state as before its first call
    monkeypatch.setattr(errorword, "_bits", {})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**QWEN3_LAYER), dtype=torch.bfloat16).eval()
    block = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(2)
    hidden = [torch.randn(2, 8, QWEN3_LAYER["hidden_size"], generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    torch._dynamo.reset()
    counters.clear()
    model.set_experts_implementation(implementation)
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    got = []
    for h in hidden:  # warm-up, record, replay; each output cloned before the next run overwrites it
        out = compiled(h)
        got.append((out[0] if isinstance(out, tuple) else out).clone())
    assert errorword._words, "the error word was never made"
    model.set_experts_implementation("eager")
    for h, out in zip(hidden, got):
        want = block(h)
        want = want[0] if isinstance(want, tuple) else want
        assert rel_l2(out, want) <= tolerance_for(None).rel_l2
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("implementation", ["triton_moe", "cute_moe"])
@torch.no_grad()
def test_gpu_compiled_model_matches_eager(implementation, mode):
    """``torch.compile(model, fullgraph=True, mode=...)`` with inductor, on a prefill and two decode steps
    (the second a CUDA-graph replay under reduce-overhead, with new tokens):

    * one MoE block compiled alone gives its eager output within the bf16 bound (the router's
      linear and softmax are inductor's, the experts our op);
    * the whole model's logits are within the cross-backend bound (two implementations that each
      meet the bound, :func:`compare.metrics.cross_backend_tolerance`) of the same model compiled the
      same way with transformers' grouped_mm experts — not of the eager model: inductor also rewrites
      the attention and the norms, which moves the logits of any experts by more than one bound;
    * our eager forward is within the bound of transformers' eager experts, the compiled forward ran
      the op (not the eager function), and reduce-overhead recorded no CUDA-graph skip."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import compare.hf_experts as hx
    from compare.metrics import cross_backend_tolerance, tolerance_for
    from moe_spec.oracle import rel_l2

    hx.register()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**QWEN3_LAYER), dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, QWEN3_LAYER["vocab_size"], shape, generator=g).cuda() for shape in ((2, 64), (8, 1), (8, 1))
    ]
    tol, cross = tolerance_for(None).rel_l2, cross_backend_tolerance(None)
    model.set_experts_implementation("eager")
    refs = [model(ids).logits for ids in batches]
    model.set_experts_implementation(implementation)
    ours = [model(ids).logits for ids in batches]
    for ids, ref, eager in zip(batches, refs, ours):
        assert rel_l2(eager, ref) <= tol, ("eager", tuple(ids.shape))

    torch._dynamo.reset()
    block = model.model.layers[0].mlp
    hidden = torch.randn(2, 64, QWEN3_LAYER["hidden_size"], generator=g).to("cuda", torch.bfloat16)
    want = block(hidden)
    got = torch.compile(block, fullgraph=True, mode=mode)(hidden)
    want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
    assert rel_l2(got, want) <= tol, ("block", rel_l2(got, want))

    def compiled_logits(experts):
        torch._dynamo.reset()
        model.set_experts_implementation(experts)
        compiled = torch.compile(model, fullgraph=True, mode=mode)
        return [compiled(ids).logits.clone() for ids in batches]

    counters.clear()
    base = compiled_logits("grouped_mm")
    calls = hx.CALLS[implementation]
    counters.clear()
    for ids, got, want in zip(batches, compiled_logits(implementation), base):
        assert rel_l2(got, want) <= cross, ("compiled", tuple(ids.shape), rel_l2(got, want))
    assert hx.CALLS[implementation] == calls  # the compiled forward ran, not the eager one
    if mode == "reduce-overhead":
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])

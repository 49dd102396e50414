"""triton_moe's path rule for calls run eagerly (``triton_moe.plan.EAGER_DECODE_MAX_PAIRS``): a call on a
CUDA device with no CUDA graph being captured (``triton_moe.plan.runs_eagerly``) and at most that many
(token, slot) pairs takes the one-launch decode kernel in every format; a captured call keeps the graph
rule; a backend option still decides; the warm-up lists the eager plan where CUDA is present; and the
eager path computes the captured path's bits (interpreter)."""

import importlib

import pytest
import torch

import triton_moe
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.validate import MoEDims
from triton_moe import heuristic
from triton_moe.config import DecodeConfig, TritonConfig
from triton_moe.jit import count_compilations
from triton_moe.plan import plan, plans_for

_PLAN = importlib.import_module("triton_moe.plan")  # the module (triton_moe.plan is also the function)
_MOE = importlib.import_module("triton_moe.moe")
FORMATS = (None, "fp8_tensor", "fp8_channel", "fp8_block")


@pytest.mark.parametrize("quant", FORMATS, ids=lambda q: q or "bf16")
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_an_eager_call_of_a_few_pairs_takes_the_decode_kernel(quant, top_k):
    last = _PLAN.EAGER_DECODE_MAX_PAIRS // top_k
    assert 1 <= last and _PLAN.EAGER_DECODE_MAX_PAIRS >= _PLAN.DECODE_MAX_PAIRS
    at, past = (MoEDims(T=T, E=16, K=256, I=128, top_k=top_k) for T in (last, last + 1))
    assert plan(at, quant, eager=True).path == "decode" and plan(past, quant, eager=True).path == "grouped"
    assert plan(past, quant, eager=True) == plan(past, quant)  # past its reach: the captured plan
    captured = _PLAN.uses_decode(last, top_k, quant)  # the graph rule, unchanged
    assert plan(at, quant).path == ("decode" if captured else "grouped")
    forced = (dict(config=TritonConfig(16, 64, 128)), dict(swap_ab=True))
    assert all(plan(at, quant, eager=True, **o).path == "grouped" for o in forced)
    assert plan(past, quant, eager=True, config=DecodeConfig()).path == "decode"


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_plans_for_lists_the_eager_decode_plan_where_cuda_is_present(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(heuristic, "current_device_name", lambda: None)  # the heuristic, no table
    listed = plans_for(16, 256, 128, 8, "fp8_tensor", max_tokens=64)
    eager = plan(MoEDims(T=1, E=16, K=256, I=128, top_k=8), "fp8_tensor", eager=True)
    assert eager.path == "decode" and (listed[0] == eager) == cuda
    assert all(p.path == "grouped" for p in listed[int(cuda) :])  # then every plan a graph captures
    assert (
        plans_for(16, 256, 128, 8, "fp8_tensor", max_tokens=64, config=TritonConfig(16, 64, 128))[0].path == "grouped"
    )


@pytest.fixture
def eagerly(monkeypatch):
    """Calls on this CPU planned as eager GPU calls are (the interpreter runs either path)."""
    monkeypatch.setattr(_PLAN, "runs_eagerly", lambda x: True)
    _MOE.forget_plans()
    yield
    _MOE.forget_plans()


@pytest.mark.parametrize("quant", FORMATS, ids=lambda q: q or "bf16")
def test_the_eager_path_is_one_launch_with_the_captured_paths_bits(quant, eagerly):
    """One launch — after the first call of the signature, which also runs the captured path once
    (triton_moe.capture: its kernels loaded before any capture meets them)."""
    inp = make_inputs(MoEShape("eager", 8, 2, 256, 128, "test"), 3, quant, seed=3).kwargs()  # 6 pairs
    with count_compilations(dry_run=False) as counter:
        first = triton_moe.fused_moe(**inp)
    assert counter.launches[-1] == "decode_moe_kernel" and "moe_gemm_kernel" in counter.launches
    with count_compilations(dry_run=False) as counter:
        one = triton_moe.fused_moe(**inp)
    assert counter.launches == ["decode_moe_kernel"] and torch.equal(one, first)
    inp["topk_ids"] = inp["topk_ids"].long()  # another ids dtype: kernels of their own, primed again
    with count_compilations(dry_run=False) as counter:
        triton_moe.fused_moe(**inp)
    assert "moe_gemm_kernel" in counter.launches
    _PLAN.runs_eagerly = lambda x: False  # restored by the fixture's monkeypatch
    _MOE.forget_plans()
    with count_compilations(dry_run=False) as counter:
        grouped = triton_moe.fused_moe(**inp)
    assert "decode_moe_kernel" not in counter.launches and "moe_gemm_kernel" in counter.launches
    assert torch.equal(one.view(torch.int16), grouped.view(torch.int16))


def test_runs_eagerly_is_false_off_the_gpu():
    assert _PLAN.runs_eagerly(torch.zeros(1)) is False


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_compares_config_column_names_the_eager_plan_where_it_differs(cuda, monkeypatch):
    from compare.backends import load_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(heuristic, "current_device_name", lambda: None)
    describe = load_backend("triton_moe").describe
    one, many = (MoEDims(T=T, E=16, K=256, I=128, top_k=8) for T in (1, 64))
    captured = plan(one, "fp8_tensor").describe()
    eager = f" (eager: {plan(one, 'fp8_tensor', eager=True).describe()})" if cuda else ""
    assert describe(one, "fp8_tensor") == captured + eager and eager.startswith(" (eager: decode 1-launch") == cuda
    assert describe(many, "fp8_tensor") == plan(many, "fp8_tensor").describe()  # past the reach: one plan


def test_nothing_is_primed_where_a_capture_takes_the_decode_kernel_too_or_an_option_decides(eagerly):
    inp = make_inputs(MoEShape("eager", 8, 2, 256, 128, "test"), 1, None, seed=4).kwargs()  # bf16, 2 pairs
    assert _PLAN.uses_decode(1, 2, None)  # the graph rule's reach: a capture runs the decode kernel too
    for options in ({}, {"config": DecodeConfig()}):
        with count_compilations(dry_run=False) as counter:
            triton_moe.fused_moe(**inp, **options)
        assert counter.launches == ["decode_moe_kernel"], options


@pytest.mark.gpu
def test_gpu_a_capture_after_eager_calls_finds_the_grouped_kernels_loaded():
    """The usual capture — eager calls, then the same call captured — with the grouped pipeline's kernels
    forgotten first (their binaries not loaded in this process): the eager call takes the decode kernel
    and primes the grouped pipeline, so the capture (which cannot load a binary) records it, and the
    replay gives the eager call's output within the bf16 bound (its bits where the K order matches)."""
    from moe_spec.oracle import rel_l2
    from triton_moe import jit
    from triton_moe.lab.hostcost import reset_kernel

    _MOE.forget_plans()
    for kernel in list(jit._launched):
        reset_kernel(kernel)
    inp = make_inputs(MoEShape("capture", 32, 8, 512, 256, "test"), 1, "fp8_tensor", seed=5).to("cuda").kwargs()
    with count_compilations() as counter:
        eager = triton_moe.fused_moe(**inp)
    assert counter.launches[-1] == "decode_moe_kernel" and "moe_gemm_kernel" in counter.launches  # primed
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_moe.fused_moe(**inp)  # eager on the side stream, as torch.cuda.graph's users warm up
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = triton_moe.fused_moe(**inp)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_l2(captured, eager.double()) <= 5e-3


def test_the_traced_op_makes_the_decode_counters_an_eager_call_will_use():
    """``torch.ops.triton_moe.fused_moe``'s fake implementation makes the decode kernel's counter block
    while the graph is traced (``triton_moe.ops.decode_counters``), so that a CUDA-graph tree's warm-up
    (an eager run of the compiled graph, its allocations in the graph's pool) never makes one."""
    from triton_moe import decode_host
    from triton_moe.decode_host import counter_words
    from triton_moe.ops import decode_counters

    cpu = torch.device("cpu")
    one, many = (MoEDims(T=T, E=16, K=384, I=128, top_k=8) for T in (1, 2))
    words = counter_words(384, plan(one, "fp8_block", eager=True).config)
    decode_host._counter_blocks.pop((cpu, None, words), None)
    decode_counters(cpu, many, "fp8_block")  # 16 pairs: the grouped pipeline, no decode counters
    assert (cpu, None, words) not in decode_host._counter_blocks
    decode_counters(cpu, one, "fp8_block")
    assert int(decode_host._counter_blocks[(cpu, None, words)].abs().sum()) == 0

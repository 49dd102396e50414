"""One backend on one case: what the backend declares (not the device), batch invariance, the budget."""

import time

import pytest
import torch

from compare import numerics
from compare.backends import Backend, load_backend
from compare.baselines import loop_fused_moe
from compare.cases import Budget, Case, OutOfTime, draw_weights, reduce_shape
from moe_spec.problem import MoEShape, get_shape, make_inputs

SMALL = MoEShape("small", 4, 2, 64, 32, "test")


def _case(quant, T, shape=SMALL):
    return Case(shape, shape, quant, T, reduced=True).build(draw_weights(shape, 0, "cpu"), seed=1, device="cpu")


def _gpu_only_bf16(x, w1, w2, topk_weights, topk_ids, *, quant=None, **kw):
    """A stand-in for a bf16-only GPU kernel that follows the contract: declines FP8 before any launch."""
    if quant is not None:
        raise NotImplementedError(f"quant={quant!r} is not implemented (bf16 only)")
    if x.shape[0] == 0:
        return x.new_empty((0, x.shape[1]))
    raise AssertionError("launched a kernel")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_not_implemented_is_what_the_backend_declares_on_every_device(device):
    backend = Backend("gpu_kernel", fused_moe=_gpu_only_bf16, needs_cuda=True)
    fp8 = _case("fp8_tensor", 3)
    assert (
        numerics.unavailable(backend, fp8.inputs, device)
        == "not implemented: quant='fp8_tensor' is not implemented (bf16 only)"
    )
    bf16 = numerics.unavailable(backend, _case(None, 3).inputs, device)
    assert bf16 == (
        None
        if device == "cuda"
        else "not available: needs a Hopper GPU (the CPU report shows its configs and PTX instead)"
    )


def test_the_real_cute_moe_builds_fp8_and_lacks_only_the_gpu():
    cute = load_backend("cute_moe")
    if cute.missing:
        pytest.skip(cute.missing)
    fp8 = _case("fp8_tensor", 3).inputs
    assert numerics.unavailable(cute, fp8, "cpu").startswith("not available: needs a Hopper GPU")
    assert numerics.unavailable(cute, fp8, "cuda") is None


def _batch_dependent(x, w1, w2, topk_weights, topk_ids, **kw):
    """Correct within the bound but not batch invariant: a term that depends on the whole batch."""
    return (loop_fused_moe(x, w1, w2, topk_weights, topk_ids, **kw).float() + 1e-3 * x.float().mean(0)).bfloat16()


def test_batch_invariance_column():
    assert numerics.probe_tokens(1) == [] and numerics.probe_tokens(2) == [0, 1] and numerics.probe_tokens(9) == [0, 8]
    loop = Backend("torch_loop", fused_moe=loop_fused_moe)
    for quant, T, want in ((None, 9, True), (None, 1, None), ("fp8_channel", 9, True), ("fp8_tensor", 9, False)):
        row, _ = numerics.measure(loop, _case(quant, T))
        assert row["status"] == "ok" and row["batch_invariant"] is want, (quant, T, row)
    row, _ = numerics.measure(Backend("mean", fused_moe=_batch_dependent), _case(None, 9))
    assert row["batch_invariant"] is False


def test_batch_invariance_of_triton_on_the_reduced_shapes():
    """The CPU path measures the column on the reduced shapes, through the interpreter."""
    triton = load_backend("triton_moe")
    shape = reduce_shape(get_shape("qwen3-30b-a3b"))
    row, _ = numerics.measure(triton, _case(None, 5, shape))
    assert row["status"] == "ok" and row["batch_invariant"] in (True, False)


def test_a_budget_stops_the_work_inside_a_case():
    budget = Budget(0.5)
    start = time.monotonic()
    with pytest.raises(OutOfTime, match=r"time budget \(0.5 s\)"):
        with budget.armed():
            while True:  # stands for an interpreted kernel that would run far past the budget
                sum(range(1000))
    assert time.monotonic() - start < 3 and budget.spent()
    with pytest.raises(OutOfTime):
        budget.check()
    assert Budget(None).left() == float("inf") and not Budget(None).spent()


def test_out_of_time_is_not_swallowed_as_a_backend_error():
    """measure() turns a backend's Exception into a row; the budget's OutOfTime must pass through."""

    def slow(*args, **kw):
        raise OutOfTime("time budget (1 s)")

    with pytest.raises(OutOfTime):
        numerics.measure(Backend("slow", fused_moe=slow), _case(None, 2))


def test_inputs_cut_to_tokens_keep_the_problem():
    inputs = make_inputs(SMALL, 6, "fp8_block", seed=0)
    one = numerics._tokens(inputs, slice(5, 6))
    assert one.x.shape == (1, 64) and torch.equal(one.x[0], inputs.x[5]) and one.w1_scale is inputs.w1_scale

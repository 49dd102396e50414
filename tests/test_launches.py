"""How many device operations one ``fused_moe`` call launches, per backend and format (CPU).

Kernel launches are host time (each costs microseconds of Python and driver work before the GPU
sees it), so an eager call is only as fast as a CUDA-graph replay when it launches few kernels and
never waits for the GPU. Counted here, in a warm (steady-state) call:

* Triton launches, through the launch wrapper of :mod:`triton_moe.jit` (dry run: nothing runs);
* torch kernels: every aten op a ``TorchDispatchMode`` sees, except the ones that only allocate or
  make a view (``torch.empty`` is not a launch, ``torch.zeros`` is);
* reads of device data on the host (``.item()``, ``bool()``, ``int()`` of a tensor: the aten op
  ``_local_scalar_dense``), which would be a sync on a GPU: none may happen.

Targets (notes/triton_moe.md, "Launches and host cost per call"): triton_moe bf16 ≤ 6 launches,
FP8 ≤ 8. The exact counts are asserted, so a change that adds one shows up here.

cute_moe runs its GPU path on CPU tensors with every CuTe launch and compilation stubbed
(``cute_moe.lab.bench_align.gpu_stand_in``): the stubs record the CuTe launches, the dispatch mode the
torch ones (notes/cute_moe.md, "Launches and host cost per call").

"""

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from moe_spec.problem import MoEShape, make_inputs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

#: aten ops that launch nothing: allocation and views.
NO_LAUNCH = {
    "empty",
    "empty_strided",
    "new_empty",
    "view",
    "_unsafe_view",
    "reshape",
    "slice",
    "select",
    "alias",
    "as_strided",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "detach",
    "lift_fresh",
    "_reshape_alias",
}
#: aten ops that read a device value on the host (a sync on a GPU).
HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal"}


class CountOps(TorchDispatchMode):
    """Records every aten op name (overload stripped) run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    @property
    def launches(self):
        return [op for op in self.ops if op not in NO_LAUNCH]


SHAPE = MoEShape("launches", 8, 2, 128, 64, "test: Mixtral-like routing, small sizes")
#: T = 4: 8 pairs, inside the decode rule's reach (triton_moe.plan.uses_decode); T = 40: 80 pairs,
#: one chunk of the grouped pipeline; T = 300: 600 pairs, three chunks (the launches are the same).
DECODE, SMALL_GROUPED, PREFILL = 4, 40, 300
TRITON = {  # (quant, T): exact Triton launches of a warm grouped call where GEMM1 quantizes neither
    # the intermediate in its epilogue (triton_moe.plan.epilogue_quant) nor x in its A load
    # (triton_moe.plan.x_quant_in_gemm1): one launch less for each it does; the targets are bf16 ≤ 6, FP8 ≤ 8
    (None, SMALL_GROUPED): 5,
    (None, PREFILL): 5,
    ("fp8_tensor", SMALL_GROUPED): 8,
    ("fp8_tensor", PREFILL): 8,
    ("fp8_channel", SMALL_GROUPED): 7,
    ("fp8_channel", PREFILL): 7,
    ("fp8_block", SMALL_GROUPED): 7,
    ("fp8_block", PREFILL): 7,
}
QUANTS = (None, "fp8_tensor", "fp8_channel", "fp8_block")


def _plan(quant, T, top_k=2, config=None):
    from moe_spec.validate import MoEDims
    from triton_moe.plan import plan

    return plan(MoEDims(T=T, E=8, K=128, I=64, top_k=top_k), quant, config=config)


def _path(quant, T, top_k=2):
    return _plan(quant, T, top_k).path


def _triton_call(quant, T, top_k_one=False, config=None, static=False):
    import torch

    from triton_moe import fused_moe
    from triton_moe.jit import count_compilations

    shape = MoEShape("launches1", 8, 1, 128, 64, "test") if top_k_one else SHAPE
    kw = make_inputs(shape, T, quant, seed=0).kwargs()
    if static:
        kw.update(a1_scale=torch.tensor([0.01]), a2_scale=torch.tensor([0.002]))
    with count_compilations(dry_run=True):
        fused_moe(**kw, config=config)  # warm: the error word, the workspace, the plan
    with count_compilations(dry_run=True) as counter, CountOps() as ops:
        fused_moe(**kw, config=config)
    return counter.launches, ops


@pytest.mark.parametrize("quant, T", list(TRITON), ids=[f"{q or 'bf16'}-T{T}" for q, T in TRITON])
def test_triton_launches_per_call(quant, T):
    assert _path(quant, T) == "grouped"
    launches, ops = _triton_call(quant, T)
    p = _plan(quant, T)
    assert len(launches) == TRITON[quant, T] - p.epilogue_quant() - p.x_quant_in_gemm1(), launches
    assert len(launches) <= (6 if quant is None else 8)
    assert ops.launches == [], ops.launches  # no torch kernel: no fill, no copy, no check
    assert not HOST_READS & set(ops.ops), ops.ops
    assert launches[:2] == ["_count_kernel", "_place_kernel"]
    assert launches[-2:] == ["moe_gemm_kernel", "combine_kernel"]


#: Where GEMM1's epilogue quantizes the intermediate (triton_moe.plan.epilogue_quant): fp8_block with a
#: 128-wide GEMM1 tile, fp8_tensor with static scales — six launches, the intermediate's quantize gone.
FUSED = {"fp8_block": (False, 128), "fp8_tensor static": (True, 64)}


@pytest.mark.parametrize("case", list(FUSED))
def test_triton_launches_with_the_intermediate_quantized_in_gemm1(case):
    from triton_moe import TritonConfig
    from triton_moe.moe import separate_act_quant

    quant, static, block_n = case.split()[0], *FUSED[case]
    cfg = TritonConfig(16, block_n, 64, swap_ab=True)
    p = _plan(quant, SMALL_GROUPED, config=cfg)
    assert p.epilogue_quant(static)  # the rule's owner says so
    launches, ops = _triton_call(quant, SMALL_GROUPED, config=cfg, static=static)
    x_quant = [] if p.x_quant_in_gemm1(static) else ["quantize_kernel"]  # x: static fp8_tensor in GEMM1's A load
    assert launches == [
        "_count_kernel",
        "_place_kernel",
        *x_quant,
        "moe_gemm_kernel",  # GEMM1 → E4M3 intermediate (+ block scales)
        "moe_gemm_kernel",
        "combine_kernel",
    ], launches
    assert ops.launches == [] and not HOST_READS & set(ops.ops), ops.ops
    with separate_act_quant():  # the path of before: one quantize launch more
        separate, _ = _triton_call(quant, SMALL_GROUPED, config=cfg, static=static)
    gemm2 = len(launches) - 2
    assert separate == launches[:gemm2] + ["quantize_kernel"] + launches[gemm2:], separate


@pytest.mark.parametrize("quant", QUANTS, ids=[q or "bf16" for q in QUANTS])
def test_triton_decode_is_one_launch(quant, monkeypatch):
    """On the decode path (the rule widened to every format and 64 pairs, as triton_moe.plan allows)
    a warm call is one launch: routing, quantization, both GEMMs and the top-k sum in one kernel;
    no torch kernel and no host read."""
    import importlib

    from triton_moe.moe import forget_plans

    tplan = importlib.import_module("triton_moe.plan")
    monkeypatch.setattr(tplan, "DECODE_FORMATS", ("bf16", "fp8_tensor", "fp8_channel", "fp8_block"))
    monkeypatch.setattr(tplan, "DECODE_MAX_PAIRS", 64)
    forget_plans()
    try:
        assert _path(quant, DECODE) == "decode"
        launches, ops = _triton_call(quant, DECODE)
    finally:
        forget_plans()
    assert launches == ["decode_moe_kernel"]
    assert ops.launches == [] and not HOST_READS & set(ops.ops), ops.ops


def test_triton_top_k_one_skips_the_combine():
    from triton_moe.plan import DECODE_MAX_PAIRS

    T = DECODE_MAX_PAIRS + 1  # past the decode rule: the grouped pipeline
    assert _path(None, T, top_k=1) == "grouped"
    launches, _ = _triton_call(None, T, top_k_one=True)
    assert launches == ["_count_kernel", "_place_kernel", "moe_gemm_kernel", "moe_gemm_kernel"]


def test_triton_empty_batch_launches_nothing():
    from triton_moe import fused_moe
    from triton_moe.jit import count_compilations

    kw = make_inputs(SHAPE, 0, "fp8_tensor").kwargs()
    with count_compilations(dry_run=True) as counter, CountOps() as ops:
        fused_moe(**kw)
    assert counter.launches == [] and ops.launches == []


#: cute_moe: (quant, T) -> exact launches of a warm call. T = 4: 8 pairs, one chunk (the alignment's
#: place kernel alone); T = 1100: 2200 pairs, two chunks (its count kernel too).
CUTE_PREFILL = 1100
CUTE_ALIGN = {DECODE: ["place"], CUTE_PREFILL: ["count", "place"]}


def _cute_layer():
    """The bf16 fused layer's launches after the alignment, as the two switches of cute_moe.unfused stand."""
    from cute_moe.unfused import GATED_GEMM1, GATHER_IN_PRODUCER

    return (
        ([] if GATHER_IN_PRODUCER else ["gather"])
        + ["GroupedGemm"]
        + ([] if GATED_GEMM1 else ["silu_mul"])
        + ["GroupedGemm", "combine"]
    )


def _cute_fp8(quant, T):
    """The FP8 layer's launches after the alignment: x quantized where its rows are gathered, after its amax
    unless per block (cute_moe.plan.gather_quant), or quantized, then gathered; then GEMM1 and SiLU·up with its
    amax after it, or the amax alone after a gated GEMM1 (cute_moe.plan.gated_gemm1: here fp8_block's I = 64
    is not whole scale blocks), or none where a gated GEMM1 takes the amax in its epilogue
    (cute_moe.plan.epilogue_quant: the normal path, and swap-AB while SWAP_AB_EPILOGUE_AMAX)."""
    from cute_moe.plan import EPILOGUE_QUANT, GATED_FP8_GEMM1, SWAP_AB_EPILOGUE_AMAX, _bucket, gather_quant

    swap, _ = _bucket(T * SHAPE.top_k / SHAPE.num_experts, None, (SHAPE.hidden, SHAPE.intermediate))
    gated = ("swap_ab" if swap else "normal") in GATED_FP8_GEMM1 and quant != "fp8_block"
    in_epilogue = gated and EPILOGUE_QUANT and (SWAP_AB_EPILOGUE_AMAX or not swap)
    amax = [] if in_epilogue else ["a_amax" if gated else "silu_amax"]
    x = ["x_amax", "x_quantize", "gather"]
    if gather_quant(quant, "fused", swap, SHAPE.top_k):
        x = ([] if quant == "fp8_block" else ["x_amax"]) + ["x_gather_quantize"]
    return [*x, "GroupedGemm", *amax, "a_quantize", "GroupedGemm", "combine"]


CUTE_CASES = [(q, T) for q in (None, "fp8_tensor", "fp8_channel", "fp8_block") for T in (DECODE, CUTE_PREFILL)]


@pytest.mark.parametrize("quant, T", CUTE_CASES, ids=[f"{q or 'bf16'}-T{T}" for q, T in CUTE_CASES])
def test_cute_launches_per_call(quant, T):
    from cute_moe.lab.bench_align import gpu_stand_in, launches_per_call

    kw = make_inputs(SHAPE, T, quant, seed=0).kwargs()
    with gpu_stand_in() as (fused_moe, launches):
        cute, torch_ops, ops = launches_per_call(fused_moe, launches, kw)
    import cute_moe
    from moe_spec.validate import MoEDims

    d = MoEDims(T=T, E=SHAPE.num_experts, K=SHAPE.hidden, I=SHAPE.intermediate, top_k=SHAPE.top_k)
    one = cute_moe.plan(d, quant)
    if one.path == "decode":  # the whole layer in one launch (cute_moe.plan.one_launch)
        assert cute == ["DecodeKernel"], cute
    else:
        assert cute == CUTE_ALIGN[T] + (_cute_layer() if quant is None else _cute_fp8(quant, T)), cute
    # the row maps, block maps, data checks and amax zeroing are the alignment's: the one torch op that
    # can be left gathers x's channel / block scales into the sorted rows, where x is quantized on its own
    gathered = quant in (None, "fp8_tensor") or (quant is not None and one.gather_quant)
    assert torch_ops == ([] if gathered else ["index_select"]), torch_ops
    assert not HOST_READS & set(ops), ops
    assert len(cute) + len(torch_ops) <= (6 if quant is None else 11)


def test_cute_separate_pipeline_launches():
    from cute_moe.lab.bench_align import gpu_stand_in, launches_per_call

    kw = make_inputs(SHAPE, DECODE, None, seed=0).kwargs()
    with gpu_stand_in() as (fused_moe, launches):
        cute, torch_ops, _ = launches_per_call(lambda **k: fused_moe(**k, fusion="separate"), launches, kw)
    assert cute == ["place", "gather", "GroupedGemm", "silu_mul", "GroupedGemm", "weighted_combine"], cute
    assert torch_ops == [], torch_ops


def test_cute_host_cost_counts_the_launches_of_a_timed_call():
    """``cute_moe.lab.bench_align.host_cost`` (the CPU host-cost study): a positive host time from
    ``moe_spec.timing.host_us`` and the launch count of a bf16 decode call."""
    from cute_moe.lab.bench_align import host_cost

    r = host_cost(1, calls=2, repeats=1)
    import cute_moe
    from moe_spec.validate import MoEDims

    one = cute_moe.plan(MoEDims(T=1, E=128, K=256, I=128, top_k=8)).path == "decode"  # host_cost's layer
    assert r["host_us"] > 0 and r["cute_launches"] == (1 if one else 4) and r["torch_launches"] == 0, r

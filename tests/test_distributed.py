"""The tensor- and expert-parallel layers (compare.distributed) on two CPU ranks: gloo, Triton interpreter.

One spawn of two ranks runs every case (:data:`CASES`) and returns the outputs; the tests compare
them here with the single-process layer (triton_moe's ``fused_moe`` on the whole problem), with the
fp64 oracle of the whole layer, and with the oracle of each layer's own function
(``simulate_tp`` / ``simulate_ep``), under the project's tolerance policy (compare.metrics). The
sharding arithmetic is checked exactly, in-process; argument errors on a one-rank group; the
launcher's failure paths (a rank's error reaches the test, a hang is killed) with small spawns.
The ``gpu`` test at the end runs the same cases on two GPUs (NCCL) with both backends.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from compare.distributed import (
    SHARDERS,
    SIMULATORS,
    EPMoE,
    TPMoE,
    layer_for,
    plan_dispatch,
    shard_ep,
    shard_tp,
    token_range,
)
from compare.launch import RankError, rank_device, run_ranks
from compare.metrics import check, cross_backend_tolerance, errors, tolerance_for
from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.quant import dequantize_weight

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

WORLD = 2
# I/2 = 128: fp8_block can be split; K = 64: one partial 128-group along K; E/2 = 2 experts per rank
SHAPE = MoEShape("dist", 4, 2, 64, 256, "test: tiny, fp8_block-splittable")
QUANTS = [None, "fp8_tensor", "fp8_channel", "fp8_block"]


@dataclass(frozen=True)
class Case:
    name: str
    parallel: str  # "tp" or "ep"
    quant: str | None
    T: int
    to_rank0: bool = False  # route every token to rank 0's experts (EP: rank 1 receives nothing)
    repeat: bool = False  # run twice (determinism)
    shape: MoEShape = SHAPE

    def inputs(self):
        inp = make_inputs(self.shape, self.T, self.quant, seed=11 + self.T)
        if self.to_rank0:
            inp.topk_ids[:] = torch.arange(self.shape.top_k, dtype=inp.topk_ids.dtype)
        return inp


CASES = {
    c.name: c
    for c in [
        *(Case(f"tp-{q or 'bf16'}", "tp", q, 5, repeat=q is None) for q in QUANTS),
        *(Case(f"ep-{q or 'bf16'}", "ep", q, 6, repeat=q is None) for q in QUANTS),
        Case("ep-uneven", "ep", None, 6, to_rank0=True),
        Case("tp-T0", "tp", None, 0),
        Case("ep-T0", "ep", "fp8_block", 0),
        Case("tp-T1", "tp", "fp8_block", 1),
        Case("ep-T1", "ep", "fp8_channel", 1),  # EP T = 1: rank 1 has no token
    ]
}
#: the cases whose layer computes the single-process function (see compare.distributed: Numerics)
SAME_FUNCTION = ["tp-bf16", "tp-fp8_block", "ep-bf16", "ep-fp8_channel", "ep-fp8_block", "ep-uneven", "tp-T1", "ep-T1"]


def _worker(rank, world, cases, backend, peer_errors=False):
    device = rank_device(dist.get_backend(), rank)
    out = {}
    for c in cases:
        part = SHARDERS[c.parallel](c.inputs().to(device), rank, world)
        layer = layer_for(c.parallel)(backend)
        for run in range(1 + c.repeat):
            out[c.name + "/again" * run] = layer(**part.kwargs()).cpu()
    if peer_errors:  # every rank raises after the agreement's all_gather: the group stays usable
        out["errors"] = [_caught(_disagree, rank, world), _caught(_refuse_on_rank1, rank, world)]
        dist.barrier()
    return out


def _caught(fn, rank, world):
    try:
        fn(rank, world)
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _disagree(rank, world):
    inp = make_inputs(dataclasses.replace(SHAPE, intermediate=64), 3 + rank, None)  # T = 3 and 4
    TPMoE("torch_loop")(**shard_tp(inp, rank, world).kwargs())


def _refuse_on_rank1(rank, world):
    inp = make_inputs(dataclasses.replace(SHAPE, intermediate=64), 3, None)
    kwargs = shard_ep(inp, rank, world).kwargs()
    if rank == 1:
        kwargs["x"] = kwargs["x"].float()
    EPMoE("torch_loop")(**kwargs)


def _assemble(case, per_rank, key=None):
    key = key or case.name
    if case.parallel == "tp":
        return per_rank[0][key]
    return torch.cat([r[key] for r in per_rank])


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, WORLD, (list(CASES.values()), "triton_moe", True), backend="gloo", timeout_s=300)


@pytest.fixture(scope="module")
def single():
    """The single-process layer on the whole problem, per case (triton_moe, interpreter)."""
    from triton_moe import fused_moe

    return {n: fused_moe(**CASES[n].inputs().kwargs()) for n in SAME_FUNCTION}


def _single_process_check(name, ranks, single):
    case = CASES[name]
    out = _assemble(case, ranks)
    inp = case.inputs()
    assert out.dtype == torch.bfloat16 and out.shape == inp.x.shape
    ok, why = check(errors(out, oracle(**inp.kwargs())), case.quant)
    assert ok, f"{name} vs the whole layer's oracle: {why}"
    diff = rel_l2(out, single[name].double())
    assert diff <= cross_backend_tolerance(case.quant), f"{name} vs the single-process layer: rel L2 {diff:.2e}"


@pytest.mark.parametrize("name", ["tp-bf16", "tp-fp8_block"])
def test_tp_equals_the_single_process_layer(name, ranks, single):
    _single_process_check(name, ranks, single)
    assert torch.equal(ranks[0][name], ranks[1][name])  # the all_reduce leaves the same bits on both ranks


@pytest.mark.parametrize("name", ["ep-bf16", "ep-fp8_channel", "ep-fp8_block"])
def test_ep_equals_the_single_process_layer(name, ranks, single):
    _single_process_check(name, ranks, single)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].T])
def test_each_layer_computes_its_own_function(name, ranks):
    """Against the fp64 oracle of the sharded function — for per-tensor / per-token FP8 under TP and
    per-tensor FP8 under EP the only reference that is exact (they quantize on what a rank sees)."""
    case = CASES[name]
    ref = SIMULATORS[case.parallel](case.inputs(), WORLD, oracle)
    err = rel_l2(_assemble(case, ranks), ref)
    assert err <= tolerance_for(case.quant).rel_l2, f"{name}: rel L2 {err:.2e} to its own function"


def test_uneven_routing_one_rank_receives_no_token(ranks, single):
    case = CASES["ep-uneven"]
    inp = case.inputs()
    per = SHAPE.num_experts // WORLD
    sent = sum(plan_dispatch(shard_ep(inp, r, WORLD).topk_ids, per, WORLD).send_counts for r in range(WORLD))
    assert sent.tolist() == [inp.topk_ids.numel(), 0]  # the case is what it claims
    _single_process_check("ep-uneven", ranks, single)


@pytest.mark.parametrize("name", ["tp-T0", "ep-T0"])
def test_no_tokens(name, ranks):
    for r in range(WORLD):
        assert ranks[r][name].shape == (0, SHAPE.hidden) and ranks[r][name].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["tp-T1", "ep-T1"])
def test_one_token(name, ranks, single):
    if CASES[name].parallel == "ep":
        assert ranks[1][name].shape == (0, SHAPE.hidden)  # rank 1 brought no token, still served rank 0's
    _single_process_check(name, ranks, single)


@pytest.mark.parametrize("name", ["tp-bf16", "ep-bf16"])
def test_a_repeated_call_gives_the_same_bits(name, ranks):
    for r in range(WORLD):
        assert torch.equal(ranks[r][name], ranks[r][name + "/again"])


# --- the sharding, exactly (no ranks) -------------------------------------------------------------


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_shards_hold_the_weights_and_scales_of_their_rows(quant):
    """Dequantized, a TP shard is exactly its gate rows, up rows and W2 columns of the whole layer;
    an EP shard exactly its experts (every scale followed its rows)."""
    inp = make_inputs(SHAPE, 3, quant, seed=1)
    deq = (lambda w, s: w.double()) if quant is None else (lambda w, s: dequantize_weight(w, s, quant, torch.float64))
    W1, W2 = deq(inp.w1, inp.w1_scale), deq(inp.w2, inp.w2_scale)
    I, part = SHAPE.intermediate, SHAPE.intermediate // WORLD
    for r in range(WORLD):
        tp = shard_tp(inp, r, WORLD)
        mine = slice(r * part, (r + 1) * part)
        assert torch.equal(deq(tp.w1, tp.w1_scale), torch.cat([W1[:, mine], W1[:, I:][:, mine]], dim=1))
        assert torch.equal(deq(tp.w2, tp.w2_scale), W2[:, :, mine])
        ep = shard_ep(inp, r, WORLD)
        experts = slice(r * 2, r * 2 + 2)
        assert torch.equal(deq(ep.w1, ep.w1_scale), W1[experts]) and torch.equal(deq(ep.w2, ep.w2_scale), W2[experts])


@pytest.mark.parametrize("parallel", ["tp", "ep"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_which_splits_change_the_function(parallel, quant):
    """In fp64, split and whole layer agree to rounding exactly where compare.distributed says so;
    per-tensor / per-token FP8 scales taken over a rank's part move the result by a fraction of the
    FP8 quantization error (compare.studies.dist_numerics measures it; notes/distributed.md)."""
    inp = make_inputs(SHAPE, 6, quant, seed=2)
    gap = rel_l2(SIMULATORS[parallel](inp, WORLD, oracle), oracle(**inp.kwargs()))
    same = quant in (None, "fp8_block") or (parallel == "ep" and quant == "fp8_channel")
    assert (gap < 1e-12) if same else (1e-3 < gap < tolerance_for(quant).quant_error), f"{parallel} {quant}: {gap:.2e}"


@pytest.mark.parametrize("T, world", [(0, 2), (1, 2), (5, 2), (6, 2), (7, 3)])
def test_token_range_splits_like_tensor_split(T, world):
    ranges = [token_range(T, r, world) for r in range(world)]
    assert [b - a for a, b in ranges] == [len(c) for c in torch.tensor_split(torch.arange(T), world)]
    assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] and ranges[-1][1] == T


# --- argument errors (a one-rank group in this process) -----------------------------------------


@pytest.fixture
def one_rank_group():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(d, 'rv')}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=30),
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda i: shard_tp(i, 0, 2), "^world: fp8_block needs I/world to be a multiple of 128"),
        (lambda i: shard_tp(i, 0, 3), "^world: 3 ranks do not divide the intermediate size I = 128"),
        (lambda i: shard_tp(i, 2, 2), "^rank: expected 0 <= rank < world = 2, got 2"),
        (lambda i: shard_tp(i, 0, 0), "^world: expected at least 1 rank"),
        (lambda i: shard_ep(i, 0, 3), "^world: 3 ranks do not divide the expert count E = 4"),
        (lambda i: shard_ep(i.kwargs(), 0, 2), "^inputs: expected a moe_spec.problem.MoEInputs"),
    ],
)
def test_sharding_refusals_name_the_argument(call, match):
    inp = make_inputs(dataclasses.replace(SHAPE, intermediate=128), 2, "fp8_block")  # I/2 = 64
    with pytest.raises((TypeError, ValueError), match=match):
        call(inp)


def test_layer_option_errors_name_the_argument():
    with pytest.raises(ValueError, match="^backend: expected one of"):
        TPMoE("no_such_backend")
    with pytest.raises(TypeError, match="^check_peers: expected True or False"):
        EPMoE("triton_moe", check_peers="yes")
    with pytest.raises(ValueError, match="^parallel: expected 'tp' or 'ep'"):
        layer_for("dp")


@pytest.mark.parametrize(
    "layer, edit, match",
    [
        ("tp", lambda k: k.update(x=k["x"].float()), "^x: expected dtype bfloat16"),
        ("tp", lambda k: k.update(w1_scale=None), "^w1_scale: required"),
        ("ep", lambda k: k.update(x=k["x"].float()), "^x: expected dtype bfloat16"),
        ("ep", lambda k: k.update(topk_weights=k["topk_weights"][:, 0]), "^topk_weights: expected a 2-D tensor"),
        ("ep", lambda k: k.update(topk_ids=k["topk_ids"] + 3), r"^topk_ids: expected global expert ids in \[0, E=4\)"),
        ("ep", lambda k: k.update(topk_ids=k["topk_ids"][:, :1]), "^topk_ids: expected shape"),
        ("ep", lambda k: k.update(w1="w1"), "^w1: expected a torch.Tensor"),
    ],
)
def test_call_errors_name_the_argument(one_rank_group, layer, edit, match):
    kwargs = make_inputs(SHAPE, 3, "fp8_channel", seed=4).kwargs()
    edit(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        layer_for(layer)("triton_moe")(**kwargs)


def test_one_rank_layers_are_the_single_process_layer(one_rank_group):
    from triton_moe import fused_moe

    inp = make_inputs(dataclasses.replace(SHAPE, intermediate=64), 4, None, seed=5)
    want = fused_moe(**inp.kwargs())
    assert torch.equal(TPMoE("triton_moe")(**shard_tp(inp, 0, 1).kwargs()), want)
    assert rel_l2(EPMoE("triton_moe")(**shard_ep(inp, 0, 1).kwargs()), want.double()) <= cross_backend_tolerance(None)


# --- ranks that disagree; the launcher: a failure reaches the test, a hang is killed --------------


def test_ranks_that_disagree_all_raise_the_same_error(ranks):
    want = "ValueError: x: the ranks disagree on T: [3, 4] (rank order); every rank must hold the same layer"
    assert [r["errors"][0] for r in ranks] == [want, want]


def test_a_rank_refusing_its_arguments_tells_its_peer(ranks):
    assert ranks[0]["errors"][1] == (
        "RuntimeError: rank(s) [1] refused their arguments (their own error says which); no collective ran"
    )
    assert ranks[1]["errors"][1].startswith("TypeError: x: expected dtype bfloat16")


def _hang_on_rank1(rank, world):
    if rank == 1:
        time.sleep(600)
    dist.barrier()


def test_a_rank_error_fails_the_run_with_its_message():
    with pytest.raises(RankError, match=r"(?s)rank \d failed:.*x: the ranks disagree on T: \[3, 4\]"):
        run_ranks(_disagree, WORLD, backend="gloo", timeout_s=120)


def test_a_hang_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"still running after 10 s: killed"):
        run_ranks(_hang_on_rank1, WORLD, backend="gloo", timeout_s=10)
    assert time.monotonic() - start < 30


# --- two GPUs (NCCL), both backends ---------------------------------------------------------------

GPU_SHAPE = MoEShape("dist-gpu", 8, 2, 512, 512, "test: two-GPU check")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
@pytest.mark.parametrize("backend, quants", [("triton_moe", QUANTS), ("cute_moe", [None])])
def test_two_gpus_nccl(backend, quants):
    from compare.backends import load_backend

    cases = [
        Case(f"{p}-{q or 'bf16'}-{T}", p, q, T, shape=GPU_SHAPE)
        for p in ("tp", "ep")
        for q in quants
        for T in (1, 37, 256)
    ]
    per_rank = run_ranks(_worker, WORLD, (cases, backend), backend="nccl", timeout_s=500)
    fused_moe = load_backend(backend).fused_moe
    for c in cases:
        inp = c.inputs()
        out = _assemble(c, per_rank)
        own = rel_l2(out, SIMULATORS[c.parallel](inp, WORLD, oracle))
        assert own <= tolerance_for(c.quant).rel_l2, f"{backend} {c.name}: {own:.2e} to its own function"
        if c.quant in (None, "fp8_block") or (c.parallel == "ep" and c.quant == "fp8_channel"):
            one = fused_moe(**inp.to("cuda").kwargs()).cpu()
            assert rel_l2(out, one.double()) <= cross_backend_tolerance(c.quant), f"{backend} {c.name} vs one GPU"

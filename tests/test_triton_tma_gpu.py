"""The persistent TMA grouped GEMM on the GPU (``-m gpu``, the H200 lane): every quant format on a
small shape and on a catalog prefill shape, against the fp64 oracle and against ``moe_gemm_kernel``
on the same tile (the same K order and epilogue: bit for bit is expected, and checked separately
from the tolerance), reruns bit-identical, CUDA-graph capture equal to eager (the descriptors'
scratch comes from the graph's pool), no recompilation over a batch sweep."""

from dataclasses import replace

import pytest
import torch

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, get_shape, make_inputs

pytestmark = pytest.mark.gpu

QUANTS = [None, "fp8_tensor", "fp8_channel", "fp8_block"]
TOL = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_channel": 1e-2, "fp8_block": 1e-2}
SMALL = MoEShape("small", 8, 2, 160, 80, "test shape: K, I not multiples of the tiles")
CATALOG = ("qwen3-30b-a3b", 4096)  # prefill: 256 tokens per expert


def _small(quant):
    from triton_moe import TritonConfig

    inp = make_inputs(SMALL, 300, quant, seed=1, device="cuda")
    return inp.kwargs(), TritonConfig(64, 64, 64, 2, 4, 3, False)


def _catalog(quant):
    from triton_moe.lab.workload import Problem, drop_weights

    drop_weights()
    p = Problem(get_shape(CATALOG[0]), CATALOG[1], quant, n_sets=1)
    return p.sets[0], replace(p.config(), swap_ab=False)


def _both(kwargs, cfg):
    from triton_moe import fused_moe

    base = fused_moe(**kwargs, config=cfg)
    out = fused_moe(**kwargs, config=replace(cfg, persistent_tma=True))
    torch.cuda.synchronize()
    return base, out


@pytest.mark.parametrize("where", ["small", "catalog"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_against_oracle_and_grouped_kernel(quant, where):
    kwargs, cfg = (_small if where == "small" else _catalog)(quant)
    base, out = _both(kwargs, cfg)
    ref = oracle(**kwargs)
    assert rel_l2(out, ref) <= TOL[quant], (rel_l2(out, ref), rel_l2(base, ref))
    assert rel_l2(out, base.double()) <= TOL[quant]


@pytest.mark.parametrize("where", ["small", "catalog"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_bit_identical_to_grouped_kernel(quant, where):
    kwargs, cfg = (_small if where == "small" else _catalog)(quant)
    base, out = _both(kwargs, cfg)
    assert torch.equal(out, base), f"rel L2 between the kernels {rel_l2(out, base.double()):.2e}"


@pytest.mark.parametrize("flatten", [False, True], ids=["loop", "flatten"])
@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
def test_rerun_and_graph_replay(quant, flatten):
    from triton_moe.lab.workload import Problem, drop_weights

    drop_weights()
    p = Problem(get_shape(CATALOG[0]), CATALOG[1], quant, n_sets=1)
    cfg = replace(p.config(), swap_ab=False, persistent_tma=True, tma_flatten=flatten)
    while not cfg.fits(quant):  # flattening takes more shared memory: one stage less
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    r = p.check(cfg)
    assert r["rel_l2"] <= TOL[quant], r
    assert r["bit_identical"] and r["graph_equal"], r


def test_batch_sweep_does_not_recompile():
    from triton_moe import TritonConfig, fused_moe
    from triton_moe.jit import count_compilations
    from triton_moe.lab.workload import Problem

    cfg = TritonConfig(128, 128, 64, 8, 8, 3, False, persistent_tma=True)
    problem = lambda T: Problem(get_shape("qwen3-30b-a3b"), T, None, n_sets=1).sets[0]  # noqa: E731
    with count_compilations() as counter:
        fused_moe(**problem(5), config=cfg)
        counter.mark()
        for T in (1, 17, 128, 1000, 4097):
            fused_moe(**problem(T), config=cfg)
        torch.cuda.synchronize()
    assert counter.compilations == [] and counter.new_keys == {}, counter.compilations

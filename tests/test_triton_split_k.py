"""Split-K of GEMM1 (``TritonConfig.split_k``) on the CPU (Triton interpreter): every format, both
swap-AB paths, K not a multiple of the split, a split with no K steps of its own; the last program
sums the partials in a fixed order, so reruns are bitwise; the counters are left zero; bad
weight scales seen by any program reach the error word (the config's refusals of a bad split are
in tests/test_triton_config.py).

The interpreter runs a launch's programs one after another, so here the last program of a tile
is always split SPLIT_K − 1; on the GPU any may be last, which the fixed summation order makes
irrelevant (checked on the GPU lane: tests/test_triton_gpu.py).
"""

import pytest
import torch

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from triton_moe import TritonConfig, fused_moe

TOL = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_channel": 1e-2, "fp8_block": 1e-2}
QUANTS = [None, "fp8_tensor", "fp8_channel", "fp8_block"]
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

# K = 416 = 6.5 steps of 64: split 2 → 4 + 3 steps (the last partial), split 8 → 1 step each, the
# eighth program has none (its partial is zero); I = 80 is not a multiple of the 32/64-wide tiles
SHAPE = MoEShape("split", 8, 2, 416, 80, "test shape: K not a multiple of BLOCK_K × split")


def _cfg(split_k, swap_ab):
    return TritonConfig(16, 64 if swap_ab else 32, 64, 1, 4, 2, swap_ab, split_k=split_k)


@pytest.mark.parametrize("swap_ab", [False, True], ids=["noswap", "swap"])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16")
def test_split_k_matches_the_oracle_and_reruns_bitwise(quant, swap_ab):
    from triton_moe import moe

    inp = make_inputs(SHAPE, 3, quant, seed=4)  # 6 pairs: the split is along K, T only sets the tile count
    ref = oracle(**inp.kwargs())
    unsplit = fused_moe(**inp.kwargs(), config=_cfg(1, swap_ab))
    for split_k in (2, 8):
        out = fused_moe(**inp.kwargs(), config=_cfg(split_k, swap_ab))
        err = rel_l2(out, ref)
        assert err <= TOL[quant], f"split_k={split_k}: rel L2 {err:.2e}"
        # the same function as the unsplit kernel, up to the order of the fp32 additions
        assert rel_l2(out, unsplit) <= TOL[quant] / 2
    # a rerun after both splits ran on the same workspaces: what a call leaves behind (its counters, its
    # partial sums) does not reach the next call's bits (split 8 followed split 2 already, checked above)
    again = fused_moe(**inp.kwargs(), config=_cfg(8, swap_ab))
    assert torch.equal(out, again), "split_k=8: a rerun differs"
    counts = [ws["counts_split"] for ws in moe._workspaces.values() if "counts_split" in ws]
    assert counts and all(int(c.abs().sum()) == 0 for c in counts), "a split-K counter was left non-zero"


def test_split_k_changes_the_grid_of_gemm1_only(monkeypatch):
    from triton_moe import jit

    seen = []
    real = jit.launch  # every launch, bound or not, under the interpreter

    def spy(kernel, grid, *args, **kwargs):
        if "SPLIT_K" in kwargs:
            seen.append((kwargs["FUSE_SILU"], tuple(grid), kwargs["SPLIT_K"]))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(jit, "launch", spy)
    fused_moe(**make_inputs(SHAPE, 3, None, seed=5).kwargs(), config=_cfg(4, True))
    (gemm1, grid1, split1), (gemm2, grid2, split2) = seen
    assert gemm1 and not gemm2 and (split1, split2) == (4, 1)
    assert grid1[1] == 4 and len(grid2) == 1


def test_a_bad_block_scale_in_any_split_sets_the_error_bit():
    from moe_spec.validate import check

    inp = make_inputs(SHAPE, 5, "fp8_block", seed=6)
    w1_scale = inp.w1_scale.clone()
    w1_scale[:, :, 0] = -1.0  # the first K group: read only by split 0 of each tile
    check()
    fused_moe(**dict(inp.kwargs(), w1_scale=w1_scale), config=_cfg(4, True))
    with pytest.raises(ValueError, match="^w1_scale"):
        check()


SM90 = r"""
import json, sys
from triton_moe.sm90 import compile_sm90
from triton_moe.kernels import moe_gemm_kernel

split_k, fp8 = json.loads(sys.argv[1])
op = "*fp8e4nv" if fp8 else "*bf16"
ptrs = {"a_ptr": op, "w_ptr": op, "out_ptr": "*fp32" if fp8 else "*bf16", "sorted_ids_ptr": "*i32",
        "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32", "topk_ids_ptr": "*i32", "error_ptr": "*i32",
        "count_ptr": "*i32"}
sig = {n: ptrs.get(n, "*fp32") for n in moe_gemm_kernel.arg_names if n.endswith("_ptr")}
sig.update(num_pairs="i32", N="i32", K="i32", E="i32")
cex = dict(A_ROW_DIV=8, FUSE_SILU=True, MUL_ROUTED_WEIGHT=False, QUANT=1 if fp8 else 0, FP8_IMPRECISE_ACC=0,
           SWAP_AB=True, INTERPRETER=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128 if fp8 else 64, GROUP_M=1,
           SPLIT_K=split_k)
r = compile_sm90(moe_gemm_kernel, sig, cex, num_warps=4, num_stages=4,
                 divisible_by_16=[n for n in sig if n != "num_pairs"])
t = r.pop("ttgir")
r.update(acq_rel=t.count("acq_rel"), cg_loads=t.count("cacheModifier = cg"), wgmma=t.count("ttng.warp_group_dot "),
         async_copies=t.count("ttg.async_copy_global_to_local"))
print(json.dumps(r))
"""


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_split_k_gemm1_compiles_for_sm90_with_its_exchange(fp8):
    """The decode GEMM1 with SPLIT_K = 4 keeps its WGMMA pipeline and gains exactly the exchange:
    one acquire-release counter atomic and L2-only (.cg) loads of the partials, without spilling."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    got = {}
    for split_k in (1, 4):
        run = subprocess.run(
            [sys.executable, "-c", SM90, json.dumps([split_k, fp8])], capture_output=True, text=True, env=env
        )
        if run.returncode and "ptxas" in run.stderr and "No such file" in run.stderr:
            pytest.skip("Triton's bundled ptxas is missing")
        assert run.returncode == 0, run.stderr[-2000:]
        got[split_k] = json.loads(run.stdout.strip().splitlines()[-1])
    one, four = got[1], got[4]
    # the error word's atomic OR is acquire-release in both; SPLIT_K = 4 adds the counter's atomic
    assert one["cg_loads"] == 0 and four["acq_rel"] == one["acq_rel"] + 1, got
    assert four["cg_loads"] >= 2, four  # gate and up partials, read from L2
    assert four["wgmma"] == one["wgmma"] == 2 and four["async_copies"] == one["async_copies"] > 0, got
    assert four["spill_bytes"] == 0, four


# --- the study command ------------------------------------------------------------------------------------------


def test_the_split_k_study_report_renders(tmp_path):
    import json

    from triton_moe.lab import bench_splitk

    def row(s, us):
        return dict(
            shape="deepseek-v3:tp8",
            dtype="bf16",
            T=1,
            tile="16x64x64/g1w4s5",
            split_k=s,
            us=us,
            rel_l2=3.0e-3,
            bit_identical=True,
            graph_equal=True,
            shipped_split_k=4,
        )

    results = dict(
        date="d",
        device="dev",
        commit="c",
        command="cmd",
        cut=["mixtral-8x7b bf16 T=128"],
        rows=[
            row(1, 45.4),
            row(4, 34.5),
            dict(
                shape="deepseek-v3:tp8", dtype="bf16", T=1, tile="16x64x64/g1w4s5", split_k=8, error="ValueError('x')"
            ),
        ],
    )
    bench_splitk._write(tmp_path, results)
    md = (tmp_path / "splitk.md").read_text()
    assert "| deepseek-v3:tp8 | bf16 | 1 | 16x64x64/g1w4s5 | 1 | 45.4 | 1.000 |" in md, md
    assert "| 4 (best) | 34.5 | 0.760 | 3.0e-03 | True | True |" in md, md
    assert "| 8 | error: ValueError('x') |" in md and "Not run (deadline): mixtral-8x7b bf16 T=128" in md
    assert json.loads((tmp_path / "splitk.json").read_text())["rows"][1]["us"] == 34.5


def test_the_deepseek_tp8_tables_split_gemm1_at_decode_only():
    """The shipped DeepSeek-V3 TP8 tables give split_k 4 to the T = 1 entry (which serves T ≤ 4) and
    1 elsewhere, in every format, and each entry passes the config's own checks."""
    from moe_spec.problem import get_shape
    from triton_moe.heuristic import get_config

    s = get_shape("deepseek-v3:tp8")
    for quant in (None, "fp8_tensor", "fp8_channel", "fp8_block"):
        for T, want in ((1, 4), (4, 4), (8, 1), (128, 1), (4096, 1)):
            cfg = get_config(T, s.num_experts, s.top_k, s.intermediate, s.hidden, quant, device_name="NVIDIA H200")
            assert cfg.split_k == want, (quant, T, cfg)
            cfg.resolved().check(quant)

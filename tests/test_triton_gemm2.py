"""GEMM2's own tile (``TritonConfig.gemm2``) on the CPU: a layer whose GEMM2 tile differs from
GEMM1's against the fp64 oracle (Triton interpreter; bf16 and an FP8 format), the launches each GEMM
gets, GEMM2 on the persistent TMA kernel while GEMM1 is not (and the reverse), GEMM2 alone as the
study times it, the sm_90a binary of a GEMM2 tile (compiled on the CPU in a subprocess), and the
study's report. The config's own checks are in tests/test_triton_config.py, the warm-up's in
tests/test_warmup.py."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from triton_moe import TritonConfig, fused_moe
from triton_moe.config import Gemm2Tile
from triton_moe.jit import count_compilations

TOL = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_channel": 1e-2, "fp8_block": 1e-2}
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

SMALL = MoEShape("tiny", 8, 2, 160, 80, "test shape: K, I not multiples of the tiles")
#: GEMM1: 16 tokens × 32 columns, no swap; GEMM2: 64 weight rows × 16 tokens (swap-AB by the rule),
#: 64-deep K steps (I = 80: a partial second step), its own GROUP_M, warps and stages
GEMM1 = TritonConfig(16, 32, 32, 1, 4, 2)
OWN = TritonConfig(16, 32, 32, 1, 4, 2, gemm2=Gemm2Tile(64, 64, GROUP_M=2, num_warps=8, num_stages=3))


def _gemm_launches(monkeypatch):
    from triton_moe import jit

    seen = []
    real = jit.launch  # every launch, bound or not, under the interpreter

    def spy(kernel, grid, *args, **kwargs):
        if "FUSE_SILU" in kwargs:
            seen.append(
                dict(
                    grid=tuple(grid),
                    **{
                        k: kwargs[k]
                        for k in (
                            "FUSE_SILU",
                            "BLOCK_M",
                            "BLOCK_N",
                            "BLOCK_K",
                            "GROUP_M",
                            "SWAP_AB",
                            "num_warps",
                            "num_stages",
                        )
                    },
                )
            )
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(jit, "launch", spy)
    return seen


@pytest.mark.parametrize("quant", [None, "fp8_channel"], ids=lambda q: q or "bf16")
def test_a_gemm2_tile_of_its_own_matches_the_oracle(quant, monkeypatch):
    inp = make_inputs(SMALL, 11, quant, seed=1)  # 22 pairs over 8 experts: some experts empty
    ref = oracle(**inp.kwargs())
    shared = fused_moe(**inp.kwargs(), config=GEMM1)
    seen = _gemm_launches(monkeypatch)
    out = fused_moe(**inp.kwargs(), config=OWN)
    err = rel_l2(out, ref)
    assert err <= TOL[quant], f"rel L2 {err:.2e}"
    assert rel_l2(out, shared.double()) <= TOL[quant] / 2  # the same function, other K and N tiles
    g1, g2 = seen
    assert g1["FUSE_SILU"] and not g2["FUSE_SILU"]
    assert {k: g1[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "num_warps")} == dict(
        BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SWAP_AB=False, num_warps=4
    )
    assert {
        k: g2[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SWAP_AB", "num_warps", "num_stages")
    } == dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, SWAP_AB=True, num_warps=8, num_stages=3)
    blocks = g1["grid"][0] // 3  # GEMM1: cdiv(I = 80, 32) = 3 N tiles per M-block
    assert g2["grid"] == (blocks * 3,)  # GEMM2: cdiv(K = 160, 64) = 3 N tiles per M-block


@pytest.fixture
def few_programs(monkeypatch):
    """Three persistent programs instead of one per SM: each loops over several tiles."""
    import triton_moe.kernels_tma as kt

    monkeypatch.setattr(kt, "sm_count", lambda device=None: 3)


TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2, swap_ab=False)


@pytest.mark.parametrize("persistent", ["gemm2", "gemm1"])
def test_one_gemm_on_the_persistent_tma_kernel_the_other_grouped(persistent, few_programs):
    """GEMM2's tile picks GEMM2's kernel: the persistent TMA GEMM for one GEMM, the grouped one for
    the other, bit for bit the all-grouped layer on the same tiles (same K order, same epilogue)."""
    inp = make_inputs(SMALL, 11, None, seed=1)
    g2 = Gemm2Tile(64, 32, 2, 4, 2, swap_ab=False)  # another tile than GEMM1's
    grouped = fused_moe(**inp.kwargs(), config=TritonConfig(**TILE, gemm2=g2))
    cfg = (
        TritonConfig(**TILE, gemm2=Gemm2Tile(**{**g2.as_dict(), "persistent_tma": True}))
        if persistent == "gemm2"
        else TritonConfig(**TILE, persistent_tma=True, gemm2=g2)
    )
    with count_compilations() as counter:
        out = fused_moe(**inp.kwargs(), config=cfg)
    gemms = [n for n in counter.launches if n.startswith("moe_gemm")]
    assert gemms == (
        ["moe_gemm_kernel", "moe_gemm_tma_kernel"]
        if persistent == "gemm2"
        else ["moe_gemm_tma_kernel", "moe_gemm_kernel"]
    )
    assert rel_l2(out, oracle(**inp.kwargs())) <= TOL[None]
    assert torch.equal(out, grouped)


def test_only_the_persistent_gemms_weight_is_checked_for_tma():
    """I = 20 bf16 values (40-byte rows of W2) cannot go through TMA: refused, naming w2, before any
    launch, only when GEMM2 runs the persistent kernel."""
    inp = make_inputs(MoEShape("odd", 4, 2, 32, 20, "test"), 3, None, seed=2)
    tma2 = TritonConfig(**TILE, gemm2=Gemm2Tile(32, 64, swap_ab=False, persistent_tma=True))
    with count_compilations(dry_run=True) as counter:
        with pytest.raises(ValueError, match=r"^w2: persistent_tma reads the weights through TMA"):
            fused_moe(**inp.kwargs(), config=tma2)
    assert counter.launches == []
    tma1 = TritonConfig(**TILE, persistent_tma=True, gemm2=Gemm2Tile(32, 64, swap_ab=False))
    with count_compilations(dry_run=True) as counter:
        fused_moe(**inp.kwargs(), config=tma1)  # K = 32: W1's rows are 64 bytes
    assert [n for n in counter.launches if n.startswith("moe_gemm")] == ["moe_gemm_tma_kernel", "moe_gemm_kernel"]


def test_gemm2_alone_is_the_layers_gemm2():
    """``triton_moe.moe.gemm2`` (what ``python -m triton_moe.lab.bench_gemm2`` times) writes the y the
    layer's own GEMM2 launch wrote, for the layer's routing and intermediate."""
    from moe_spec.quant import get_format
    from triton_moe import moe
    from triton_moe.align import align_block_size

    quant = "fp8_tensor"
    inp = make_inputs(SMALL, 7, quant, seed=3)
    cfg = OWN.resolved().check(quant)
    T, K, I, E, top_k = 7, SMALL.hidden, SMALL.intermediate, SMALL.num_experts, SMALL.top_k  # noqa: E741
    routing = align_block_size(inp.topk_ids, E, cfg.BLOCK_M)
    ws = moe._buffers(T, top_k, E, K, I, quant, cfg.BLOCK_M, inp.x.device, moe._split(cfg))
    out = moe.expert_computation(
        inp.x,
        inp.w1,
        inp.w2,
        inp.topk_weights,
        inp.topk_ids,
        routing,
        quant=quant,
        w1_scale=inp.w1_scale,
        w2_scale=inp.w2_scale,
        config=cfg,
        workspace=ws,
    )
    assert get_format(quant).quantized and rel_l2(out, oracle(**inp.kwargs())) <= TOL[quant]
    y = torch.empty_like(ws["y"])
    moe.gemm2(
        ws["aq"], ws["act_scale"], inp.w2, inp.w2_scale, y, inp.topk_weights, inp.topk_ids, routing, cfg, quant=quant
    )
    assert torch.equal(y, ws["y"])


SM90 = r"""
import json, sys
from dataclasses import replace
from triton_moe.config import Gemm2Tile, TritonConfig
from triton_moe.sm90 import compile_sm90
from triton_moe.kernels import moe_gemm_kernel as k
from triton_moe.moe import _gemm_constants
from triton_moe.plan import plan
from moe_spec.validate import MoEDims

quant, g2 = json.loads(sys.argv[1])
bk = 64 if quant is None else 128
# DeepSeek-V3 TP8 at T = 4096: the shipped 128x128 tile for GEMM1, GEMM2's own from the argument
p = plan(MoEDims(T=4096, E=256, K=7168, I=256, top_k=8), quant,
         config=TritonConfig(128, 128, bk, 8, 8, 3, gemm2=Gemm2Tile(**g2)))
cfg = p.gemm2
cex = dict(_gemm_constants(cfg, quant, False, 1, 256), INTERPRETER=False)  # K = I = 256: EARLY_ROUTING
warps, stages = cex.pop("num_warps"), cex.pop("num_stages")
op = "*bf16" if quant is None else "*fp8e4nv"
ptrs = {"a_ptr": op, "w_ptr": op, "out_ptr": "*bf16", "sorted_ids_ptr": "*i32", "expert_of_block_ptr": "*i32",
        "num_padded_ptr": "*i32", "topk_ids_ptr": "*i32", "error_ptr": "*i32", "count_ptr": "*i32"}
sig = {n: ptrs.get(n, "*fp32") for n in k.arg_names if n.endswith("_ptr")}
sig.update(num_pairs="i32", N="i32", K="i32", E="i32")
r = compile_sm90(k, sig, cex, num_warps=warps, num_stages=stages, divisible_by_16=[n for n in sig if n != "num_pairs"])
t = r.pop("ttgir")
from triton_moe.sm90 import build_sm90
ptx = build_sm90(k, sig, cex, num_warps=warps, num_stages=stages,
                 divisible_by_16=[n for n in sig if n != "num_pairs"]).asm["ptx"]
r.update(model=cfg.smem_bytes(quant, gemm=2), mma=p.mma[1], in_ptx=p.mma[1] in ptx,
         wgmma=t.count("ttng.warp_group_dot "), block_n=cex["BLOCK_N"], block_k=cex["BLOCK_K"])
print(json.dumps(r))
"""


@pytest.mark.parametrize(
    "quant, g2",
    [
        (None, dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)),
        ("fp8_tensor", dict(BLOCK_N=128, BLOCK_K=256, GROUP_M=8, num_warps=8, num_stages=3)),
    ],
    ids=["bf16-128x256x64", "fp8-128x128x256"],
)
def test_a_gemm2_tile_compiles_for_sm90_as_planned(quant, g2):
    """The GEMM2 launch of a plan with its own tile (constexprs from ``moe._gemm_constants``),
    compiled for sm_90a on the CPU: the WGMMA the plan names is in the PTX, the shared memory is
    what the config's model counts for GEMM2 (one weight tile) and fits, nothing spills."""
    from triton_moe.config import SMEM_LIMIT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SM90, json.dumps([quant, g2])], capture_output=True, text=True, env=env)
    if run.returncode and "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert (r["block_n"], r["block_k"]) == (g2["BLOCK_N"], g2["BLOCK_K"])
    assert r["in_ptx"] and r["wgmma"] == 1, r
    assert r["shared_bytes"] == r["model"] <= SMEM_LIMIT, r
    assert r["spill_bytes"] == 0, r


# --- the study command ----------------------------------------------------------------------------------------


def test_the_study_candidates_fit_and_differ_from_the_shared_tile():
    from moe_spec.problem import get_shape
    from triton_moe.heuristic import get_config
    from triton_moe.lab.bench_gemm2 import CELLS, candidates

    assert CELLS[:2] == (("deepseek-v3:tp8", None, 4096), ("deepseek-v3:tp8", "fp8_tensor", 4096))
    for spec, quant, T in CELLS:
        s = get_shape(spec)
        shipped = get_config(T, s.num_experts, s.top_k, s.intermediate, s.hidden, quant, device_name="NVIDIA H200")
        tiles = candidates(shipped, quant, s.intermediate)
        assert 5 <= len(tiles) <= 10, (spec, quant, T, tiles)
        for t in tiles:
            cfg = dataclasses.replace(shipped, gemm2=t).resolved().check(quant)
            assert cfg.gemm2_config() != shipped.gemm2_config() and cfg.BLOCK_M == shipped.BLOCK_M


def test_the_study_report_and_tables_render(tmp_path, monkeypatch):
    from triton_moe import heuristic as C
    from triton_moe.lab import bench_gemm2

    monkeypatch.setattr(C, "current_device_name", lambda: "NVIDIA H200")
    g2 = Gemm2Tile(256, 64, 8, 8, 4)

    def row(tile, us, **kw):
        return dict(
            shape="deepseek-v3:tp8", dtype="bf16", T=4096, tile=tile, us=us, tflops=1.0, vs_shared=us / 600, **kw
        )

    results = dict(
        date="d",
        device="dev",
        commit="c",
        command="python -m triton_moe.lab.bench_gemm2 --out x",
        cut=["mixtral-8x7b fp8_block T=4096"],
        rows=[
            row("shared 128x128x64/g8w8s3", 600.0),
            row(g2.label(), 400.0, rel_l2=1e-3, equal=True, best=True),
            dict(shape="deepseek-v3:tp8", dtype="bf16", T=4096, tile="256x128/g8w8s3", error="E('x')"),
        ],
        cells=[
            dict(
                shape="deepseek-v3:tp8",
                dtype="bf16",
                T=4096,
                shipped="128x128x64/g8w8s3",
                shared_us=600.0,
                best=g2.label(),
                best_us=400.0,
                gemm2=g2.as_dict(),
                written=True,
                layer_rel_l2=3e-3,
                bit_identical=True,
                graph_equal=True,
                layer_shared_us=1300.0,
                layer_best_us=1100.0,
            )
        ],
    )
    bench_gemm2._write(tmp_path, results)
    md = (tmp_path / "gemm2.md").read_text()
    assert "| deepseek-v3:tp8 | bf16 | 4096 | 256x64/g8w8s4 | 400.0 (best) | 0.667 | 1 | 1.0e-03 | True |" in md, md
    assert "| 256x128/g8w8s3 | error: E('x') |" in md and "Not run (deadline): mixtral-8x7b fp8_block T=4096" in md
    assert "| 600.0 → 400.0 | 1300.0 → 1100.0 | 3.0e-03 | True | True | True |" in md, md
    bodies = bench_gemm2.write_tables(results, tmp_path)
    name = "E=256,N=256,K=7168,dtype=bf16,device=NVIDIA_H200.json"
    assert list(bodies) == [name]
    table = C.load_table(str(tmp_path / "tables" / name))
    shipped = C.load_table(str(C.table_path(256, 256, 7168, None, "NVIDIA H200")))
    assert table[4096].gemm2 == g2 and table[1024] == shipped[1024]  # a cell not in the results keeps its entry
    body = json.loads((tmp_path / "tables" / name).read_text())
    assert body["gemm2_measured"]["4096"] == {"gemm2_us": [600.0, 400.0], "layer_us": [1300.0, 1100.0]}
    assert "command" not in body or body["command"] == json.loads(
        C.table_path(256, 256, 7168, None, "NVIDIA H200").read_text()
    ).get("command")
    C.load_table.cache_clear()


def test_the_study_refuses_a_non_empty_output_directory(tmp_path, capsys):
    from triton_moe.lab import bench_gemm2

    (tmp_path / "x").write_text("")
    with pytest.raises(SystemExit) as e:
        bench_gemm2.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


def test_the_study_runs_a_cell_end_to_end_on_a_stand_in(tmp_path, monkeypatch):
    """The study's cell (operands from a layer run, GEMM2 alone per candidate, the comparison with the
    shared tile, the best checked and written) on the CPU: a tiny layer stands in for the catalog
    shape and one interpreted call for the CUDA-graph timing."""
    import moe_spec.problem
    import moe_spec.timing
    import triton_moe.lab.workload
    from moe_spec.timing import Timing
    from triton_moe.lab import bench_gemm2

    shape = MoEShape("stand-in", 8, 2, 160, 80, "test")
    calls = []
    winner = 3  # the third timing (the second candidate) is the fastest

    class Stand:
        def __init__(self, shape_, T, quant):
            inp = make_inputs(shape, T, quant, seed=5)
            self.sets = [inp.kwargs()]

        def config(self):
            return GEMM1.resolved()

        def check(self, cfg):
            out = fused_moe(**self.sets[0], config=cfg)
            return {"rel_l2": rel_l2(out, oracle(**self.sets[0])), "bit_identical": True, "graph_equal": True}

        def time(self, cfg):
            return 100.0 if cfg.gemm2 is None else 90.0

    def timed(make_call, n_sets, **kw):
        make_call(0)()
        calls.append(1)
        us = 40.0 if len(calls) == winner else 50.0 + len(calls)
        return Timing(us, 0, 0, 0, 1, 1)

    monkeypatch.setattr(moe_spec.problem, "get_shape", lambda spec: shape)
    monkeypatch.setattr(triton_moe.lab.workload, "Problem", Stand)
    monkeypatch.setattr(moe_spec.timing, "time_cuda_graph", timed)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    results = dict(date="d", device="cpu", commit="c", command="cmd", rows=[], cells=[], cut=[])
    import time

    bench_gemm2._cell("stand-in", None, 9, results, tmp_path, time.time() + 600, 0.03)
    tiles = bench_gemm2.candidates(GEMM1.resolved(), None, shape.intermediate)
    assert len(results["rows"]) == 1 + len(tiles) == len(calls)
    assert all("error" not in r for r in results["rows"]), results["rows"]
    assert all(r["rel_l2"] <= TOL[None] for r in results["rows"][1:])
    (cell,) = results["cells"]
    md = (tmp_path / "gemm2.md").read_text()
    assert "| stand-in | bf16 | 9 | shared 16x32x32/g1w4s2 | 51.0 | 1.000 |" in md, md
    # the third row's tile: checked as a layer against the oracle, faster as a layer, written
    assert cell["best"] == tiles[winner - 2].label() and cell["best_us"] == 40.0
    assert cell["layer_rel_l2"] <= TOL[None] and cell["written"], cell
    assert f"| {tiles[winner - 2].label()} | 40.0 (best) | 0.784 |" in md, md


def test_shipped_fp8_gemm2_tiles_keep_the_entrys_block_k():
    """Under FP8 BLOCK_K cuts the K sum into promoted partial sums: a GEMM2 tile with another
    BLOCK_K than its entry's would change a token's bits between table entries (batch invariance,
    tests/test_batch_invariance_gpu.py), so no shipped FP8 table has one; bf16 tables may."""
    import glob

    from triton_moe import heuristic as C

    seen = 0
    for path in glob.glob(str(C.CONFIG_DIR / "*.json")):
        if "dtype=bf16" in path:
            continue
        for T, cfg in C.load_table(path).items():
            if cfg.gemm2 is not None:
                seen += 1
                assert cfg.gemm2.BLOCK_K == cfg.BLOCK_K, (path, T, cfg)
    assert seen >= 1  # DeepSeek-V3 TP8 fp8_tensor's T = 1024 entry has its own GEMM2 tile

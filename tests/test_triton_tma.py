"""The persistent TMA grouped GEMM (``triton_moe.kernels_tma``) on the CPU.

Triton's interpreter runs tensor descriptors (``tl.make_tensor_descriptor``: zero fill past the
tensor's edges, as TMA does), so the numerics are checked here: against the fp64 oracle and bit for
bit against ``moe_gemm_kernel`` on the same tile (same K order, same epilogue). The grid is forced
down to 3 programs so that every program loops over several tiles of the grouped order; I = 80 is
not a multiple of BLOCK_N = 32, so the last N tile of each expert reads weight rows of the next
block through the descriptor (masked out by the epilogue). Also on the CPU: the config fields, the
dispatch (the kernel runs only when the config asks), the tables turn it on only where measured faster, the TMA
operand check, and the sm_90 binary (compiled with Triton's compiler in a subprocess). The GPU
side is ``tests/test_triton_tma_gpu.py``.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.validate import BAD_ID, BAD_W2_SCALE
from triton_moe import TritonConfig, fused_moe
from triton_moe.heuristic import CONFIG_DIR, default_tiles, load_table
from triton_moe.jit import count_compilations

TOL = {None: 5e-3, "fp8_tensor": 1e-2, "fp8_channel": 1e-2, "fp8_block": 1e-2}
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

SMALL = MoEShape("tiny", 8, 2, 160, 80, "test shape: K, I not multiples of the tiles")
TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2, swap_ab=False)


@pytest.fixture
def few_programs(monkeypatch):
    """Three persistent programs instead of one per SM: each loops over several tiles."""
    import triton_moe.kernels_tma as kt

    monkeypatch.setattr(kt, "sm_count", lambda device=None: 3)


@pytest.mark.parametrize(
    "quant, flatten",
    [(None, False), ("fp8_block", False), ("fp8_tensor", False), (None, True), ("fp8_block", True)],
    ids=["bf16", "fp8_block", "fp8_tensor", "bf16-flatten", "fp8_block-flatten"],
)
def test_matches_the_oracle_and_the_grouped_kernel_bit_for_bit(quant, flatten, few_programs):
    inp = make_inputs(SMALL, 11, quant, seed=1)  # 22 pairs over 8 experts: some experts empty
    base = fused_moe(**inp.kwargs(), config=TritonConfig(**TILE))
    with count_compilations() as counter:
        out = fused_moe(**inp.kwargs(), config=TritonConfig(**TILE, persistent_tma=True, tma_flatten=flatten))
    assert counter.launches.count("moe_gemm_tma_kernel") == 2 and "moe_gemm_kernel" not in counter.launches
    err = rel_l2(out, oracle(**inp.kwargs()))
    assert err <= TOL[quant], f"rel L2 {err:.2e}"
    assert torch.equal(out, base)


def test_bad_data_gives_the_same_nan_rows_and_error_bits(few_programs, word):
    """A bad id (token 2) and a NaN W2 scale of a used expert under fp8_channel: the persistent
    kernel's output (NaN pattern included) and error word are the grouped kernel's."""
    inp = make_inputs(SMALL, 11, "fp8_channel", seed=3)
    inp.topk_ids[2, 1] = 8
    inp.w2_scale[int(inp.topk_ids[0, 0]), 5] = float("nan")
    results = []
    for persistent in (False, True):
        word.zero_()
        out = fused_moe(**inp.kwargs(), config=TritonConfig(**TILE, persistent_tma=persistent))
        results.append((out, int(word)))
    (base, base_word), (out, out_word) = results
    assert out_word == base_word == BAD_ID | BAD_W2_SCALE
    assert bool(out[2].isnan().all()) and torch.equal(out.isnan(), base.isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(base))


def test_selected_only_when_the_config_asks():
    from triton_moe.plan import DECODE_MAX_PAIRS

    inp = make_inputs(SMALL, DECODE_MAX_PAIRS // SMALL.top_k + 1, None, seed=1)  # past the decode rule
    for cfg, kernel in [
        (None, "moe_gemm_kernel"),
        (TritonConfig(**TILE), "moe_gemm_kernel"),
        (TritonConfig(**TILE, persistent_tma=True), "moe_gemm_tma_kernel"),
    ]:
        with count_compilations(dry_run=True) as counter:
            fused_moe(**inp.kwargs(), config=cfg)
        gemms = [n for n in counter.launches if n.startswith("moe_gemm")]
        assert gemms == [kernel, kernel], (cfg, counter.launches)


def test_the_heuristic_leaves_it_off_and_a_table_turns_it_on_only_where_measured_faster():
    """A shipped table entry runs the persistent kernel only with the committed measurement of that
    token count beside it (grouped µs, persistent µs), and only where the persistent one was faster."""
    tables = sorted(CONFIG_DIR.glob("*.json"))
    assert tables
    heuristic = [c for q in (None, "fp8_tensor", "fp8_channel", "fp8_block") for _, c in default_tiles(q)]
    assert not any(c.persistent_tma or c.tma_flatten for c in heuristic)
    on = 0
    for path in tables:
        measured = json.loads(path.read_text()).get("persistent_tma_measured", {})
        for T, c in load_table(str(path)).items():
            assert not c.tma_flatten, path.name
            if c.persistent_tma:
                grouped_us, persistent_us = measured[str(T)]
                assert persistent_us < grouped_us, (path.name, T)
                on += 1
    assert on  # the measurement found cells where it pays (Mixtral bf16 prefill)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(persistent_tma=1), TypeError, r"^persistent_tma: expected True or False, got 1"),
        (dict(tma_flatten="yes"), TypeError, r"^tma_flatten: expected True or False"),
        (dict(tma_flatten=True), ValueError, r"^tma_flatten=True: .* needs persistent_tma=True"),
        (dict(persistent_tma=True, swap_ab=True), ValueError, r"^persistent_tma=True: .* non-swap-AB path"),
        (dict(persistent_tma=True, BLOCK_N=512), ValueError, r"^persistent_tma=True: .* BLOCK_N=512"),
        (dict(persistent_tma=True, BLOCK_K=512), ValueError, r"^persistent_tma=True: .* BLOCK_K=512"),
    ],
)
def test_config_fields_are_checked_on_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        TritonConfig(**{**TILE, **kwargs})


def test_flatten_counts_its_extra_shared_memory():
    """Compiled for sm_90a, flattening the fp8 GEMM1 at 128×128×128 with 4 stages needs 262 176
    bytes of shared memory, beyond the SM's 232 448: the config refuses it; with 3 stages it fits."""
    cfg = TritonConfig(128, 128, 128, 8, 8, 4, False, persistent_tma=True)
    assert cfg.fits("fp8_tensor") and not cfg.__class__(**{**cfg.as_dict(), "tma_flatten": True}).fits("fp8_tensor")
    with pytest.raises(ValueError, match="^config: .* exceed the 232448-byte shared memory"):
        TritonConfig(128, 128, 128, 8, 8, 4, False, persistent_tma=True, tma_flatten=True).check("fp8_tensor")
    assert TritonConfig(128, 128, 128, 8, 8, 3, False, persistent_tma=True, tma_flatten=True).fits("fp8_tensor")


def test_a_tile_that_resolves_to_swap_ab_is_refused_before_any_launch():
    inp = make_inputs(SMALL, 11, None, seed=1)
    cfg = TritonConfig(16, 64, 64, persistent_tma=True)  # BLOCK_M < 64 <= BLOCK_N: the swap-AB rule
    with count_compilations(dry_run=True) as counter:
        with pytest.raises(ValueError, match=r"^config: persistent_tma is the non-swap-AB path, but BLOCK_M=16"):
            fused_moe(**inp.kwargs(), config=cfg)
        with pytest.raises(ValueError, match=r"^persistent_tma=True: "):
            fused_moe(**inp.kwargs(), config=TritonConfig(**TILE, persistent_tma=True), swap_ab=True)
    assert counter.launches == []
    assert fused_moe(**inp.kwargs(), config=cfg, swap_ab=False).shape == inp.x.shape


@pytest.mark.parametrize("K, I, name", [(36, 32, "w1"), (32, 20, "w2")])
def test_rows_tma_cannot_read_are_named(K, I, name):  # noqa: E741
    """TMA needs rows of a multiple of 16 bytes: K = 36 or I = 20 bf16 values (72, 40 bytes)."""
    inp = make_inputs(MoEShape("odd", 4, 2, K, I, "test"), 3, None, seed=2)
    with count_compilations(dry_run=True) as counter:
        with pytest.raises(ValueError, match=rf"^{name}: persistent_tma reads the weights through TMA.* bytes"):
            fused_moe(**inp.kwargs(), config=TritonConfig(**TILE, persistent_tma=True))
    assert counter.launches == []  # both weights are checked before the alignment's first launch
    assert fused_moe(**inp.kwargs(), config=TritonConfig(**TILE)).shape == inp.x.shape  # the grouped kernel runs


SM90 = r"""
import json, sys
from triton_moe.sm90 import compile_sm90
from triton_moe.kernels_tma import moe_gemm_tma_kernel as k

fuse_silu, quant, block_k = json.loads(sys.argv[1])
dt = "*fp8e4nv" if quant else "*bf16"
ptrs = {"a_ptr": dt, "w_ptr": dt, "out_ptr": ("*fp32" if quant else "*bf16") if fuse_silu else "*bf16",
        "sorted_ids_ptr": "*i32", "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32",
        "topk_ids_ptr": "*i32", "error_ptr": "*i32"}
sig = {n: ptrs.get(n, "*fp32") for n in k.arg_names if n.endswith("_ptr")}
sig.update(num_pairs="i32", N="i32", K="i32", E="i32")
cex = dict(A_ROW_DIV=2 if fuse_silu else 1, FUSE_SILU=fuse_silu, MUL_ROUTED_WEIGHT=not fuse_silu, QUANT=quant,
           FP8_IMPRECISE_ACC=0, INTERPRETER=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8,
           FLATTEN=False)
r = compile_sm90(k, sig, cex, num_warps=8, num_stages=3, divisible_by_16=[n for n in sig if n != "num_pairs"])
t = r.pop("ttgir")
r.update(tma_loads=t.count("ttng.async_tma_copy_global_to_local"),
         async_copies=t.count("ttg.async_copy_global_to_local"), wgmma=t.count("ttng.warp_group_dot "))
print(json.dumps(r))
"""


@pytest.mark.parametrize("fuse_silu, quant, block_k", [(True, 0, 64), (False, 1, 128)], ids=["bf16_gemm1", "fp8_gemm2"])
def test_sm90_binary_reads_weights_by_tma_and_rows_by_async_copy(fuse_silu, quant, block_k):
    """Compiled for sm_90a on the CPU: the weight tiles (gate and up in GEMM1) arrive by TMA, the
    gathered A rows by cp.async, both feed WGMMA; the prefill tile does not spill."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", SM90, json.dumps([fuse_silu, quant, block_k])], capture_output=True, text=True, env=env
    )
    if run.returncode and "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    weights = 2 if fuse_silu else 1
    assert r["tma_loads"] >= weights and r["async_copies"] > 0 and r["wgmma"] == weights, r
    assert r["spill_bytes"] == 0, r


def test_bench_refuses_a_non_empty_output_directory(tmp_path, capsys):
    from triton_moe.lab import bench_tma

    (tmp_path / "old.md").write_text("an earlier run\n")
    with pytest.raises(SystemExit) as e:
        bench_tma.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "--out: " in (err := capsys.readouterr().err) and "is not empty" in err
    assert [p.name for p in tmp_path.iterdir()] == ["old.md"]


def test_bench_report_renders(tmp_path):
    from triton_moe.lab import bench_tma

    row = dict(
        shape="mixtral-8x7b",
        dtype="bf16",
        T=4096,
        tile="128x128x64/g8w8s3",
        grouped_us=5357.0,
        persistent_us=5000.0,
        speedup=1.0714,
        grouped_tflops=478.0,
        persistent_tflops=512.0,
        rel_l2=0.0,
        bit_identical=True,
    )
    results = dict(
        date="d",
        device="dev",
        commit="c",
        command="cmd",
        flatten=False,
        cut=["qwen3-30b-a3b bf16 T=1024"],
        rows=[
            row,
            dict(
                shape="deepseek-v3:tp8",
                dtype="bf16",
                T=1024,
                tile="32x64x64/g1w4s4",
                skipped="the table's tile is swap-AB",
            ),
        ],
        oracle=[dict(dtype="bf16", grouped_rel_l2=3e-3, persistent_rel_l2=3e-3, bit_identical=True)],
    )
    bench_tma._write(tmp_path, results)
    md = (tmp_path / "tma_bench.md").read_text()
    assert "| mixtral-8x7b | bf16 | 4096 | 128x128x64/g8w8s3 | 5357.0 | 5000.0 | 1.071 | 478 | 512 |" in md
    assert "skipped: the table's tile is swap-AB" in md and "Not run (deadline): qwen3-30b-a3b bf16 T=1024" in md
    assert json.loads((tmp_path / "tma_bench.json").read_text())["rows"][0]["persistent_us"] == 5000.0


WS_PROBE = r"""
import triton, triton.language as tl
from triton_moe.sm90 import compile_sm90

@triton.jit
def mm(a_ptr, idx_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
       GATHER: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    npn = tl.cdiv(N, BN)
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BM) * npn, tl.num_programs(0), warp_specialize=True):
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        rows = tl.load(idx_ptr + t // npn * BM + tl.arange(0, BM))
        for k in range(0, tl.cdiv(K, BK)):
            if GATHER:  # A rows gathered by index, as the MoE GEMM reads them
                a = tl.load(a_ptr + rows[:, None] * K + k * BK + tl.arange(0, BK)[None, :])
            else:
                a = a_desc.load([t // npn * BM, k * BK])
            acc = tl.dot(a, b_desc.load([t % npn * BN, k * BK]).T, acc)
        c_desc.store([t // npn * BM, t % npn * BN], acc.to(tl.bfloat16))

sig = {"a_ptr": "*bf16", "idx_ptr": "*i32", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
for gather in (False, True):
    try:
        r = compile_sm90(mm, sig, dict(BM=128, BN=128, BK=64, GATHER=gather), num_warps=4, num_stages=3,
                         divisible_by_16=["M", "N", "K"])
        print("specialized" if "ttg.warp_specialize" in r["ttgir"] else "plain", flush=True)
    except RuntimeError:
        print("failed", flush=True)
"""


def test_triton_on_sm90_warp_specializes_only_all_tma_operands(tmp_path):
    """Why the persistent kernel offers no warp specialization (see triton_moe.kernels_tma): Triton
    3.6 compiles ``warp_specialize=True`` for sm_90a into warp-specialized partitions when both dot
    operands come through TMA, and fails when A is gathered with pointer loads. A Triton that
    handles the gather fails this test (and the kernel could then try it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    probe = tmp_path / "ws_probe.py"  # a @triton.jit function must live in a file
    probe.write_text(WS_PROBE)
    run = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env)
    if "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert run.stdout.split() == ["specialized", "failed"], (run.stdout, run.stderr[-2000:])

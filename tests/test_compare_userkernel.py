"""``python -m compare --backends file.py:fn``: your own kernel beside ours, on the CPU.

Kernels written to a temporary directory: a correct one passes, one with gate and up swapped is a
FAIL, one that raises, returns the wrong shape or dtype, or writes into its input is an error row
and the run goes on; vLLM's fused_experts signature is detected and converted; bad specs are one
line naming --backends and exit status 2 before any work.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compare import cli, userkernel
from compare.peers import Converted
from moe_spec.contract import make_fused_experts

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--shapes", "mixtral-8x7b", "--tokens", "4", "--quant", "bf16", "--no-jit", "--no-plots", "--no-progress"]

GOOD = """
import torch
import torch.nn.functional as F


def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
    if quant is not None:
        raise NotImplementedError("bf16 only")
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = x[t].float() @ w1[e].float().T
            a = F.silu(h[:I]) * h[I:]
            out[t] += topk_weights[t, j] * (a @ w2[e].float().T)
    return out.to(torch.bfloat16)
"""
VLLM_SIGNATURE = (
    "def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False,\n"
    "                  use_fp8_w8a8=False, per_channel_quant=False, w1_scale=None, w2_scale=None,\n"
    "                  block_shape=None):\n"
    "    x = hidden_states\n    if use_fp8_w8a8:"
)
KERNELS = {
    "good": GOOD,
    "swapped": GOOD.replace("F.silu(h[:I]) * h[I:]", "F.silu(h[I:]) * h[:I]"),  # the planted bug
    "raises": GOOD.replace("    I = w2.shape[2]\n", "    raise RuntimeError('kernel exploded')\n"),
    "writes": GOOD.replace("    I = w2.shape[2]\n", "    I = w2.shape[2]\n    x[0, 0] = 7.0\n"),
    "shape": GOOD.replace("return out.to(torch.bfloat16)", "return out[:, 1:].to(torch.bfloat16)"),
    "dtype": GOOD.replace("return out.to(torch.bfloat16)", "return out"),
    "vllm_sig": GOOD.replace(
        "def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, "
        "w2_scale=None):\n    if quant is not None:",
        VLLM_SIGNATURE,
    ),
}


@pytest.fixture
def kernels(tmp_path):
    """Each kernel as tmp/<name>.py; returns name -> the --backends spec."""
    specs = {}
    for name, source in KERNELS.items():
        (tmp_path / f"{name}.py").write_text(source)
        specs[name] = f"{tmp_path / name}.py:" + ("fused_experts" if name == "vllm_sig" else "fused_moe")
    return specs


def _rows(out: Path) -> dict:
    return {r["backend"]: r for r in json.loads((out / "results.json").read_text())["rows"]}


def test_command_line_runs_a_user_file_beside_triton_moe(kernels, tmp_path):
    """The README's command, as a subprocess: exit 0, the kernel's row passes, agrees with triton_moe,
    and what it does not expose (plan, alignment, config) reads '-'."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "compare", "--backends", f"triton_moe,{kernels['good']}", *QUICK, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    row = _rows(out)[kernels["good"]]
    assert row["status"] == "ok" and row["rel_l2"] < 1e-2 and row["deterministic"] and row["batch_invariant"]
    assert row["vs_ours_of"] == "triton_moe" and row["vs_ours_ok"] and 0 < row["vs_ours"] < 2e-2
    assert row["config"] == "-" and "prep_us" not in row
    assert row["converted"].startswith("none")
    assert kernels["good"] in proc.stdout  # its row is in the printed table
    report = (out / "report.md").read_text()
    assert "| converted |" in report and "vs ours" in report


def test_bad_kernels_become_rows_and_the_run_goes_on(kernels, tmp_path, capsys):
    """The writer runs first: its write is flagged and undone, so the correct kernel after it still
    passes on the original inputs. --strict fails on your kernel's FAIL and errors."""
    order = ["writes", "good", "swapped", "raises", "shape", "dtype", "vllm_sig"]
    out = tmp_path / "out"
    code = cli.main(["--backends", ",".join(kernels[k] for k in order), *QUICK, "--out", str(out), "--strict"])
    printed = capsys.readouterr().out
    assert code == 1
    rows = _rows(out)
    status = {k: rows[kernels[k]]["status"] for k in order}
    assert status["good"] == "ok" and status["vllm_sig"] == "ok"
    assert status["swapped"] == "FAIL" and "rel_l2" in rows[kernels["swapped"]]["check"]
    assert status["raises"] == "error: RuntimeError: kernel exploded"
    assert status["writes"].startswith("error: wrote into its input x ")
    assert status["shape"] == "error: WrongOutput: returned shape [4, 255], expected [T, K] = [4, 256]"
    assert status["dtype"] == "error: WrongOutput: returned dtype torch.float32, expected torch.bfloat16"
    assert rows[kernels["good"]]["rel_l2"] == rows[kernels["vllm_sig"]]["rel_l2"]  # same arithmetic, other spelling
    assert "vLLM" not in rows[kernels["good"]]["converted"] and "use_fp8_w8a8" in rows[kernels["vllm_sig"]]["converted"]
    for k in ("swapped", "raises", "writes", "shape", "dtype"):
        assert kernels[k] in printed.split("problem(s):")[1]
    assert kernels["good"] not in printed.split("problem(s):")[1]


def test_a_format_the_kernel_declines_is_not_implemented(kernels, tmp_path):
    """Both signatures decline FP8 through the T = 0 probe: 'not implemented', not an error."""
    out = tmp_path / "out"
    args = ["--backends", f"{kernels['good']},{kernels['vllm_sig']}", *QUICK, "--out", str(out)]
    args[args.index("bf16")] = "fp8_block"
    assert cli.main(args) == 0
    for spec in (kernels["good"], kernels["vllm_sig"]):
        assert _rows(out)[spec]["status"] == "not implemented: bf16 only"


def test_a_module_path_from_the_working_directory(tmp_path):
    (tmp_path / "mykernels.py").write_text(GOOD)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "compare", "--backends", "mykernels:fused_moe@ours", *QUICK, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert _rows(out)["mykernels:fused_moe@ours"]["status"] == "ok"


def _refused(args, capsys) -> str:
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured
    return lines[0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{dir}/good.py", "no ':function' here"),
        ("{dir}/nothere.py:fused_moe", "no such file"),
        ("no_such_module_xyz:fused_moe", "importing module 'no_such_module_xyz' failed: ModuleNotFoundError"),
        ("{dir}/good.py:fused_mo", "has no attribute 'fused_mo'; its functions: fused_moe"),
        ("{dir}/constant.py:WIDTH", "is not callable (int)"),
        ("{dir}/good.py:fused_moe@sglang", "unknown signature suffix '@sglang'"),
        ("{dir}/ambiguous.py:kernel", "cannot tell the signature of kernel"),
        ("{dir}/broken.py:fused_moe", "importing file"),
    ],
)
def test_a_bad_spec_is_one_line_naming_backends_before_any_work(spec, message, kernels, tmp_path, capsys):
    (tmp_path / "constant.py").write_text("WIDTH = 3\n")
    (tmp_path / "ambiguous.py").write_text("def kernel(a, b, c, d, e):\n    return a\n")
    (tmp_path / "broken.py").write_text("def fused_moe(x:\n")
    out = tmp_path / "out"
    line = _refused(["--backends", spec.format(dir=tmp_path), *QUICK, "--out", str(out)], capsys)
    assert line.startswith("python -m compare: error: --backends: ") and message in line
    assert not out.exists()


def test_an_explicit_suffix_settles_a_signature_it_cannot_read(tmp_path):
    header = "def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):"
    wrapper = "def kernel(*args, **kwargs):\n    return fused_moe(*args, **kwargs)\n\n\n"
    (tmp_path / "ambiguous.py").write_text(GOOD.replace(header, wrapper + header))
    with pytest.raises(userkernel.SpecError, match="append @ours"):
        userkernel.resolve(f"{tmp_path}/ambiguous.py:kernel")
    assert userkernel.resolve(f"{tmp_path}/ambiguous.py:kernel@ours")[2] == "ours"


def test_signatures_are_read_from_parameter_names():
    def ours(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None): ...
    def flags(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, use_fp8_w8a8=False): ...
    def config(a, w1, w2, topk_weights, topk_ids, quant_config=None): ...
    def both(x, w1, w2, topk_weights, topk_ids, quant=None, use_fp8_w8a8=False): ...
    def neither(a, b, c, d, e): ...

    assert userkernel.detect_signature(ours) == "ours"
    assert userkernel.detect_signature(flags) == "vllm" and userkernel.detect_signature(config) == "vllm"
    assert userkernel.detect_signature(both) is None and userkernel.detect_signature(neither) is None
    # moe_spec.contract's fused_experts wraps fused_moe with functools.wraps: its own parameters count
    assert userkernel.detect_signature(make_fused_experts(ours)) == "vllm"


def test_backends_items_are_names_or_specs():
    args = cli._parse(["--backends", "Triton_MoE,VLLM,dir/My.py:Fn,pkg.mod:fn@VLLM"])
    assert args.backends == ("triton_moe", "vllm", "dir/My.py:Fn", "pkg.mod:fn@VLLM")


def test_writes_into_inputs_are_found_and_undone():
    """userkernel.measure on a kernel that scales w2 in place: the row names w2 and the case's w2 is back."""
    from compare.cases import Case
    from moe_spec.problem import get_shape

    def sneaky(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        w2.mul_(2)
        return torch.zeros(x.shape, dtype=torch.bfloat16)

    shape = get_shape("qwen3-30b-a3b")
    small = type(shape)(shape.name, 4, 2, 64, 32, shape.source)
    case = Case(small, small, None, 3, True).build(None, 0, "cpu")
    w2 = case.inputs.w2.clone()
    backend = userkernel.ExternalBackend("k.py:sneaky", fused_moe=userkernel._checked(sneaky))
    fields, out = userkernel.measure(backend, case)
    assert fields["status"] == "error: wrote into its input w2 (put back for the backends after it)"
    assert torch.equal(case.inputs.w2, w2)


def test_conversions_are_made_once_per_tensor_and_go_with_it():
    cache, made = Converted(), []
    w = torch.ones(4, 4)

    def double(t):
        made.append(1)
        return t * 2

    first = cache.get("double", (w,), lambda w=w: double(w))
    assert cache.get("double", (w,), lambda w=w: double(w)) is first and len(made) == 1
    w.add_(1)  # an in-place write: converted again
    assert torch.equal(cache.get("double", (w,), lambda w=w: double(w)), torch.full((4, 4), 4.0)) and len(made) == 2
    view = cache.get("view", (w,), w.t)  # shares w's storage: not kept, it would keep w alive
    assert view.data_ptr() == w.data_ptr() and len(cache) == 1
    del w, first, view
    assert len(cache) == 0


def test_the_router_table_routes_only_to_backends_it_can_load():
    from compare.router import build_table

    case = dict(shape="s", quant="bf16", T=8, E=4, K=64, I=32, top_k=2, status="ok")
    rows = [
        dict(case, backend="triton_moe", us=10.0),
        dict(case, backend="k.py:fn", us=5.0),
        dict(case, backend="vllm", us=4.0),
    ]
    assert [e["backend"] for e in build_table(rows, {})["entries"]] == ["triton_moe"]


@pytest.mark.gpu
def test_on_the_gpu_your_kernel_gets_the_timing_columns(tmp_path):
    """triton_moe given as your kernel in vLLM's spelling: triton_moe's bits, timed like every row,
    and what it does not expose reads '-'."""
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "--backends",
                "triton_moe,triton_moe:fused_experts",
                "--shapes",
                "qwen3-30b-a3b",
                "--tokens",
                "8",
                "--quant",
                "bf16,fp8_block",
                "--quick",
                "--no-jit",
                "--no-plots",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads((out / "results.json").read_text())["rows"]
    for r in (r for r in rows if r["backend"] == "triton_moe:fused_experts"):
        assert r["status"] == "ok" and r["vs_ours"] == 0.0 and r["vs_ours_of"] == "triton_moe"
        assert r["us"] > 0 and r["eager_us"] > 0 and r["pct_floor"] > 0 and r["timing"] == "graph"
        assert r["config"] == "-" and "prep_us" not in r and "use_fp8_w8a8" in r["converted"]

"""``python -m compare`` end to end on the CPU, and its one-line errors for bad input."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compare import metrics

from compare import cli

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("cute_moe", "triton_moe", "torch_grouped", "torch_loop")


def _run(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "compare", *args], capture_output=True, text=True, env=env,
                          cwd=cwd or ROOT, timeout=600)


@pytest.mark.parametrize("args, message", [
    (["--shapes", "mixtral-8x7b,gpt5"], "unknown shape 'gpt5'"),
    (["--shapes", "deepseek-v3:tp3"], "tp"),
    (["--tokens", "1,x,8"], "bad token count 'x'"),
    (["--tokens", "0"], "bad token count '0'"),
    (["--tokens", "1,,8"], "empty item"),
    (["--backends", "cute_moe,vllm"], "unknown backend 'vllm'"),
    (["--quant", "int4"], "unknown quant format 'int4'"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--merge", "/nonexistent/results.json"], "cannot read results file"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_bad_input_from_the_shell_has_no_traceback():
    r = _run("--shapes", "gpt5", "--tokens", "1")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("python -m compare: error: unknown shape 'gpt5'; known: mixtral-8x7b, qwen3-30b-a3b, "
                                "qwen3-235b-a22b, deepseek-v3 (optionally ':tpN')")


def test_help():
    r = _run("--help")
    assert r.returncode == 0 and "--shapes" in r.stdout and "--write-router" in r.stdout


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare-out")
    router = out / "router.json"
    r = _run("--shapes", "mixtral-8x7b", "--tokens", "1,8", "--quant", "bf16,fp8_tensor", "--out", str(out),
             "--no-progress", "--write-router", str(router))
    return r, out, router


def test_cpu_run_exits_0_and_writes_the_report(cpu_run):
    r, out, router = cpu_run
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("results.json", "results.csv", "report.md", "numerics.png"):
        assert (out / name).stat().st_size > 0, name
    assert "NOT written" in r.stdout and not router.exists()  # nothing timed on a CPU: the table is kept


def test_every_backend_is_a_row_or_says_why_not(cpu_run):
    r, out, _ = cpu_run
    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["mode"] == "reduced (CPU interpreter)"
    rows = result["rows"]
    cases = {(row["quant"], row["T"]) for row in rows}
    assert cases == {("bf16", 1), ("bf16", 8), ("fp8_tensor", 1), ("fp8_tensor", 8)}
    for case in cases:
        got = {row["backend"]: row for row in rows if (row["quant"], row["T"]) == case}
        assert set(got) == set(BACKENDS)
        for row in got.values():
            assert row["status"] == "ok" or row["status"].startswith("not available: "), row
            assert row["timing"] == "skipped: no GPU"
    by = {(row["backend"], row["quant"], row["T"]): row for row in rows}
    assert by[("cute_moe", "bf16", 1)]["status"].startswith("not available: needs a Hopper GPU")
    for quant in ("bf16", "fp8_tensor"):  # the two that run on a CPU pass the policy and rerun bit-exactly
        for backend in ("triton_moe", "torch_loop"):
            row = by[(backend, quant, 8)]
            assert row["status"] == "ok" and row["deterministic"] is True
            assert row["rel_l2"] <= metrics.tolerance_for(None if quant == "bf16" else quant).rel_l2
    assert by[("torch_loop", "fp8_tensor", 8)]["quant_error"] > 0.01  # FP8 costs something vs bf16
    # every backend appears in the printed table too
    for backend in BACKENDS:
        assert backend in r.stdout
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)


def test_cpu_run_shows_cute_ptx_and_jit(cpu_run):
    _, out, _ = cpu_run
    result = json.loads((out / "results.json").read_text())
    ptx = result["cute_ptx"]
    assert ptx["status"] == "ok" and ptx["configs"]
    ops = [op for c in ptx["configs"] for op in c.get("wgmma", {})]
    assert any("m64n8k16" in op for op in ops)  # decode: swap-AB with an 8-token tile
    triton_jit = [j for j in result["jit"] if j["backend"] == "triton_moe"]
    assert triton_jit and all(j["compilations_after_warmup"] == 0 for j in triton_jit)
    demo = result["jit_demo"]["variants"]
    assert demo['do_not_specialize=["T"]']["compilations"] == 1
    assert demo["specialized (default @triton.jit)"]["compilations"] == 3
    report = (out / "report.md").read_text()
    for heading in ("## Results", "## Tolerance policy", "## Quantization error", "## JIT", "## CuTe configs",
                    "## Router"):
        assert heading in report


def test_merge_rerenders_without_running(cpu_run, tmp_path):
    _, out, _ = cpu_run
    r = _run("--merge", str(out / "results.json"), str(out / "results.json"), "--out", str(tmp_path), "--no-plots")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list(tmp_path.glob("*.png")) and "![" not in (tmp_path / "report.md").read_text()
    merged = json.loads((tmp_path / "results.json").read_text())
    single = json.loads((out / "results.json").read_text())
    assert len(merged["rows"]) == 2 * len(single["rows"])


def test_time_budget_turns_the_rest_into_explicit_rows(tmp_path, capsys):
    code = cli.main(["--shapes", "mixtral-8x7b,qwen3-30b-a3b", "--tokens", "1", "--quant", "bf16", "--out",
                     str(tmp_path), "--no-progress", "--no-jit", "--no-ptx", "--time-budget", "1e-9",
                     "--commit", "abc123"])
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["commit"] == "abc123"
    assert len(result["rows"]) == 2 * len(BACKENDS)
    assert all(r["status"].startswith("skipped: time budget") for r in result["rows"])

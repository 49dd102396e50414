"""``python -m compare`` end to end on the CPU: its banner and tables, its one-line refusals of bad input
(each found by fuzzing the CLI), its output directory, Ctrl-C."""

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compare import cli, metrics
from compare.cases import CPU_MAX_TOKENS

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("cute_moe", "triton_moe", "torch_grouped", "torch_loop")


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")


def _run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "compare", *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd or ROOT,
        timeout=600,
    )


def _refused(args, capsys) -> str:
    """cli.main(args) must exit 2 with one line on stderr, nothing on stdout, and quickly; returns the line."""
    start = time.monotonic()
    assert cli.main(args) == 2
    assert time.monotonic() - start < 10
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shapes", "mixtral-8x7b,gpt5"], "--shapes: unknown shape 'gpt5'"),
        (["--shapes", "deepseek-v3:tp3"], "tp"),
        (["--tokens", "1,x,8"], "--tokens: bad token count 'x'"),
        (["--tokens", "0"], "bad token count '0'"),
        (["--tokens", "1,,8"], "--tokens: empty item"),
        (["--backends", "cute_moe,vlm"], "--backends: unknown backend 'vlm'"),
        (["--quant", "int4"], "--quant: unknown quant format 'int4'"),
        (["--frobnicate"], "unrecognized arguments"),
        (["--merge", "/nonexistent/results.json"], "cannot read results file"),
        # found by fuzzing:
        (["--tokens", "100000", "--shapes", "mixtral-8x7b", "--backends", "triton_moe"], f"T = {CPU_MAX_TOKENS}"),
        (["--time-budget", "-5", "--strict"], "--time-budget: expected a finite number of seconds > 0"),
        (["--time-budget", "0"], "--time-budget"),
        (["--time-budget", "nan"], "--time-budget"),
        (["--time-budget", "inf"], "--time-budget"),
        (["--seed", str(10**23)], "--seed: expected an integer in [0, 2**32)"),
        (["--seed", "-1"], "--seed"),
        (["--seed", "1e23"], "--seed"),
        (["--outlier-expert", "nan"], "--outlier-expert: expected a finite factor"),
        (["--outlier-expert", "inf"], "--outlier-expert"),
        (["--outlier-expert", "-3"], "--outlier-expert"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path):
    line = _refused(args + ["--out", str(tmp_path / "out")], capsys)
    assert message in line and line.startswith("python -m compare: error: ")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())  # refused before any work


def test_lists_are_normalized():
    """Repeats after normalization are one item: 08 is 8, names are case-insensitive, :tp1 is the shape."""
    args = cli._parse(
        [
            "--tokens",
            "8,08,008,1",
            "--shapes",
            "qwen3-30b-a3b,QWEN3-30B-A3B,qwen3-30b-a3b:tp1",
            "--quant",
            "BF16,bf16",
            "--backends",
            "Triton_MoE,triton_moe",
        ]
    )
    assert args.tokens == (8, 1)
    assert args.shapes == ("qwen3-30b-a3b",)
    assert args.quant == (None,) and args.backends == ("triton_moe",)
    assert cli._parse(["--shapes", "deepseek-v3:TP8,deepseek-v3:tp8"]).shapes == ("deepseek-v3:tp8",)


@pytest.mark.parametrize(
    "make, option, message",
    [
        (lambda t: ["--out", str(t / "a_file")], "--out", "is not a directory"),
        (lambda t: ["--out", str(t / "a_file" / "sub")], "--out", "cannot create"),
        (lambda t: ["--write-router", str(t)], "--write-router", "is a directory"),
        (lambda t: ["--write-router", str(t / "a_file" / "router.json")], "--write-router", "cannot create"),
        (
            lambda t: ["--out", str(t / "o"), "--write-router", str(t / "o" / "results.json")],
            "--write-router",
            "one of the report's own files",
        ),
    ],
)
def test_unwritable_outputs_are_refused_before_any_work(make, option, message, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    args = make(tmp_path)
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    line = _refused(args + ["--shapes", "mixtral-8x7b", "--tokens", "1"], capsys)
    assert line.startswith(f"python -m compare: error: {option}: ") and message in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing staged, nothing created


def test_bad_input_from_the_shell_has_no_traceback():
    r = _run("--shapes", "gpt5", "--tokens", "1")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        "python -m compare: error: --shapes: unknown shape 'gpt5'; known: mixtral-8x7b, "
        "qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, mixtral-8x22b, olmoe-1b-7b, qwen1.5-moe-a2.7b "
        "(optionally ':tpN')"
    )


def test_help():
    r = _run("--help")
    assert r.returncode == 0 and "--shapes" in r.stdout and "--write-router" in r.stdout
    assert "repeats" in r.stdout and f"T ≤ {CPU_MAX_TOKENS}" in r.stdout  # the normalization and the CPU limit


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare-out")
    (out / "roofline.png").write_bytes(b"an earlier GPU run's plot")  # must not survive next to a CPU report
    (out / "keep.txt").write_text("not the report's")
    router = out / "router.json"
    r = _run(
        "--shapes",
        "mixtral-8x7b",
        "--tokens",
        "1,8",
        "--quant",
        "bf16,fp8_tensor",
        "--out",
        str(out),
        "--no-progress",
        "--write-router",
        str(router),
    )
    return r, out, router


def test_cpu_run_exits_0_and_writes_the_report(cpu_run):
    r, out, router = cpu_run
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("results.json", "results.csv", "report.md", "numerics.png"):
        assert (out / name).stat().st_size > 0, name
    assert "NOT written" in r.stdout and not router.exists()  # nothing timed on a CPU: the table is kept
    # the reused directory holds this run's report only, the user's own file untouched, no staging left
    assert not (out / "roofline.png").exists() and (out / "keep.txt").read_text() == "not the report's"
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]


def test_banner_says_what_the_cpu_run_did_not_do(cpu_run):
    r, out, _ = cpu_run
    lines = r.stdout.splitlines()
    assert lines[0].startswith("What this run did — CPU")
    head = " ".join(" ".join(lines[: lines.index("")]).split())  # the banner, its wrapped lines joined
    assert "shapes REDUCED for the Triton interpreter" in head and "mixtral-8x7b → E=8, top_k=2, K=256, I=128" in head
    assert "cute_moe was NOT executed" in head
    assert "CuTe-vs-Triton (cute_moe vs triton_moe) equivalence NOT checked: cute_moe did not run" in head
    assert "timing SKIPPED: no GPU" in head
    assert f'{out / "report.md"} (section "CuTe configs and their PTX")' in head
    report = (out / "report.md").read_text()
    assert "timing SKIPPED: no GPU" in report and "## CuTe configs and their PTX" in report


def test_tables_have_no_empty_columns_whole_statuses_and_a_legend(cpu_run):
    r, out, _ = cpu_run
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("  T  "))
    for empty in ("best", "µs", "speedup", "%floor", "xdiff"):  # nothing timed, CuTe not run: no such column
        assert empty not in header
    for column in ("rel L2 ≤", "status"):
        assert column in header and any(line.startswith(f"{column} ") for line in lines), f"{column} not explained"
    result = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    notes = " ".join(r.stdout.split())  # the notes under the terminal summary, wrapped lines joined
    for row in result["rows"]:
        assert row["status"] in report  # whole, in markdown
        if row["status"] not in ("ok", "FAIL"):
            assert f"{row['backend']}" in notes and row["status"] in notes  # whole, in a note
    assert "**batch-invariant**:" in report and "**bitwise rerun**:" in report
    assert "| µs (median)" not in report and "CuTe vs Triton |" not in report.split("## Tolerance policy")[0]


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
            assert row["status"] == "ok" or row["status"].startswith(("not available: ", "not implemented: ")), row
            assert row["timing"] == "skipped: no GPU"
    by = {(row["backend"], row["quant"], row["T"]): row for row in rows}
    assert by[("cute_moe", "bf16", 1)]["status"].startswith("not available: needs a Hopper GPU")
    # cute_moe builds FP8 too: on a CPU it is the device it lacks, as for bf16
    assert by[("cute_moe", "fp8_tensor", 1)]["status"].startswith("not available: needs a Hopper GPU")
    for quant in ("bf16", "fp8_tensor"):  # the two that run on a CPU pass the policy and rerun bit-exactly
        for backend in ("triton_moe", "torch_loop"):
            row = by[(backend, quant, 8)]
            assert row["status"] == "ok" and row["deterministic"] is True
            assert row["rel_l2"] <= metrics.tolerance_for(None if quant == "bf16" else quant).rel_l2
            assert row["batch_invariant"] in (True, False) and by[(backend, quant, 1)]["batch_invariant"] is None
    assert by[("torch_loop", "fp8_tensor", 8)]["batch_invariant"] is False  # a per-tensor scale is the batch's amax
    assert by[("torch_loop", "fp8_tensor", 8)]["quant_error"] > 0.01  # FP8 costs something vs bf16
    for backend in BACKENDS:  # every backend appears in the printed table too
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
    assert any("m64n8k32.f32.e4m3.e4m3" in op for op in ops)  # the FP8 plan of the same decode
    assert ptx["refused"] == {}
    triton_jit = [j for j in result["jit"] if j["backend"] == "triton_moe"]
    assert triton_jit and all(j["compilations_after_warmup"] == 0 for j in triton_jit)
    demo = result["jit_demo"]["variants"]
    assert demo['do_not_specialize=["T"]']["compilations"] == 1
    assert demo["specialized (default @triton.jit)"]["compilations"] == 3
    report = (out / "report.md").read_text()
    for heading in (
        "## Results",
        "## Tolerance policy",
        "## Quantization error",
        "## JIT",
        "## CuTe configs",
        "## Router",
    ):
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
    code = cli.main(
        [
            "--shapes",
            "mixtral-8x7b,qwen3-30b-a3b",
            "--tokens",
            "1",
            "--quant",
            "bf16",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--no-jit",
            "--no-ptx",
            "--time-budget",
            "1e-9",
            "--commit",
            "abc123",
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["commit"] == "abc123"
    assert len(result["rows"]) == 2 * len(BACKENDS)
    assert all(r["status"].startswith("skipped: time budget") for r in result["rows"])
    assert "time budget (1e-09 s) spent: 2 of 2 cases stopped or skipped" in capsys.readouterr().out


def test_time_budget_stops_a_case_that_overruns_it(tmp_path, capsys):
    """One interpreted FP8 call at T = 200 takes longer than the whole budget: the case is stopped inside."""
    from compare.backends import load_backend

    load_backend("triton_moe")  # its import is not what this test measures
    budget = 3.0
    start = time.monotonic()
    code = cli.main(
        [
            "--shapes",
            "mixtral-8x7b",
            "--tokens",
            "200",
            "--quant",
            "fp8_tensor",
            "--backends",
            "torch_loop,triton_moe",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--no-jit",
            "--no-ptx",
            "--time-budget",
            str(budget),
            "--strict",
        ]
    )
    took = time.monotonic() - start
    assert code == 1  # --strict: a stopped case is a problem
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    stopped = [r for r in rows if r["status"].startswith("stopped: time budget (3 s) spent")]
    assert len(stopped) == 1 and all(
        r in stopped or r["status"].startswith(("ok", "skipped: time budget")) for r in rows
    )
    assert took < budget + 15, took  # bounded: the case did not run to its end (one call alone takes longer)
    assert "stopped" in capsys.readouterr().out


def test_ctrl_c_is_one_line_exit_130_and_leaves_the_directory_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("the previous report")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "compare",
            "--shapes",
            "mixtral-8x7b",
            "--tokens",
            ",".join(str(t) for t in range(200, 216)),  # many cases: still running when Ctrl-C comes
            "--quant",
            "fp8_tensor",
            "--backends",
            "triton_moe",
            "--no-jit",
            "--no-ptx",
            "--no-progress",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell without job control starts background jobs with SIGINT ignored, and a child
        # inherits that (Python then installs no KeyboardInterrupt handler): CI may run us so
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not [p for p in tmp_path.iterdir() if ".partial-" in p.name]:  # the run has started its work
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip().splitlines() == [
        "python -m compare: interrupted (Ctrl-C); nothing written, the output directory is as it was"
    ]
    assert stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory left
    assert [p.name for p in out.iterdir()] == ["report.md"] and (out / "report.md").read_text() == "the previous report"


# --- what a newcomer reads first -------------------------------------------

WIDTH = 120
H200_RECORD = ROOT / "notes" / "results" / "compare_h200_2026-12-03_fd84fba.json"


def _too_wide(text: str) -> list:
    return [line for line in text.splitlines() if len(line) > WIDTH]


def test_terminal_output_fits_120_columns(cpu_run, tmp_path):
    """The CPU main job, a GPU record re-rendered (--merge) and --help: no line over 120 characters; the
    terminal shows a summary per shape and format, the full table is in report.md."""
    r, out, _ = cpu_run
    assert not _too_wide(r.stdout), _too_wide(r.stdout)
    assert "mixtral-8x7b · bf16 — reduced (CPU interpreter): E=8, K=256, I=128, top_k=2" in r.stdout
    merged = _run("--merge", str(H200_RECORD), "--out", str(tmp_path / "gpu"), "--no-plots")
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert not _too_wide(merged.stdout), _too_wide(merged.stdout)
    lines = merged.stdout.splitlines()
    group = lines[lines.index("qwen3-30b-a3b · bf16 (E=128, K=2048, I=768, top_k=8)") :]
    assert group[1].split()[:3] == ["T", "best", "µs"]
    rows = json.loads(H200_RECORD.read_text())["rows"]
    for line in group[2:8]:  # T = 1 … 4096: the fastest row that passed, and its µs
        T = int(line.split()[0])
        best = min(
            (
                row
                for row in rows
                if (row["shape"], row["quant"], row["T"], row["status"]) == ("qwen3-30b-a3b", "bf16", T, "ok")
            ),
            key=lambda row: row["us"],
        )
        assert line.split()[1:3] == [best["backend"], f"{best['us']:.1f}"], line
    assert "| config |" in (tmp_path / "gpu" / "report.md").read_text()  # every column is in the report
    helped = _run("--help")
    assert helped.returncode == 0 and not _too_wide(helped.stdout), _too_wide(helped.stdout)


def test_cpu_report_says_what_the_run_did_not_time(cpu_run):
    """Nothing is timed on a CPU: the report's results say so instead of describing CUDA-graph timing, and
    what the README quotes of the CPU run is what the run prints."""
    r, out, _ = cpu_run
    results = (out / "report.md").read_text().split("## Results")[1].split("## Tolerance policy")[0]
    assert "CUDA-graph" not in results and "Nothing was timed in this run (no GPU)" in results
    with open(out / "results.csv") as f:
        assert {row["timing"] for row in csv.DictReader(f)} == {"skipped: no GPU"}
    readme = (ROOT / "README.md").read_text()
    cpu = readme[readme.index("Without a GPU the main job still runs") :]
    cpu = cpu[: cpu.index("\n\n")]
    quoted = re.findall(r'"([^"]+)"|`([^`]+)`', cpu)
    printed = [q for pair in quoted for q in pair if " " in q and not q.startswith(".venv")]  # not a command
    assert printed, cpu  # the README quotes what the run prints: each quote is in the run's output
    for quote in printed:
        assert quote in r.stdout and quote in (out / "report.md").read_text(), quote


def test_reduced_shapes_say_they_share_their_sizes(cpu_run):
    r, out, _ = cpu_run
    rule = "every catalog shape becomes E=8, K=256, I=128 here, top_k = min(its own, 4)"
    assert rule in " ".join(r.stdout.split()) and rule in (out / "report.md").read_text()


def test_batch_invariance_no_is_explained(cpu_run):
    """fp8_tensor's NO (the activation scale is the batch's amax) is said to be expected, under the table."""
    _, out, _ = cpu_run
    report = (out / "report.md").read_text()
    result = json.loads((out / "results.json").read_text())
    no = [row for row in result["rows"] if row.get("batch_invariant") is False]
    assert no and {row["quant"] for row in no} == {"fp8_tensor"}
    note = next(line for line in report.splitlines() if line.startswith("batch-invariant NO in"))
    assert f"NO in {len(no)} row(s)" in note and "expected" in note and "the batch's amax" in note
    for row in no:
        assert f"{row['backend']} fp8_tensor" in note


def test_ptx_listing_names_configs_as_the_results_do(cpu_run):
    """One naming: the PTX section's configs are the plan's own describe() (as the results' config column)."""
    import cute_moe
    from moe_spec.problem import get_shape
    from moe_spec.validate import MoEDims

    _, out, _ = cpu_run
    ptx = json.loads((out / "results.json").read_text())["cute_ptx"]["configs"]
    section = (out / "report.md").read_text().split("## CuTe configs and their PTX")[1].split("\n## ")[0]
    for entry in ptx:
        shape, quant, T, gemm = entry["used_by"][0].split()
        s = get_shape(shape)
        plan = cute_moe.plan(
            MoEDims(T=int(T[2:]), E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k),
            None if quant == "bf16" else quant,
        )
        said = dict(part.split(" ", 1) for part in plan.describe().split(" | ")[:2])[gemm]  # G1, G2 (then xq:…)
        assert entry["describe"] == said and f"| {said} |" in section
    assert "stages" not in section.split("| config |")[1]  # no second naming ("normal M128×N128×K64, 4 stages")


def test_progress_is_a_line_per_step_without_a_terminal(tmp_path, capsys):
    """Not a terminal (a log, CI): no bar redrawn with carriage returns, one line per step on stderr."""
    code = cli.main(
        [
            "--shapes",
            "mixtral-8x7b",
            "--tokens",
            "1,2",
            "--quant",
            "bf16",
            "--backends",
            "torch_loop",
            "--out",
            str(tmp_path),
            "--no-jit",
            "--no-ptx",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out
    assert captured.err.splitlines() == [
        "[0/2 done] mixtral-8x7b bf16 T=1 torch_loop",
        "[1/2 done] mixtral-8x7b bf16 T=2 torch_loop",
    ]


def test_the_banners_ptx_hint_gives_the_whole_ptx(tmp_path, monkeypatch, capsys):
    """The CPU banner's "one config's whole PTX" command gives the whole PTX of that config (a file it names,
    or stdout), not a summary; the explorer's --ptx counts each instruction once; its help claims no compile
    time it does not keep."""
    import importlib

    from compare.tables import FULL_PTX_COMMAND
    from cute_moe.plan import choose_config
    from cute_moe.ptx import compile_ptx

    argv = shlex.split(FULL_PTX_COMMAND)
    assert argv[:2] == ["python", "-m"]
    explore = importlib.import_module(argv[2])
    monkeypatch.chdir(tmp_path)
    assert explore.main(argv[3:]) == 0
    printed = capsys.readouterr().out
    ptx = compile_ptx(choose_config(2, explore.DEFAULT_N_OUT, explore.DEFAULT_K))
    assert ".entry" in ptx and ".target sm_90a" in ptx
    written = [p.read_text() for p in tmp_path.iterdir()]
    assert written == [ptx] or ptx in printed  # the whole PTX, every line
    assert explore.main(["--tokens-per-expert", "2", "--ptx"]) == 0
    counted = capsys.readouterr().out.split("PTX (compiled")[1].splitlines()[1:]
    ops = [line.split("×")[1].strip() for line in counted if "×" in line]
    assert ops and all(sum(line.strip().endswith(op) for line in counted) == 1 for op in ops)  # once each
    with pytest.raises(SystemExit):
        explore.main(["--help"])
    assert "under a second" not in capsys.readouterr().out  # the compile alone takes seconds on a CPU

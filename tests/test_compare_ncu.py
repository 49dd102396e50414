"""compare.studies.ncu on the CPU: ncu's raw CSV read into per-launch rows, the per-call summary, the
child's profiler range around the calls, the commands, the report and its options. Nothing here runs
ncu; the GPU run is the study itself (notes/results cite it)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from pathlib import Path

import pytest

from compare.backends import Backend
from compare.studies import ncu
from compare.studies import profile as prof
from compare.timed import Clock
from moe_spec.problem import MoEShape
from moe_spec.studyout import UsageError

TINY = MoEShape("tiny", 4, 2, 64, 32, "a layer small enough for the CPU")

HEADER = [
    "ID",
    "Process ID",
    "Process Name",
    "Host Name",
    "Kernel Name",
    "Context",
    "Stream",
    "Block Size",
    "Grid Size",
    "Device",
    "CC",
    "gpu__time_duration.sum",
    "dram__bytes.sum.per_second",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__warps_active.avg.per_cycle_active",
    "smsp__warps_eligible.avg.per_cycle_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__grid_size",
    "launch__block_size",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_dynamic",
    "launch__shared_mem_per_block_static",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
]
UNITS = ["", "", "", "", "", "", "", "", "", "", ""] + [
    "ns",  # as ncu 2025 writes them with --print-units base (read from an H200 run's CSV)
    "byte/s",
    "%",
    "%",
    "%",
    "warp",
    "warp",
    "%",
    "",
    "",
    "register/thread",
    "byte/block",
    "byte/block",
    "inst",
    "inst",
    "inst",
]


def _launch(i, name, ns, moved, long_sb=5.0, barrier=1.0):
    return [str(i), "1", "python3", "h", name, "1", "7", "(160, 1, 1)", "(132, 1, 1)", "0", "9.0"] + [
        f"{ns:,}",  # ncu writes thousands separators
        f"{moved / (ns * 1e-9):,.2f}",  # bytes per second
        "61.2",
        "20.5",
        "12.0",
        "1.25",
        "0.10",
        "7.8",
        "132",
        "160",
        "168",
        "149,504",
        "0",
        str(long_sb),
        str(barrier),
        "0.5",
    ]


def _csv(rows, units=True, preamble=("==PROF== Disconnected from process 1",)):
    buf = io.StringIO()
    for line in preamble:
        buf.write(line + "\n")
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(HEADER)
    if units:
        w.writerow(UNITS)
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


TWO_CALLS = _csv(
    [
        _launch(0, "moe_gemm_kernel", 20_000, 30_000_000, 6.0),
        _launch(1, "moe_gemm_kernel", 10_000, 10_000_000, 2.0, 3.0),
        _launch(2, "combine", 2_000, 100_000),
        _launch(3, "moe_gemm_kernel", 22_000, 30_000_000, 4.0),
        _launch(4, "moe_gemm_kernel", 10_000, 10_000_000, 2.0, 3.0),
        _launch(5, "combine", 2_000, 100_000),
    ]
)


def test_the_raw_page_is_read_per_launch_in_order_past_ncus_own_lines():
    launches = ncu.parse_raw(TWO_CALLS)
    assert [x["name"] for x in launches] == ["moe_gemm_kernel", "moe_gemm_kernel", "combine"] * 2
    rec = ncu.launch_record(launches[0])
    assert rec["us"] == pytest.approx(20.0)  # ns converted
    assert rec["dram_mb"] == pytest.approx(30.0)
    assert rec["dram_tbps"] == pytest.approx(30_000_000 / 20e-6 / 1e12)
    assert rec["smem_kib"] == pytest.approx(146.0)
    assert rec["registers"] == 168 and rec["grid"] == 132 and rec["block"] == 160
    assert list(rec["stalls"]) == ["long_scoreboard", "barrier", "wait"]  # largest first


def test_without_a_units_row_the_values_are_taken_as_they_are():
    launches = ncu.parse_raw(_csv([_launch(0, "k", 1500, 10)], units=False))
    assert ncu.launch_record(launches[0])["us"] == 1500 * 1e6  # no unit: read as seconds (base)


@pytest.mark.parametrize(
    "value, unit, base, expected",
    [
        (31968, "ns", "second", 31.968e-6),
        (2.5, "usecond", "second", 2.5e-6),
        (3, "msecond", "second", 3e-3),
        (4, "Kbyte", "byte", 4000),
        (2.4e12, "byte/s", "byte/second", 2.4e12),
        (2.4, "Tbyte/second", "byte/second", 2.4e12),
        (7, "", "second", 7),  # no units row
        (2, "Kbyte/block", "byte", 2000),
        (7, "warp", "second", None),  # another family: not a duration
        (7, "cycle", "second", None),
    ],
)
def test_units_are_converted_to_their_base(value, unit, base, expected):
    assert ncu._in_base(value, unit, base) == pytest.approx(expected)


def test_text_without_the_header_is_refused():
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu.parse_raw("==PROF== no kernels were profiled\n")


def test_the_summary_is_per_launch_position_averaged_over_the_calls():
    s = ncu.summarize(ncu.parse_raw(TWO_CALLS), calls=2)
    assert s["grouped"] and s["launches_per_call"] == 3
    gemm1, gemm2, combine = s["kernels"]
    assert gemm1["us"] == pytest.approx(21.0) and gemm2["us"] == pytest.approx(10.0)  # the same name, two rows
    assert s["us_per_call"] == pytest.approx(33.0)
    assert gemm1["stalls"]["long_scoreboard"] == pytest.approx(5.0)
    assert gemm2["cycles_per_issue"] == pytest.approx(2.0 + 3.0 + 0.5)
    assert list(gemm2["stalls"])[0] == "barrier"


def test_launches_that_do_not_split_into_equal_calls_are_one_row_each():
    s = ncu.summarize(ncu.parse_raw(TWO_CALLS), calls=4)  # 6 launches are not 4 equal calls
    assert not s["grouped"] and len(s["kernels"]) == 6 and s["us_per_call"] is None
    assert s["launches_per_call"] == 1.5
    assert ncu.summarize([], calls=2)["kernels"] == []


def test_the_cell_key_round_trips_and_a_bad_one_is_named():
    cell = prof.Cell("cute_moe", "deepseek-v3:tp8", 1, "fp8_tensor")
    assert ncu.parse_cell_key(ncu.cell_key(cell)) == cell
    assert ncu.slug(cell) == "cute_moe_deepseek-v3-tp8_fp8_tensor_T1"
    with pytest.raises(UsageError, match="--target"):
        ncu.parse_cell_key("cute_moe/qwen3/bf16")


def test_ncu_runs_the_child_with_the_profiler_range_off_at_start_and_cold_caches():
    cmd = ncu.ncu_command("/usr/bin/ncu", prof.Cell("triton_moe", "qwen3-30b-a3b", 8, "bf16"), Path("r.ncu-rep"), 2, 0)
    joined = " ".join(cmd)
    assert "--profile-from-start off" in joined and "--cache-control all" in joined
    assert "--clock-control none" in joined and "--export r.ncu-rep" in joined
    assert all(f"--section {s}" in joined for s in ncu.SECTIONS)
    assert cmd[-8:] == ["-m", "compare.studies.ncu", "--target", "triton_moe/qwen3-30b-a3b/bf16/8"] + [
        "--calls",
        "2",
        "--seed",
        "0",
    ]
    assert ncu.import_command("ncu", Path("r")) == ["ncu", "--import", "r", "--csv", "--page", "raw"] + [
        "--print-units",
        "base",
    ]


class _Cudart:
    def __init__(self, log):
        self.log = log

    def cudaProfilerStart(self):
        self.log.append("start")

    def cudaProfilerStop(self):
        self.log.append("stop")


def _env(log, backend):
    clock = Clock(time=None, ceilings=None, sync=lambda: log.append("sync"), device=lambda: "cpu")
    return prof.Env(clock=clock, device="cpu", shape_of=lambda label: TINY, load=lambda name: backend)


def test_the_child_profiles_only_the_calls_after_the_warm_up():
    log = []
    backend = Backend("triton_moe", fused_moe=lambda **kw: log.append("call") or kw["x"])
    row = ncu.run_target(prof.Cell("triton_moe", "tiny", 3, "bf16"), 2, 0, _env(log, backend), _Cudart(log))
    assert row["status"] == "ok"
    assert log == ["call"] * ncu.WARMUP_CALLS + ["sync", "start", "call", "call", "sync", "stop"]


def test_a_failing_child_cell_is_a_status_and_the_range_is_closed():
    log = []

    def fail(**kw):
        if log.count("call") >= ncu.WARMUP_CALLS:
            raise NotImplementedError("fp8_channel is not built")
        log.append("call")
        return kw["x"]

    row = ncu.run_target(
        prof.Cell("cute_moe", "tiny", 3, "bf16"), 2, 0, _env(log, Backend("cute_moe", fused_moe=fail)), _Cudart(log)
    )
    assert row["status"].startswith("not implemented") and log[-2:] == ["stop", "sync"]  # closed, then synced


def _fake_run(csv_text, rc=0, child="target status: ok", report=True, ncu_err=""):
    calls = []

    def run(cmd, timeout):
        calls.append((cmd, timeout))
        if "--export" in cmd:
            if report:
                Path(cmd[cmd.index("--export") + 1]).write_text("report")
            return subprocess.CompletedProcess(cmd, rc, stdout=f"==PROF== ...\n{child}\n", stderr=f"x\n{ncu_err}")
        return subprocess.CompletedProcess(cmd, 0, stdout=csv_text, stderr="")

    return run, calls


def test_a_cell_keeps_its_raw_csv_and_its_summary(tmp_path):
    run, calls = _fake_run(TWO_CALLS)
    cell = prof.Cell("triton_moe", "qwen3-30b-a3b", 1, "bf16")
    row = ncu.profile_cell(cell, tmp_path, "ncu", 2, 0, timeout_s=42.0, run=run)
    assert row["status"] == "ok" and row["profile"]["launches_per_call"] == 3
    assert (tmp_path / row["csv"]).read_text() == TWO_CALLS
    assert len(calls) == 2 and calls[0][1] == 42.0 and calls[1][0][1] == "--import"


def test_a_failing_ncu_or_child_is_a_row_saying_why(tmp_path):
    run, _ = _fake_run(TWO_CALLS, rc=1, child="target status: error: RuntimeError: boom")
    row = ncu.profile_cell(prof.Cell("cute_moe", "qwen3-30b-a3b", 1, "bf16"), tmp_path, "ncu", 2, 0, run=run)
    assert row["status"] == "ncu rc=1: target status: error: RuntimeError: boom" and "profile" not in row
    # the child was fine but ncu was not: ncu's own lines say why, and a missing report is named
    err = "==ERROR== ERR_NVGPUCTRPERM - no permission to access the GPU's counters"
    run, _ = _fake_run(TWO_CALLS, rc=0, report=False, ncu_err=err)
    row = ncu.profile_cell(prof.Cell("cute_moe", "qwen3-30b-a3b", 1, "bf16"), tmp_path, "ncu", 2, 0, run=run)
    assert row["status"] == f"ncu rc=0: no report written; {err}"
    run, _ = _fake_run("==PROF== no kernels\n")
    row = ncu.profile_cell(prof.Cell("cute_moe", "qwen3-30b-a3b", 1, "bf16"), tmp_path, "ncu", 2, 0, run=run)
    assert row["profile"] is None and "Kernel Name" in row["parse_error"]


def _meta():
    return {"date": "2026-12-06 23:00 UTC", "device": "NVIDIA H200", "commit": "abc1234", "command": "python -m x"}


def test_the_run_writes_after_every_cell_skips_past_the_deadline_and_rereads_the_csvs(tmp_path):
    cells = [prof.Cell("triton_moe", "qwen3-30b-a3b", 1, "bf16"), prof.Cell("cute_moe", "qwen3-30b-a3b", 1, "bf16")]
    seen = []

    def runner(cell, out, exe, calls, seed, timeout_s):
        seen.append((cell, timeout_s))
        (out / "a.csv").parent.mkdir(parents=True, exist_ok=True)
        (out / "a.csv").write_text(TWO_CALLS)
        return {"cell": cell.title, "key": ncu.cell_key(cell), "csv": "a.csv", "status": "ok", "profile": None}

    ncu.run_ncu(cells, tmp_path, ncu="ncu", calls=2, seed=0, meta=_meta(), deadline_s=1e9, cell_runner=runner)
    assert (
        len(seen) == 2
        and seen[0][1] == ncu.CELL_TIMEOUT_S
        and json.loads((tmp_path / "ncu.json").read_text())["cells"][1]["status"] == "ok"
    )
    again = ncu.resummarize(tmp_path, json.loads((tmp_path / "ncu.json").read_text()))
    assert again["cells"][0]["profile"]["us_per_call"] == pytest.approx(33.0)
    md = ncu.to_markdown(again)
    assert "- commit: `abc1234`" in md and "| 0 | `moe_gemm_kernel` | 21.0 |" in md
    assert "long_scoreboard 5.0" in md
    late = ncu.run_ncu(
        cells,
        tmp_path / "late",
        ncu="ncu",
        calls=2,
        seed=0,
        meta=_meta(),
        deadline_s=ncu.MIN_CELL_S - 1,
        cell_runner=lambda *a: (_ for _ in ()).throw(AssertionError("a cell ran")),
    )
    assert late["cells"][1]["status"] == "skipped (deadline)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "X", "--tokens", "1", "--calls", "0"], "--calls"),
        (["--out", "X", "--shapes", "qwen3-30b-a3b"], "--tokens"),
        (["--out", "X", "--tokens", "1", "--quants", "fp9"], "--quants"),
        (["--from", "/nonexistent"], "--from"),
        (["--out", "X", "--tokens", "1", "--ncu", "/no/such/ncu"], "--ncu"),
    ],
)
def test_bad_options_are_one_line_naming_the_option(argv, message, capsys):
    assert ncu.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{ncu.PROG}: error: {message}") and "\n" not in err


def test_a_cell_never_runs_past_the_deadline(tmp_path):
    got = []

    def runner(cell, out, exe, calls, seed, timeout_s):
        got.append(timeout_s)
        return {"cell": cell.title, "status": "ok"}

    cells = [prof.Cell("triton_moe", "qwen3-30b-a3b", 1, "bf16")]
    ncu.run_ncu(cells, tmp_path, ncu="ncu", calls=2, seed=0, meta=_meta(), deadline_s=100.0, cell_runner=runner)
    assert 90.0 < got[0] <= 100.0  # what is left of the deadline, not CELL_TIMEOUT_S


def test_selected_is_not_shown_as_a_stall():
    k = {"stalls": {"long_scoreboard": 5.0, "selected": 1.0, "barrier": 0.5}}
    assert ncu._stalls(k) == "long_scoreboard 5.0, barrier 0.5"


def test_from_refuses_a_directory_that_is_not_a_run_of_this_study(tmp_path, capsys):
    (tmp_path / "ncu.json").write_text("{not json")
    assert ncu.main(["--from", str(tmp_path)]) == 2
    assert "--from:" in capsys.readouterr().err
    (tmp_path / "ncu.json").write_text(json.dumps({"cells": []}))
    assert ncu.main(["--from", str(tmp_path)]) == 2
    assert ncu.main(["--from", str(tmp_path), "--tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith(f"{ncu.PROG}: error: --from:") for e in err)


def test_a_timed_out_cell_kills_the_whole_process_group(tmp_path):
    """ncu's child would keep the GPU: the group goes, grandchildren included."""
    pidfile = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    import os
    import sys
    import time

    with pytest.raises(subprocess.TimeoutExpired):
        ncu.run_group([sys.executable, "-c", script], timeout=5.0)
    pid = int(pidfile.read_text())
    for _ in range(50):  # the kill is delivered at once; reaping by init may take a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for init is dead too
            assert f.read().split()[2] == "Z"

"""The generated status tables (notes/targets.md, README.md) say what the report they name says.

The tables are parsed here on their own terms — markdown rows, numbers as printed — and every number
is compared with the JSON of the report the block links to, so a hand edit, a stale table or a
generator bug fails. ``compare.status`` itself is checked to notice a planted difference and to
refuse bad options in one line.
"""

import copy
import json
import re
import subprocess
import sys

import pytest

from compare import status

ROOT = status.ROOT


def _block(name):
    file, _ = status.BLOCKS[name]
    return status.read_block((ROOT / file).read_text(), name)


def _report_of(name):
    path = status.named_report(_block(name))
    assert path.exists(), f"{status.BLOCKS[name][0]} names {path.name}, which is not committed"
    return json.loads(path.read_text())


def _table_rows(block, first_header):
    """The data rows (lists of cells) of the markdown table whose header starts with ``first_header``."""
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _num(cell):
    return float(cell.replace("*", ""))


def _cells(report):
    return {(r["backend"], r["shape"], r["quant"], r["T"]): r for r in report["rows"]}


def test_blocks_name_their_report_date_device_commit_and_command():
    for name in status.BLOCKS:
        block, meta = _block(name), _report_of(name)["meta"]
        for field in ("date", "device", "commit", "command"):
            assert meta[field] in block, (name, field)


def test_targets_table_numbers_are_the_reports():
    block, report = _block("targets"), _report_of("targets")
    cells = _cells(report)
    rows = _table_rows(block, "backend")
    assert rows, "no target rows"
    seen = set()
    for backend, shape, quant, T, target, us, pct, met in rows:
        T, target = int(T), float(target)
        row = cells[(backend, shape, quant, T)]
        assert _num(us) == round(row["us"], 1), (backend, shape, quant, T)
        assert _num(pct) == round(row["pct_floor"]), (backend, shape, quant, T)
        assert (met == "yes") == (row["us"] <= target), (backend, shape, quant, T)
        assert float(status.TARGETS[(quant, backend, shape)][T]) == target
        seen.add((quant, backend, shape, T))
    listed = {(q, b, s, T) for (q, b, s), by_T in status.TARGETS.items() for T in by_T}
    absent = listed - seen
    for q, b, s, T in absent:  # a target the report has no row for is named as absent, never dropped
        assert (b, s, q, T) not in cells and f"{b} {s} {q} T = {T}" in block


def test_copy_floor_and_alignment_tables_are_the_reports():
    block, cells = _block("targets"), _cells(_report_of("targets"))
    shape, quant, tokens, bound, pct = status.COPY_FLOOR_TARGET
    for backend, *values, met in _table_rows(block, "backend | T = 1"):
        got = [cells[(backend, shape, quant, T)]["pct_floor"] for T in tokens]
        assert [_num(v) for v in values] == [round(g) for g in got], backend
        if backend == bound:
            assert (met == "yes") == (min(got) >= pct)
    shapes = [h.strip() for h in block.split("| backend | bound |")[1].splitlines()[0].split("|")[:-3]]
    for backend, bounds, *values, target, met in _table_rows(block, "backend | bound"):
        low, high = (int(n) for n in re.findall(r"\d+", bounds))
        worst = [
            max(
                r["prep_us"]
                for (b, s, q, T), r in cells.items()
                if (b, s, q) == (backend, shape_, "bf16") and low <= T <= high
            )
            for shape_ in shapes
        ]
        assert [_num(v) for v in values] == [round(w, 1) for w in worst], (backend, bounds)
        assert (met == "yes") == (max(worst) <= float(target))


def test_glance_table_numbers_are_the_reports():
    block, report = _block("glance"), _report_of("glance")
    cells = _cells(report)
    header = next(line for line in block.splitlines() if line.startswith("| shape | format |"))
    tokens = [int(t) for t in re.findall(r"T = (\d+)", header)]
    rows = _table_rows(block, "shape")
    assert len(rows) == len({(r["shape"], r["quant"]) for r in report["rows"]})
    for shape, quant, *pairs in rows:
        for T, pair in zip(tokens, pairs):
            cute, triton = (c.strip() for c in pair.split("/"))
            us = [cells[(b, shape, quant, T)]["us"] for b in ("cute_moe", "triton_moe")]
            assert [_num(cute), _num(triton)] == [round(u, 1) for u in us], (shape, quant, T)
            faster = cute if us[0] < us[1] else triton
            assert faster.startswith("**"), (shape, quant, T, "the faster is not bold")


def test_the_tables_are_generated_from_the_newest_committed_report():
    newest = status.newest_report()
    for name in status.BLOCKS:
        assert status.named_report(_block(name)).name == newest["_path"].name, name
    assert status.stale_blocks(newest) == []


def test_a_planted_mismatch_is_found(tmp_path):
    report = status.newest_report()
    for file, _ in status.BLOCKS.values():
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_text((ROOT / file).read_text())
    assert status.stale_blocks(report, root=tmp_path) == []
    planted = copy.deepcopy(report)
    row = next(
        r
        for r in planted["rows"]  # a target cell, in both tables
        if (r["backend"], r["shape"], r["quant"], r["T"]) == ("cute_moe", "qwen3-30b-a3b", "bf16", 1)
    )
    row["us"] += 0.5
    stale = status.stale_blocks(planted, root=tmp_path)
    assert len(stale) == 2 and "targets" in stale[0] and "glance" in stale[1]
    # and a hand edit of one number in the file, against the true report
    text = (tmp_path / "README.md").read_text()
    before = status.read_block(text, "glance")
    edited = re.sub(r"\d+\.\d", lambda m: f"{float(m.group()) + 1:.1f}", before, count=1)
    (tmp_path / "README.md").write_text(text.replace(before, edited))
    assert [s for s in status.stale_blocks(report, root=tmp_path) if s.startswith("README.md")]
    status.write_blocks(report, root=tmp_path)
    assert status.stale_blocks(report, root=tmp_path) == []


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "compare.status", *args], cwd=ROOT, capture_output=True, text=True)


def test_check_passes_on_the_committed_files():
    r = _cli("--check")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "args", [(), ("--check", "--write"), ("--bogus",), ("--check", "--report", "/nonexistent.json")]
)
def test_bad_options_are_one_line_and_exit_2(args):
    r = _cli(*args)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr, r.stderr


def test_a_study_run_does_not_stand_for_the_suite(tmp_path):
    # a newer report that times one shape (a study, a your-kernel run) is not taken for the status tables
    suite = status.newest_report()
    study = copy.deepcopy({k: v for k, v in suite.items() if k != "_path"})
    study["meta"]["date"] = "2099-01-01 00:00 UTC"
    study["rows"] = [r for r in study["rows"] if r["shape"] == "qwen3-30b-a3b"]
    (tmp_path / suite["_path"].name).write_text(suite["_path"].read_text())
    (tmp_path / "compare_h200_2099-01-01_study.json").write_text(json.dumps(study))
    assert status.newest_report(tmp_path)["_path"].name == suite["_path"].name
    whole = dict(study, rows=suite["rows"])
    (tmp_path / "compare_h200_2099-01-01_study.json").write_text(json.dumps(whole))
    assert status.newest_report(tmp_path)["_path"].name == "compare_h200_2099-01-01_study.json"
    # a whole newer run on another machine (an H100) is a result, not the status of the H200's targets
    h100 = dict(whole, meta=dict(whole["meta"], device="NVIDIA H100 80GB HBM3", date="2099-02-01 00:00 UTC"))
    (tmp_path / "compare_h100_2099-02-01.json").write_text(json.dumps(h100))
    assert status.newest_report(tmp_path)["_path"].name == "compare_h200_2099-01-01_study.json"

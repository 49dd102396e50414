"""The study commands' output rules (``moe_spec.studyout``): ``--out`` refused in one line before any
work, files written whole, the run named in the markdown header; and the four commands use them."""

import os
import re
from pathlib import Path

import pytest

from moe_spec import runinfo, studyout

ROOT = Path(__file__).resolve().parents[1]
FILES = ("a.md", "a.json")
COMMANDS = (
    "cute_moe/lab/crossover.py",
    "cute_moe/lab/bench_align.py",
    "cute_moe/lab/bench_pingpong.py",
    "cute_moe/lab/bench_gated.py",
    "cute_moe/lab/bench_schedule.py",
    "cute_moe/lab/bench_decode.py",
    "cute_moe/lab/trace_decode.py",
    "triton_moe/lab/promotion.py",
    "triton_moe/lab/bench_align.py",
    "triton_moe/lab/bench_tma.py",
    "triton_moe/lab/bench_splitk.py",
    "triton_moe/lab/bench_static.py",
    "triton_moe/lab/bench_epilogue_quant.py",  # and bench_x_quant, which runs its Study
    "triton_moe/lab/bench_gemm2.py",
)


def _refusal(text) -> str:
    with pytest.raises(studyout.OutError) as caught:
        studyout.check_out(text, FILES)
    message = str(caught.value)
    assert message.startswith("--out: ") and "\n" not in message
    return message


# --- check_out ------------------------------------------------------------------------------------------------


def test_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    assert _refusal(str(tmp_path / "file")) == f"--out: {str(tmp_path / 'file')!r} exists and is not a directory"
    assert (tmp_path / "file").read_text() == "x"


def test_a_non_empty_directory_is_refused_and_left_alone(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "a.md").write_text("an earlier run")
    assert "is not empty; give a new or empty directory (no directory mixes two runs)" in _refusal(
        str(tmp_path / "used")
    )
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / ".a.md.partial").write_text("")  # a leftover counts too
    assert "is not empty" in _refusal(str(tmp_path / "hidden"))
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["a.md"]


def test_a_path_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    message = _refusal(str(tmp_path / "file" / "sub" / "out"))
    assert message == (
        f"--out: cannot create {str(tmp_path / 'file' / 'sub' / 'out')!r}: "
        f"{str(tmp_path / 'file')!r} is not a writable directory"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_a_read_only_parent_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    try:
        assert "cannot create" in _refusal(str(tmp_path / "ro" / "out"))
    finally:
        (tmp_path / "ro").chmod(0o700)


@pytest.mark.parametrize("text", [None, ""])
def test_out_is_required_and_the_message_names_the_files(text):
    assert _refusal(text) == "--out: required: a new or empty directory for a.md and a.json"
    with pytest.raises(studyout.OutError, match=r"for x\.md, x\.json and x\.svg$"):
        studyout.check_out(text, ("x.md", "x.json", "x.svg"))
    with pytest.raises(studyout.OutError, match=r"directory$"):
        studyout.check_out(text)


def test_a_new_or_empty_directory_is_accepted_and_nothing_is_created(tmp_path):
    (tmp_path / "empty").mkdir()
    assert studyout.check_out(str(tmp_path / "empty"), FILES) == tmp_path / "empty"
    assert studyout.check_out(str(tmp_path / "a" / "b"), FILES) == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists() and list((tmp_path / "empty").iterdir()) == []


# --- write_files ----------------------------------------------------------------------------------------------


def test_files_are_written_with_their_parents_and_no_partial_is_left(tmp_path):
    out = tmp_path / "new" / "out"
    studyout.write_files(out, {"a.md": "# one\n", "a.json": "{}\n"})
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "a.md"]
    studyout.write_files(out, {"a.md": "# two\n", "a.json": "[]\n"})  # rewritten after every part
    assert (out / "a.md").read_text() == "# two\n" and (out / "a.json").read_text() == "[]\n"
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "a.md"]


def test_a_write_cut_off_before_the_rename_leaves_the_previous_file(tmp_path, monkeypatch):
    studyout.write_files(tmp_path, {"a.md": "the previous report\n"})

    def cut_off(src, dst):
        raise OSError("cut off")

    monkeypatch.setattr(studyout.os, "replace", cut_off)
    with pytest.raises(OSError, match="cut off"):
        studyout.write_files(tmp_path, {"a.md": "half of the next"})
    assert (tmp_path / "a.md").read_text() == "the previous report\n"
    assert (tmp_path / ".a.md.partial").read_text() == "half of the next"


# --- header_lines ---------------------------------------------------------------------------------------------


def test_the_header_names_date_device_commit_command_and_versions():
    info = runinfo.run_info("python -m x --out 'my dir'", cuda=False, commit="abc1234")
    lines = studyout.header_lines(info)
    assert re.fullmatch(r"- date: \d{4}-\d\d-\d\d \d\d:\d\d UTC", lines[0])
    assert lines[1].startswith("- device: CPU (") and lines[2] == "- commit: `abc1234`"
    assert lines[3] == "- command: `python -m x --out 'my dir'`"
    assert lines[4] == f"- versions: python {info['python']}, torch {info['torch']}, triton {info['triton']}"
    assert len(lines) == 5


def test_the_header_of_a_dict_without_versions_has_four_lines():
    lines = studyout.header_lines({"date": "d", "device": "H200", "commit": "c", "command": "cmd", "rows": []})
    assert lines == ["- date: d", "- device: H200", "- commit: `c`", "- command: `cmd`"]


# --- the study commands ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", COMMANDS)
def test_the_study_commands_use_these_rules(path):
    source = (ROOT / path).read_text()
    assert any(f"studyout.{f}(" in source for f in ("check_out", "out_or_exit", "start_gpu_study")), path
    assert "studyout.write_files(" in source, path
    assert "studyout.header_lines(" in source, path
    assert "os.replace" not in source and ".partial" not in source and "iterdir" not in source, path
    assert "write_text" not in source, path


def _stderr_of(module, argv, capsys) -> str:
    try:
        status = module.main(argv)
    except SystemExit as stop:
        status = stop.code
    err = capsys.readouterr().err
    if isinstance(status, str):  # SystemExit(message): Python prints it on stderr, status 1
        err, status = status, 1
    assert status in (1, 2)
    return err


@pytest.mark.parametrize(
    "name",
    [
        "cute_moe.lab.crossover",
        "cute_moe.lab.bench_align",
        "cute_moe.lab.bench_pingpong",
        "cute_moe.lab.bench_gated",
        "cute_moe.lab.bench_schedule",
        "cute_moe.lab.bench_decode",
        "cute_moe.lab.trace_decode",
        "triton_moe.lab.promotion",
        "triton_moe.lab.bench_align",
        "triton_moe.lab.bench_tma",
        "triton_moe.lab.bench_splitk",
        "triton_moe.lab.bench_static",
        "triton_moe.lab.bench_epilogue_quant",
        "triton_moe.lab.bench_x_quant",
        "triton_moe.lab.bench_gemm2",
    ],
)
def test_every_command_refuses_a_used_out_in_one_line_before_any_work(name, tmp_path, capsys):
    import importlib

    module = importlib.import_module(name)
    (tmp_path / "file").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "old.md").write_text("an earlier run")
    for out, why in (
        (tmp_path / "file", "exists and is not a directory"),
        (tmp_path / "used", "is not empty"),
        (tmp_path / "file" / "sub", "cannot create"),
    ):
        err = _stderr_of(module, ["--out", str(out)], capsys)
        assert len(err.strip().splitlines()) == 1 and "error: --out: " in err, err
        assert repr(str(out)) in err and why in err, err
    assert (tmp_path / "file").read_text() == "x" and [p.name for p in (tmp_path / "used").iterdir()] == ["old.md"]


def test_out_or_exit_prints_one_line_and_exits_2(tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "old.md").write_text("x")
    with pytest.raises(SystemExit) as stop:
        studyout.out_or_exit("python -m some.study", str(tmp_path / "used"), FILES)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("python -m some.study: error: --out: ") and err.count("\n") == 1
    assert (
        studyout.out_or_exit("p", str(tmp_path / "new"), FILES) == tmp_path / "new" and not (tmp_path / "new").exists()
    )


# --- the command line: one parser, list and number rules, one main ---------------------------------------------


def test_the_parser_turns_argparse_errors_into_one_usage_error():
    p = studyout.Parser(prog="p")
    p.add_argument("--n", type=int)
    with pytest.raises(studyout.UsageError, match=r"^argument --n: invalid int value: 'x'$"):
        p.parse_args(["--n", "x"])
    with pytest.raises(studyout.UsageError, match="unrecognized arguments: --m"):
        p.parse_args(["--m"])
    assert issubclass(studyout.OutError, studyout.UsageError)


def test_progress_is_one_line_on_stderr(capsys):
    studyout.progress("python -m x")("cell 1 of 2")
    assert capsys.readouterr() == ("", "python -m x: cell 1 of 2\n")


def test_lists_and_numbers():
    assert studyout.split_list("--a", " x, y ,x") == ["x", "y", "x"]
    for text in ("", " ", "x,,y", "x,"):
        with pytest.raises(studyout.UsageError, match=f"^--a: empty item in list {re.escape(repr(text))}$"):
            studyout.split_list("--a", text)
    assert studyout.positive_ints("--tokens", "8,08,1,8") == (8, 1)
    with pytest.raises(
        studyout.UsageError,
        match=r"^--tokens: bad token count '0' in '1,0': expected positive "
        r"integers, e.g. 1,8,32$",
    ):
        studyout.positive_ints("--tokens", "1,0")
    with pytest.raises(studyout.UsageError, match=r"^--m: bad count '-2' in '-2': expected positive integers, e.g. 4$"):
        studyout.positive_ints("--m", "-2", noun="count", example="4")
    seconds = dict(lowest=0.0, allow_lowest=False, what="seconds > 0")
    assert studyout.number("--s", " 2.5", **seconds) == 2.5 and studyout.number("--s", 3.0, **seconds) == 3.0
    assert studyout.number("--f", "0", lowest=0.0, allow_lowest=True, what="f >= 0") == 0.0
    for bad in ("0", "-1", "nan", "inf", "x", 0.0):
        with pytest.raises(studyout.UsageError, match=rf"^--s: expected seconds > 0, got {re.escape(repr(bad))}$"):
            studyout.number("--s", bad, **seconds)


def test_shape_labels_are_canonical_and_unknown_ones_named():
    assert studyout.shape_labels("--shapes", "QWEN3-30B-A3B,qwen3-30b-a3b:tp1,mixtral-8x7b") == (
        "qwen3-30b-a3b",
        "mixtral-8x7b",
    )
    with pytest.raises(studyout.UsageError, match=r"^--shapes: unknown shape 'gpt5'"):
        studyout.shape_labels("--shapes", "mixtral-8x7b,gpt5")


class _Stop(Exception):
    pass


def test_run_command_exit_statuses_and_one_line_messages(capsys):
    def parse(argv):
        if argv == ["bad"]:
            raise studyout.UsageError("--x: bad")
        if argv == ["ctrl-c"]:
            raise KeyboardInterrupt
        return {"out": "DIR", "argv": argv}

    def run(options, argv):
        what = argv[0] if argv else ""
        if what == "stop":
            raise _Stop("--y: refused by a command's own error")
        if what == "interrupt":
            raise KeyboardInterrupt
        print(f"ran {options['argv']}")
        return 0

    def main(argv):
        return studyout.run_command(
            "p", argv, parse, run, errors=(_Stop,), interrupted=lambda o: f"the rest is in {o['out']}"
        )

    assert main(["go"]) == 0 and capsys.readouterr().out == "ran ['go']\n"
    expected = {
        ("bad",): (2, "p: error: --x: bad\n"),
        ("stop",): (2, "p: error: --y: refused by a command's own error\n"),
        ("interrupt",): (130, "p: interrupted (Ctrl-C); the rest is in DIR\n"),
        ("ctrl-c",): (130, "p: interrupted (Ctrl-C); nothing written\n"),
    }
    for argv, (status, err) in expected.items():
        assert main(list(argv)) == status
        assert capsys.readouterr().err == err
    import argparse

    def interrupt(options, argv):
        raise KeyboardInterrupt

    for options, err in (
        (argparse.Namespace(out=Path("d")), "p: interrupted (Ctrl-C); the rest is in d\n"),
        (argparse.Namespace(out=None), "p: interrupted (Ctrl-C); nothing written\n"),
    ):
        assert studyout.run_command("p", [], lambda argv: options, interrupt, interrupted="the rest is in {out}") == 130
        assert capsys.readouterr().err == err
    with pytest.raises(ValueError, match="not a usage error"):  # any other error is the command's bug: a traceback
        studyout.run_command("p", [], parse, lambda o, a: (_ for _ in ()).throw(ValueError("not a usage error")))


def test_run_command_ends_quietly_when_stdout_is_closed():
    import subprocess
    import sys

    code = (
        "from moe_spec import studyout\n"
        "def run(options, argv):\n"
        "    raise BrokenPipeError\n"
        "raise SystemExit(studyout.run_command('p', [], lambda argv: None, run))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert (r.returncode, r.stderr) == (1, "")


# --- run_cells ------------------------------------------------------------------------------------------------


def test_run_cells_writes_every_row_keeps_errors_and_cuts_skipped_cells(capsys):
    results = {"rows": [], "cut": []}
    writes, after = [], []

    def measure(cell):
        if cell["T"] == 2:
            raise RuntimeError("boom")
        return {"us": 10.0 * cell["T"], "config": "hidden"}

    cells = [{"shape": "s", "format": "bf16", "T": T} for T in (1, 2, 3, 4)]
    took = studyout.run_cells(
        results,
        cells,
        measure,
        lambda r: writes.append(len(r["rows"])),
        deadline_s=1e6,
        cell_s=1.0,
        skip=lambda cell: cell["T"] == 3,
        after=after.append,
        shown=lambda row: {k: v for k, v in row.items() if k != "config"},
    )
    assert took >= 0
    assert [r["T"] for r in results["rows"]] == [1, 2, 4]
    assert results["rows"][0] == {"shape": "s", "format": "bf16", "T": 1, "us": 10.0, "config": "hidden"}
    assert results["rows"][1]["error"] == "RuntimeError('boom')" and "us" not in results["rows"][1]
    assert results["cut"] == ["s bf16 T=3"]
    assert writes == [1, 2, 3, 3] and after == [0, 1, 3]  # after each row, then once at the end
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and "hidden" not in printed[0] and '"us": 10.0' in printed[0]


def test_run_cells_starts_no_cell_past_the_deadline():
    results = {"rows": [], "cut": []}
    studyout.run_cells(
        results,
        [{"shape": "s", "T": 1}, {"shape": "s", "T": 8}],
        lambda cell: {"us": 1.0},
        lambda r: None,
        deadline_s=5.0,
        cell_s=10.0,  # fewer than cell_s seconds are left from the start
    )
    assert results["rows"] == [] and results["cut"] == ["s T=1", "s T=8"]


def test_known_list_names_the_option_and_the_unknown_items():
    assert studyout.known_list("--quants", "fp8_tensor,bf16", ("bf16", "fp8_tensor")) == ["fp8_tensor", "bf16"]
    with pytest.raises(studyout.UsageError, match=r"^--quants: unknown fp9, int4; known: bf16, fp8_tensor$"):
        studyout.known_list("--quants", "bf16,fp9,int4", ("bf16", "fp8_tensor"))
    with pytest.raises(studyout.UsageError, match=r"^--quants: empty item"):
        studyout.known_list("--quants", "bf16,,", ("bf16",))

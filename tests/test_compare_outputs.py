"""Where the report goes: staged beside the target, moved into place at the end, never mixed with an
earlier run, nothing half-written when stopped."""

import pytest

from compare.outputs import OutputError, Outputs
from compare.report import OUTPUT_FILES


def _stage(outputs: Outputs, files: dict):
    staging = outputs.stage()
    for name, text in files.items():
        (staging / name).write_text(text)
    return staging


def test_a_new_directory_is_the_staging_directory_renamed(tmp_path):
    out = tmp_path / "deep" / "out"
    o = Outputs(out, OUTPUT_FILES).check()
    staging = _stage(o, {"report.md": "new"})
    assert staging.parent == out.parent and staging.name.startswith(".out.partial-")
    assert not out.exists()  # nothing at the target until the commit
    o.commit()
    assert (out / "report.md").read_text() == "new" and not staging.exists() and o.committed
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_a_reused_directory_holds_this_run_only(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("report.md", "roofline.png", "speedup.png", "results.json"):
        (out / name).write_text("earlier run")
    (out / "notes.txt").write_text("the user's")
    o = Outputs(out, OUTPUT_FILES).check()
    _stage(o, {"report.md": "new", "results.json": "new", "numerics.png": "new"})
    o.commit()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "numerics.png", "report.md", "results.json"]
    assert all((out / n).read_text() == "new" for n in ("report.md", "results.json", "numerics.png"))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_stopped_run_leaves_the_target_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("earlier run")
    o = Outputs(out, OUTPUT_FILES).check()
    _stage(o, {"report.md": "half"})
    o.discard()  # what the CLI does on Ctrl-C or an error before the commit
    assert (out / "report.md").read_text() == "earlier run" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_router_table_is_written_whole(tmp_path):
    o = Outputs(tmp_path / "out", OUTPUT_FILES, tmp_path / "data" / "router.json").check()
    _stage(o, {"report.md": "r"})
    o.commit('{"entries": []}\n')
    assert (tmp_path / "data" / "router.json").read_text() == '{"entries": []}\n'
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["router.json"]


@pytest.mark.parametrize(
    "out, router, message",
    [
        ("file", None, "--out: "),
        ("file/sub", None, "--out: cannot create"),
        ("out", ".", "--write-router: "),
        ("out", "file/r.json", "--write-router: cannot create"),
        ("out", "out/report.md", "--write-router: "),
    ],
)
def test_unwritable_targets(out, router, message, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match=message):
        Outputs(tmp_path / out, OUTPUT_FILES, None if router is None else tmp_path / router).check()


def test_written_with_the_modes_of_plain_files(tmp_path):
    o = Outputs(tmp_path / "out", OUTPUT_FILES, tmp_path / "router.json").check()
    _stage(o, {"report.md": "r"})
    o.commit("{}\n")
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "f").write_text("")
    assert (tmp_path / "out").stat().st_mode == probe.stat().st_mode
    assert (tmp_path / "router.json").stat().st_mode == (probe / "f").stat().st_mode

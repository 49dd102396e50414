"""``--merge``: every results record this repository has committed is read back and re-rendered; the merged
metadata is the union of the inputs; anything that is not a results record is one line and exit 2."""

import json
from pathlib import Path

import pytest

from compare import cli, results
from compare.tables import banner

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted((ROOT / "notes" / "results").glob("compare_*.json"))


def test_the_repository_has_committed_records():
    assert COMMITTED  # the H200 run; the tests below read every one of them


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_every_committed_record_merges_and_renders(path, tmp_path, capsys):
    assert cli.main(["--merge", str(path), "--out", str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    record = results.load(str(path))
    report = (tmp_path / "report.md").read_text()
    assert f"# MoE kernels compared: {record['meta']['device']}" in report
    assert out.startswith("What this run did — " + record["meta"]["device"])
    merged = json.loads((tmp_path / "results.json").read_text())
    assert len(merged["rows"]) == len(record["rows"]) and len(merged["cases"]) == len(record["cases"])
    if any(r.get("us") for r in record["rows"]):
        assert "fastest correct" in report and "## Ceilings measured" in report


def test_older_records_are_filled_in():
    """Records written before the per-expert lists and with NaN as a string read as the current shape."""
    old = {
        "meta": {"command": "x"},
        "rows": [
            {
                "shape": "s",
                "quant": "bf16",
                "T": 1,
                "backend": "b",
                "status": "ok",
                "E": 2,
                "K": 4,
                "I": 4,
                "top_k": 1,
                "rel_l2": "nan",
            }
        ],
        "cases": [{"shape": "s", "quant": "bf16", "T": 1, "flagged_experts": [3]}],
    }
    record = results.check(old)
    assert record["cases"][0]["experts"] == [] and record["rows"][0]["rel_l2"] != record["rows"][0]["rel_l2"]
    assert record["jit"] == [] and record["ceilings"] is None


def _record(**meta):
    row = {
        "shape": "s",
        "quant": "bf16",
        "T": 1,
        "backend": meta["backends"][0],
        "status": "ok",
        "E": 2,
        "K": 4,
        "I": 4,
        "top_k": 1,
    }
    return results.check({"meta": {"device": "NVIDIA H200", "commit": "abc", **meta}, "rows": [row]})


def test_merged_metadata_is_the_union_of_the_inputs():
    a = _record(backends=["triton_moe"], tokens=[1, 8], shapes=["mixtral-8x7b"], seed=0, command="run a")
    b = _record(
        backends=["cute_moe", "triton_moe"], tokens=[32, 8], shapes=["deepseek-v3:tp8"], seed=1, command="run b"
    )
    m = results.merge([a, b])["meta"]
    assert m["backends"] == ["triton_moe", "cute_moe"]
    assert m["tokens"] == [1, 8, 32] and m["shapes"] == ["mixtral-8x7b", "deepseek-v3:tp8"]
    assert m["seed"] == [0, 1]  # the inputs differ: both are named, neither is hidden
    assert m["device"] == "NVIDIA H200" and m["commit"] == "abc"  # they agree: one value
    assert m["merged_from"] == ["run a", "run b"]
    assert results.merge([results.merge([a, b]), a])["meta"]["merged_from"] == ["run a", "run b", "run a"]
    c = _record(backends=["torch_loop"], device="NVIDIA H100", command="run c")
    both = results.merge([a, c])
    assert both["meta"]["device"] == ["NVIDIA H200", "NVIDIA H100"]
    assert banner(both, "below")[0].startswith("What this run did — NVIDIA H200 + NVIDIA H100,")


ROW = {"shape": "s", "quant": "bf16", "T": 1, "backend": "b", "status": "ok", "E": 2, "K": 4, "I": 4, "top_k": 1}


@pytest.mark.parametrize(
    "record, message",
    [
        ({}, "not a compare results record (no 'meta' or 'rows')"),
        ([], "expected a JSON object with 'meta' and 'rows', got list"),
        ("text", "expected a JSON object"),
        ({"meta": [], "rows": []}, "'meta' must be an object"),
        ({"meta": {}, "rows": {}}, "'rows' must be a list"),
        ({"meta": {}, "rows": [1]}, "rows[0]: expected an object"),
        ({"meta": {}, "rows": [{"shape": "s"}]}, "rows[0]: 'quant' must be str"),
        ({"meta": {}, "rows": [{**ROW, "T": "8"}]}, "rows[0]: 'T' must be int"),
        ({"meta": {}, "rows": [{**ROW, "T": True}]}, "rows[0]: 'T' must be int"),
        ({"meta": {}, "rows": [{**ROW, "rel_l2": "small"}]}, "rows[0].rel_l2: expected a number"),
        (
            {"meta": {}, "rows": [{**ROW, "deterministic": "yes"}]},
            "rows[0]: 'deterministic' must be true, false or null",
        ),
        ({"meta": {}, "rows": [ROW], "cases": [{"shape": "s"}]}, "cases[0]: 'quant' must be str"),
        (
            {"meta": {}, "rows": [ROW], "cases": [{"shape": "s", "quant": "q", "T": 1, "experts": [1]}]},
            "cases[0]: 'experts' must be a list of objects",
        ),
    ],
)
def test_wrong_shapes_are_one_line_and_exit_2(record, message, tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    assert cli.main(["--merge", str(path), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and message in lines[0], captured.err
    assert lines[0].startswith(f"python -m compare: error: results file '{path}'")
    assert not (tmp_path / "out").exists()


def test_not_json_is_one_line(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text("{not json")
    assert cli.main(["--merge", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "is not JSON" in capsys.readouterr().err

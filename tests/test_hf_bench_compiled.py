"""compare.studies.hf_bench's torch.compile'd rows, on a tiny model on the CPU.

The option parsing (``--compiled``, ``--compile-modes``, ``--compile-backend``) and the rows a run
writes: a compiled triton_moe model (``aot_eager``: dynamo and AOT autograd trace it whole, the
graph runs without code generation) gives the logits of eager bf16 within the bf16 tolerance, with
prefill and decode timed on fixed shapes (decode on a static KV cache); cute_moe, which cannot run on
a CPU, is a row with its refusal; the markdown table carries the compile column.
"""

import json
import re

import pytest

from compare.metrics import tolerance_for
from compare.studies import hf_bench

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
)


def run(tmp_path, *extra):
    return hf_bench.main(
        [
            "--layers",
            "1",
            "--prefill",
            "1x16",
            "--decode-batch",
            "2",
            "--decode-steps",
            "2",
            "--decode-prompt",
            "8",
            "--reps",
            "1",
            "--formats",
            "bf16",
            "--out",
            str(tmp_path),
            "--commit",
            "abc1234",
            "--config",
            json.dumps(TINY),
            "--deadline-s",
            "1000",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--compiled", "triton_moe,flash"], "--compiled: unknown ['flash']"),
        (["--compiled", "triton_moe", "--compile-modes", "fast"], "--compile-modes: unknown ['fast']"),
        (["--compiled", "triton_moe", "--compile-modes", ""], "--compile-modes: at least one mode"),
    ],
)
def test_bad_compile_options_are_named(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        run(tmp_path, "--implementations", "eager", *argv)


def test_compile_options_default_to_no_compiled_rows():
    args = hf_bench.parse_args([])
    assert args.compiled == "" and args.compile_modes == "reduce-overhead" and args.compile_backend == "inductor"


def test_compiled_rows(tmp_path):
    res = run(
        tmp_path,
        "--implementations",
        "eager,triton_moe",
        "--compiled",
        "triton_moe,cute_moe",
        "--compile-modes",
        "default",
        "--compile-backend",
        "aot_eager",
    )
    rows = {(r["implementation"], r.get("compile")): r for r in res["rows"]}
    assert len(rows) == len(res["rows"]) == 4
    eager, compiled = rows["triton_moe", None], rows["triton_moe", "default"]
    assert eager["status"] == "ok" and compiled["status"] == "ok", compiled["status"]
    tol = tolerance_for(None).rel_l2
    assert compiled["rel_l2_vs_eager_bf16"] <= tol and eager["rel_l2_vs_eager_bf16"] <= tol
    assert compiled["rel_l2_vs_eager_bf16"] > 0  # our kernel, not transformers' eager experts
    assert compiled["prefill_ms"] > 0 and compiled["decode_tokens_per_s"] > 0 and compiled["first_call_s"] > 0
    assert "our_kernel_calls" not in compiled  # the compiled forward is not counted (compare.hf_experts.CALLS)
    assert "cute_moe runs on a CUDA device" in rows["cute_moe", "default"]["status"]
    assert res["setup"]["compiled"] == ["triton_moe", "cute_moe"] and res["setup"]["compile_modes"] == ["default"]
    md = next(tmp_path.glob("hf_bench_*.md")).read_text()
    assert "| compile |" in md and "| bf16 | triton_moe | default |" in md and "| bf16 | triton_moe |  |" in md


def test_decode_batches_speedups_and_a_second_run_beside_the_first(tmp_path, monkeypatch):
    """--decode-batch 1,2: one decode measurement per batch (ms per step = batch / rate), a speed-up
    table over grouped_mm, and a second run on the same day writes ``…_2`` instead of overwriting.
    Before the first row, every batch is decoded once with the eager experts (untimed), so that no
    row pays an attention backend's one-time setup per KV length."""
    decodes, decode_rate = [], hf_bench._decode_rate

    def logged(model, prompt, steps, forward=None):
        decodes.append((model.config._experts_implementation, prompt.shape[0]))
        return decode_rate(model, prompt, steps, forward)

    monkeypatch.setattr(hf_bench, "_decode_rate", logged)
    argv = ("--implementations", "grouped_mm,triton_moe", "--decode-batch", "1,2")
    res = run(tmp_path, *argv)
    assert decodes == [("eager", 1), ("eager", 2), ("grouped_mm", 1), ("grouped_mm", 2)] + [
        ("triton_moe", 1),
        ("triton_moe", 2),
    ]
    rows = {r["implementation"]: r for r in res["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), [r["status"] for r in rows.values()]
    for r in rows.values():
        assert set(r["decode"]) == {"1", "2"}
        for b, d in r["decode"].items():
            assert d["ms_per_step"] == pytest.approx(1e3 * int(b) / d["tokens_per_s"])
        assert r["decode_tokens_per_s"] == r["decode"]["1"]["tokens_per_s"]
    assert res["setup"]["decode_batch"] == [1, 2]
    (md,) = tmp_path.glob("hf_bench_*.md")
    text = md.read_text()
    assert "| decode b1 ms/step | decode b2 ms/step |" in text
    speedup = text.split("Speed-up over grouped_mm")[1]
    g, t = rows["grouped_mm"], rows["triton_moe"]
    assert f"| bf16 | triton_moe |  | {g['prefill_ms'] / t['prefill_ms']:.2f}× |" in speedup
    assert "| grouped_mm |" not in speedup
    run(tmp_path, *argv)
    assert sorted(p.name for p in tmp_path.glob("hf_bench_*.md")) == [md.name, md.stem + "_2.md"]


@pytest.mark.parametrize("text", ["0", "1,1", "a", ""])
def test_bad_decode_batches_are_named(text):
    with pytest.raises(SystemExit):
        hf_bench.parse_args(["--decode-batch", text])


def test_profile_steps_say_where_a_decode_step_goes(tmp_path):
    """--profile-steps 2: each row profiles two steps of a second decode of its first batch (torch.profiler)
    and the markdown lists, per row, the operators with the most host time per step; our op is among
    the compiled row's operators (one call per MoE layer and step)."""
    res = run(
        tmp_path,
        "--implementations",
        "triton_moe",
        "--compiled",
        "triton_moe",
        "--compile-modes",
        "default",
        "--compile-backend",
        "aot_eager",
        "--profile-steps",
        "2",
    )
    assert res["setup"]["profile_steps"] == 2
    for row in res["rows"]:
        assert row["status"] == "ok", row
        prof = row["profile"]
        assert prof["steps"] == 2 and 0 < len(prof["host"]) <= hf_bench.PROFILE_TOP[0], prof
        assert all(e["us_per_step"] >= 0 and e["calls_per_step"] > 0 for e in prof["host"])
    compiled = next(r for r in res["rows"] if r.get("compile"))
    ops = [e["op"] for e in compiled["profile"]["host"]]
    assert "triton_moe::fused_moe" in ops, ops  # the op's CPU kernel: the Triton interpreter, the costliest
    eager = next(r for r in res["rows"] if not r.get("compile"))
    ops = [e["op"] for e in eager["profile"]["host"]]
    assert "triton_moe experts (compare.hf_experts)" in ops, ops  # the eager call's named range
    md = next(tmp_path.glob("hf_bench_*.md")).read_text()
    assert "Where a decode step's time goes (batch 2" in md and "**bf16 triton_moe default** (2 steps)" in md


def test_profile_steps_are_checked(tmp_path):
    for steps in ("-1", "3"):  # the run's --decode-steps is 2
        with pytest.raises(SystemExit, match=r"--profile-steps: expected 0 to --decode-steps \(2\) steps"):
            run(tmp_path, "--implementations", "triton_moe", "--profile-steps", steps)

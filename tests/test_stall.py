"""The recompile-stall model (compare.studies.stall_model) by hand and by simulation; the stall and scaling
scripts (compare.studies.stall, compare.studies.scaling) on two CPU ranks with tiny sizes (gloo, Triton
interpreter)."""

from __future__ import annotations

import json
import math
import random

import pytest

from compare.metrics import cross_backend_tolerance
from compare.studies.stall_model import (
    class_probabilities,
    p_rank_compiles,
    p_some_rank_compiles,
    predict,
    uniform_tokens,
)
from moe_spec.problem import MoEShape

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")


def triton_like(T: int) -> str:
    """Triton's integer classes, written out for the hand calculation (the scripts ask Triton)."""
    return "one" if T == 1 else "x16" if T % 16 == 0 else "other"


# T uniform on 1…32: q(one) = 1/32, q(x16) = 2/32 (16, 32), q(other) = 29/32; the warm-up compiled "other"
Q = class_probabilities(uniform_tokens(1, 32), triton_like)


def test_class_probabilities_by_hand():
    assert Q == pytest.approx({"one": 1 / 32, "x16": 2 / 32, "other": 29 / 32})


def test_the_model_by_hand():
    # a rank compiles in step 0 when T is 1, 16 or 32; in step 1 when that class is new then
    assert p_rank_compiles(Q, {"other"}, 0) == pytest.approx(3 / 32)
    assert p_rank_compiles(Q, {"other"}, 1) == pytest.approx(1 / 32 * 31 / 32 + 2 / 32 * 30 / 32)  # 91/1024
    assert p_some_rank_compiles(Q, {"other"}, 2) == pytest.approx(183 / 1024)  # 1 − (29/32)²
    assert p_some_rank_compiles(Q, {"other"}, 8) == pytest.approx(1 - (29 / 32) ** 8)
    assert p_some_rank_compiles(Q, {"other", "one", "x16"}, 8) == 0.0
    p = predict(Q, {"other"}, ranks=2, steps=2, compile_ms=100.0)
    stall = 183 / 1024 + 178087 / 1048576  # step 1: 1 − (933/1024)²
    assert p.p_stall_first_step == pytest.approx(183 / 1024)
    assert p.stalled_steps == pytest.approx(stall)
    assert p.compiles_per_rank == pytest.approx(3 / 32 + 91 / 1024)
    assert p.added_ms == pytest.approx(100 * stall)
    # a rank waits when it does not compile and its peer does: 2 · (1 − P) · P per step, × 100 ms
    assert p.wait_rank_ms == pytest.approx(100 * (174 / 1024 + 169806 / 1048576))
    assert predict(Q, {"other"}, ranks=1, steps=5, compile_ms=50.0).wait_rank_ms == 0.0


def test_the_model_agrees_with_a_simulation():
    """Draw token counts for R ranks, track each rank's compiled classes: the mean stalled steps and
    waiting rank-steps of 4000 runs are within 4 standard errors of the model's expectations."""
    rng, ranks, steps, runs = random.Random(1), 8, 6, 4000
    stalls, waits = [], []
    for _ in range(runs):
        seen = [{"other"} for _ in range(ranks)]
        stalled = waiting = 0
        for _ in range(steps):
            new = []
            for r in range(ranks):
                k = triton_like(rng.randint(1, 32))
                new.append(k not in seen[r])
                seen[r].add(k)
            if any(new):
                stalled += 1
                waiting += new.count(False)
        stalls.append(stalled)
        waits.append(waiting)
    want = predict(Q, {"other"}, ranks, steps, compile_ms=1.0)
    for got, expect in ((stalls, want.stalled_steps), (waits, want.wait_rank_ms)):
        mean = sum(got) / runs
        se = math.sqrt(sum((g - mean) ** 2 for g in got) / (runs - 1) / runs)
        assert abs(mean - expect) < 4 * se, f"simulated {mean:.3f} ± {se:.3f}, model {expect:.3f}"


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: uniform_tokens(0, 4), "^tokens:"),
        (lambda: class_probabilities({1: 0.5}, triton_like), "^token_probs:"),
        (lambda: predict(Q, set(), 0, 3), "^ranks:"),
        (lambda: predict(Q, set(), 2, -1), "^steps:"),
        (lambda: predict(Q, set(), 2, 3, compile_ms=-5), "^compile_ms:"),
    ],
)
def test_model_arguments_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_demo_kernel_classes_are_tritons():
    """The scripts take κ(T) from Triton's binder: the jit demo's kernel splits 1…64 into {1},
    {16, 32, 48, 64} and the rest; with do_not_specialize it is one class."""
    from compare.jitdemo import VARIANTS
    from compare.studies.stall import demo_key

    specialized, plain = (demo_key(v) for v in VARIANTS)
    groups: dict = {}
    for T in range(1, 65):
        groups.setdefault(specialized(T), []).append(T)
    assert sorted(map(tuple, groups.values()), key=len) == [
        (1,),
        (16, 32, 48, 64),
        tuple(T for T in range(2, 65) if T % 16),
    ]
    assert len({plain(T) for T in range(1, 65)}) == 1


# --- the scripts on two CPU ranks -----------------------------------------------------------------

TINY = MoEShape("tiny", 4, 2, 64, 64, "test: tiny")


def test_stall_script_on_two_cpu_ranks(tmp_path):
    from compare.jitdemo import VARIANTS
    from compare.studies.stall import StallSpec, demo_key, markdown, run_stall, write

    spec = StallSpec(TINY, steps=3, tokens=(1, 32), command="pytest")
    result = run_stall(spec)
    table = spec.token_table()
    specialized, plain = (result["variants"][v] for v in VARIANTS)
    for name, v in result["variants"].items():
        assert [r["T"] for r in v["steps"]] == table
        assert all(w >= 0 for r in v["steps"] for w in r["wait_ms"])
        # every rank compiles the demo kernel exactly when its T is a class it has not met (warm-up included)
        key, seen = demo_key(name), [{demo_key(name)(spec.warmup_tokens)} for _ in range(spec.world)]
        for row in v["steps"]:
            want = [r for r in range(spec.world) if key(row["T"][r]) not in seen[r]]
            assert row["demo_compiled"] == want, (name, row)
            for r in range(spec.world):
                seen[r].add(key(row["T"][r]))
    assert specialized["demo_compiles"] >= 1, "the token table should exercise a compilation"
    assert plain["demo_compiles"] == 0
    # the layer's kernels are the same in both runs: same steps, same new keys
    assert [r["layer_compiled"] for r in specialized["steps"]] == [r["layer_compiled"] for r in plain["steps"]]
    assert [m["compile_ms"] for m in result["models"]] == [None]  # nothing compiles on the CPU: no time to model
    write(result, tmp_path)
    saved = json.loads((tmp_path / "stall.json").read_text())
    assert {"date", "device", "commit", "command"} <= set(saved["meta"]) and saved["meta"]["command"] == "pytest"
    assert "cpu: gloo + Triton interpreter" in saved["meta"]["mode"]
    assert (tmp_path / "stall.md").read_text() == markdown(result)


def test_stall_model_only_cli(capsys, tmp_path):
    from compare.studies.stall import main

    assert (
        main(["--model-only", "--compile-ms", "100,250", "--tokens", "1-32", "--steps", "2", "--out", str(tmp_path)])
        == 0
    )
    text = capsys.readouterr().out
    assert "c = 100 ms" in text and "c = 250 ms" in text and f"| 2 | {183 / 1024:.3f} |" in text
    assert f"| {250 * (183 / 1024 + 178087 / 1048576):.0f} |" in text  # E[added ms] at c = 250, 2 ranks
    assert (tmp_path / "stall_model.md").read_text() == text
    saved = json.loads((tmp_path / "stall_model.json").read_text())
    assert saved["meta"]["command"].startswith("python -m compare.studies.stall --model-only")
    for bad in (["--tokens", "8-2"], ["--compile-ms", "-3"]):
        with pytest.raises(SystemExit) as exc:
            main(["--model-only", "--out", str(tmp_path), *bad])
        assert exc.value.code == 2


def test_scaling_script_on_two_cpu_ranks(tmp_path):
    from compare.studies.scaling import ScalingSpec, run_scaling

    spec = ScalingSpec(
        shapes=(TINY,),
        tokens=(3,),
        quants=("bf16", "fp8_block"),
        iters=1,
        warmup=0,
        out=str(tmp_path),
        command="pytest",
    )
    bf16, block = run_scaling(spec)
    for r in (bf16, block):
        assert r["one_gpu_us"] > 0 and r["ep_us"] > 0 and r["ep_pairs_sent_remote"] >= 0
        assert r["ep_rel_l2_vs_one_gpu"] <= cross_backend_tolerance(None if r["quant"] == "bf16" else r["quant"])
    assert bf16["tp_rel_l2_vs_one_gpu"] <= cross_backend_tolerance(None)
    assert block["tp_refused"].startswith("world: fp8_block needs I/world to be a multiple of 128")
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert saved["meta"]["commit"] and len(saved["rows"]) == 2
    assert "| tiny | fp8_block | 3 |" in (tmp_path / "scaling.md").read_text()

"""The suite's GPU plumbing (timing rows, roofline, speedup, router, plots), exercised on the CPU with a
stand-in clock passed to the suite: every number the H200 run reports goes through the same code, only
the clock differs."""

import time

import pytest

from compare import report, router, suite
from compare.cases import SuiteSpec
from compare.timed import Clock
from moe_spec import timing


def _wall_clock_timer(make_call, n_sets, *, use_graph=True, **_):
    """One wall-clock pass over the sets (the interpreter is slow; one sample is enough here)."""
    calls = [make_call(i) for i in range(n_sets)]
    start = time.perf_counter()
    for c in calls:
        c()
    us = (time.perf_counter() - start) * 1e6 / n_sets
    return timing.Timing(median_us=us, p10_us=us, p90_us=us, min_us=us, samples=1, calls_per_sample=n_sets)


def _wall_clock_eager(make_call, n_sets, *, quick=False):
    """The eager column's stand-in: plain calls round the sets, wall time per call."""
    return _wall_clock_timer(make_call, n_sets).median_us


STAND_IN = Clock(
    time=_wall_clock_timer,
    ceilings=lambda: timing.Ceilings(device="fake", copy_tbps=4.0, bf16_tflops=700.0, fp8_tflops=1300.0),
    sync=lambda: None,
    device=lambda: "fake GPU",
    eager=_wall_clock_eager,
)


@pytest.fixture(scope="module")
def timed_result():
    """Reduced shapes on the CPU (device "cpu"), timed by the stand-in clock."""
    spec = SuiteSpec(
        shapes=("qwen3-30b-a3b",),
        tokens=(1, 16),
        quants=(None, "fp8_block"),
        backends=("cute_moe", "triton_moe", "torch_grouped", "torch_loop"),
        device="cpu",
        jit=False,
        quick=True,
        command="test",
    )
    return suite.run_suite(spec, progress=False, clock=STAND_IN)


def test_timed_rows_carry_roofline_and_speedup(timed_result):
    rows = timed_result["rows"]
    assert timed_result["ceilings"]["copy_tbps"] == 4.0
    assert timed_result["meta"]["device"] == "fake GPU" and timed_result["meta"]["timed"] is True
    timed_base = {}  # case -> the baseline whose time the case's speedups are quoted against
    for r in rows:
        if r["backend"] in ("torch_grouped", "torch_loop") and r.get("us"):
            timed_base.setdefault((r["quant"], r["T"]), set()).add(r["backend"])
    for r in rows:
        if r["status"] == "ok" and r["backend"] == "torch_loop" and r["quant"] != "bf16":
            assert r["timing"].startswith("not timed") and "us" not in r  # the fp32 W8A8 reference
        elif r["status"] == "ok":
            assert r["us"] > 0 and r["p10_us"] <= r["us"] <= r["p90_us"]
            assert r["weight_tbps"] > 0 and r["tflops"] > 0 and 0 < r["pct_floor"]
            assert r["eager_us"] > 0 and r["eager_ratio"] == pytest.approx(r["eager_us"] / r["us"])
            assert "separate_us" not in r  # only a backend with an unfused pipeline (cute_moe: GPU only)
            assert r["bound"] in ("memory", "compute")
            bases = timed_base.get((r["quant"], r["T"]), set())
            if bases:
                want = "torch_grouped" if "torch_grouped" in bases else "torch_loop"
                assert r["speedup"] > 0 and r["speedup_vs"] == want
            else:
                assert "speedup" not in r  # fp8_block: no grouped spelling, the loop is not timed
        else:
            assert r["timing"].startswith(("skipped: not available", "skipped: not implemented")), r
    grouped = {r["quant"]: r for r in rows if r["backend"] == "torch_grouped" and r["T"] == 16}
    assert grouped["bf16"]["speedup"] == 1.0
    assert grouped["bf16"]["prep_us"] > 0  # the alignment step, timed alone
    assert grouped["fp8_block"]["status"].startswith("not implemented")  # declared by the backend itself


def test_router_table_from_the_run(timed_result):
    table = router.build_table(timed_result["rows"], timed_result["meta"])
    assert {(e["quant"], e["T"]) for e in table["entries"]} == {(q, T) for q in ("bf16", "fp8_block") for T in (1, 16)}
    for e in table["entries"]:
        assert e["backend"] == min(e["us"], key=e["us"].get)
        assert "cute_moe" not in e["us"]  # not available on this machine: never a candidate
    # the entries carry the measured (reduced) sizes, so a full-size request takes the vote at its T
    winner = [e for e in table["entries"] if e["quant"] == "fp8_block" and e["T"] == 16][0]["backend"]
    assert router.choose_backend("qwen3-30b-a3b", "fp8_block", 16, table) == winner


def test_all_outputs_with_timing(timed_result, tmp_path):
    written = report.write_all(timed_result, tmp_path)
    names = {p.name for p in written}
    assert {"results.json", "results.csv", "report.md", "numerics.png", "roofline.png", "speedup.png"} <= names
    md = (tmp_path / "report.md").read_text()
    assert "Ceilings measured at the start of the run" in md and "fastest correct" in md
    assert "timing SKIPPED" not in md and "timing SKIPPED" not in "\n".join(report.compact_table(timed_result))
    assert "µs (median)" in md and "% of floor" in md  # timed columns are shown when timed


def test_strict_problems_flag_kernels_and_crashes_not_baselines_by_design():
    from compare.report import problems

    row = dict(shape="s", quant="fp8_tensor", T=8)
    result = {
        "rows": [
            {**row, "backend": "triton_moe", "status": "FAIL", "check": "rel_l2 2e-2 > 1e-2"},
            {**row, "backend": "torch_grouped", "status": "FAIL", "check": "rel_l2 1.5e-2 > 1e-2"},
            {**row, "backend": "torch_loop", "status": "error: RuntimeError: boom"},
            {**row, "backend": "cute_moe", "status": "not implemented: bf16 only"},
        ],
        "jit": [{"backend": "triton_moe", "quant": "bf16", "status": "error: RuntimeError: x"}],
    }
    found = problems(result)
    assert any("triton_moe: numerics" in p for p in found) and any("torch_loop: error" in p for p in found)
    assert not any("torch_grouped" in p or "cute_moe" in p for p in found)
    assert any(p.startswith("JIT triton_moe") for p in found) and len(found) == 3


def test_fp8_rows_time_the_separate_pipeline_beside_the_fused_one():
    """A backend with an unfused pipeline gets, on FP8 rows only, its separate µs, the speedup of
    fusing and both pipelines' analytic bytes (cute_moe's, which needs a GPU, through a stand-in
    backend that runs triton_moe's layer for both)."""
    import triton_moe
    from compare.backends import Backend
    from compare.cases import reduce_shape
    from compare.timed import time_backend
    from cute_moe.unfused import hbm_bytes
    from moe_spec.problem import get_shape, make_inputs
    from moe_spec.validate import MoEDims

    shape = reduce_shape(get_shape("qwen3-30b-a3b"))
    separate_calls = []

    def separate(**kw):
        separate_calls.append(kw["quant"])
        return triton_moe.fused_moe(**kw)

    fake = Backend("fake", fused_moe=triton_moe.fused_moe, separate=separate, pass_bytes=hbm_bytes)
    ceilings = STAND_IN.ceilings()
    for quant in (None, "fp8_tensor"):
        inputs = make_inputs(shape, 4, quant, seed=0)
        dims = MoEDims(T=4, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
        row = time_backend(STAND_IN, fake, [inputs], dims, quant, ceilings, quick=True)
        if quant is None:
            assert "separate_us" not in row and not separate_calls
            continue
        assert separate_calls == ["fp8_tensor"]
        assert row["fusion_speedup"] == pytest.approx(row["separate_us"] / row["us"])
        hit = row["experts_hit"]
        assert row["fused_bytes"] == sum(hbm_bytes(4, dims.K, dims.I, dims.top_k, hit, quant, "fused").values())
        assert row["separate_bytes"] > row["fused_bytes"]

"""CPU lane for the one-launch decode kernel's task trace (cute_moe/decode_trace.py, cute_moe.lab.trace_decode):
the instrumented twin compiles with its clocks and only it reads them, the trace's summary on a hand-made
trace, and the phase bounds the kernel numbers by.  The trace itself runs on a GPU only."""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("torch")
pytest.importorskip("cutlass")

from cute_moe import decode_parts as dp  # noqa: E402
from cute_moe.decode import compile_decode  # noqa: E402
from cute_moe.lab import trace_decode as td  # noqa: E402


@pytest.mark.parametrize("quant", [None, "fp8_tensor"])
def test_only_the_twin_reads_the_clocks(quant):
    traced = compile_decode("int32", quant, trace=True, keep_ptx=True).__ptx__
    plain = compile_decode("int32", quant, keep_ptx=True).__ptx__
    assert "%globaltimer" not in plain and "%smid" not in plain
    # the producer's claim and ready stamps, the consumers' take and end (FP8: A's producer waits too)
    assert traced.count("mov.u64") >= 4 and "%globaltimer" in traced and "%smid" in traced
    # the same MMAs and the same protocol
    for needle in ("wgmma.mma_async", "red.release.gpu.global.add.s32", "ld.acquire.gpu.global.b32"):
        assert traced.count(needle) == plain.count(needle), needle


def test_phase_bounds_are_the_kernels():
    ids = [0, 1, 1, 2]  # 3 leaders
    E, T, K, I = 4, 2, 256, 256  # noqa: E741
    nt1, nk, ntb = dp.tile_counts(T, K, I)
    b0, c0, end = dp.phase_starts(3, nt1, nk, ntb)
    assert td.phase_bounds(ids, E, T, K, I, False) == (0, b0, b0, c0, end)
    assert td.phase_bounds(ids, E, T, K, I, True) == dp.fp8_phase_starts(3, nt1, nk, ntb)
    bounds = td.phase_bounds(ids, E, T, K, I, True)
    assert [td.phase_of(t, bounds) for t in range(bounds[-1])] == (
        ["Q1"] * bounds[0] + ["A"] * (bounds[1] - bounds[0]) + ["Q2"] * 3 + ["B"] * 2 * 3 + ["C"] * 2
    )


def test_the_summary_of_a_hand_made_trace():
    bounds = (1, 3, 4, 5, 6)  # Q1 0, A 1–2, Q2 3, B 4, C 5
    us = 1000
    rows = [  # sm, claim, ready, take, done (ns)
        [0, 0, 0, 0, 2 * us],  # Q1
        [1, 0, 3 * us, 1 * us, 10 * us],  # A: waited 3 µs for x
        [2, 1 * us, 4 * us, 2 * us, 12 * us],  # A
        [0, 2 * us, 0, 2 * us, 14 * us],  # Q2
        [3, 3 * us, 14 * us, 4 * us, 16 * us],  # B: waited 11 µs for Q2
        [0, 14 * us, 0, 14 * us, 20 * us],  # C
        [9, 99 * us, 0, 99 * us, 99 * us],  # past END: ignored
    ]
    s = td.summarize(rows, bounds)
    assert s["span_us"] == 20.0 and s["sms"] == 4
    assert s["busy_fraction"] == round((2 + 9 + 10 + 12 + 12 + 6) / (20 * 4), 3)
    a = s["phases"]["A"]
    assert a["tasks"] == 2 and a["first_take_us"] == 1.0 and a["last_done_us"] == 12.0
    assert a["mean_busy_us"] == 9.5 and a["mean_producer_wait_us"] == 3.0 and a["mean_queued_us"] == 1.0
    assert s["phases"]["B"]["mean_producer_wait_us"] == 11.0 and s["phases"]["Q2"]["mean_producer_wait_us"] is None
    assert list(s["phases"]) == ["Q1", "A", "Q2", "B", "C"]


def test_a_variant_sets_the_kernels_constants_and_refuses_what_does_not_fit(monkeypatch):
    from argparse import Namespace

    from cute_moe.lab.bench_decode import apply_variant
    from moe_spec.studyout import UsageError

    for name in ("STAGES", "CTAS_PER_SM", "FP8_OVERLAP"):
        monkeypatch.setattr(dp, name, getattr(dp, name))  # restored after the test
    default = apply_variant(Namespace(stages=None, ctas_per_sm=None, fp8_overlap=None))
    assert default == {"stages": dp.STAGES, "ctas_per_sm": dp.CTAS_PER_SM, "fp8_overlap": dp.FP8_OVERLAP}
    two = apply_variant(Namespace(stages=5, ctas_per_sm=2, fp8_overlap="off"))
    assert two == {"stages": 5, "ctas_per_sm": 2, "fp8_overlap": False} and dp.stages() == 5
    assert dp.grid_size(8, 8, 128, 2048, 768, 132) == 264  # two CTAs per SM
    for bad, needle in (
        (dict(stages=1, ctas_per_sm=None), "--stages"),
        (dict(stages=None, ctas_per_sm=0), "--ctas-per-sm"),
        (dict(stages=8, ctas_per_sm=2), "--ctas-per-sm: 2 CTAs of 8 stages"),  # 2 × 147 KB > 228 KB
    ):
        with pytest.raises(UsageError, match=needle):
            apply_variant(Namespace(fp8_overlap=None, **bad))

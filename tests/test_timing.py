"""The timing utility: roofline arithmetic (CPU) and the CUDA-graph timer against known work (GPU)."""

import pytest
import torch

from moe_spec.timing import Ceilings, _percentile, moe_traffic, roofline, sets_for_cold_l2, time_cuda_graph


def test_roofline_picks_the_larger_floor():
    c = Ceilings("test", copy_tbps=4.0, bf16_tflops=800.0, fp8_tflops=1600.0)
    mem = roofline(4e9, 1e9, c)  # 1 ms of bytes, 1.25 µs of math
    assert mem["bound"] == "memory" and mem["floor_us"] == pytest.approx(1000.0)
    comp = roofline(4e6, 8e12, c, matmul="fp8", measured_us=10_000.0)
    assert comp["bound"] == "compute" and comp["floor_us"] == pytest.approx(5000.0)
    assert comp["pct_of_floor"] == pytest.approx(50.0) and comp["tflops"] == pytest.approx(800.0)


def test_traffic_counts_weights_of_hit_experts_once():
    b, f = moe_traffic(T=8, K=4096, I=14336, top_k=2, experts_hit=8, weight_bytes=2)
    assert b == 8 * 3 * 14336 * 4096 * 2 + 2 * 8 * 4096 * 2
    assert f == 2 * 8 * 2 * 3 * 14336 * 4096


def test_rotation_covers_the_l2():
    assert sets_for_cold_l2(10 * 2**20) == 18  # 3 × 60 MiB / 10 MiB
    assert sets_for_cold_l2(2**40) == 2 and sets_for_cold_l2(1) == 64


def test_percentile_interpolates():
    assert _percentile([1, 2, 3, 4, 5], 0.5) == 3 and _percentile([0, 10], 0.1) == pytest.approx(1.0)


@pytest.mark.gpu
def test_graph_timer_measures_a_copy_at_plausible_bandwidth():
    n = 64 * 2**20  # 128 MiB of bf16 per buffer
    sets = [
        (torch.randn(n, device="cuda").bfloat16(), torch.empty(n, device="cuda", dtype=torch.bfloat16))
        for _ in range(3)
    ]
    t = time_cuda_graph(lambda i: lambda: sets[i][1].copy_(sets[i][0]), len(sets), replays=10)
    tbps = 2 * n * 2 / (t.median_us * 1e-6) / 1e12
    assert 1.0 < tbps < 5.5, tbps  # H200: ~4.2 TB/s (read + write)
    assert t.p10_us <= t.median_us <= t.p90_us


@pytest.mark.gpu
def test_oracle_on_gpu_matches_cpu():
    from moe_spec.oracle import oracle, rel_l2
    from moe_spec.problem import MoEShape, make_inputs

    inp = make_inputs(MoEShape("s", 8, 2, 256, 128, "test"), 33, "fp8_block", seed=2)
    assert rel_l2(oracle(**inp.to("cuda").kwargs()).cpu(), oracle(**inp.kwargs())) < 1e-12


class _Clock:
    """A stand-in ``time`` module whose ``perf_counter`` moves only when the work under test says so."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def perf_counter(self):
        return self.now

    def work(self, name, us):
        self.log.append(name)
        self.now += us * 1e-6


def test_wall_loop_goes_round_the_runs_and_syncs_each_repeat(monkeypatch):
    from moe_spec import timing

    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    runs = [lambda: clock.work("a", 3.0), lambda: clock.work("b", 5.0)]
    us = timing.wall_us(runs, calls=3, repeats=2, sync=lambda: clock.work("sync", 10.0))
    assert clock.log == ["a", "b", "sync"] + ["a", "b", "a", "sync"] * 2
    assert us == pytest.approx((3 + 5 + 3 + 10) / 3)
    with pytest.raises(ValueError, match="wall_us: .*calls = 0"):
        timing.wall_us(runs, calls=0, repeats=1)


def test_host_us_is_the_median_per_call_without_sync(monkeypatch):
    from moe_spec import timing

    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    costs = iter([100.0] + [1.0] * 4 + [2.0] * 4 + [9.0] * 4)  # a warm-up call, then three repeats of four
    seen = []

    def fn(x):
        seen.append(x)
        clock.work("call", next(costs))

    assert timing.host_us(fn, {"x": 7}, calls=4, repeats=3) == pytest.approx(2.0)
    assert seen == [7] * 13 and clock.log == ["call"] * 13


def test_the_eager_study_profiles_where_the_host_time_goes():
    """compare.studies.eager --profile: the first rows by own time of N calls, pstats' header first."""
    from compare.studies.eager import profile_rows

    calls = []

    def fn(n):
        calls.append(n)
        return sorted(range(n), key=lambda i: -i)

    rows = profile_rows(fn, {"n": 50}, calls=7, rows=5)
    assert rows[0].split()[:2] == ["ncalls", "tottime"] and 2 <= len(rows) <= 6
    assert len(calls) == 8  # one warm-up call, then the profiled ones
    assert any("fn)" in row and row.split()[0] == "7" for row in rows[1:]), rows

"""``python -m compare.studies.profile`` on the CPU: the kernel-name rule, the aggregation of profiler events, the
two phases with a stand-in clock and profiler (a real Triton backend through the interpreter, and
failing cells), the reports, and the one-line refusals of bad options and of a used ``--out``."""

import json
import time

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

import compare.studies.profile as prof
from compare.backends import Backend, load_backend
from compare.timed import Clock
from moe_spec.problem import MoEShape, get_shape
from moe_spec.quant import get_format
from moe_spec.timing import Timing

TINY = MoEShape("tiny", 4, 2, 64, 32, "a layer small enough for the Triton interpreter")

# Kernel names as the profiler reports them: Triton names a kernel after its @triton.jit function
# (triton_moe/align.py, triton_moe/kernels.py); the CuTe DSL as kernel_cutlass_<method>_<module><Class>
# followed by its mangled arguments (which contain "align16" whatever the kernel does); torch as C++.
CUTE = "kernel_cutlass_kernel_cute_moe{}_object_at__tensorptrbf16gmemalign16o1024_tensorptri32gmemalign16o1_0"
NAMES = [
    ("moe_gemm_kernel", "gemm"),
    ("_count_kernel", "alignment"),
    ("_place_kernel", "alignment"),
    ("amax_kernel", "quantize"),
    ("quantize_kernel", "quantize"),
    ("combine_kernel", "combine"),
    (CUTE.format("alignopsCountExperts"), "alignment"),
    (CUTE.format("alignopsPlacePairs"), "alignment"),
    (CUTE.format("gemmGroupedGemm"), "gemm"),
    (CUTE.format("gemmGroupedGemm").replace("kernel_cute_moe", "kernel_fp8_cute_moe"), "gemm"),
    (CUTE.format("rowopsGatherRows"), "gather"),
    (CUTE.format("rowopsSiluMul"), "activation"),
    (CUTE.format("rowopsCombineRows"), "combine"),
    (CUTE.format("rowopsWeightedCombineRows"), "combine"),
    (CUTE.format("rowopsScaleRows"), "quantize"),
    (CUTE.format("quantopsRowAmax"), "quantize"),
    (CUTE.format("quantopsQuantizeRows"), "quantize"),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul> >"
        "(int, at::native::FillFunctor<int>, std::array<char*, 1ul>)",
        "torch",
    ),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<bool, at::native::func_wrapper_t<bool, "
        "at::native::or_kernel_cuda(at::TensorIterator&)::{lambda(bool, bool)#1}>, unsigned int, bool, 4, 4> >"
        "(at::native::ReduceOp<bool>)",
        "torch",
    ),
    (
        "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, int, long, at::native::LTOp<int, true>, unsigned int>"
        "(at::cuda::detail::TensorInfo<int, unsigned int>)",
        "torch",
    ),
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("Memset (Device)", "memset"),
    ("my_fused_kernel", "other"),
]


@pytest.mark.parametrize("name, stage", NAMES)
def test_a_kernel_name_gives_its_stage(name, stage):
    assert prof.stage_of(name) == stage


def test_the_display_name_drops_the_cute_arguments_and_short_cuts_to_the_width():
    assert prof.display_name(CUTE.format("gemmGroupedGemm")) == "kernel_cute_moegemmGroupedGemm"
    long = prof.short(NAMES[17][0])
    assert len(long) == prof.NAME_WIDTH and long.endswith("…") and long.startswith("at::native::vectorized")
    assert prof.short("moe_gemm_kernel") == "moe_gemm_kernel"


def test_aggregate_groups_by_name_per_layer_call():
    per_call = [
        ("moe_gemm_kernel", 40.0),
        ("_count_kernel", 2.0),
        ("moe_gemm_kernel", 30.0),
        ("Memset (Device)", 1.0),
        ("combine_kernel", 5.0),
        ("_place_kernel", 3.0),
    ]
    other_call = [(n, us + 1.0 if n == "moe_gemm_kernel" else us) for n, us in per_call]
    a = prof.aggregate(per_call + other_call, calls=2)
    assert a["calls"] == 2 and a["launches_per_call"] == 5 and a["memset_per_call"] == 1
    assert a["memcpy_per_call"] == 0
    assert a["busy_us"] == pytest.approx(82.0)  # (81 + 83) / 2
    assert a["stages"] == pytest.approx({"alignment": 5.0, "gemm": 71.0, "combine": 5.0, "memset": 1.0})
    gemm = a["kernels"][0]
    assert gemm["name"] == "moe_gemm_kernel" and gemm["calls_per_call"] == 2 and gemm["count"] == 4
    assert gemm["us_per_call"] == pytest.approx(71.0) and gemm["share"] == pytest.approx(71 / 82)
    assert [k["name"] for k in a["kernels"]][1:] == [
        "combine_kernel",
        "_place_kernel",
        "_count_kernel",
        "Memset (Device)",
    ]
    assert sum(k["share"] for k in a["kernels"]) == pytest.approx(1.0)
    # the same sequence in every call: each name's µs per launch, in call order (GEMM1, then GEMM2)
    assert gemm["launch_us"] == pytest.approx([40.5, 30.5]) and a["kernels"][1]["launch_us"] == [5.0]
    shuffled = prof.aggregate(per_call + other_call[::-1], calls=2)
    assert shuffled["kernels"][0]["launch_us"] is None and shuffled["busy_us"] == pytest.approx(82.0)
    assert prof.aggregate(per_call + per_call[:2], calls=2)["kernels"][0]["launch_us"] is None


def test_aggregate_of_nothing_and_a_bad_call_count():
    empty = prof.aggregate([], calls=20)
    assert empty["kernels"] == [] and empty["busy_us"] == 0 and empty["launches_per_call"] == 0
    with pytest.raises(ValueError, match="calls"):
        prof.aggregate([("k", 1.0)], calls=0)


def test_device_records_keep_the_cuda_events_of_the_profiler():
    events = [  # a profiler without a device set reads device_time_total 0: the event's own range counts
        FunctionEvent(2, "combine_kernel", 1, 40, 47, device_type=DeviceType.CUDA),
        FunctionEvent(0, "moe_gemm_kernel", 1, 10, 35, use_device="cuda", device_type=DeviceType.CUDA),
        FunctionEvent(1, "cudaLaunchKernel", 1, 5, 9, use_device="cuda", device_type=DeviceType.CPU),
    ]
    assert prof.device_records(events) == [("moe_gemm_kernel", 25.0), ("combine_kernel", 7.0)]  # in launch order


# --- cells ---------------------------------------------------------------------------------------------


def test_every_target_cell_names_a_catalog_shape_a_format_and_a_backend():
    cells = prof.TARGET_CELLS
    assert len(cells) == 26 and len(set((c.backend, c.shape, c.T, c.quant) for c in cells)) == 26
    for c in cells:
        assert get_shape(c.shape).label == c.shape
        assert get_format(prof.QUANT_NAMES[c.quant]).label == c.quant
        assert c.backend in prof.BACKENDS and c.T >= 1 and c.target_us > 0
    assert get_shape("deepseek-v3:tp8").intermediate == 256


def test_select_cells_filters_the_targets():
    assert list(prof.select_cells()) == list(prof.TARGET_CELLS)
    fp8 = prof.select_cells(backends=("triton_moe",), quants=("fp8_tensor",))
    assert [(c.shape, c.T, c.target_us) for c in fp8] == [
        ("mixtral-8x7b", 128, 420),
        ("mixtral-8x7b", 4096, 2900),
        ("qwen3-30b-a3b", 4096, 520),
        ("deepseek-v3:tp8", 1, 50),
        ("deepseek-v3:tp8", 4096, 950),
    ]
    ds = prof.select_cells(shapes=("deepseek-v3:tp8",), tokens=(4096,))
    assert [(c.backend, c.quant) for c in ds] == [
        ("cute_moe", "bf16"),
        ("triton_moe", "bf16"),
        ("triton_moe", "fp8_tensor"),
        ("cute_moe", "fp8_tensor"),
        ("cute_moe", "fp8_block"),
    ]
    assert prof.select_cells(quick=True) == list(prof.TARGET_CELLS[: prof.QUICK_CELLS])


def test_a_grid_runs_every_combination_and_keeps_the_targets_it_meets():
    cells = prof.select_cells(backends=("triton_moe",), shapes=("qwen3-30b-a3b",), tokens=(1, 64), grid=True)
    assert [(c.T, c.quant, c.target_us) for c in cells] == [(1, "bf16", 38.0), (64, "bf16", None)]


def test_parse_args_normalizes_the_lists():
    args = prof.parse_args(["--shapes", "DeepSeek-V3:TP8", "--quants", "FP8_Block", "--list"])
    assert [c.title for c in args.cells] == ["cute_moe deepseek-v3:tp8 fp8_block T=4096"]
    assert args.time_budget == 450 and args.calls == prof.PROFILE_CALLS and not args.quick


def test_list_prints_the_cells_without_a_gpu(capsys):
    assert prof.main(["--backends", "cute_moe", "--quants", "fp8_channel", "--list"]) == 0
    assert capsys.readouterr().out.strip() == "cute_moe mixtral-8x7b fp8_channel T=4096  target 3000 µs"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backends", "cute_moe,vllm"], "--backends: unknown name 'vllm'"),
        (["--shapes", "gpt5"], "--shapes: unknown shape 'gpt5'"),
        (["--quants", "int4"], "--quants: unknown name 'int4'"),
        (["--tokens", "0"], "--tokens: bad token count '0'"),
        (["--tokens", "1,,8"], "--tokens: empty item"),
        (["--calls", "0"], "--calls: expected a positive integer"),
        (["--calls", "x"], "argument --calls: invalid int value"),
        (["--time-budget", "-1"], "--time-budget: expected a finite number of seconds > 0"),
        (["--time-budget", "nan"], "--time-budget"),
        (["--grid", "--backends", "triton_moe"], "--grid: needs --tokens"),
        (["--tokens", "3"], "no target cell matches"),
        (["--quick", "--cells-all"], "not allowed with argument"),
    ],
)
def test_bad_options_are_one_line_naming_the_option(args, message, tmp_path, capsys):
    start = time.monotonic()
    assert prof.main(args + ["--out", str(tmp_path / "new")]) == 2
    assert time.monotonic() - start < 5
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and message in captured.err
    assert not (tmp_path / "new").exists()


def test_out_must_be_a_new_or_empty_directory(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "profile.md").write_text("an earlier run")
    (tmp_path / "file").write_text("x")
    for argv, why in (
        (["--out", str(used)], "is not empty"),
        (["--out", str(tmp_path / "file")], "exists and is not a directory"),
        ([], "required: a new or empty directory for profile.json and profile.md"),
    ):
        assert prof.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m compare.studies.profile: error: --out: ") and why in err, err
        assert len(err.strip().splitlines()) == 1
    assert (used / "profile.md").read_text() == "an earlier run"
    assert prof.parse_args(["--out", str(tmp_path / "a" / "b")]).out == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # checked, not created


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_without_a_gpu_the_run_stops_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        prof.main(["--quick", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- the two phases with stand-ins -----------------------------------------------------------------------


def _clock(log, seconds=0.0):
    def time_graph(make_call, n_sets, use_graph=True, **options):
        make_call(0)()
        log.append(("graph" if use_graph else "eager", options))
        time.sleep(seconds)
        return Timing(median_us=100.0, p10_us=90.0, p90_us=110.0, min_us=90.0, samples=1, calls_per_sample=1)

    return Clock(time=time_graph, ceilings=None, sync=lambda: None, device=lambda: "stand-in clock (CPU)")


class _Recorder:
    """A backend whose every call emits the device events of one layer call; the stand-in profiler
    returns the events emitted while it ran."""

    def __init__(self, fail=None):
        self.events, self.fail = [], fail

    def fused_moe(self, x, quant=None, **kwargs):
        if self.fail is not None and quant == "fp8_tensor":
            raise self.fail
        self.events += [
            ("_count_kernel", 2.0),
            ("moe_gemm_kernel", 40.0),
            ("moe_gemm_kernel", 30.0),
            ("combine_kernel", 5.0),
        ]
        return x.clone()

    def profile(self, run):
        start = len(self.events)
        run()
        return self.events[start:]


def _env(recorder, log, backends=None, seconds=0.0, profile=None):
    backends = backends or {}
    load = lambda name: backends.get(name) or Backend(name, fused_moe=recorder.fused_moe)  # noqa: E731
    return prof.Env(
        clock=_clock(log, seconds),
        profile=profile or recorder.profile,
        device="cpu",
        shape_of=lambda label: TINY,
        load=load,
    )


def test_both_phases_fill_each_row_and_a_failing_cell_says_why(tmp_path):
    recorder, log, written = _Recorder(fail=NotImplementedError("cute_moe: fp8_tensor is not built")), [], []
    cells = [
        prof.Cell("triton_moe", "tiny", 3, "bf16", 150.0),
        prof.Cell("triton_moe", "tiny", 3, "fp8_tensor", 50.0),
        prof.Cell("cute_moe", "tiny", 3, "bf16", 50.0),
        prof.Cell("triton_moe", "tiny", 5, "bf16", None),
    ]
    missing = {"cute_moe": Backend("cute_moe", missing="import cute_moe failed: ImportError: no cutlass")}
    result = prof.run_profile(
        cells,
        env=_env(recorder, log, missing),
        calls=4,
        command="pytest",
        commit="abc1234",
        write=lambda r: written.append(json.dumps(r)),
    )
    assert result["meta"]["commit"] == "abc1234" and result["meta"]["device"] == "stand-in clock (CPU)"
    ok, refused, absent, untargeted = result["cells"]
    assert ok["status"] == "ok" and ok["graph_us"] == 100.0 and ok["met"] is True and ok["timing"] == "graph"
    assert ok["eager_us"] > 0 and ok["profile_status"] == "ok"
    p = ok["profile"]
    assert p["launches_per_call"] == 4 and p["busy_us"] == pytest.approx(77.0)  # exactly the 4 profiled calls
    assert p["stages"] == pytest.approx({"alignment": 2.0, "gemm": 70.0, "combine": 5.0})
    assert refused["status"] == "not implemented: NotImplementedError: cute_moe: fp8_tensor is not built"
    assert refused["profile_status"] == "not profiled: the cell did not run" and "graph_us" not in refused
    assert absent["status"] == "not available: import cute_moe failed: ImportError: no cutlass"
    assert untargeted["status"] == "ok" and untargeted["met"] is None
    assert [kind for kind, _ in log] == ["graph", "graph"]
    assert log[0][1] == dict(replays=20, min_calls=10, warmup=2)  # the suite's full timing options
    assert len(written) >= 4 and json.loads(written[-1]) == json.loads(json.dumps(result))


def test_out_of_memory_and_a_failing_profiler_are_rows(tmp_path):
    recorder, log = _Recorder(fail=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")), []
    cells = [prof.Cell("triton_moe", "tiny", 3, "fp8_tensor", 50.0), prof.Cell("triton_moe", "tiny", 3, "bf16", 50.0)]
    result = prof.run_profile(cells, env=_env(recorder, log), calls=2)
    assert result["cells"][0]["status"].startswith("out of memory: OutOfMemoryError: CUDA out of memory.")
    assert result["cells"][1]["met"] is False

    def broken(run):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore")

    result = prof.run_profile(cells[1:], env=_env(recorder, log, profile=broken), calls=2)
    row = result["cells"][0]
    assert row["status"] == "ok" and row["graph_us"] == 100.0
    assert row["profile_status"] == "error: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"
    result = prof.run_profile(cells[1:], env=_env(recorder, log, profile=lambda run: run() or []), calls=2)
    assert result["cells"][0]["profile_status"].startswith("no device events recorded")


def test_the_time_budget_skips_cells_and_profiles_cleanly(monkeypatch):
    recorder, log = _Recorder(), []
    cells = [prof.Cell("triton_moe", "tiny", T, "bf16", 50.0) for T in (1, 2)]
    result = prof.run_profile(cells, env=_env(recorder, log), calls=2, time_budget_s=1.0)  # < 2 × the reserve
    assert [r["status"] for r in result["cells"]] == [
        "skipped: time budget (1 s): the rest was kept to profile the cells timed"
    ] * 2
    monkeypatch.setattr(prof, "PROFILE_RESERVE_S", 0.0)
    result = prof.run_profile(cells, env=_env(recorder, log, seconds=0.3), calls=2, time_budget_s=0.2)
    first, second = result["cells"]
    assert first["status"] == "ok" and first["profile_status"] == "skipped: time budget (0.2 s) spent"
    assert second["status"].startswith("skipped: time budget (0.2 s)")


def test_a_real_backend_runs_on_the_problem_the_cells_build():
    """triton_moe through the interpreter: the inputs, the sets and the calls are what a GPU run makes."""
    log, calls = [], []
    real = load_backend("triton_moe")
    counted = Backend("triton_moe", fused_moe=lambda **kw: calls.append(kw["quant"]) or real.fused_moe(**kw))
    env = prof.Env(
        clock=_clock(log),
        profile=lambda run: run() or [("moe_gemm_kernel", 1.0)],
        device="cpu",
        shape_of=lambda label: TINY,
        load=lambda name: counted,
    )
    cells = [prof.Cell("triton_moe", "tiny", 3, q, None) for q in ("bf16", "fp8_tensor")]
    result = prof.run_profile(cells, env=env, calls=1)
    assert [(r["status"], r["profile_status"]) for r in result["cells"]] == [("ok", "ok")] * 2
    assert result["cells"][0]["input_sets"] == 64  # a tiny layer: the most sets sets_for_cold_l2 gives
    # per cell: 3 warm-up + 1 in the stand-in clock + 1 eager; then per cell 3 warm-up + 1 profiled
    assert calls == [None] * 5 + ["fp8_tensor"] * 5 + [None] * 4 + ["fp8_tensor"] * 4  # phase 1, then phase 2


# --- reports ---------------------------------------------------------------------------------------------


def _result():
    meta = {
        "date": "2026-12-01 22:00 UTC",
        "device": "NVIDIA H200",
        "commit": "abc1234",
        "command": "python -m compare.studies.profile --out x",
        "calls": 20,
        "warmup_calls": 3,
        "stage_rules": {s: list(w) for s, w in prof.STAGE_RULES},
    }
    gemm = CUTE.format("gemmGroupedGemm")
    profile = prof.aggregate(
        [
            (gemm, 40.0),
            (CUTE.format("alignopsCountExperts"), 4.0),
            (NAMES[17][0], 1.5),
            ("moe_gemm_kernel", 7.0),
            ("moe_gemm_kernel", 3.0),
        ]
        * 20,
        20,
    )
    ok = {
        **prof.Cell("cute_moe", "qwen3-30b-a3b", 1, "bf16", 45.0).record(),
        "status": "ok",
        "graph_us": 52.25,
        "eager_us": 80.0,
        "met": False,
        "profile_status": "ok",
        "profile": profile,
    }
    failed = {
        **prof.Cell("cute_moe", "mixtral-8x7b", 4096, "fp8_channel", 3000.0).record(),
        "status": "not implemented: NotImplementedError: fp8_channel | not built",
        "profile_status": "not profiled: the cell did not run",
    }
    return {"meta": meta, "cells": [ok, failed]}


def test_markdown_has_the_header_the_summary_and_a_kernel_table_per_profiled_cell():
    md = prof.to_markdown(_result())
    assert "- device: NVIDIA H200" in md and "- commit: `abc1234`" in md
    assert "- command: `python -m compare.studies.profile --out x`" in md
    assert "| cute_moe qwen3-30b-a3b bf16 T=1 | 45.0 | 52.2 | **no** | 80.0 | 5 | 55.5 | 1.5 | 4.0 | 50.0 | ok |" in md
    assert (
        "| cute_moe mixtral-8x7b fp8_channel T=4096 | 3000.0 | — | — | — | — | — | — | — | — | "
        "not implemented: NotImplementedError: fp8_channel / not built |"
    ) in md
    assert md.count("\n## ") == 1 and "## cute_moe qwen3-30b-a3b bf16 T=1: graph 52.2 µs" in md
    assert "| `kernel_cute_moegemmGroupedGemm` | gemm | 1 | 40.0 | 72 % |" in md
    assert "| `moe_gemm_kernel` | gemm | 2 | 10.0 (7.0 + 3.0) | 18 % |" in md
    header = next(line for line in md.splitlines() if line.startswith("| cell |"))
    assert header.count("|") == md.splitlines()[md.splitlines().index(header) + 1].count("|")
    assert "torch µs" in header and "memcpy" not in header


def test_outputs_are_written_whole_and_read_back(tmp_path):
    result = _result()
    prof.write_outputs(result, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["profile.json", "profile.md"]
    assert json.loads((tmp_path / "out" / "profile.json").read_text()) == result
    assert (tmp_path / "out" / "profile.md").read_text() == prof.to_markdown(result)


def test_main_runs_both_phases_and_writes_the_reports_even_when_every_cell_fails(tmp_path, monkeypatch, capsys):
    """The command's wiring on a CPU: the device calls fail (no GPU), every cell becomes an error row."""
    monkeypatch.setattr(prof.runinfo, "require_cuda", lambda prog: None)
    monkeypatch.setattr(
        prof.timed, "GPU_CLOCK", Clock(time=None, ceilings=None, sync=lambda: None, device=lambda: "no GPU (test)")
    )
    out = tmp_path / "out"
    assert prof.main(["--quick", "--calls", "2", "--out", str(out), "--commit", "abc1234"]) == 0
    result = json.loads((out / "profile.json").read_text())
    expected = f"python -m compare.studies.profile --quick --calls 2 --out {out} --commit abc1234"
    assert result["meta"]["command"] == expected
    assert [r["cell"] for r in result["cells"]] == [c.title for c in prof.TARGET_CELLS[: prof.QUICK_CELLS]]
    assert all(
        r["status"].startswith("error: ") and r["profile_status"].startswith("not profiled") for r in result["cells"]
    )
    assert (out / "profile.md").read_text() == prof.to_markdown(result)
    printed = capsys.readouterr().out
    assert printed.startswith("| cell | target µs |") and f"wrote {out / 'profile.md'}" in printed


def test_a_cell_timed_without_a_graph_says_so_in_the_summary():
    recorder, log = _Recorder(), []
    loop = {"triton_moe": Backend("triton_moe", fused_moe=recorder.fused_moe, capturable=False)}
    result = prof.run_profile(
        [prof.Cell("triton_moe", "tiny", 3, "bf16", 50.0)], env=_env(recorder, log, loop), calls=2
    )
    assert log == [("eager", dict(replays=20, min_calls=10, warmup=2))]
    assert result["cells"][0]["timing"] == "eager (host-synchronizing loop)"
    assert prof.summary_table(result)[-1].endswith("| ok; graph µs timed eager (host-synchronizing loop) |")

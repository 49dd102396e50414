"""The suite through transformers' experts module: hf_triton_moe, hf_cute_moe, hf_grouped_mm.

CPU (Triton interpreter, reduced shapes, no clock): hf_triton_moe's rows pass the policy with
exactly triton_moe's numbers (its output has triton_moe's bits: the experts module hands the kernel
the same arguments); hf_cute_moe says it needs a GPU; a format transformers has no counterpart for
is declined in words; ``report.problems`` flags a FAIL of our kernels inside transformers, not of
transformers' own forward; the experts classes of the catalog's models compute the same function
(which is why the harness may run one class for every shape); and the project still imports and
lists every backend without transformers.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compare import cli, report, suite
from compare.backends import BACKEND_NAMES, HF_BACKENDS, load_backend
from compare.cases import DEFAULT_BACKENDS, SuiteSpec
from compare.metrics import tolerance_for

ROOT = Path(__file__).resolve().parents[1]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (the hf extra)")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

NUMERICS = ("status", "rel_l2", "max_abs", "max_ulp", "cosine", "deterministic", "batch_invariant", "err_vs_bf16")
NO_COUNTERPART = "not implemented: quant: 'fp8_tensor' has no transformers counterpart"


@pytest.fixture(scope="module")
def hf_result():
    spec = SuiteSpec(
        shapes=("qwen3-30b-a3b",),
        tokens=(8,),
        quants=(None, "fp8_block", "fp8_tensor"),
        backends=("triton_moe",) + tuple(HF_BACKENDS),
        device="cpu",
        jit=False,
        quick=True,
        command="test",
    )
    return suite.run_suite(spec, progress=False)


def _by(result) -> dict:
    return {(r["backend"], r["quant"]): r for r in result["rows"]}


@needs_transformers
def test_hf_triton_moe_rows_are_triton_moes_numbers(hf_result):
    by = _by(hf_result)
    for quant in ("bf16", "fp8_block"):
        ours, hf = by[("triton_moe", quant)], by[("hf_triton_moe", quant)]
        assert hf["status"] == "ok", hf
        assert hf["rel_l2"] <= tolerance_for(None if quant == "bf16" else quant).rel_l2
        assert {k: hf.get(k) for k in NUMERICS} == {k: ours.get(k) for k in NUMERICS}
        assert hf["config"].startswith("transformers ") and hf["config"].endswith(ours["config"])
        assert ("MixtralExperts" if quant == "bf16" else "FP8Experts") in hf["config"]
        assert hf["timing"] == "skipped: no GPU"
    assert report.problems(hf_result) == []


@needs_transformers
@pytest.mark.parametrize("quant", [None, "fp8_block"])
def test_hf_triton_moe_output_has_triton_moes_bits(quant):
    from moe_spec.problem import MoEShape, make_inputs

    inp = make_inputs(MoEShape("t", 8, 4, 256, 128, "test"), 8, quant, seed=3)
    ours = load_backend("triton_moe").fused_moe(**inp.kwargs())
    hf = load_backend("hf_triton_moe").fused_moe(**inp.kwargs())
    assert torch.equal(hf, ours)


@needs_transformers
def test_hf_cute_moe_and_other_formats_say_why_not(hf_result):
    by = _by(hf_result)
    for quant in ("bf16", "fp8_block"):
        assert by[("hf_cute_moe", quant)]["status"].startswith("not available: needs a Hopper GPU")
    for name in HF_BACKENDS:
        assert by[(name, "fp8_tensor")]["status"].startswith(NO_COUNTERPART), name
        assert by[(name, "fp8_tensor")]["config"] == ""
    assert by[("triton_moe", "fp8_tensor")]["status"] == "ok"  # the format itself runs here
    grouped = by[("hf_grouped_mm", "bf16")]
    assert grouped["status"] == "ok" and grouped["rel_l2"] <= tolerance_for(None).rel_l2
    assert "torch._grouped_mm" in grouped["config"]
    fp8 = by[("hf_grouped_mm", "fp8_block")]  # transformers' FP8 grouped_mm runs a Hub kernel, when it loads
    assert fp8["status"] == "ok" or fp8["status"].startswith(
        "not available: transformers' FP8 grouped_mm needs its Hub kernel"
    ), fp8
    table = report.compact_table(hf_result)
    for name in HF_BACKENDS:
        assert name in table
    assert "has no transformers counterpart" in table


def test_problems_flag_our_kernels_inside_transformers_not_transformers_own():
    row = dict(shape="s", quant="bf16", T=8, status="FAIL", check="rel_l2 2e-2 > 1e-2")
    result = {
        "rows": [
            {**row, "backend": "hf_triton_moe"},
            {**row, "backend": "hf_cute_moe"},
            {**row, "backend": "hf_grouped_mm"},
            {**row, "backend": "hf_grouped_mm", "T": 1, "status": "error: ImportError: no kernel"},
        ]
    }
    found = report.problems(result)
    assert len(found) == 3 and not any("hf_grouped_mm: numerics" in p for p in found)
    assert any("hf_triton_moe: numerics" in p for p in found) and any("hf_cute_moe: numerics" in p for p in found)


def test_hf_backends_are_not_in_the_default_run():
    assert not set(HF_BACKENDS) & set(DEFAULT_BACKENDS)
    assert cli._parse([]).backends == DEFAULT_BACKENDS
    assert cli._parse(["--backends", "all"]).backends == BACKEND_NAMES
    assert set(HF_BACKENDS) <= set(BACKEND_NAMES)
    assert cli._parse(["--backends", "HF_Triton_MoE,triton_moe"]).backends == ("hf_triton_moe", "triton_moe")
    assert all(not load_backend(name).capturable for name in HF_BACKENDS if not load_backend(name).missing)


@needs_transformers
def test_the_catalogs_experts_classes_compute_the_same_function():
    """Why one experts class may stand for every shape: each catalog model's class, same weights,
    same bits (transformers' grouped_mm and our triton_moe)."""
    import compare.hf_experts as hx
    from moe_spec.problem import CATALOG, MoEShape, make_inputs

    assert set(hx.CATALOG_MODEL_TYPES) == set(CATALOG)  # a new catalog shape needs its model type here
    assert hx.model_type_of("deepseek-v3:tp8") == "deepseek_v3" and hx.model_type_of("QWEN3-30B-A3B") == "qwen3_moe"
    with pytest.raises(ValueError, match="^shape: "):
        hx.model_type_of(MoEShape("gpt", 8, 2, 64, 32, "test"))
    inp = make_inputs(MoEShape("t", 8, 4, 256, 128, "test"), 8, None, seed=4)
    for implementation in ("grouped_mm", "triton_moe"):
        hx.register()
        want = hx.experts_fused_moe(implementation, hx.HARNESS_MODEL_TYPE)(**inp.kwargs())
        for model_type in sorted(set(hx.CATALOG_MODEL_TYPES.values())):
            got = hx.experts_fused_moe(implementation, model_type)(**inp.kwargs())
            assert torch.equal(got, want), (implementation, model_type)


def test_compare_lists_hf_backends_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from compare import cli, suite\n"
        "from compare.backends import HF_BACKENDS, load_backend\n"
        "from compare.cases import SuiteSpec\n"
        "assert set(HF_BACKENDS) <= set(cli._parse(['--backends', 'all']).backends)\n"
        "for name in HF_BACKENDS:\n"
        "    print(name, '|', load_backend(name).missing)\n"
        "spec = SuiteSpec(shapes=('mixtral-8x7b',), tokens=(1,), quants=(None,), backends=('hf_grouped_mm',),\n"
        "                 device='cpu', jit=False, ptx=False, command='test')\n"
        "print('row |', suite.run_suite(spec, progress=False)['rows'][0]['status'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split(" | ", 1) for line in run.stdout.splitlines())
    for name in HF_BACKENDS:
        assert lines[name].startswith(f"import {name} failed: ImportError: compare.hf_experts needs transformers")
    assert lines["row"].startswith(
        "not available: import hf_grouped_mm failed: ImportError: compare.hf_experts needs transformers"
    )


def _wall_clock_eager(make_call, n_sets, *, quick=False):
    """The eager column's stand-in on the CPU: one pass of plain calls round the sets, µs per call."""
    import time

    calls = [make_call(i) for i in range(n_sets)]
    start = time.perf_counter()
    for c in calls:
        c()
    return (time.perf_counter() - start) * 1e6 / n_sets


def _compiled_suite(
    hf_compiled: bool, compile=None, quants=(None, "fp8_block"), backends=("triton_moe", "hf_triton_moe")
):
    from compare.timed import Clock, compile_fullgraph
    from moe_spec import timing

    clock = Clock(
        time=lambda make_call, n, **_: timing.Timing(
            *(4 * [_wall_clock_eager(make_call, n)]), samples=1, calls_per_sample=n
        ),
        ceilings=lambda: timing.Ceilings(device="fake", copy_tbps=4.0, bf16_tflops=700.0, fp8_tflops=1300.0),
        sync=lambda: None,
        device=lambda: "stand-in clock (CPU)",
        eager=_wall_clock_eager,
        compile=compile or (lambda module: compile_fullgraph(module, backend="aot_eager")),
    )
    spec = SuiteSpec(
        shapes=("qwen3-30b-a3b",),
        tokens=(8,),
        quants=quants,
        backends=backends,
        device="cpu",
        jit=False,
        quick=True,
        hf_compiled=hf_compiled,
        command="test",
    )
    return suite.run_suite(spec, progress=False, clock=clock)


@needs_transformers
def test_hf_compiled_columns_time_the_compiled_experts_module():
    """--hf-compiled: the hf backend's call with transformers' experts module under
    torch.compile(fullgraph=True) (aot_eager here: dynamo traces it whole, our op one node) is timed
    as the eager column is, beside it, and gives the eager call's output; a backend without a module
    (triton_moe itself) and a run without the option get no compiled columns."""
    import torch

    compiled_modules = []

    def compile(module):
        compiled_modules.append(type(module).__name__)
        return torch.compile(module, fullgraph=True, dynamic=False, backend="aot_eager")

    torch._dynamo.reset()
    by = _by(_compiled_suite(True, compile))
    for quant in ("bf16", "fp8_block"):
        hf, ours = by[("hf_triton_moe", quant)], by[("triton_moe", quant)]
        assert hf["status"] == "ok" and "compiled_note" not in hf, hf
        assert hf["compiled_us"] > 0 and hf["compiled_ratio"] == pytest.approx(hf["compiled_us"] / hf["eager_us"])
        assert hf["compiled_rel_l2"] <= tolerance_for(None if quant == "bf16" else quant).rel_l2, hf
        assert "compiled_us" not in ours
    assert len(compiled_modules) == 2, compiled_modules  # one experts module per format, compiled once
    assert all(
        "compiled_us" not in r for r in _compiled_suite(False, quants=(None,), backends=("hf_triton_moe",))["rows"]
    )


@needs_transformers
def test_hf_compiled_names_what_did_not_compile():
    """A module that does not compile (here: a compile that refuses) leaves a note, not a number."""

    def refuse(module):
        raise RuntimeError("graph break in the stand-in compiler")

    row = _by(_compiled_suite(True, refuse, quants=(None,), backends=("hf_triton_moe",)))[("hf_triton_moe", "bf16")]
    assert row["status"] == "ok" and row["compiled_us"] is None
    assert row["compiled_note"] == "not compiled: RuntimeError: graph break in the stand-in compiler", row


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--hf-compiled", "--backends", "triton_moe"], "--hf-compiled: compiles the hf backends' experts module"),
        (["--hf-compiled", "--backends", "hf_triton_moe", "--cpu"], "--hf-compiled: the compiled columns are timings"),
    ],
)
def test_hf_compiled_options_are_named(argv, message, tmp_path, capsys):
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


class _Doubler(torch.nn.Module):
    def forward(self, x):
        return 2 * x


class _Set:
    def __init__(self, x):
        self.x = x

    def kwargs(self):
        return {"x": self.x}


def _module_backend():
    """A stand-in backend with a torch module, as the hf backends have: each ``compiled`` call makes a
    new module of one class (one per case)."""
    from compare.backends import Backend

    return Backend("stand-in", fused_moe=lambda x: 2 * x, compiled=lambda compile: lambda x: compile(_Doubler())(x))


def _stand_in_clock(compile):
    from compare.timed import Clock

    return Clock(
        time=None, ceilings=None, sync=lambda: None, device=lambda: "cpu", eager=_wall_clock_eager, compile=compile
    )


def test_compiled_columns_do_not_run_into_dynamos_recompile_limit():
    """Every case compiles a new module of one class for new sizes (``dynamic=False``); past dynamo's
    recompile limit (8) fullgraph would refuse, unless each case starts from reset caches
    (compare.timed._compiled)."""
    from compare.timed import _compiled, compile_fullgraph

    clock = _stand_in_clock(lambda m: compile_fullgraph(m, backend="aot_eager"))
    cases = [[_Set(torch.randn(T, 8)) for _ in range(2)] for T in range(1, 13)]
    rows = [_compiled(clock, _module_backend(), sets, None, 1.0, True) for sets in cases]
    assert all(r.get("compiled_us") and r["compiled_rel_l2"] == 0 for r in rows), rows


def test_a_compiled_output_that_differs_gives_no_number():
    from compare.timed import _compiled

    clock = _stand_in_clock(lambda m: lambda x: 3 * x)  # a "compiler" that changes the function
    row = _compiled(clock, _module_backend(), [_Set(torch.randn(4, 8))], None, 1.0, True)
    assert row["compiled_us"] is None and row["compiled_note"].startswith("differs from eager: rel L2 5.0e-01"), row

"""``python -m triton_moe.lab.promotion`` on the CPU: the study kernel in every promotion mode through the
interpreter (exact there: it checks what is computed, not the tensor core's rounding), what Triton
compiles each mode to for sm_90a, the verdict, a whole run with a stand-in clock (the layer through
the real backend), the reports, and the one-line refusals of bad options and of a used ``--out``."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import triton_moe.lab.promotion as pr
from moe_spec.problem import MoEShape
from moe_spec.timing import Timing

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

TINY = MoEShape("tiny", 4, 2, 128, 64, "a layer small enough for the Triton interpreter")


def _clock(log):
    def time_graph(make_call, n_sets, **options):
        assert options == pr.TIMING and n_sets >= 2
        make_call(n_sets - 1)()
        log.append(n_sets)
        return Timing(median_us=100.0 + len(log), p10_us=0, p90_us=0, min_us=0, samples=1, calls_per_sample=1)

    return time_graph


def _env(log):
    return pr.Env(
        time=_clock(log),
        sync=lambda: None,
        device_name=lambda: "stand-in (CPU)",
        device="cpu",
        rows=64,
        time_gemm=(64, 64, 512),
        block_mn=32,
        layer_shape=lambda: TINY,
        layer_T=8,
    )


# --- the kernel ----------------------------------------------------------------------------------------------


def test_modes_and_the_intervals_a_format_has():
    assert [pr.mode_of(n, "fp8_tensor") for n in pr.INTERVALS] == [pr.STEP] + [pr.WITHIN] * 3 + [pr.GROUPED] * 2 + [
        pr.ALL_K
    ]
    assert [pr.applies(n, "fp8_block") for n in pr.INTERVALS] == [True] * 4 + [False] * 3
    with pytest.raises(ValueError, match="^interval: 256 under fp8_block: its scales change every 128 of K"):
        pr.mode_of(256, "fp8_block")
    with pytest.raises(ValueError, match="^interval: expected one of 0, 32, 64, 128, 256, 512, never, got 96"):
        pr.mode_of(96, "fp8_tensor")
    assert [pr.effective(n) for n in (0, 32, 128, pr.NEVER)] == [128, 32, 128, 2**30]
    assert pr.catalog_max_k() == 16384  # Mixtral-8x22B's intermediate: GEMM2's K


@pytest.mark.parametrize("quant", pr.FORMATS)
def test_every_mode_computes_the_w8a8_product(quant):
    for K in (512, 1024):
        p = pr.gemm_problem(64, 32, K, quant, seed=K, device="cpu")
        ref = pr.reference(p)
        assert ref.dtype == torch.float64 and ref.shape == (64, 32)
        for n in pr.INTERVALS:
            if not pr.applies(n, quant):
                continue
            out = pr.fp8_gemm(p["a"], p["a_scale"], p["w"], p["w_scale"], quant, n, block_mn=32)
            assert out.dtype == torch.float32 and pr.rel_l2(out, ref) < 1e-6, (quant, K, n)
    wrong = pr.fp8_gemm(p["a"], p["a_scale"], p["w"], p["w_scale"] * 2, quant, 0, block_mn=32)
    assert pr.rel_l2(wrong, ref) == pytest.approx(1.0, rel=1e-5)  # the scales are read: a test that can fail


def test_sizes_the_kernel_does_not_take_are_refused():
    p = pr.gemm_problem(64, 32, 384, "fp8_tensor", seed=0, device="cpu")
    with pytest.raises(ValueError, match="^K = 384: must be a multiple of 256"):
        pr.fp8_gemm(p["a"], p["a_scale"], p["w"], p["w_scale"], "fp8_tensor", 256, block_mn=32)
    with pytest.raises(ValueError, match="^N = 32: must be a multiple of 64"):
        pr.fp8_gemm(p["a"], p["a_scale"], p["w"], p["w_scale"], "fp8_tensor", 0, block_mn=64)
    with pytest.raises(ValueError, match=r"^w: expected \[N, K=384\]"):
        pr.fp8_gemm(p["a"], p["a_scale"], p["w"][:, :128], p["w_scale"], "fp8_tensor", 0, block_mn=32)


SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_spec.quant import get_format
from triton_moe.lab.promotion import BLOCK_K, FORMATS, INTERVALS, applies, label, mode_of, promotion_gemm_kernel as k

sig = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "out_ptr": "*fp32",
       "M": "i32", "N": "i32", "K": "i32"}
attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig}
out = {}
for quant in FORMATS:
    for n in [n for n in INTERVALS if applies(n, quant)]:
        cex = dict(BLOCKWISE=get_format(quant).scales_along_k, MODE=mode_of(n, quant), INTERVAL=n, INTERPRETER=False,
                   BLOCK_M=128, BLOCK_N=128, BLOCK_K=BLOCK_K)
        src = ASTSource(k, signature={a: sig.get(a, "constexpr") for a in k.arg_names}, constexprs=cex, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
        ttgir = c.asm["ttgir"]
        intervals = sorted({int(v) for v in re.findall(r"maxNumImpreciseAcc = (\d+)", ttgir)})
        out[f"{quant} {label(n)}"] = [intervals, len(re.findall(r"= arith.addf", ttgir)), "e4m3" in c.asm["ptx"],
                                      bool(c.asm["cubin"])]
print(json.dumps(out))
"""


def test_what_triton_compiles_each_mode_to_for_sm90():
    """TTGIR: the dot's promotion interval and the fp32 adds of the loop; PTX: E4M3 WGMMA; a cubin (ptxas ran)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env)
    if run.returncode and "No such file" in run.stderr and "ptxas" in run.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    never = 2**30
    assert got == {  # [maxNumImpreciseAcc values, fp32 adds (arith.addf), E4M3 operands, cubin]
        "fp8_tensor 0": [[never], 1, True, True],  # acc += dot(a, w): the dot from zero, then one add
        "fp8_tensor 32": [[32], 0, True, True],
        "fp8_tensor 64": [[64], 0, True, True],
        "fp8_tensor 128": [[128], 0, True, True],  # Triton's lowering promotes inside the dot
        "fp8_tensor 256": [[never], 1, True, True],
        "fp8_tensor 512": [[never], 1, True, True],  # partial, then add
        "fp8_tensor never": [[never], 0, True, True],  # the tensor core's accumulator for all of K
        "fp8_block 0": [[never], 1, True, True],
        "fp8_block 32": [[32], 1, True, True],
        "fp8_block 64": [[64], 1, True, True],
        "fp8_block 128": [[128], 1, True, True],
    }


# --- the verdict ------------------------------------------------------------------------------------------


def _rows(quant, errors):
    """Rows of :func:`pr.accuracy`'s shape from {n: {K: rel L2}}."""
    return [
        {
            "quant": quant,
            "n": n,
            "effective": pr.effective(n),
            "rel_l2": {str(k): v for k, v in errors.get(n, {}).items()},
        }
        for n in pr.INTERVALS
    ]


KS = (1024, 4096, 16384)
ERRORS = {
    0: dict.fromkeys(KS, 1e-4),
    32: dict.fromkeys(KS, 5e-5),
    64: dict.fromkeys(KS, 8e-5),
    128: dict.fromkeys(KS, 1e-4),
    256: dict.fromkeys(KS, 5e-3),
    512: {1024: 5e-3, 4096: 9e-3, 16384: 1.5e-2},
    pr.NEVER: {1024: 8e-3, 4096: 2e-2, 16384: 4e-2},
}


def test_the_verdict_is_the_largest_interval_within_tolerance_at_every_k():
    v = pr.verdict(_rows("fp8_tensor", ERRORS), "fp8_tensor", KS, 1e-2, 14336)
    assert v["judged_ks"] == [1024, 4096, 16384] and v["covers_catalog"]
    assert (v["largest"], v["largest_ns"]) == (256, ["256"])
    assert (v["config_largest"], v["config_ns"]) == (128, ["0", "128"])
    # measured only to 4096: 512 passes there, but that is no verdict for the catalog
    v = pr.verdict(_rows("fp8_tensor", ERRORS), "fp8_tensor", (1024, 4096), 1e-2, 14336)
    assert (v["largest"], v["covers_catalog"]) == (512, False)
    # K beyond the first that covers the catalog do not count
    errors = {n: {**e, 32768: 1.0} for n, e in ERRORS.items()}
    v = pr.verdict(_rows("fp8_tensor", errors), "fp8_tensor", KS + (32768,), 1e-2, 14336)
    assert v["judged_ks"] == [1024, 4096, 16384] and v["largest"] == 256
    # a cell not measured (a string) or not applicable (None) never passes
    errors = {**ERRORS, 256: {**ERRORS[256], 4096: "skipped: time budget spent"}}
    assert pr.verdict(_rows("fp8_tensor", errors), "fp8_tensor", KS, 1e-2, 14336)["largest"] == 128
    assert pr.verdict(_rows("fp8_tensor", {}), "fp8_tensor", KS, 1e-2, 14336)["largest"] is None


# --- a run with stand-ins ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def result():
    log = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pr, "sets_for_cold_l2", lambda nbytes: 2)  # a tiny layer would get 64 sets
        return pr.run(
            pr.FORMATS,
            (512, 1024),
            env=_env(log),
            command="python -m triton_moe.lab.promotion --out x",
            commit="abc1234",
        ), log


def test_a_run_fills_accuracy_gemm_and_layer_columns(result):
    result, log = result
    assert result["meta"]["device"] == "stand-in (CPU)" and result["meta"]["commit"] == "abc1234"
    rows = {(r["quant"], r["n"]): r for r in result["rows"]}
    assert len(rows) == 2 * len(pr.INTERVALS)
    for (quant, n), r in rows.items():
        if pr.applies(n, quant):
            assert all(0 <= v < 1e-6 for v in r["rel_l2"].values()) and r["gemm_us"] > 100
        else:
            assert r["rel_l2"] == {"512": None, "1024": None} and "gemm_us" not in r
    layer = [k for k, r in rows.items() if "layer_us" in r]
    # the layer as it runs, in the row of its kernels' interval (K steps of at most 128: n = 0)
    assert layer == [("fp8_tensor", 0), ("fp8_block", 0)]
    assert all(rows[k]["layer_rel_l2"] < 1e-2 for k in layer)  # the real layer, through the interpreter
    assert result["layer"]["fp8_tensor"]["shape"] == "tiny" and result["layer"]["fp8_block"]["T"] == 8
    assert [result["layer"][q]["n"] for q in pr.FORMATS] == [0, 0]
    assert len(log) == 7 + 4 + 1 + 1  # GEMM: 7 + 4 intervals; layer: one per format
    assert [v["largest"] for v in result["verdicts"]] == [2**30, 128]  # exact on the CPU: every interval passes
    assert [v["covers_catalog"] for v in result["verdicts"]] == [False, False]


def test_the_time_budget_skips_cells():
    log = []
    env = _env(log)
    result = pr.run(["fp8_tensor"], (512,), env=env, layer=False, time_budget_s=1e-9)
    assert (
        all(
            r["rel_l2"] == {"512": "skipped: time budget spent"} and r["gemm_us"] == "skipped: time budget spent"
            for r in result["rows"]
        )
        and not log
    )
    assert result["layer"] == {} and result["verdicts"][0]["largest"] is None


def test_markdown_names_the_run_and_has_the_table(result):
    result, _ = result
    md = pr.to_markdown(result)
    assert "- device: stand-in (CPU)" in md and "- commit: `abc1234`" in md and "- date: " in md
    assert "- command: `python -m triton_moe.lab.promotion --out x`" in md
    assert "- layer (fp8_tensor): tiny, T = 8, " in md
    assert "| format | n | promoted every | rel L2 K=512 | rel L2 K=1024 | GEMM µs | layer µs | layer rel L2 |" in md
    assert "| fp8_block | never | never | n/a | n/a | n/a | — | — |" in md
    row = next(line for line in md.splitlines() if line.startswith("| fp8_tensor | 32 | 32 of K |"))
    assert row.count("|") == 9 and "e-" in row
    assert (
        "- fp8_block: the largest interval with rel L2 ≤ 0.01 at K = 512, 1024: 128 of K (n = 0 or 128); the "
        "largest within one K step: 128 (n = 0 or 128) (the K measured stop below the catalog's largest, 16384"
    ) in md


def test_outputs_are_written_whole(result, tmp_path):
    result, _ = result
    pr.write_outputs(result, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(pr.FILES)
    assert json.loads((tmp_path / "out" / "promotion.json").read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "out" / "promotion.md").read_text() == pr.to_markdown(result)


def test_main_runs_and_prints_the_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pr.runinfo, "require_cuda", lambda prog: None)
    env = _env([])
    monkeypatch.setattr(pr, "Env", lambda: env)
    out = tmp_path / "out"
    assert pr.main(["--ks", "512", "--formats", "fp8_block", "--no-layer", "--out", str(out)]) == 0
    result = json.loads((out / "promotion.json").read_text())
    assert (
        result["meta"]["command"] == f"python -m triton_moe.lab.promotion --ks 512 --formats fp8_block --no-layer "
        f"--out {out}"
    )
    assert {r["quant"] for r in result["rows"]} == {"fp8_block"} and result["layer"] == {}
    captured = capsys.readouterr()
    assert captured.out.startswith("| format | n |") and "- fp8_block: the largest interval" in captured.out
    assert "accuracy fp8_block K=512: 0 " in captured.err and "256 n/a" in captured.err


# --- options ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ks", "1000"], "--ks: bad K '1000': expected positive multiples of 512"),
        (["--ks", "0"], "--ks: bad K '0'"),
        (["--ks", "512,,1024"], "--ks: empty item"),
        (["--formats", "fp8_channel"], "--formats: unknown format 'fp8_channel'; known: fp8_tensor, fp8_block"),
        (["--time-budget", "0"], "--time-budget: expected a finite number of seconds > 0"),
        (["--time-budget", "x"], "argument --time-budget: invalid float value: 'x'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_options_are_one_line_naming_the_option(args, message, tmp_path, capsys):
    start = time.monotonic()
    assert pr.main(args + ["--out", str(tmp_path / "new")]) == 2
    assert time.monotonic() - start < 5
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and message in captured.err
    assert captured.err.startswith("python -m triton_moe.lab.promotion: error: ")
    assert not (tmp_path / "new").exists()


def test_out_must_be_a_new_or_empty_directory(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "promotion.md").write_text("an earlier run")
    (tmp_path / "file").write_text("x")
    for argv, why in (
        (["--out", str(used)], "is not empty"),
        (["--out", str(tmp_path / "file")], "exists and is not a directory"),
        (["--out", str(tmp_path / "file" / "sub")], "cannot create"),
        ([], "required: a new or empty directory for promotion.md and promotion.json"),
    ):
        assert pr.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m triton_moe.lab.promotion: error: --out: ") and why in err, err
        assert len(err.strip().splitlines()) == 1
    assert (used / "promotion.md").read_text() == "an earlier run"
    assert pr.parse_args(["--out", str(tmp_path / "a" / "b")]).out == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # checked, not created


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_without_a_gpu_the_run_stops_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        pr.main(["--out", str(tmp_path / "out")])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

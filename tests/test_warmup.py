"""The warm-up (moe_spec.warmup, triton_moe.warmup, cute_moe.warmup) and the study (compare.warm_study), on the CPU.

After ``warmup(E, K, I, top_k, quant, max_tokens)`` a sweep of every T = 1 … max_tokens (a reduced layer)
or of ≈ 250 values up to 16384 (a catalog layer: powers of two, 2ᵏ ± 1, odd values) must compile
nothing:

* Triton: the sweep's specialization keys (Triton's own binder, ``count_compilations(dry_run=True)``)
  are all among the warm-up's — for bf16 and every FP8 format, with both ``topk_ids`` dtypes,
  the heuristic and the H200's tuned tables;
* CuTe: every GEMM config the plan of each T picks is among the warm-up's, and compiling each
  T's plan (``compile_plan``) compiles nothing — for the kernels compiled to PTX on this CPU,
  the alignment's for both ``topk_ids`` dtypes included.

Dropping one plan from the enumeration the warm-up reads must make the sweep fail (both backends).
"""

import dataclasses
import importlib
import inspect
import json

import pytest
import torch

import cute_moe
import triton_moe
from compare import warm_study
from compare.warm_study import CPU_SHAPE, run_warm_study, sweep_tokens
from cute_moe import cache
from moe_spec.quant import QUANT_FORMATS
from moe_spec.validate import MoEDims
from moe_spec.warmup import WarmupReport, placeholder_inputs
from triton_moe import heuristic as triton_config
from triton_moe.jit import count_compilations

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

TRITON_WARMUP = importlib.import_module("triton_moe.warmup")  # the module (triton_moe.warmup is the function)
CUTE_WARMUP = importlib.import_module("cute_moe.warmup")
LAYERS = [(8, 2, 64, 32), (6, 1, 40, 24)]  # (E, top_k, K, I): a combine; top_k = 1, K not a multiple of 16
MAX_T = 512


def _triton_sweep(E, top_k, K, I, quant, tokens, static=False, **options):  # noqa: E741
    """fused_moe over ``tokens`` (dry run: keys only), topk_ids int32 at even T, int64 at odd T
    (``static``: with static activation scales); returns the plans the sweep met. Weights and x are
    placeholders: keys do not depend on values."""
    base = placeholder_inputs(E, K, I, top_k, quant, 1, "cpu")
    scales = {name: torch.ones(1) for name in ("a1_scale", "a2_scale")} if static else {}
    met = set()
    for T in tokens:
        # token t goes to experts 7t, 7t + 1, … (mod E): distinct in a row, spread over all experts
        topk_ids = (torch.arange(T)[:, None] * 7 + torch.arange(top_k)) % E
        topk_ids = topk_ids.to(torch.int64 if T % 2 else torch.int32)
        topk_weights = torch.full((T, top_k), 1 / top_k)
        triton_moe.fused_moe(
            torch.empty(T, K, dtype=torch.bfloat16),
            base.w1,
            base.w2,
            topk_weights,
            topk_ids,
            quant=quant,
            w1_scale=base.w1_scale,
            w2_scale=base.w2_scale,
            **scales,
            **options,
        )
        met.add(triton_moe.plan(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k), quant, **options))
    return met


def _triton_new_keys(E, top_k, K, I, quant, max_tokens, tokens=None, static=False, sweep_static=None, **options):  # noqa: E741
    """Warm-up (``static``), then the sweep (default: every T up to ``max_tokens``; static scales when
    ``sweep_static``, default ``static``), in one dry-run counter."""
    sweep_static = static if sweep_static is None else sweep_static
    with count_compilations(dry_run=True) as counter:
        report = triton_moe.warmup(E, K, I, top_k, quant, max_tokens=max_tokens, device="cpu", static=static, **options)
        counter.mark()
        met = _triton_sweep(E, top_k, K, I, quant, tokens or range(1, max_tokens + 1), sweep_static, **options)
        swept = {(name, key) for name, keys in counter.keys.items() for key in keys}
    return report, counter.new_keys, swept, met


@pytest.fixture
def grouped_only(monkeypatch):
    """The grouped pipeline at every T (the decode path's reach set to 0 pairs): for the tests of
    its kernels' warm-up (tests/test_triton_decode.py warms the decode kernel)."""
    monkeypatch.setattr(importlib.import_module("triton_moe.plan"), "DECODE_MAX_PAIRS", 0)
    importlib.import_module("triton_moe.moe").forget_plans()
    yield
    importlib.import_module("triton_moe.moe").forget_plans()


@pytest.mark.parametrize("quant", QUANT_FORMATS, ids=lambda q: q or "bf16")
@pytest.mark.parametrize("E, top_k, K, I", LAYERS, ids=["topk2", "topk1-K40"])
def test_triton_sweep_after_warmup_compiles_nothing(E, top_k, K, I, quant):  # noqa: E741
    report, new_keys, swept, met = _triton_new_keys(E, top_k, K, I, quant, MAX_T)
    assert new_keys == {}, f"compiled after the warm-up: {new_keys}"
    assert swept == report.covered  # nothing the layer needs is missing, nothing extra was warmed
    assert len(met) == len(report.plans) > 1  # the sweep crossed every bucket
    # what a fresh process compiles: per grouped plan GEMM1 and GEMM2, each per ids dtype (the GEMMs
    # read topk_ids for the device-side checks); per BLOCK_M the place kernel (per ids dtype); the
    # count kernel (per ids dtype); the combine (top_k > 1); FP8: the quantize kernel for x unless every
    # plan's GEMM1 quantizes x in its A load (triton_moe.plan.x_quant_in_gemm1), for the intermediate
    # unless every plan's GEMM1 epilogue does (triton_moe.plan.epilogue_quant) — a key of its own where
    # x was quantized in GEMM1 (it then leaves the amax zero) — plus the amax of x for fp8_tensor; the
    # decode plan's one kernel, per ids dtype
    grouped = [p for p in met if p.path == "grouped"]
    block_ms = {p.config.BLOCK_M for p in grouped}
    x_quant = any(not p.x_quant_in_gemm1() for p in grouped)
    act_quants = {p.x_quant_in_gemm1() for p in grouped if not p.epilogue_quant()}
    fp8 = 0 if quant is None else (quant == "fp8_tensor") + x_quant + len(act_quants)
    expected = 4 * len(grouped) + 2 * len(block_ms) + 2 + (top_k > 1) + fp8
    expected += 2 * (len(met) - len(grouped))
    assert report.count == len(report.covered) == expected


def test_triton_static_scales_sweep_after_static_warmup_compiles_nothing(grouped_only):
    # static fp8_tensor calls: GEMM1 quantizes the intermediate in its epilogue (QUANT_OUT) and x is
    # quantized by the given scale, keys of their own that only warmup(static=True) compiles
    E, top_k, K, I = LAYERS[0]  # noqa: E741
    report, new_keys, swept, met = _triton_new_keys(E, top_k, K, I, "fp8_tensor", 64, static=True)
    assert new_keys == {}, f"compiled after the static warm-up: {new_keys}"
    assert swept == report.covered and all(p.epilogue_quant(static=True) for p in met)
    _, missed, _, _ = _triton_new_keys(E, top_k, K, I, "fp8_tensor", 64, static=False, sweep_static=True)
    assert "moe_gemm_kernel" in missed, missed  # GEMM1 with QUANT_OUT (and x's static quantize kernel)


def test_triton_static_warmup_refusals():
    with pytest.raises(TypeError, match=r"^static: expected a bool"):
        triton_moe.warmup(8, 64, 32, 2, "fp8_tensor", device="cpu", static=1)
    with pytest.raises(ValueError, match=r"^static: static activation scales need quant='fp8_tensor'"):
        triton_moe.warmup(8, 64, 32, 2, "fp8_block", device="cpu", static=True)


@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=["bf16", "fp8_tensor"])
def test_triton_warmup_covers_the_h200_tables(quant, monkeypatch):
    monkeypatch.setattr(triton_config, "current_device_name", lambda: "NVIDIA H200")
    report, new_keys, _, met = _triton_new_keys(128, 8, 2048, 768, quant, 16384, sweep_tokens(16384))  # Qwen3-30B
    assert new_keys == {} and len(met) == len(report.plans) >= 3


@pytest.mark.parametrize("quant", [None, "fp8_block"], ids=["bf16", "fp8_block"])
def test_triton_warmup_covers_the_split_k_entries_of_the_h200_tables(quant, monkeypatch, grouped_only):
    """DeepSeek-V3 TP8's H200 tables split GEMM1's K four ways at T = 1 (a constexpr of its own):
    the warm-up compiles that kernel too, and no T up to 4096 meets a key it missed."""
    monkeypatch.setattr(triton_config, "current_device_name", lambda: "NVIDIA H200")
    report, new_keys, _, met = _triton_new_keys(256, 8, 7168, 256, quant, 4096, sweep_tokens(4096))
    assert new_keys == {} and len(met) == len(report.plans) >= 3
    assert {p.config.split_k for p in met} == {1, 4}
    # fp8_block: 64-wide GEMM1 tiles quantize the intermediate in a launch of its own, 128-wide ones in
    # GEMM1's epilogue (triton_moe.plan.epilogue_quant): both GEMM1 variants and the quantize were warmed
    assert {p.epilogue_quant() for p in met} == ({True, False} if quant else {False})


def test_triton_sweep_catches_a_plan_the_warmup_skipped(monkeypatch):
    full = triton_moe.plans_for(8, 64, 32, 2, None, MAX_T)
    monkeypatch.setattr(TRITON_WARMUP, "plans_for", lambda *a, **k: full[:1] + full[2:])
    _, new_keys, _, _ = _triton_new_keys(8, 2, 64, 32, None, MAX_T)
    assert new_keys.get("moe_gemm_kernel") == 4  # GEMM1 and GEMM2 of the skipped plan, per ids dtype


def test_triton_warmup_covers_the_callers_options():
    cfg = triton_moe.TritonConfig(32, 64, 64, swap_ab=False)
    report, new_keys, _, met = _triton_new_keys(8, 2, 64, 32, "fp8_channel", 64, config=cfg)
    assert new_keys == {} and len(report.plans) == len(met) == 1
    report, new_keys, _, met = _triton_new_keys(8, 2, 64, 32, None, MAX_T, swap_ab=False)
    assert new_keys == {} and all(not p.config.swap_ab for p in met)


def test_triton_warmup_compiles_both_tiles_of_a_gemm2_override(tmp_path, monkeypatch, grouped_only):
    """A config with GEMM2's own tile: the warm-up compiles GEMM1's tile and GEMM2's (a warm-up of
    the shared tile would leave GEMM2's two keys, one per ids dtype, to the first call), from the
    caller's config and from a tuned table's entry."""
    from triton_moe.config import Gemm2Tile

    shared = triton_moe.TritonConfig(16, 32, 32, 1, 4, 2)
    own = triton_moe.TritonConfig(16, 32, 32, 1, 4, 2, gemm2=Gemm2Tile(64, 64, 2, 8, 3))
    report, new_keys, _, met = _triton_new_keys(8, 2, 64, 32, "fp8_tensor", 64, config=own)
    assert new_keys == {} and len(report.plans) == len(met) == 1
    with count_compilations(dry_run=True) as counter:
        triton_moe.warmup(8, 64, 32, 2, "fp8_tensor", max_tokens=64, device="cpu", config=shared)
        counter.mark()
        _triton_sweep(8, 2, 64, 32, "fp8_tensor", [2, 3], config=own)
    assert counter.new_keys == {"moe_gemm_kernel": 2}

    monkeypatch.setattr(triton_config, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(triton_config, "current_device_name", lambda: "Fake GPU")
    table = {"1": shared.as_dict(), "128": dataclasses.replace(own, BLOCK_M=64).as_dict()}
    triton_config.table_path(8, 32, 64, None, "Fake GPU").write_text(json.dumps({"configs": table}))
    triton_config.load_table.cache_clear()
    try:
        report, new_keys, _, met = _triton_new_keys(8, 2, 64, 32, None, MAX_T)
    finally:
        triton_config.load_table.cache_clear()
    assert new_keys == {} and len(met) == len(report.plans) == 2
    assert {p.config.gemm2 for p in met} == {None, Gemm2Tile(64, 64, 2, 8, 3, swap_ab=False)}


def test_triton_warmup_with_one_ids_dtype_misses_the_other(grouped_only):
    with count_compilations(dry_run=True) as counter:
        triton_moe.warmup(8, 64, 32, 2, max_tokens=MAX_T, device="cpu", ids_dtypes=(torch.int32,))
        counter.mark()
        _triton_sweep(8, 2, 64, 32, None, [2, 3])  # int32, then int64
    # every kernel that reads topk_ids: the alignment's two and the GEMMs (their device-side checks)
    assert set(counter.new_keys) == {"_count_kernel", "_place_kernel", "moe_gemm_kernel"}


# ---- CuTe: compiled to PTX on this CPU ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cute_warm():
    """A warm-up from an empty compile cache (the module's own), for the reduced layer up to MAX_T."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache, "_cache", {})
        before = cache.compile_count()
        report = cute_moe.warmup(8, 64, 32, 2, max_tokens=MAX_T, device="cpu")
        yield report, cache.compile_count() - before


def _cute_sweep(report, tokens):
    """Per T: the plan's GEMMs are in the warm-up's set; compiling the plan compiles nothing.
    Returns (GEMM configs missing from the report, kernels the sweep compiled, plans met)."""
    missing, met, before = set(), set(), cache.compile_count()
    for T in tokens:
        p = cute_moe.plan(MoEDims(T=T, E=8, K=64, I=32, top_k=2))
        missing |= {cfg for cfg in (p.gemm1, p.gemm2) if ("grouped_gemm", cfg) not in report.covered}
        cute_moe.compile_plan(p)
        met.add(p)
    return missing, cache.compile_count() - before, met


def test_cute_sweep_after_warmup_compiles_nothing(cute_warm):
    report, compiled = cute_warm
    missing, swept_compiles, met = _cute_sweep(report, range(1, MAX_T + 1))
    assert not missing and swept_compiles == 0
    assert len(met) == len(report.plans) == len(importlib.import_module("cute_moe.plan").path_rule()) > 1
    gemms = {cfg for p in met for cfg in (p.gemm1, p.gemm2)}
    aligns = len(CUTE_WARMUP.ALIGN_KERNELS) * len(CUTE_WARMUP.IDS_DTYPES)
    assert compiled == report.count == len(gemms) + len(CUTE_WARMUP.ROW_KERNELS) + aligns
    assert [s.what for s in report.steps][-3:] == [
        "row kernels",
        "alignment kernels, int32 ids",
        "alignment kernels, int64 ids",
    ]
    assert all(s.seconds > 0 for s in report.steps)


def test_cute_alignment_of_either_ids_dtype_after_warmup_compiles_nothing(cute_warm):
    """The alignment kernels read topk_ids, one compile per dtype: after the warm-up neither an int32
    nor an int64 call's alignment, nor any plan for either dtype, compiles anything."""
    from cute_moe.alignops import compile_align_kernels

    report, _ = cute_warm
    before = cache.compile_count()
    for ids_dtype in (torch.int64, torch.int32):
        assert ("align", ids_dtype) in report.covered
        compile_align_kernels(ids_dtype)  # what sort_rows compiles for a call's topk_ids.dtype
        for p in cute_moe.plans_for(8, 64, 32, 2, None, MAX_T):
            assert cute_moe.compile_plan(p, ids_dtypes=(ids_dtype,)) == 0
    assert cache.compile_count() == before


def test_cute_warmup_of_one_ids_dtype_lists_its_alignment_only():
    int32 = cute_moe.warmup(8, 64, 32, 2, max_tokens=16, device="cpu", dry_run=True, ids_dtypes=(torch.int32,))
    both = cute_moe.warmup(8, 64, 32, 2, max_tokens=16, device="cpu", dry_run=True)
    assert both.count - int32.count == len(CUTE_WARMUP.ALIGN_KERNELS)
    aligns = [n for n in int32.compiled if n.startswith("align")]
    assert aligns == ["align count (int32 ids)", "align place (int32 ids)"]
    assert ("align", torch.int64) in both.covered and ("align", torch.int64) not in int32.covered


def test_cute_warmup_again_compiles_nothing(cute_warm):
    again = cute_moe.warmup(8, 64, 32, 2, max_tokens=MAX_T, device="cpu")
    assert again.count == 0 and again.covered == cute_warm[0].covered


def test_cute_sweep_catches_a_plan_the_warmup_skipped(monkeypatch):
    full = cute_moe.plans_for(8, 64, 32, 2, None, 40)  # T ≤ 40: token tiles 8 and 16
    assert len(full) == 2
    monkeypatch.setattr(CUTE_WARMUP, "plans_for", lambda *a, **k: full[:1])
    monkeypatch.setattr(cache, "_cache", {})
    report = cute_moe.warmup(8, 64, 32, 2, max_tokens=40, device="cpu")
    missing, swept_compiles, _ = _cute_sweep(report, range(1, 41))
    assert missing == {full[1].gemm1, full[1].gemm2} and swept_compiles == 2


def test_cute_dry_run_lists_without_compiling():
    before = cache.compile_count()
    report = cute_moe.warmup(128, 2048, 768, 8, max_tokens=16384, device="cpu", dry_run=True)
    assert cache.compile_count() == before and report.mode.startswith("dry run")
    # two GEMMs per grouped plan, the row kernels, the alignment's two per topk_ids dtype, and — where the
    # path rule sends T = 1 to the one launch — its kernel per topk_ids dtype
    one = cute_moe.plan(MoEDims(T=1, E=128, K=2048, I=768, top_k=8)).path == "decode"
    grouped = len(importlib.import_module("cute_moe.plan").path_rule())
    assert len(report.plans) == grouped + one and report.count == 2 * grouped + 3 + 2 * 2 + 2 * one


# ---- one interface, refusals ----------------------------------------------------------------------------


def test_both_backends_have_the_same_warmup():
    sig = {name: inspect.signature(mod.warmup).parameters for name, mod in (("cute", cute_moe), ("triton", triton_moe))}
    assert (
        list(sig["cute"])[:9]
        == list(sig["triton"])[:9]
        == ["E", "K", "I", "top_k", "quant", "max_tokens", "device", "dry_run", "ids_dtypes"]
    )
    assert sig["cute"]["ids_dtypes"].default == sig["triton"]["ids_dtypes"].default == (torch.int32, torch.int64)
    r = triton_moe.warmup(8, 64, 32, 2, "fp8_block", max_tokens=16, device="cpu")
    assert isinstance(r, WarmupReport) and r.backend == "triton_moe"
    d = json.loads(json.dumps(r.as_dict()))
    assert d["quant"] == "fp8_block" and d["compiled"] == r.count == sum(len(s["compiled"]) for s in d["steps"])
    assert f"{r.count:2d} kernels  in all" in r.summary()


@pytest.mark.parametrize("mod", [cute_moe, triton_moe], ids=["cute", "triton"])
@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((0, 64, 32, 2), {}, ValueError, r"^E: expected at least 1 expert \(E\), got 0"),
        ((8, 64, 32, 9), {}, ValueError, r"^top_k: expected 1 <= top_k <= E=8"),
        ((8, 64, 32, 2), {"max_tokens": 0}, ValueError, r"^max_tokens: expected at least 1 tokens"),
        ((8, 64, 32, 2), {"max_tokens": "64"}, TypeError, r"^max_tokens: expected an int"),
        ((8, 64.0, 32, 2), {}, TypeError, r"^K: expected an int"),
        ((8, 64, 32, 2, "fp9"), {}, ValueError, r"^quant: expected one of"),
    ],
)
def test_bad_arguments_are_named(mod, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        mod.warmup(*args, device="cpu", **kwargs)


def test_refusals_by_name():
    for mod in (cute_moe, triton_moe):
        with pytest.raises(ValueError, match=r"^quant: "):
            mod.warmup(8, 64, 32, 2, "fp8_weird", device="cpu")
    for mod in (cute_moe, triton_moe):
        with pytest.raises(ValueError, match=r"^ids_dtypes:"):
            mod.warmup(8, 64, 32, 2, device="cpu", ids_dtypes=(torch.float32,))
        with pytest.raises(ValueError, match=r"^ids_dtypes:"):
            mod.warmup(8, 64, 32, 2, device="cpu", ids_dtypes=())
        with pytest.raises(TypeError, match=r"^ids_dtypes:"):
            mod.warmup(8, 64, 32, 2, device="cpu", ids_dtypes=torch.int64)
    with pytest.raises(ValueError, match=r"^K: hidden size"):  # the backend's own limit, from its plan
        cute_moe.warmup(8, 60, 32, 2, device="cpu")
    if not torch.cuda.is_available():
        for mod in (cute_moe, triton_moe):
            with pytest.raises(ValueError, match=r"^device: 'cuda' asked for"):
                mod.warmup(8, 64, 32, 2)


# ---- the study (reduced form, CPU) ------------------------------------------------------------------------


def test_sweep_tokens():
    t = sweep_tokens(16384)
    assert t == sorted(set(t)) and 150 <= len(t) <= 400 and t[0] == 1 and t[-1] == 16384
    assert all(2**k in t and 2**k + 1 in t for k in range(14)) and sum(v % 2 for v in t) > 0.8 * len(t)


def test_warm_study_cpu(tmp_path):
    study = run_warm_study(
        [CPU_SHAPE], [None, "fp8_tensor"], ("triton_moe", "cute_moe"), sweep_tokens(40), device="cpu"
    )
    cases = {(c["backend"], c["quant"]): c for c in study["cases"]}
    for key in [("triton_moe", "bf16"), ("triton_moe", "fp8_tensor"), ("cute_moe", "bf16"), ("cute_moe", "fp8_tensor")]:
        c = cases[key]
        assert c["status"] == "ok" and c["compilations_after_warmup"] == 0, c
        assert c["caches_empty_at_start"] is True and c["warmup"]["compiled"] > 0
        assert len(c["per_T"]) == len(sweep_tokens(40))
    assert {"date", "device", "commit", "command"} <= set(study["meta"])
    md = warm_study.to_markdown(study)
    plans = len(triton_moe.plans_for(8, 64, 32, 2, "fp8_tensor", 40))
    assert f"| triton_moe | warm-tiny | fp8_tensor | {plans} |" in md and "## cute_moe, warm-tiny, bf16" in md


def test_warm_study_cli(tmp_path, capsys):
    assert warm_study.main(["--count", "--shapes", "qwen3-30b-a3b", "--quants", "bf16", "--max-tokens", "16384"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = cute_moe.warmup(128, 2048, 768, 8, max_tokens=16384, device="cpu", dry_run=True)  # the rule's count
    counts = f"{len(listed.plans)} plans, {listed.count} kernels"
    assert any(line.startswith("cute_moe") and counts in line for line in lines)
    rc = warm_study.main(["--out", str(tmp_path), "--max-tokens", "20", "--backends", "triton_moe", "--quants", "bf16"])
    assert rc == 0
    data = json.loads((tmp_path / "warm_study.json").read_text())
    assert data["meta"]["command"].startswith("python -m compare.warm_study --out")
    assert (tmp_path / "warm_study.md").read_text().startswith("# Warm-up study")


@pytest.mark.gpu
def test_cute_warmup_gpu_then_calls_of_either_ids_dtype_compile_nothing():
    """On the H200: after cute_moe.warmup, fused_moe calls with int64 and with int32 topk_ids (the
    alignment kernels compile per dtype) at several T compile nothing."""
    E, K, I, top_k = 8, 256, 128, 2  # noqa: E741
    report = cute_moe.warmup(E, K, I, top_k, max_tokens=64, device="cuda")
    assert {("align", torch.int32), ("align", torch.int64)} <= report.covered
    before = cache.compile_count()
    for ids_dtype in (torch.int64, torch.int32):
        for T in (1, 7, 64):
            cute_moe.fused_moe(**placeholder_inputs(E, K, I, top_k, None, T, "cuda", ids_dtype).kwargs())
    torch.cuda.synchronize()
    assert cache.compile_count() == before


@pytest.mark.gpu
def test_warm_study_gpu():
    """On the H200: from empty caches, after the warm-up no T of the sweep compiles (both backends)."""
    study = run_warm_study(["qwen3-30b-a3b"], [None], ("triton_moe", "cute_moe"), sweep_tokens(2048))
    assert all(c["status"] == "ok" and c["compilations_after_warmup"] == 0 for c in study["cases"]), study["cases"]

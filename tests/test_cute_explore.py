"""The layout explorer (python -m cute_moe.lab.explore) reads the kernel's own layout data faithfully,
explains it, draws it, and refuses what the kernel refuses."""

import xml.etree.ElementTree as ET

import pytest

from cute_moe.lab import explore
from cute_moe.layouts import describe
from cute_moe.plan import choose_config


@pytest.mark.parametrize("swap", [True, False])
def test_owner_grid_inverts_the_gemm_accumulators(swap):
    cfg = choose_config(2, 28672, 4096, swap_ab=swap)
    desc = describe(cfg)
    grid = explore.owner_grid(desc)
    owners = [cell for row in grid for cell in row]
    assert len(set(owners)) == len(owners)  # one (thread, register) per output
    # Independently, from the GEMM-space accumulators: (m, n) is (token, weight) normally, (weight, token) swapped.
    for thread, coords in enumerate(desc["accumulators"]):
        for reg, (m, n) in enumerate(coords):
            token, weight = (n, m) if swap else (m, n)
            if token < len(grid) and weight < len(grid[0]):
                assert grid[token][weight] == f"{thread}.{reg}"


def test_cli_prints_the_rule_s_kernel_and_explains_the_swizzle(capsys):
    assert explore.main(["--tokens-per-expert", "2"]) == 0
    text = capsys.readouterr().out
    assert "swap_ab path" in text and "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16" in text
    # the swizzle is a permutation of the 16-byte chunks of each row: row r's chunk j lands in chunk j XOR r
    lines = text.splitlines()
    for r in range(8):
        row = next(line for line in lines if line.strip().startswith(f"row {r} "))
        assert row.split()[2:] == [str(j ^ r) for j in range(8)]
    assert "no conflict" in text and "8-way conflict" in text
    # the conflicts are ldmatrix / stmatrix's; WGMMA's descriptor has no mode for unswizzled 128-byte rows
    assert "an ldmatrix / stmatrix access (one chunk of each of 8 rows)" in text and "WGMMA core-matrix" not in text
    assert "WGMMA's descriptor: 128-byte swizzle mode; unswizzled rows 128 B apart: no mode" in text


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tokens-per-expert", "-1"], "--tokens-per-expert: expected a finite mean ≥ 0"),
        (["--tokens-per-expert", "nan"], "--tokens-per-expert"),
        (["--k", "4100"], "grouped_gemm: K=4100 must be a positive multiple of 8"),
        (["--n-out", "12"], "grouped_gemm: N_out=12 must be a positive multiple of 8"),
        (["--k", "0"], "K=0"),
        (["--experts", "0"], "--experts"),
        (["--swap-ab", "--tokens-tile", "12"], "multiple of 8"),
        (["--swap-ab", "--weights-tile", "256"], "at most 128"),
        (["--stages", "1"], "at least 2 stages"),
        (["--normal", "--tokens-per-expert", "512", "--stages", "8"], "shared memory over budget"),
    ],
)
def test_cli_refuses_what_the_kernel_refuses(capsys, argv, needle):
    assert explore.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_cli_draws_the_kernel(tmp_path, capsys):
    assert explore.main(["--tokens-per-expert", "2", "--svg", str(tmp_path)]) == 0
    assert "Pictures:" in capsys.readouterr().out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        [
            "fragment_bf16.svg",
            "fragment_fp8.svg",
            "smem_bf16.svg",
            "smem_fp8.svg",
            "swapab.svg",
            "pipeline_bf16.svg",
            "pipeline_fp8.svg",
            "tma.svg",
        ]
    )
    roots = {n: ET.parse(tmp_path / n).getroot() for n in names}
    assert roots["fragment_fp8.svg"].get("data-n") == "8"
    assert "m64n8k32" in roots["fragment_fp8.svg"].get("data-instruction")


# ---- --layer: a layer call's plan and the one launch's tasks ------------------------------------------------
def test_layer_view_prints_the_plan_and_the_launch_from_the_kernels_constants(capsys):
    from cute_moe import decode_parts as dp
    from cute_moe.plan import plan
    from moe_spec.validate import MoEDims

    assert explore.main(["--layer", "qwen3-30b-a3b", "--tokens", "1"]) == 0
    text = capsys.readouterr().out
    dims = MoEDims(T=1, E=128, K=2048, I=768, top_k=8)
    assert f"plan: {plan(dims).describe()}" in text and "one_launch: taken" in text
    grid = dp.grid_size(1, 8, 128, 2048, 768, 132)
    assert f"One launch   {grid} CTAs × {dp.THREADS} threads" in text
    a, b, c = dp.task_counts(8, 1, 2048, 768)
    assert f") {a}, B" in text and f") {b}, C" in text and f") {c} — at most" in text
    assert dp.WGMMA in text and f"{dp.counter_words(2048)} int32 words" in text
    assert "a model, not a measurement" in text


def test_layer_view_of_a_grouped_call_names_the_reason(capsys):
    assert explore.main(["--layer", "mixtral-8x7b", "--tokens", "1"]) == 0
    text = capsys.readouterr().out
    assert "not taken: I = 14336 > ONE_LAUNCH_MAX_I" in text and "G1 swap-AB" in text and "One launch" not in text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--layer", "nope"], "--layer: unknown shape 'nope'"),
        (["--layer", "qwen3-30b-a3b", "--tokens", "0"], "--tokens: expected at least 1"),
        (["--layer", "qwen3-30b-a3b", "--stages", "3"], "--stages: a GEMM option"),
        (["--layer", "qwen3-30b-a3b", "--swap-ab"], "--swap-ab: a GEMM option"),
        (["--layer", "qwen3-30b-a3b", "--ptx"], "--ptx: a GEMM option"),
        (["--layer", "qwen3-30b-a3b", "--sms", "0"], "--sms: expected at least 1"),
        (["--layer", "qwen3-30b-a3b", "--tokens-per-expert", "9"], "--tokens-per-expert: a GEMM option"),
        (["--layer", "qwen3-30b-a3b", "--n-out", "256"], "--n-out: a GEMM option"),
        (["--layer", "qwen3-30b-a3b", "--json", "--svg", "d"], "--svg: not with --json"),
        (["--layer", "qwen3-30b-a3b", "--copy-tbps", "-1"], "--copy-tbps: expected a positive rate"),
        (["--tokens", "4"], "--tokens: an option of --layer"),
        (["--sms", "7", "--tokens-per-expert", "2"], "--sms: an option of --layer"),
        (["--tokens-per-expert", "2", "--json", "--svg", "d"], "--svg: not with --json"),
    ],
)
def test_layer_view_refuses_in_one_line(capsys, argv, needle):
    assert explore.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and needle in captured.err


def test_layer_view_draws_the_modelled_timeline_with_every_task_once(tmp_path, capsys):
    import json

    assert explore.main(["--layer", "deepseek-v3:tp8", "--tokens", "2", "--svg", str(tmp_path)]) == 0
    assert "decode_timeline.svg" in capsys.readouterr().out
    root = ET.parse(tmp_path / "decode_timeline.svg").getroot()
    bars = [el for el in root.iter("{http://www.w3.org/2000/svg}rect") if el.get("data-task") is not None]
    assert sorted(int(el.get("data-task")) for el in bars) == list(range(len(bars)))
    assert explore.main(["--layer", "deepseek-v3:tp8", "--tokens", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    phases = data["model"]["phases"]
    assert len(bars) == sum(phases.values())
    for phase, n in phases.items():
        assert sum(el.get("data-phase") == phase for el in bars) == n


@pytest.mark.parametrize("spec, T", [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 8), ("deepseek-v3:tp8", 4)])
@pytest.mark.parametrize("sms", [132, 7])
def test_the_modelled_schedule_keeps_the_kernels_order_and_waits(spec, T, sms):
    import random

    from cute_moe import decode_parts as dp
    from cute_moe.lab.fig_decode import schedule
    from moe_spec.problem import get_shape

    shape = get_shape(spec)
    E, K, I, k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k  # noqa: E741
    rng = random.Random(1)
    ids = [e for _ in range(T) for e in rng.sample(range(E // 16), k)]  # a few hot experts: shared leaders
    run = schedule(ids, T, k, E, K, I, sms, 4.0)
    tasks, leaders = run["tasks"], dp.leader_tables(ids, E)["n_leaders"]
    nt1, nk, ntb = dp.tile_counts(T, K, I)
    assert [t.number for t in tasks] == list(range(sum(dp.task_counts(leaders, T, K, I))))
    claimed = [t.claimed for t in tasks]
    assert claimed == sorted(claimed)  # tickets in increasing order
    assert run["grid"] == dp.grid_size(T, k, E, K, I, sms) and {t.cta for t in tasks} <= set(range(run["grid"]))
    b0, c0, _ = dp.phase_starts(leaders, nt1, nk, ntb)
    a_end = {r: max(t.end for t in tasks[:b0] if dp.a_task(t.number, nt1)[0] == r) for r in range(leaders)}
    b_end = {kt: max(t.end for t in tasks[b0:c0] if dp.b_task(t.number - b0, leaders)[0] == kt) for kt in range(nk)}
    for t in tasks[b0:c0]:
        assert t.ready >= a_end[dp.b_task(t.number - b0, leaders)[1]] - 1e-9 and t.end > t.ready
    for t in tasks[c0:]:
        assert t.ready >= b_end[dp.c_task(t.number - c0, ntb)[0]] - 1e-9 and t.end > t.ready
    per_cta = {}
    for t in tasks:  # a CTA runs one task at a time
        per_cta.setdefault(t.cta, []).append((t.claimed, t.end))
    for spans in per_cta.values():
        spans.sort()
        assert all(a_end_ <= b_start + 1e-9 for (_, a_end_), (b_start, _) in zip(spans, spans[1:]))
    assert run["model_us"] >= run["floor_us"]  # at most the whole rate, at least each weight once


def test_the_model_refuses_wrong_ids():
    from cute_moe.lab.fig_decode import schedule

    with pytest.raises(ValueError, match="ids: expected T·top_k = 16"):
        schedule([0] * 15, 2, 8, 128, 2048, 768, 132, 4.0)

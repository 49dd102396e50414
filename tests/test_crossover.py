"""``python -m cute_moe.lab.crossover`` on the CPU: the balanced routing, the path rule's per-layer limit,
the rows and the limit the measurement supports (a stand-in clock and layer), the reports, and the
one-line refusals of bad options and of a used ``--out``."""

import dataclasses
import importlib
import json
import math
import time
import xml.etree.ElementTree as ET

import pytest
import torch

import cute_moe
import cute_moe.lab.crossover as cx
from moe_spec.problem import MoEShape, get_shape
from moe_spec.timing import Timing
from moe_spec.validate import MoEDims

cute_plan = importlib.import_module("cute_moe.plan")  # the attribute cute_moe.plan is the function

TINY = MoEShape("tiny", 4, 2, 64, 32, "a layer small enough for a CPU test")


# --- routing and token counts ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", cx.SHAPES)
@pytest.mark.parametrize("m", [1, 12, 128])
def test_balanced_routing_gives_every_expert_exactly_m_tokens(spec, m):
    s = get_shape(spec)
    T = cx.tokens_for(s, m)
    assert T == m * s.num_experts // s.top_k
    w, ids = cx.balanced_routing(T, s.num_experts, s.top_k)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (T, s.top_k)
    assert torch.bincount(ids.flatten().long(), minlength=s.num_experts).tolist() == [m] * s.num_experts
    assert all(len(set(row)) == s.top_k for row in ids.tolist()[:64])  # distinct experts per token
    assert torch.allclose(w.sum(1), torch.ones(T))


def test_a_count_that_needs_a_fractional_T_is_refused():
    odd = MoEShape("odd", 6, 4, 64, 32, "E/top_k = 1.5")
    assert cx.tokens_for(odd, 2) == 3
    with pytest.raises(ValueError, match="--tokens: 1 tokens per expert on odd needs T = 1·6/4, not an integer"):
        cx.tokens_for(odd, 1)


# --- the path rule's per-layer limit ---------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 12, 24, 32, 64, 96, math.inf])
def test_the_rule_with_a_layer_limit_runs_a_forced_path_config_on_each_side(limit, monkeypatch):
    monkeypatch.setattr(cute_plan, "SWAP_AB_MAX_BY_LAYER", {(4096, 14336): limit})
    buckets = cute_plan.path_rule(None, (4096, 14336))
    assert [b[0] for b in buckets] == sorted(b[0] for b in buckets) and buckets[-1][0] == math.inf
    assert len({b[1:] for b in buckets}) == len(buckets)  # one bucket per config
    for m in [0.5, 1, 7, 8, 9, 12, 13, 16, 24, 25, 32, 33, 63, 64, 65, 96, 97, 128, 500]:
        rule = cute_plan.choose_config(m, 28672, 4096, layer=(4096, 14336))
        forced = cute_plan.choose_config(m, 28672, 4096, swap_ab=m <= limit)
        assert rule == forced, (limit, m)
    # another layer, and no layer, keep the one limit of 64
    assert cute_plan.path_rule(None, (2048, 768)) == cute_plan.path_rule() == cute_plan.path_rule(None, None)
    assert cute_plan.choose_config(64, 1536, 2048, layer=(2048, 768)).swap_ab


def test_without_an_entry_the_rule_is_the_64_token_rule():
    assert cute_plan.SWAP_AB_MAX_BY_LAYER == {} and cute_plan.SWAP_AB_MAX_TOKENS_PER_EXPERT == 64
    assert cute_plan.path_rule() == (
        (8.0, True, 8),
        (16.0, True, 16),
        (32.0, True, 32),
        (64.0, True, 64),
        (math.inf, False, 128),
    )
    assert cute_plan.path_rule(True)[-1] == (math.inf, True, 64)
    assert cute_plan.path_rule(False) == ((64.0, False, 64), (math.inf, False, 128))


def test_plans_for_follows_a_layer_limit(monkeypatch):
    s = get_shape("qwen3-30b-a3b")
    monkeypatch.setattr(cute_plan, "SWAP_AB_MAX_BY_LAYER", {(s.hidden, s.intermediate): 24})
    monkeypatch.setattr(cute_plan, "ONE_LAUNCH", False)  # the grouped pipeline's buckets only
    d = MoEDims(T=1, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k)
    listed = cute_moe.plans_for(d.E, d.K, d.I, d.top_k, max_tokens=1200)
    seen = {}
    for T in range(1, 1201):  # dense: every T lands on a listed plan, in order
        p = cute_moe.plan(dataclasses.replace(d, T=T))
        assert p.swap_ab[0] == (T * s.top_k / s.num_experts <= 24), T
        seen.setdefault(p, T)
    assert list(seen) == list(listed)
    assert [p.gemm1.tokens_tile for p in listed] == [8, 16, 32, 64, 128]  # swap 8, 16, 32 (24), normal 64, 128


# --- a run with stand-ins ----------------------------------------------------------------------------------


class _Layer:
    """A layer whose time is a function of (T, path): the stand-in clock reads the last call."""

    def __init__(self, us, fail=None):
        self.us, self.fail, self.calls = us, fail, []

    def fused_moe(self, x, w1, w2, topk_weights, topk_ids, swap_ab):
        assert x.shape[1] == w1.shape[2] and topk_ids.dtype == torch.int32
        m = topk_ids.numel() // w1.shape[0]
        if self.fail and self.fail(m, swap_ab):
            raise NotImplementedError(f"no kernel for m={m}\nsecond line")
        self.calls.append((x.shape[0], swap_ab))

    def time(self, make_call, n_sets, **options):
        assert n_sets >= 2 and set(options) == {"replays", "min_calls", "warmup"}
        make_call(n_sets - 1)()
        T, swap = self.calls[-1]
        us = self.us(T * TINY.top_k // TINY.num_experts, swap)
        return Timing(median_us=us, p10_us=us, p90_us=us, min_us=us, samples=1, calls_per_sample=1)


def _env(layer):
    return cx.Env(
        time=layer.time,
        fused_moe=layer.fused_moe,
        sync=lambda: None,
        device_name=lambda: "stand-in (CPU)",
        device="cpu",
        shape_of=lambda label: TINY,
    )


SWAP_WINS_TO_24 = lambda m, swap: 10 + 2 * m if swap else 40 + m  # noqa: E731 - equal at m = 30


def test_rows_ratio_rule_and_the_measured_limit():
    layer = _Layer(SWAP_WINS_TO_24)
    result = cx.run(["tiny"], cx.TOKENS, env=_env(layer), command="pytest", commit="abc1234")
    assert result["meta"]["device"] == "stand-in (CPU)" and result["meta"]["commit"] == "abc1234"
    rows = {r["tokens_per_expert"]: r for r in result["rows"]}
    assert [r["status"] for r in rows.values()] == ["ok"] * len(cx.TOKENS)
    assert {(T, swap) for T, swap in layer.calls} == {(m * 2, s) for m in cx.TOKENS for s in (True, False)}
    r = rows[8]
    assert (r["T"], r["swap_us"], r["normal_us"], r["faster"]) == (16, 26, 48, "swap")
    assert r["ratio"] == pytest.approx(48 / 26) and r["rule_swap"] and r["rule_within"]
    assert rows[32]["rule_within"]  # swap 74 vs normal 72: 2.8 % over, within 3 %
    assert rows[48]["rule_swap"] and not rows[48]["rule_within"]  # 106 vs 88
    assert not rows[96]["rule_swap"] and rows[96]["rule_within"]
    (s,) = result["shapes"]
    assert s["current_limit"] == 64 and s["measured_limit"] == 24 and s["measured_loss"] == 0
    assert s["current_loss"] == pytest.approx(((74 / 72 - 1) + (106 / 88 - 1) + (138 / 104 - 1)) / len(cx.TOKENS))
    assert s["rule_within"] == len(cx.TOKENS) - 2 and s["entry"] == "(64, 32): 24,  # tiny"


def test_an_entry_in_the_table_is_what_the_rule_runs(monkeypatch):
    monkeypatch.setattr(cute_plan, "SWAP_AB_MAX_BY_LAYER", {(64, 32): 24})
    result = cx.run(["tiny"], cx.TOKENS, env=_env(_Layer(SWAP_WINS_TO_24)))
    assert all(r["rule_within"] and r["rule_swap"] == (r["tokens_per_expert"] <= 24) for r in result["rows"])
    (s,) = result["shapes"]
    assert s["current_limit"] == s["measured_limit"] == 24 and s["current_loss"] == 0


@pytest.mark.parametrize(
    "us, limit",
    [
        (lambda m, swap: 1.0 if swap else 2.0, 128),  # swap-AB faster everywhere: the largest count measured
        (lambda m, swap: 2.0 if swap else 1.0, 0),  # never
        (lambda m, swap: 1.0, 64),  # a tie everywhere: keep the current limit
        (
            lambda m, swap: (1.0 if swap else 1.001) if m <= 48 else (1.0005 if swap else 1.0),
            64,
        ),  # within 0.1 %: keep 64
    ],
)
def test_best_limit(us, limit):
    rows = [
        cx.fill_row(
            {
                "tokens_per_expert": m,
                "swap_us": us(m, True),
                "normal_us": us(m, False),
                "status": "ok",
                "rule_swap": m <= 64,
            }
        )
        for m in cx.TOKENS
    ]
    assert cx.best_limit(rows, 64) == limit
    assert cx.best_limit([{"tokens_per_expert": 1, "status": "error: x"}], 64) is None


def test_a_failing_cell_is_a_row_and_the_budget_skips_the_rest():
    layer = _Layer(SWAP_WINS_TO_24, fail=lambda m, swap: m == 2 and not swap)
    result = cx.run(["tiny"], (1, 2, 4), env=_env(layer))
    assert [r["status"] for r in result["rows"]] == ["ok", "error: NotImplementedError: no kernel for m=2", "ok"]
    assert "ratio" not in result["rows"][1] and result["shapes"][0]["rows"] == 2

    slow = _Layer(lambda m, swap: time.sleep(0.3) or 1.0)
    result = cx.run(["tiny", "tiny2"], (1, 2, 4), env=_env(slow), time_budget_s=0.4)
    assert [r["status"] for r in result["rows"]] == ["ok"] + ["skipped: time budget spent"] * 5
    assert result["shapes"][1]["measured_limit"] is None and result["shapes"][1]["entry"] is None


# --- reports -----------------------------------------------------------------------------------------------


def _result():
    return cx.run(
        ["tiny", "tiny2"],
        cx.TOKENS,
        env=_env(_Layer(SWAP_WINS_TO_24)),
        command="python -m cute_moe.lab.crossover",
        commit="abc1234",
    )


def test_markdown_names_the_run_and_has_the_tables():
    md = cx.to_markdown(_result())
    assert "- device: stand-in (CPU)" in md and "- commit: `abc1234`" in md
    assert "- command: `python -m cute_moe.lab.crossover`" in md and "- date: " in md
    assert "| tiny | 8 | 16 | 26.0 | 48.0 | 1.846 | swap-AB | yes | ok |" in md
    assert "| tiny | 48 | 96 | 106.0 | 88.0 | 0.830 | swap-AB | **no** | ok |" in md
    assert "| tiny | (64, 32) | 64 | 24 | 4.7 % | 0.0 % | 10/12 |" in md
    assert "    (64, 32): 24,  # tiny" in md and "(replays 20, min_calls 10, warmup 2)" in md
    assert "Every shape measured supports the same limit, 24: one constant" in md
    result = _result()
    result["shapes"][1]["measured_limit"] = 32.0
    assert "The measured limits differ per shape (24, 32)." in cx.to_markdown(result)
    header = next(line for line in md.splitlines() if line.startswith("| shape | tokens/expert"))
    assert header.count("|") == md.splitlines()[md.splitlines().index(header) + 1].count("|")


def test_the_svg_is_small_and_carries_one_line_per_shape():
    result = _result()
    svg = cx.to_svg(result)
    assert len(svg.encode()) < 30_000
    root = ET.fromstring(svg)
    lines = [e for e in root.iter("{http://www.w3.org/2000/svg}polyline")]
    assert [e.get("data-shape") for e in lines] == ["tiny", "tiny2"]
    pts = json.loads(lines[0].get("data-points"))
    assert [p[0] for p in pts] == list(cx.TOKENS) and pts[3][1] == pytest.approx(48 / 26)


def test_outputs_are_written_whole(tmp_path):
    result = _result()
    cx.write_outputs(result, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(cx.FILES)
    assert json.loads((tmp_path / "out" / "crossover.json").read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "out" / "crossover.md").read_text() == cx.to_markdown(result)


def test_main_runs_and_writes_the_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cx.runinfo, "require_cuda", lambda prog: None)
    env = _env(_Layer(SWAP_WINS_TO_24))
    monkeypatch.setattr(cx, "Env", lambda: env)
    out = tmp_path / "out"
    assert cx.main(["--quick", "--shapes", "mixtral-8x7b", "--out", str(out), "--commit", "abc1234"]) == 0
    result = json.loads((out / "crossover.json").read_text())
    assert (
        result["meta"]["command"] == f"python -m cute_moe.lab.crossover --quick --shapes mixtral-8x7b --out {out} "
        "--commit abc1234"
    )
    assert [r["tokens_per_expert"] for r in result["rows"]] == list(cx.QUICK_TOKENS)
    assert result["meta"]["timing"] == cx.TIMING["quick"]
    captured = capsys.readouterr()
    assert captured.out.startswith("| shape | tokens/expert |") and "(64, 32): 16,  # mixtral-8x7b" in captured.out
    assert "mixtral-8x7b m=1 T=2: swap 12.0 µs, normal 41.0 µs" in captured.err


# --- options ----------------------------------------------------------------------------------------------


def test_list_and_defaults(capsys):
    assert cx.main(["--list", "--shapes", "Mixtral-8x7B", "--tokens", "8,1,8"]) == 0
    assert capsys.readouterr().out.splitlines() == ["mixtral-8x7b m=1 T=4", "mixtral-8x7b m=8 T=32"]
    args = cx.parse_args(["--list"])
    assert args.shapes == cx.SHAPES and args.tokens == cx.TOKENS and args.time_budget == cx.TIME_BUDGET_S
    assert {get_shape(s).name for s in cx.SHAPES} == {"qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shapes", "gpt5"], "--shapes: unknown shape 'gpt5'"),
        (["--shapes", "mixtral-8x7b,,"], "--shapes: empty item"),
        (["--tokens", "0"], "--tokens: bad count '0'"),
        (["--tokens", "1,x"], "--tokens: bad count 'x'"),
        (["--time-budget", "0"], "--time-budget: expected a finite number of seconds > 0"),
        (["--time-budget", "inf"], "--time-budget"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_options_are_one_line_naming_the_option(args, message, tmp_path, capsys):
    assert cx.main(args + ["--out", str(tmp_path / "new")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and message in captured.err
    assert captured.err.startswith("python -m cute_moe.lab.crossover: error: ")
    assert not (tmp_path / "new").exists()


def test_out_must_be_a_new_or_empty_directory(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "crossover.md").write_text("an earlier run")
    (tmp_path / "file").write_text("x")
    for argv, why in (
        (["--out", str(used)], "is not empty"),
        (["--out", str(tmp_path / "file")], "exists and is not a directory"),
        (["--out", str(tmp_path / "file" / "sub")], "cannot create"),
        ([], "required: a new or empty directory for crossover.md, crossover.json and crossover.svg"),
    ):
        assert cx.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m cute_moe.lab.crossover: error: --out: ") and why in err, err
        assert len(err.strip().splitlines()) == 1
    assert (used / "crossover.md").read_text() == "an earlier run"
    assert cx.parse_args(["--out", str(tmp_path / "a" / "b")]).out == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # checked, not created


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_without_a_gpu_the_run_stops_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cx.main(["--quick", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

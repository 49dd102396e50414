"""Where swap-AB stops paying: ``python -m cute_moe.lab.crossover --out DIR`` (GPU).

For each catalog shape and each count m of tokens per expert (1 … 128), the whole bf16 layer
(``fused_moe``: alignment, gather, GEMM1, SiLU·mul, GEMM2, combine) is timed twice — with the path
forced to swap-AB (``swap_ab=True``) and to the normal path (``swap_ab=False``) — as CUDA-graph
replays over rotated input sets (cold L2; :func:`moe_spec.timing.time_cuda_graph`, the clock the
compare suite uses). The routing gives every expert exactly m tokens (:func:`balanced_routing`),
so T = m·E/top_k and the mean the path rule keys on is m itself.

Each row: µs of both paths, their ratio (normal / swap: above 1, swap-AB is faster), the path the
current rule picks (:func:`cute_moe.plan.plan`, i.e. :func:`cute_moe.plan.path_rule` with the
layer's entry of ``SWAP_AB_MAX_BY_LAYER`` if it has one), and whether the rule's path is within
3 % of the faster one. Per shape, :func:`best_limit` reads the limit the measurement supports (the
largest m kept on swap-AB that loses the least over the measured counts); the command prints it as
an entry of ``cute_moe.plan.SWAP_AB_MAX_BY_LAYER``, the one table the rule reads.

Writes ``crossover.md``, ``crossover.json`` and ``crossover.svg`` (ratio against m, one line per
shape) to ``--out``, a new or empty directory, after every shape. Bad options and a used ``--out``
are refused in one line before any GPU work; ``--time-budget`` turns the cells not reached into
"skipped" rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_spec import runinfo, studyout
from moe_spec.problem import MoEShape, draw_weights, get_shape
from moe_spec.studyout import UsageError
from moe_spec.timing import sets_for_cold_l2
from moe_spec.validate import MoEDims

from .svg import Svg, num

PROG = "python -m cute_moe.lab.crossover"
SHAPES = ("qwen3-30b-a3b", "deepseek-v3:tp8", "mixtral-8x7b")
TOKENS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
QUICK_TOKENS = (1, 4, 16, 32, 64, 128)
WITHIN = 0.03  # the rule's path counts as right when within 3 % of the faster one
TIME_BUDGET_S = 150.0
TIMING = {"full": dict(replays=20, min_calls=10, warmup=2), "quick": dict(replays=6, min_calls=4, warmup=1)}
FILES = ("crossover.md", "crossover.json", "crossover.svg")


def tokens_for(shape: MoEShape, m: int) -> int:
    """T that gives each of the E experts exactly ``m`` (token, slot) pairs: m·E/top_k (an integer)."""
    T, rest = divmod(m * shape.num_experts, shape.top_k)
    if rest:
        raise ValueError(
            f"--tokens: {m} tokens per expert on {shape.label} needs T = {m}·{shape.num_experts}/"
            f"{shape.top_k}, not an integer"
        )
    return T


def balanced_routing(T: int, E: int, top_k: int, device="cpu"):
    """``(topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k])``: slot j of token t goes to expert
    (t·top_k + j) mod E — top_k distinct experts per token, every expert T·top_k/E pairs when E
    divides T·top_k — with weights 1/top_k."""
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected 1 <= top_k <= E = {E}, got {top_k}")
    ids = torch.arange(T * top_k, device=device, dtype=torch.int64).remainder(E).to(torch.int32).view(T, top_k)
    return torch.full((T, top_k), 1.0 / top_k, device=device), ids


def _gpu_time(make_call, n_sets, **options):
    from moe_spec.timing import time_cuda_graph

    return time_cuda_graph(make_call, n_sets, **options)


def _gpu_fused_moe(**kwargs):
    from ..moe import fused_moe

    return fused_moe(**kwargs)


def rule_swaps(shape: MoEShape, T: int) -> bool:
    """Whether the current rule runs swap-AB on this layer at T (both GEMMs share the mean)."""
    from ..plan import plan

    dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
    return plan(dims).swap_ab[0]


@dataclass
class Env:
    """What a run measures with (a CPU test passes stand-ins)."""

    time: Callable = _gpu_time  # moe_spec.timing.time_cuda_graph's signature
    fused_moe: Callable = _gpu_fused_moe
    sync: Callable = field(default=lambda: torch.cuda.synchronize())
    device_name: Callable = field(default=lambda: torch.cuda.get_device_name())
    device: str = "cuda"
    shape_of: Callable = get_shape
    rule: Callable = rule_swaps


def _sets(shape: MoEShape, T: int, weights: list, device: str, seed: int) -> list:
    gen = torch.Generator(device=device).manual_seed(seed + T)
    tw, ids = balanced_routing(T, shape.num_experts, shape.top_k, device)
    return [
        dict(
            x=torch.randn(T, shape.hidden, generator=gen, device=device).to(torch.bfloat16),
            w1=w1,
            w2=w2,
            topk_weights=tw,
            topk_ids=ids,
        )
        for w1, w2 in weights
    ]


def measure_shape(
    label: str, tokens, env: Env, options: dict, deadline: float, seed: int = 0, say: Callable = lambda text: None
) -> list[dict]:
    """The rows of one shape: both paths timed per tokens-per-expert count (or why not)."""
    shape = env.shape_of(label)
    per_set = 3 * shape.num_experts * shape.intermediate * shape.hidden * 2
    n_sets = sets_for_cold_l2(per_set)
    rows = [{"shape": label, "tokens_per_expert": m, "T": tokens_for(shape, m)} for m in tokens]
    if time.monotonic() >= deadline:
        return [{**r, "status": "skipped: time budget spent"} for r in rows]
    gen = torch.Generator(device=env.device).manual_seed(seed)
    weights = [draw_weights(shape, gen, env.device) for _ in range(n_sets)]
    for i, row in enumerate(rows):
        if time.monotonic() >= deadline:
            row["status"] = "skipped: time budget spent"
            continue
        try:
            sets = _sets(shape, row["T"], weights, env.device, seed)
            for key, swap in (("swap_us", True), ("normal_us", False)):
                call = lambda i, swap=swap: lambda: env.fused_moe(**sets[i], swap_ab=swap)  # noqa: E731
                row[key] = env.time(call, n_sets, **options).median_us
            row.update(input_sets=n_sets, rule_swap=bool(env.rule(shape, row["T"])), status="ok")
            say(
                f"{label} m={row['tokens_per_expert']} T={row['T']}: swap {row['swap_us']:.1f} µs, "
                f"normal {row['normal_us']:.1f} µs"
            )
        except Exception as exc:  # noqa: BLE001 - a failed cell is a row
            row["status"] = f"error: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            try:
                env.sync()
            except Exception:  # noqa: BLE001 - a sticky device error: it is in the row already
                pass
        fill_row(row)
    del weights
    return rows


def fill_row(row: dict) -> dict:
    """ratio = normal / swap; the rule's µs; whether it is within :data:`WITHIN` of the faster path."""
    if row.get("status") != "ok":
        return row
    best = min(row["swap_us"], row["normal_us"])
    row["ratio"] = row["normal_us"] / row["swap_us"]
    row["faster"] = "swap" if row["swap_us"] <= row["normal_us"] else "normal"
    row["rule_us"] = row["swap_us"] if row["rule_swap"] else row["normal_us"]
    row["rule_within"] = row["rule_us"] <= (1 + WITHIN) * best
    return row


def loss(rows: list, limit: float) -> float:
    """Mean extra time (fraction of the faster path) of a rule that runs swap-AB up to ``limit``."""
    ok = [r for r in rows if r.get("status") == "ok"]
    return sum(
        (r["swap_us"] if r["tokens_per_expert"] <= limit else r["normal_us"]) / min(r["swap_us"], r["normal_us"]) - 1
        for r in ok
    ) / max(len(ok), 1)


def best_limit(rows: list, current: float) -> float | None:
    """The swap-AB limit the rows support: of 0 and the measured counts, the one with the least
    :func:`loss`; within 0.1 % of the least, the one closest to ``current`` (no change without a
    reason). None when no row was measured."""
    ok = sorted(r["tokens_per_expert"] for r in rows if r.get("status") == "ok")
    if not ok:
        return None
    candidates = [0] + ok
    least = min(loss(rows, c) for c in candidates)
    near = [c for c in candidates if loss(rows, c) <= least + 1e-3]
    return float(min(near, key=lambda c: (abs(math.log2(max(c, 0.5) / max(current, 0.5))), c)))


def summarize(rows: list, shapes, env: Env) -> list[dict]:
    """Per shape: the rule's current limit, the measured one, their losses and the table entry."""
    from ..plan import SWAP_AB_MAX_BY_LAYER, SWAP_AB_MAX_TOKENS_PER_EXPERT

    out = []
    for label in shapes:
        s = env.shape_of(label)
        mine = [r for r in rows if r["shape"] == label]
        current = float(SWAP_AB_MAX_BY_LAYER.get((s.hidden, s.intermediate), SWAP_AB_MAX_TOKENS_PER_EXPERT))
        best = best_limit(mine, current)
        ok = [r for r in mine if r.get("status") == "ok"]
        out.append(
            {
                "shape": label,
                "layer": [s.hidden, s.intermediate],
                "current_limit": current,
                "measured_limit": best,
                "current_loss": loss(mine, current) if ok else None,
                "measured_loss": loss(mine, best) if ok else None,
                "rule_within": sum(r["rule_within"] for r in ok),
                "rows": len(ok),
                "entry": None if best is None else f"({s.hidden}, {s.intermediate}): {num(best)},  # {label}",
            }
        )
    return out


def run(
    shapes,
    tokens,
    *,
    env: Env | None = None,
    quick: bool = False,
    time_budget_s: float = TIME_BUDGET_S,
    command: str = "run(...)",
    commit: str | None = None,
    write: Callable = lambda result: None,
    say: Callable = lambda text: None,
) -> dict:
    env = env or Env()
    deadline = time.monotonic() + time_budget_s
    options = TIMING["quick" if quick else "full"]
    meta = runinfo.run_info(command, cuda=env.device == "cuda", commit=commit, device=env.device_name())
    meta.update(dtype="bf16", timing=options, within=WITHIN, time_budget_s=time_budget_s)
    result = {"meta": meta, "rows": [], "shapes": []}
    for i, label in enumerate(shapes):
        say(f"[{i + 1}/{len(shapes)}] {label}: {len(tokens)} counts × 2 paths")
        result["rows"] += measure_shape(label, tokens, env, options, deadline, say=say)
        if env.device == "cuda":
            torch.cuda.empty_cache()
        result["shapes"] = summarize(result["rows"], shapes[: i + 1], env)
        write(result)
    return result


def _us(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def table(result: dict) -> list[str]:
    lines = [
        "| shape | tokens/expert | T | µs swap-AB | µs normal | ratio normal/swap | rule picks | rule within 3 % "
        "| status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ok = r.get("status") == "ok"
        ratio, picks, within = (
            (f"{r['ratio']:.3f}", "swap-AB" if r["rule_swap"] else "normal", "yes" if r["rule_within"] else "**no**")
            if ok
            else ("—",) * 3
        )
        lines.append(
            f"| {r['shape']} | {r['tokens_per_expert']} | {r['T']} | {_us(r.get('swap_us'))} "
            f"| {_us(r.get('normal_us'))} | {ratio} | {picks} | {within} | {r['status'].replace('|', '/')} |"
        )
    return lines


def summary_lines(result: dict) -> list[str]:
    lines = [
        "| shape | layer (K, I) | rule's limit | measured limit | rule's mean loss | measured limit's loss "
        "| rule within 3 % |",
        "|---|---|---|---|---|---|---|",
    ]
    pct = lambda v: "—" if v is None else f"{100 * v:.1f} %"  # noqa: E731
    for s in result["shapes"]:
        lines.append(
            f"| {s['shape']} | ({s['layer'][0]}, {s['layer'][1]}) | {num(s['current_limit'])} "
            f"| {'—' if s['measured_limit'] is None else num(s['measured_limit'])} | {pct(s['current_loss'])} "
            f"| {pct(s['measured_loss'])} | {s['rule_within']}/{s['rows']} |"
        )
    return lines


def to_markdown(result: dict) -> str:
    m = result["meta"]
    entries = [s["entry"] for s in result["shapes"] if s["entry"]]
    timing = ", ".join(f"{k} {v}" for k, v in m["timing"].items())
    return (
        "\n".join(
            [
                "# Swap-AB crossover of cute_moe (bf16, whole layer)",
                "",
                *studyout.header_lines(m),
                f"- each count: both paths forced (`fused_moe(..., swap_ab=True/False)`), CUDA-graph replays over "
                f"rotated input sets (cold L2), median µs ({timing}); every expert gets exactly m tokens "
                "(T = m·E/top_k)",
                "- ratio = normal µs / swap-AB µs (above 1: swap-AB is faster); the rule is within 3 % when its path's "
                "µs ≤ 1.03 × the faster path's",
                "- loss: mean over the measured counts of the extra time a limit costs against the "
                "faster path; measured limit: of 0 and the counts, the least loss (ties: nearest the current limit)",
                "",
            ]
            + table(result)
            + ["", "## Per shape", ""]
            + summary_lines(result)
            + ["", "Entries for `cute_moe.plan.SWAP_AB_MAX_BY_LAYER` (the rule's limit per layer):", ""]
            + [f"    {e}" for e in entries]
            + ["", one_limit(result), "", "![ratio against tokens per expert](crossover.svg)"]
        )
        + "\n"
    )


def one_limit(result: dict) -> str:
    """Whether one limit serves every shape measured (then it belongs in SWAP_AB_MAX_TOKENS_PER_EXPERT)."""
    limits = {s["measured_limit"] for s in result["shapes"] if s["measured_limit"] is not None}
    if len(limits) == 1:
        return (
            f"Every shape measured supports the same limit, {num(limits.pop())}: one constant "
            f"(`SWAP_AB_MAX_TOKENS_PER_EXPERT`) says it, no per-layer entry is needed."
        )
    return f"The measured limits differ per shape ({', '.join(num(v) for v in sorted(limits)) or 'none'})."


COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00")


def to_svg(result: dict) -> str:
    """ratio (log scale) against tokens per expert (log2 scale), one polyline per shape, 1.0 marked."""
    ok = [r for r in result["rows"] if r.get("status") == "ok"]
    W, H, L, T0 = 560, 300, 60, 40  # plot box: x from L, y from T0, size W × H
    ms = sorted({r["tokens_per_expert"] for r in result["rows"]}) or [1]
    ratios = [r["ratio"] for r in ok] or [1.0]
    lo, hi = min(min(ratios), 0.8), max(max(ratios), 1.25)
    x = lambda m: L + W * (math.log2(m) - math.log2(ms[0])) / max(math.log2(ms[-1] / ms[0]), 1)  # noqa: E731
    y = lambda v: T0 + H * (math.log(hi) - math.log(v)) / (math.log(hi) - math.log(lo))  # noqa: E731
    svg = Svg(L + W + 200, T0 + H + 50, "swap-AB crossover: normal µs / swap-AB µs against tokens per expert")
    svg.text(L, 20, "normal µs / swap-AB µs (above 1: swap-AB faster) — " + result["meta"]["device"], cls="t")
    svg.rect(L, T0, W, H, cls="frame")
    for v in sorted({0.5, 0.8, 1.0, 1.25, 1.5, 2.0, round(lo, 2), round(hi, 2)}):
        if lo <= v <= hi:
            svg.el("line", x1=L, x2=L + W, y1=y(v), y2=y(v), stroke="#333" if v == 1.0 else "#ddd")
            svg.text(L - 6, y(v) + 4, f"{v:g}", text_anchor="end", cls="s")
    for m in ms:
        svg.text(x(m), T0 + H + 16, str(m), cls="s c")
    svg.text(L + W / 2, T0 + H + 36, "tokens per expert (log scale)", cls="c")
    for i, s in enumerate(result["shapes"]):
        pts = sorted((r["tokens_per_expert"], r["ratio"]) for r in ok if r["shape"] == s["shape"])
        colour = COLOURS[i % len(COLOURS)]
        if pts:
            svg.el(
                "polyline",
                points=" ".join(f"{num(x(m))},{num(y(v))}" for m, v in pts),
                fill="none",
                stroke=colour,
                stroke_width=2,
                data_shape=s["shape"],
                data_points=json.dumps(pts),
            )
        svg.rect(L + W + 16, T0 + 16 * i, 10, 10, fill=colour)
        svg.text(L + W + 30, T0 + 16 * i + 9, s["shape"], cls="s")
    return svg.render()


def write_outputs(result: dict, out: Path) -> None:
    texts = (to_markdown(result), json.dumps(result, indent=1) + "\n", to_svg(result))
    studyout.write_files(out, dict(zip(FILES, texts)))


def parse_args(argv: list) -> argparse.Namespace:
    """Every option checked (UsageError naming it otherwise); nothing run."""
    p = studyout.Parser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--out", help="a new or empty directory for crossover.md, .json and .svg (required to run)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of catalog shapes [%(default)s]")
    p.add_argument(
        "--tokens",
        default=None,
        help=f"tokens per expert, comma list [{','.join(map(str, TOKENS))}; "
        f"--quick: {','.join(map(str, QUICK_TOKENS))}]",
    )
    p.add_argument("--quick", action="store_true", help="fewer counts and timing replays")
    p.add_argument(
        "--time-budget",
        default=str(TIME_BUDGET_S),
        metavar="S",
        help="stop after S seconds; counts not reached are 'skipped' rows [%(default)s]",
    )
    p.add_argument("--commit", default=None, help="commit to record [git rev-parse of this checkout]")
    p.add_argument("--list", action="store_true", help="print the cells (shape, tokens per expert, T) and exit")
    args = p.parse_args(argv)
    args.shapes = studyout.shape_labels("--shapes", args.shapes)
    if args.tokens is None:
        args.tokens = QUICK_TOKENS if args.quick else TOKENS
    else:
        args.tokens = tuple(sorted(studyout.positive_ints("--tokens", args.tokens, noun="count", example="1,8,64")))
    for label in args.shapes:
        for m in args.tokens:
            try:
                tokens_for(get_shape(label), m)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    args.time_budget = studyout.number(
        "--time-budget", args.time_budget, lowest=0.0, allow_lowest=False, what="a finite number of seconds > 0"
    )
    if not args.list:
        args.out = studyout.check_out(args.out, FILES)
    return args


def _run(args: argparse.Namespace, argv: list) -> int:
    if args.list:
        print("\n".join(f"{s} m={m} T={tokens_for(get_shape(s), m)}" for s in args.shapes for m in args.tokens))
        return 0
    runinfo.require_cuda(PROG)
    start = time.monotonic()
    result = run(
        args.shapes,
        args.tokens,
        quick=args.quick,
        time_budget_s=args.time_budget,
        command=runinfo.command_line(PROG, argv),
        commit=args.commit,
        write=lambda r: write_outputs(r, args.out),
        say=studyout.progress(PROG),
    )
    print("\n".join(table(result) + [""] + summary_lines(result)))
    print("\nSWAP_AB_MAX_BY_LAYER entries (cute_moe/plan.py) the measurement supports:")
    print("\n".join(f"    {s['entry']}" for s in result["shapes"] if s["entry"]))
    print(f"wrote {', '.join(str(args.out / f) for f in FILES)} in {time.monotonic() - start:.0f} s")
    return 0


def main(argv=None) -> int:
    return studyout.run_command(PROG, argv, parse_args, _run, interrupted="the shapes finished so far are in {out}")


if __name__ == "__main__":
    sys.exit(main())

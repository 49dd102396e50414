"""``python -m compare.studies.stall``: what one rank's JIT compilation costs the others — measured, then modelled.

Every rank runs, step after step, the expert-parallel layer (:class:`compare.distributed.EPMoE`,
``triton_moe``: its kernels do not specialize on token counts) on its own T_r tokens, then the
small kernel of :mod:`compare.jitdemo` on T_r rows (the stand-in for any kernel of a serving step
that takes the token count as an argument), then an ``all_reduce`` — the collective at which the
ranks meet. T_r is drawn afresh for every rank and step (uniform on ``--tokens``; one table for
both runs). The loop runs twice, each time in fresh processes with empty Triton caches: with the
demo kernel specialized (Triton's default) and with ``do_not_specialize=["T"]``.

Recorded per step and rank: T, the compute time (layer + demo kernel, device synchronized), the
time spent inside the all_reduce (= waiting for the slowest rank, plus the collective itself), and
the kernels that met a new specialization key — on a GPU also the compilations Triton reported.
Then :mod:`compare.studies.stall_model` extrapolates to 1–8 ranks from the measured compile time.

    python -m compare.studies.stall --out notes/results                 # 2 GPUs, NCCL: the numbers that matter
    python -m compare.studies.stall --out /tmp/stall                    # no GPUs: gloo + interpreter, reduced
    python -m compare.studies.stall --model-only --compile-ms 318       # the model alone, no ranks started

On the CPU nothing is compiled (the interpreter runs the Python source): "compiled" there means a
new specialization key, i.e. what a GPU would compile, and the times are interpreter times that
say nothing about a GPU. Writes ``stall.json`` and ``stall.md`` (date, device, commit, command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import triton

from compare.cases import reduce_shape
from compare.distributed import EPMoE
from compare.jitdemo import BLOCK_T, ROW_WIDTH, VARIANTS
from compare.launch import default_backend, rank_device, run_ranks
from compare.studies.stall_model import Prediction, class_probabilities, predict, table, uniform_tokens
from moe_spec.cli import ArgumentParser
from moe_spec.problem import MoEShape, draw_weights, get_shape, route
from moe_spec.runinfo import git_commit as _git_commit
from triton_moe.jit import count_compilations, launch, specialization_key

DEMO_KERNEL = "_scale_rows"  # compare.jitdemo's kernel, as the compile counter names it
MODEL_RANKS = (1, 2, 4, 8)


@dataclass(frozen=True)
class StallSpec:
    shape: MoEShape
    steps: int = 48
    tokens: tuple = (1, 64)  # T per rank and step: uniform on lo … hi
    warmup_tokens: int = 3  # the warm-up step's T (Triton's "other" class)
    world: int = 2
    seed: int = 0
    timeout_s: float = 600.0
    command: str = ""

    def token_table(self) -> list[list[int]]:
        """T[step][rank], drawn once: both variants run the same steps."""
        lo, hi = self.tokens
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(lo, hi + 1, (self.steps, self.world), generator=g).tolist()


def demo_key(variant: str):
    """κ(T) of the demo kernel ``variant``: the key Triton's binder gives (triton_moe.jit)."""
    kernel = VARIANTS[variant]
    buf = torch.empty(16, ROW_WIDTH)
    return lambda T: specialization_key(
        kernel, (buf, buf[:, 0].contiguous(), buf, T), {"D": ROW_WIDTH, "BLOCK_T": BLOCK_T}
    )


# --- one rank's loop ----------------------------------------------------------------------------


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_loop(rank: int, world: int, spec: StallSpec, variant: str, table_: list) -> list[dict]:
    cache = tempfile.mkdtemp(prefix=f"stall_r{rank}_")
    os.environ["TRITON_CACHE_DIR"] = cache  # an empty cache: a compilation is a compilation
    device = rank_device(dist.get_backend(), rank)
    shape, kernel = spec.shape, VARIANTS[variant]
    per = shape.num_experts // world
    w1, w2 = (w[rank * per : (rank + 1) * per].contiguous() for w in draw_weights(shape, spec.seed, device))
    layer = EPMoE("triton_moe", check_peers=False)
    meet = torch.zeros(1, device=device)

    def step(T: int, s: int):
        g = torch.Generator().manual_seed(spec.seed + 7919 * (s + 1) + rank)
        x = torch.randn(T, shape.hidden, generator=g).to(torch.bfloat16).to(device)
        tw, ti = (t.to(device) for t in route(torch.randn(T, shape.num_experts, generator=g), shape.top_k))
        rows = torch.ones(T, ROW_WIDTH, device=device)
        scale, out = torch.full((T,), 2.0, device=device), torch.empty(T, ROW_WIDTH, device=device)
        _sync(device)
        t0 = time.perf_counter()
        layer(x, w1, w2, tw, ti)
        launch(kernel, (-(-T // BLOCK_T),), rows, scale, out, T, D=ROW_WIDTH, BLOCK_T=BLOCK_T)
        _sync(device)
        t1 = time.perf_counter()
        dist.all_reduce(meet)
        _sync(device)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    records = []
    try:
        with count_compilations() as counter:
            step(spec.warmup_tokens, -1)  # compiles the layer and the warm-up class; starts the communicator
            for s, row in enumerate(table_):
                counter.mark()
                compute_ms, wait_ms = step(row[rank], s)
                records.append(
                    {
                        "T": row[rank],
                        "compute_ms": compute_ms,
                        "wait_ms": wait_ms,
                        "new_keys": dict(counter.new_keys),
                        "compilations": list(counter.compilations),
                    }
                )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return records


# --- summaries ----------------------------------------------------------------------------------


def summarize(per_rank: list[list[dict]]) -> dict:
    """Per step (all ranks side by side) and the totals of one variant."""
    world, steps = len(per_rank), len(per_rank[0])
    rows, excess = [], []
    plain = [statistics.median([r["compute_ms"] for r in recs if not r["new_keys"]] or [0.0]) for recs in per_rank]
    for s in range(steps):
        at = [per_rank[r][s] for r in range(world)]
        demo = [r for r in range(world) if DEMO_KERNEL in at[r]["new_keys"]]
        layer = [r for r in range(world) if set(at[r]["new_keys"]) - {DEMO_KERNEL}]
        excess += [at[r]["compute_ms"] - plain[r] for r in demo if r not in layer]
        rows.append(
            {
                "step": s,
                "T": [a["T"] for a in at],
                "compute_ms": [a["compute_ms"] for a in at],
                "wait_ms": [a["wait_ms"] for a in at],
                "demo_compiled": demo,
                "layer_compiled": layer,
                "new_keys": [a["new_keys"] for a in at],
                "compilations": [a["compilations"] for a in at],
                "step_ms": max(a["compute_ms"] + a["wait_ms"] for a in at),
            }
        )
    stalled = [r for r in rows if r["demo_compiled"]]
    return {
        "steps": rows,
        "total_ms": sum(r["step_ms"] for r in rows),
        "median_step_ms": statistics.median(r["step_ms"] for r in rows),
        "steps_demo_compiled": len(stalled),
        "steps_layer_compiled": sum(bool(r["layer_compiled"]) for r in rows),
        "demo_compiles": sum(len(r["demo_compiled"]) for r in rows),
        # what the ranks that did not compile spent at the collective in the steps where one did
        "wait_ms_for_compiling_peer": sum(
            r["wait_ms"][i] for r in stalled for i in range(world) if i not in r["demo_compiled"]
        ),
        "compile_excess_ms": excess,
    }


def model_section(spec: StallSpec, compile_ms, step_ms=None) -> dict:
    """The model's predictions for both variants at MODEL_RANKS, from this spec's token distribution."""
    out = {
        "compile_ms": compile_ms,
        "step_ms": step_ms,
        "tokens": list(spec.tokens),
        "warmup_tokens": spec.warmup_tokens,
        "steps": spec.steps,
        "variants": {},
    }
    for variant in VARIANTS:
        key = demo_key(variant)
        q = class_probabilities(uniform_tokens(*spec.tokens), key)
        compiled = {key(spec.warmup_tokens)}
        out["variants"][variant] = {
            "classes": len(q),
            "p_new_class": 1.0 - sum(v for k, v in q.items() if k in compiled),
            "predictions": [predict(q, compiled, R, spec.steps, compile_ms).as_dict() for R in MODEL_RANKS],
        }
    return out


def _meta(spec: StallSpec, backend: str) -> dict:
    on_gpu = backend == "nccl"
    device = (
        f"{spec.world} × {torch.cuda.get_device_name()}"
        if on_gpu
        else f"CPU ({platform.processor() or platform.machine()}), {spec.world} processes"
    )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "commit": _git_commit(),
        "command": spec.command,
        "backend": backend,
        "mode": "gpu"
        if on_gpu
        else "cpu: gloo + Triton interpreter; 'compiled' = a new specialization key "
        "(nothing compiles); times are interpreter times, not GPU times",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "spec": {**asdict(spec), "shape": asdict(spec.shape)},
    }


def run_stall(spec: StallSpec) -> dict:
    """Both variants on ``spec.world`` ranks, summarized, with the model at the measured compile time."""
    backend = default_backend(spec.world)
    result = {"meta": _meta(spec, backend), "variants": {}}
    token_table = spec.token_table()
    for variant in VARIANTS:
        per_rank = run_ranks(_rank_loop, spec.world, (spec, variant, token_table), timeout_s=spec.timeout_s)
        result["variants"][variant] = summarize(per_rank)
    specialized = next(iter(result["variants"].values()))
    compile_ms = (
        statistics.median(specialized["compile_excess_ms"])
        if backend == "nccl" and specialized["compile_excess_ms"]
        else None
    )
    plain = result["variants"][list(result["variants"])[-1]]
    result["models"] = [model_section(spec, compile_ms, plain["median_step_ms"] if backend == "nccl" else None)]
    return result


# --- report -------------------------------------------------------------------------------------


def _fmt_ms(values) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def _layer_keys(row: dict) -> str:
    """ "rank: kernel ×n, …" for the layer's kernels that met a new key in this step."""
    return "; ".join(
        f"{r}: " + ", ".join(f"{k} ×{n}" for k, n in row["new_keys"][r].items() if k != DEMO_KERNEL)
        for r in row["layer_compiled"]
    )


def markdown(result: dict) -> str:
    m = result.get("meta", {})
    lines = ["# The recompile stall of one rank", ""]
    if m:
        lines += [f"date {m['date']}, device {m['device']}, commit `{m['commit']}`, command `{m['command']}`", ""]
    if "spec" in m:
        spec = m["spec"]
        lines += [
            f"Mode: {m['mode']}.",
            "",
            f"{spec['world']} ranks, expert-parallel layer `{spec['shape']['name']}` "
            f"(E {spec['shape']['num_experts']}, top-k {spec['shape']['top_k']}, K {spec['shape']['hidden']}, "
            f"I {spec['shape']['intermediate']}), "
            f"{spec['steps']} steps, T per rank uniform on {spec['tokens'][0]}…{spec['tokens'][1]} "
            f"(seed {spec['seed']}), warm-up T = {spec['warmup_tokens']}.",
            "",
        ]
    if result.get("variants"):
        lines += [
            "| demo kernel | steps where it compiled | its compilations | steps where a layer kernel compiled "
            "| Σ step ms | median step ms | ms the other ranks waited for a compiling one | compile excess ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        on_gpu = m.get("backend") == "nccl"
        for name, v in result["variants"].items():
            excess = (_fmt_ms(v["compile_excess_ms"]) or "–") if on_gpu else "n/a (CPU)"
            lines.append(
                f"| {name} | {v['steps_demo_compiled']} | {v['demo_compiles']} | {v['steps_layer_compiled']} "
                f"| {v['total_ms']:.1f} | {v['median_step_ms']:.2f} | {v['wait_ms_for_compiling_peer']:.1f} "
                f"| {excess} |"
            )
        for name, v in result["variants"].items():
            events = [r for r in v["steps"] if r["demo_compiled"] or r["layer_compiled"]]
            lines += [
                "",
                f"Steps with a new specialization key, {name} (ms per rank, rank 0 / rank 1 / …):",
                "",
                "| step | T | compute ms | wait ms | demo compiled on | layer kernels compiled on |",
                "|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {r['step']} | {r['T']} | {_fmt_ms(r['compute_ms'])} | {_fmt_ms(r['wait_ms'])} "
                f"| {r['demo_compiled'] or '–'} | {_layer_keys(r) or '–'} |"
                for r in events
            ] or ["| – | | | | | |"]
    for model in result["models"]:
        c = model["compile_ms"]
        lines += [""] * (lines[-1] != "") + [
            "## The model (compare.studies.stall_model)" + ("" if c is None else f": c = {c:g} ms"),
            "",
            f"T uniform on {model['tokens'][0]}…{model['tokens'][1]}, warm-up T = {model['warmup_tokens']}, "
            f"{model['steps']} steps, compile time c = "
            + ("n/a (no compilation measured)" if c is None else f"{c:g} ms")
            + (f", stall-free step {model['step_ms']:.2f} ms" if model.get("step_ms") else "")
            + ".",
            "",
        ]
        for name, v in model["variants"].items():
            lines += [
                f"**{name}**: {v['classes']} specialization class(es); a step's T falls outside the warm-up's "
                f"with probability {v['p_new_class']:.3f}.",
                "",
            ]
            lines += table([Prediction(**p) for p in v["predictions"]], model.get("step_ms")) + [""]
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path, name: str = "stall") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(result))


def _tokens(text: str) -> tuple:
    lo, sep, hi = text.partition("-")
    if not (sep and lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi):
        raise argparse.ArgumentTypeError(f"expected LO-HI with 1 <= LO <= HI, got {text!r}")
    return int(lo), int(hi)


def _floats(text: str) -> list:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative times, got {text!r}")
    return values


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = ArgumentParser(prog="python -m compare.studies.stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for stall.json / stall.md (e.g. notes/results)")
    p.add_argument("--world", type=int, default=2, help="ranks [%(default)s]")
    p.add_argument("--steps", type=int, help="steps per variant [GPU 48, CPU 4]")
    p.add_argument("--tokens", type=_tokens, default=(1, 64), help="T per rank and step: uniform LO-HI [1-64]")
    p.add_argument("--warmup-tokens", type=int, default=3, help="T of the warm-up step [%(default)s]")
    p.add_argument("--shape", help="catalog shape of the layer [GPU qwen3-30b-a3b; CPU: a reduced stand-in]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per variant [%(default)s]")
    p.add_argument("--model-only", action="store_true", help="start no ranks: the model at --compile-ms")
    p.add_argument("--compile-ms", type=_floats, help="compile time(s) for the model, e.g. 114,327 [the measured one]")
    a = p.parse_args(argv)
    on_gpu = default_backend(a.world) == "nccl"
    shape = get_shape(a.shape or "qwen3-30b-a3b")
    if not on_gpu and not a.shape:
        shape = replace(reduce_shape(shape), name=f"{shape.name} (reduced)")
    spec = StallSpec(
        shape=shape,
        steps=a.steps or (48 if on_gpu or a.model_only else 4),
        tokens=a.tokens,
        warmup_tokens=a.warmup_tokens,
        world=a.world,
        seed=a.seed,
        timeout_s=a.timeout_s,
        command="python -m compare.studies.stall " + " ".join(argv),
    )
    if a.model_only:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": "none: arithmetic (compare.studies.stall_model)",
            "commit": _git_commit(),
            "command": spec.command,
        }
        result = {"meta": meta, "models": [model_section(spec, c) for c in a.compile_ms or [None]]}
        write(result, Path(a.out), "stall_model")
        print(markdown(result), end="")
        return 0
    result = run_stall(spec)
    if a.compile_ms:
        result["models"] = [model_section(spec, c, result["models"][0]["step_ms"]) for c in a.compile_ms]
    write(result, Path(a.out))
    print(markdown(result), end="")
    print(f"wrote {Path(a.out) / 'stall.md'} and stall.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

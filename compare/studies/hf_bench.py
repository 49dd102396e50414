"""Whole-model timing of transformers' experts implementations and ours: ``python -m compare.studies.hf_bench``.

    source .device/on-device.sh && python3 -m compare.studies.hf_bench --out notes/results --commit SHA

A random model with a real MoE's layer shapes (default: Qwen3-30B-A3B — hidden 2048, 128 experts of
768, top-8, its attention and vocabulary — cut to ``--layers`` decoder layers), bf16 on one GPU. For
every experts implementation, bf16 and then FP8 (the experts replaced by transformers' FP8 experts
module with 128×128 blocks, :func:`compare.hf_experts.quantize_experts`; the other layers stay bf16):

* prefill — one forward over ``--prefill`` tokens (batch × length), the last position's logits
  only, as ``generate`` does; median wall time of ``--reps`` runs after a warm-up;
* decode — greedy steps of ``--decode-batch`` sequences (a comma-separated list: one measurement
  per batch) on a KV cache after a prompt of ``--decode-prompt`` tokens: tokens per second and ms
  per step over ``--decode-steps`` steps (eager PyTorch, no CUDA graphs: host time is part of every
  step, as in a plain ``generate``), after one untimed decode of the same lengths, so that no row
  pays the attention's one-time per-length setup;
* rel L2 — the full logits of the (first batch's) decode prompt against eager bf16's (FP8 rows: what
  quantization and kernel cost together), a check that the timed thing computes the model;
* first call — wall time of the warm-up prefill: JIT compilation included, with whatever on-disk
  kernel cache the machine had (a second run on the same machine is faster);
* with ``--profile-steps N`` (N ≤ ``--decode-steps``), where a decode step goes: the first N steps
  of a second decode of the first batch, over the timed steps' KV lengths, under torch.profiler:
  the operators with the most host (self CPU) and device time per step, in the JSON and as a table
  per row in the markdown (a compiled row shows our op as ``triton_moe::fused_moe`` /
  ``cute_moe::fused_moe``; an eager row calls the backend without the dispatcher, and its experts
  call is the named range ``triton_moe experts (compare.hf_experts)``, ``cute_moe experts …``).

Compiled rows (``--compiled grouped_mm,triton_moe,cute_moe``): the same model under
``torch.compile(model, fullgraph=True, dynamic=False, mode=...)`` for each of ``--compile-modes``
(``default``: inductor; ``reduce-overhead``: inductor and CUDA graphs), the ``compile`` column of
the row. Their prefill runs without a KV cache (``use_cache=False``) and their decode steps on a
static cache (``StaticCache``), so every call has fixed shapes: one graph for the prefill, one for
the decode prompt, one for a step. Our kernels enter the graph as ``torch.ops.triton_moe.fused_moe``
/ ``torch.ops.cute_moe.fused_moe`` (:mod:`moe_spec.ops`). "first call" is then the compilation of
the prefill graph; a model that does not trace whole (a graph break under ``fullgraph=True``) is a
row with the reason.

An implementation that fails to load or run (deepgemm and sonicmoe fetch kernels from the Hub;
transformers' FP8 grouped_mm / batched_mm / eager need its finegrained-fp8 Hub kernel) becomes a row
with the reason. ``--deadline-s`` bounds the run: rows past it are recorded as skipped, and the
JSON and markdown files are rewritten after every row. The markdown ends with each row's speed-up
over grouped_mm of the same format and compile mode. A run never overwrites another's files: a
second run on the same day in the same ``--out`` writes ``…_2``, ``…_3``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, StaticCache

import compare.hf_experts as hx
from moe_spec import runinfo
from moe_spec.cli import ArgumentParser, needs_cuda
from moe_spec.oracle import rel_l2

#: in the order they run (a deadline cuts the tail): transformers' defaults and ours first
IMPLEMENTATIONS = ("eager", "grouped_mm", "triton_moe", "cute_moe", "batched_mm", "deepgemm", "sonicmoe")
FORMATS = ("bf16", "fp8_block")
#: implementations that can also run as a torch.compile'd model (--compiled), and the modes (--compile-modes)
COMPILABLE = ("eager", "grouped_mm", "triton_moe", "cute_moe", "batched_mm")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

MODELS = {  # real layer shapes; --layers decides the depth
    "qwen3_30b_a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
    ),
    "mixtral_8x7b": (
        "MixtralConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
}


def run_info(commit: str | None) -> dict:
    """Date, device, commit and command of this run (:func:`moe_spec.runinfo.run_info`), plus transformers' version."""
    info = runinfo.run_info(
        runinfo.command_line("python -m compare.studies.hf_bench", sys.argv[1:]),
        cuda=torch.cuda.is_available(),
        commit=commit,
    )
    info["transformers"] = transformers.__version__
    return info


def build_model(name: str, layers: int, device, overrides: dict | None = None):
    cls_name, sizes = MODELS[name]
    config = getattr(transformers, cls_name)(**{**sizes, "num_hidden_layers": layers, **(overrides or {})})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _seconds(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _cache_argument(model) -> str:
    # transformers 5.17 names the argument past_key_values, later 5.x releases cache
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _decoder(model, prompt, steps: int, forward=None):
    """A greedy decode of ``prompt`` on a KV cache with room for ``steps`` more steps: a dynamic cache
    for the model itself, a static one (fixed shapes) when ``forward`` is its compiled version. Runs
    the prompt and two warm steps; returns the step function."""
    if forward is None:
        forward, cache = model, DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 2)
    kv = {_cache_argument(model): cache, "use_cache": True}
    token = forward(prompt, **kv).logits[:, -1:].argmax(-1)

    def step():
        nonlocal token
        token = forward(token, **kv).logits[:, -1:].argmax(-1)

    for _ in range(2):
        step()
    return step


def _decode_rate(model, prompt, steps: int, forward=None) -> float:
    """Greedy tokens per second of ``prompt.shape[0]`` sequences over ``steps`` steps (:func:`_decoder`).

    On a dynamic cache every step has a new KV length, and an attention backend may build a plan per
    length once per process (cuDNN's does: notes/transformers.md) — paid by whichever row decodes
    first. :func:`main` therefore decodes every batch once, untimed, with the eager experts before
    the rows, so that each eager row times the same steps on the same warm attention."""
    step = _decoder(model, prompt, steps, forward)
    return prompt.shape[0] * steps / _seconds(lambda: [step() for _ in range(steps)], prompt.device)


def _decode_profile(model, prompt, steps: int, profile_steps: int, forward=None) -> dict:
    """:func:`_profile` of the first ``profile_steps`` (at most ``steps``) steps of a decode of its own,
    on a cache of the timed decode's size: the same KV lengths as the timed steps (warm attention
    plans) and, compiled, the same static-cache shape (no recompilation, the timed rate untouched)."""
    return _profile(_decoder(model, prompt, steps, forward), profile_steps, prompt.device)


#: operators listed per profiled row: by host (self CPU) time, by device time
PROFILE_TOP = (12, 8)


def _profile(step, steps: int, device) -> dict:
    """Where ``steps`` decode steps spend their time (torch.profiler, CPU and — on a GPU — CUDA
    activity): the operators with the most self CPU time and the most device time, per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    events = prof.key_averages()
    device_us = lambda e: e.self_device_time_total  # noqa: E731
    entry = lambda e, us: {"op": e.key[:90], "us_per_step": us / steps, "calls_per_step": e.count / steps}  # noqa: E731
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: PROFILE_TOP[0]]
    busy = sorted((e for e in events if device_us(e) > 0), key=device_us, reverse=True)[: PROFILE_TOP[1]]
    return {
        "steps": steps,
        "host": [entry(e, e.self_cpu_time_total) for e in host],
        "device": [entry(e, device_us(e)) for e in busy],
    }


def _batched_mm_bytes(model, tokens: int) -> int:
    """batched_mm gathers one copy of the expert's weights per (token, expert) pair."""
    experts = next(m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor))
    per_pair = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
    return tokens * model.config.num_experts_per_tok * per_pair * experts.gate_up_proj.element_size()


def _reason(exc: BaseException) -> str:
    """One line: the exception's type and first line — for an exception torch.compile wraps (an
    exception raised in the traced code, "Observed exception"), the innermost one's."""
    inner = exc
    while (inner.__cause__ or inner.__context__) is not None and str(exc).startswith("Observed exception"):
        inner = inner.__cause__ or inner.__context__
    text = str(inner).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:240]


def inputs(model, spec):
    """(prefill tokens [batch, length], decode prompt [decode_batch, decode_prompt]): the same for every row."""
    g = torch.Generator().manual_seed(1)
    draw = lambda shape: torch.randint(0, model.config.vocab_size, shape, generator=g).to(model.device)  # noqa: E731
    return draw(tuple(spec.prefill)), {b: draw((b, spec.decode_prompt)) for b in spec.decode_batch}


def _rates(model, prompt: dict, spec, row: dict, forward=None) -> dict:
    """{batch: tokens/s} of every decode batch; with ``spec.profile_steps``, the first batch's decode
    is also profiled into ``row["profile"]``."""
    rates = {b: _decode_rate(model, p, spec.decode_steps, forward) for b, p in prompt.items()}
    if spec.profile_steps:
        row["profile"] = _decode_profile(
            model, next(iter(prompt.values())), spec.decode_steps, spec.profile_steps, forward
        )
    return rates


def _decode_rows(row: dict, rates: dict) -> None:
    """Record the decode rate of each batch (tokens/s and ms per step); the first batch's rate is
    also ``decode_tokens_per_s``."""
    row["decode"] = {str(b): {"tokens_per_s": r, "ms_per_step": 1e3 * b / r} for b, r in rates.items()}
    row["decode_tokens_per_s"] = next(iter(rates.values()))


@torch.no_grad()
def measure(model, implementation: str, fmt: str, spec, reference) -> dict:
    """One row: prefill ms, decode tokens/s, first call, rel L2 of the logits against eager bf16."""
    row = {"format": fmt, "implementation": implementation}
    device = model.device
    batch, length = spec.prefill
    prefill, prompt = inputs(model, spec)
    if implementation == "batched_mm" and device.type == "cuda":
        need = _batched_mm_bytes(model, batch * length)
        if need > 0.6 * torch.cuda.mem_get_info()[0]:
            row["status"] = f"not run: batched_mm would gather {need / 1e9:.0f} GB of weights for this prefill"
            return row
    before = hx.CALLS[implementation]
    try:
        model.set_experts_implementation(implementation)
        row["first_call_s"] = _seconds(lambda: model(prefill, logits_to_keep=1), device)
        times = [_seconds(lambda: model(prefill, logits_to_keep=1), device) for _ in range(spec.reps)]
        row["prefill_ms"] = 1e3 * statistics.median(times)
        row["prefill_tokens_per_s"] = batch * length / statistics.median(times)
        logits = model(next(iter(prompt.values()))).logits
        row["rel_l2_vs_eager_bf16"] = rel_l2(logits, reference)
        _decode_rows(row, _rates(model, prompt, spec, row))
        row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - a failing implementation is a row, not the end of the run
        row["status"] = "not available: " + _reason(exc)
    if implementation in hx.IMPLEMENTATIONS:
        row["our_kernel_calls"] = hx.CALLS[implementation] - before
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


@torch.no_grad()
def measure_compiled(
    model, implementation: str, fmt: str, spec, reference, mode: str, backend: str = "inductor"
) -> dict:
    """One compiled row: ``torch.compile(model, fullgraph=True, dynamic=False, mode=mode)`` with the
    experts of ``implementation`` — prefill ms (no KV cache), decode tokens/s (static cache), first
    call (the prefill's compilation), rel L2 of the decode prompt's logits against eager bf16."""
    row = {"format": fmt, "implementation": implementation, "compile": mode}
    device = model.device
    batch, length = spec.prefill
    prefill, prompt = inputs(model, spec)
    torch._dynamo.reset()
    try:
        model.set_experts_implementation(implementation)
        options = {} if mode == "default" else {"mode": mode}
        compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend, **options)
        call = lambda: compiled(prefill, logits_to_keep=1, use_cache=False).logits.clone()  # noqa: E731
        row["first_call_s"] = _seconds(call, device)
        call()  # reduce-overhead records its CUDA graph at the second call
        times = [_seconds(call, device) for _ in range(spec.reps)]
        row["prefill_ms"] = 1e3 * statistics.median(times)
        row["prefill_tokens_per_s"] = batch * length / statistics.median(times)
        logits = compiled(next(iter(prompt.values())), use_cache=False).logits.clone()
        row["rel_l2_vs_eager_bf16"] = rel_l2(logits, reference)
        _decode_rows(row, _rates(model, prompt, spec, row, compiled))
        row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - a model that does not compile is a row, not the end of the run
        row["status"] = "not available: " + _reason(exc)
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def write(out: Path, stem: str, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    s = results["setup"]
    batches = ", ".join(map(str, s["decode_batch"]))
    lines = [
        f"# transformers experts implementations, whole model — {results['device']}",
        "",
        f"- date: {results['date']}",
        f"- commit: `{results['commit']}`",
        f"- command: `{results['command']}`",
        f"- versions: python {results['python']}, torch {results['torch']}, triton {results['triton']}, "
        f"transformers {results['transformers']}",
        f"- model: {s['model']} layer shapes, {s['layers']} decoder layers, random weights, bf16 "
        f"(FP8 rows: experts only, 128×128 blocks); prefill {s['prefill'][0]}×{s['prefill'][1]} tokens "
        f"(median of {s['reps']}); decode batch {batches}, {s['decode_steps']} steps after a "
        f"{s['decode_prompt']}-token prompt",
        "- whole-model times: attention, norms, router and lm_head are in every row; only the experts differ",
        "- compile: empty for the eager model; else `torch.compile(model, fullgraph=True, dynamic=False, mode=...)` "
        "(prefill without a KV cache, decode on a static cache; first call = the prefill's compilation)",
        "",
        "| format | implementation | compile | prefill ms | prefill tok/s | "
        + "".join(f"decode b{b} ms/step | " for b in s["decode_batch"])
        + "first call s | rel L2 vs eager bf16 | status |",
        "|---|---|---|---|---|" + "---|" * len(s["decode_batch"]) + "---|---|---|",
    ]
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    step = lambda r, b: r.get("decode", {}).get(str(b), {}).get("ms_per_step")  # noqa: E731
    for r in results["rows"]:
        lines.append(
            f"| {r['format']} | {r['implementation']} | {r.get('compile') or ''} | {fmt(r.get('prefill_ms'), '.2f')} | "
            f"{fmt(r.get('prefill_tokens_per_s'), '.0f')} | "
            + "".join(f"{fmt(step(r, b), '.2f')} | " for b in s["decode_batch"])
            + f"{fmt(r.get('first_call_s'), '.1f')} | {fmt(r.get('rel_l2_vs_eager_bf16'), '.2e')} | {r['status']} |"
        )
    lines += ["", "Speed-up over grouped_mm of the same format and compile mode (its time over the row's):", ""]
    lines += [
        "| format | implementation | compile | prefill | " + "".join(f"decode b{b} | " for b in s["decode_batch"]),
        "|---|---|---|---|" + "---|" * len(s["decode_batch"]),
    ]
    base = {
        (r["format"], r.get("compile")): r
        for r in results["rows"]
        if r["implementation"] == "grouped_mm" and r["status"] == "ok"
    }
    ratio = lambda a, b: "" if a is None or b is None else f"{a / b:.2f}×"  # noqa: E731
    for r in results["rows"]:
        g = base.get((r["format"], r.get("compile")))
        if g is None or r["status"] != "ok" or r is g:
            continue
        lines.append(
            f"| {r['format']} | {r['implementation']} | {r.get('compile') or ''} | "
            f"{ratio(g.get('prefill_ms'), r.get('prefill_ms'))} | "
            + "".join(f"{ratio(step(g, b), step(r, b))} | " for b in s["decode_batch"])
        )
    lines += _profile_lines(results)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def _profile_lines(results: dict) -> list:
    """The markdown of the rows' decode profiles (``--profile-steps``): per row, the operators with the
    most host time and the most device time per step."""
    rows = [r for r in results["rows"] if r.get("profile")]
    if not rows:
        return []
    b = results["setup"]["decode_batch"][0]
    lines = ["", f"Where a decode step's time goes (batch {b}, torch.profiler, per step: self time µs, calls):"]
    for r in rows:
        prof = r["profile"]
        lines += [
            "",
            f"**{r['format']} {r['implementation']} {r.get('compile') or 'eager'}** ({prof['steps']} steps)",
            "",
        ]
        lines += ["| host: op | µs | calls | device: op | µs | calls |", "|---|---|---|---|---|---|"]
        host, busy = prof["host"], prof["device"]
        for i in range(max(len(host), len(busy))):
            cell = lambda side: (  # noqa: E731
                f"{side[i]['op']} | {side[i]['us_per_step']:.1f} | {side[i]['calls_per_step']:.1f}"
                if i < len(side)
                else " |  | "
            )
            lines.append(f"| {cell(host)} | {cell(busy)} |")
    return lines


def _batches(text: str) -> tuple:
    try:
        batches = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not batches or min(batches) < 1 or len(set(batches)) != len(batches):
        raise argparse.ArgumentTypeError(f"expected distinct positive integers, got {text!r}")
    return batches


def _free_stem(out: Path, stem: str) -> str:
    """``stem``, or ``stem_2``, ``stem_3``… — the first whose files do not exist in ``out`` yet."""
    n, free = 1, stem
    while (out / f"{free}.json").exists() or (out / f"{free}.md").exists():
        n += 1
        free = f"{stem}_{n}"
    return free


def parse_args(argv=None):
    ap = ArgumentParser(prog="python -m compare.studies.hf_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3_30b_a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--prefill",
        type=lambda s: tuple(int(v) for v in s.split("x")),
        default=(1, 1024),
        help="BATCHxLENGTH of the prefill (default 1x1024)",
    )
    ap.add_argument(
        "--decode-batch",
        type=_batches,
        default=(8,),
        help="decode batch sizes, comma-separated: one decode measurement each (default 8)",
    )
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=128, help="prompt length before the decode steps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="per row, profile this many steps (at most --decode-steps) of a second decode of the first batch "
        "(torch.profiler): the operators with the most host and device time per step, in the markdown [0: none]",
    )
    ap.add_argument(
        "--implementations",
        default=",".join(IMPLEMENTATIONS),
        help="eager rows, comma-separated; empty for the --compiled rows alone [%(default)s]",
    )
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument(
        "--compiled",
        default="",
        help="implementations also timed as a torch.compile'd model, "
        f"comma-separated, from {','.join(COMPILABLE)} (e.g. grouped_mm,triton_moe,cute_moe) [none]",
    )
    ap.add_argument(
        "--compile-modes",
        default="reduce-overhead",
        help=f"torch.compile modes of the compiled rows, comma-separated, from {','.join(COMPILE_MODES)} "
        "[reduce-overhead]",
    )
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend [inductor; aot_eager traces and runs the graph without code generation]",
    )
    ap.add_argument("--deadline-s", type=float, default=200.0, help="rows past this many seconds are skipped")
    ap.add_argument("--out", type=Path, default=Path("notes/results"))
    ap.add_argument("--commit", default=None, help="commit to record [git rev-parse of this checkout]")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", default="{}", help="JSON overrides of the model config (a smaller model for tests)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cpu" and args.config == "{}":  # full-size layers on a CPU: minutes and gigabytes
        needs_cuda(
            "python -m compare.studies.hf_bench",
            "on a CPU, --config with a smaller model (as tests/test_hf_bench_compiled.py runs it)",
        )
    start = time.monotonic()
    hx.register()
    impls = [name for name in args.implementations.split(",") if name]  # empty: compiled rows only
    formats = args.formats.split(",")
    compiled = [name for name in args.compiled.split(",") if name]
    modes = [m for m in args.compile_modes.split(",") if m]
    for option, given, allowed in (
        ("--implementations", impls, IMPLEMENTATIONS),
        ("--formats", formats, FORMATS),
        ("--compiled", compiled, COMPILABLE),
        ("--compile-modes", modes, COMPILE_MODES),
    ):
        if not set(given) <= set(allowed):
            raise SystemExit(f"{option}: unknown {sorted(set(given) - set(allowed))}; expected some of {allowed}")
    if not 0 <= args.profile_steps <= args.decode_steps:
        raise SystemExit(
            f"--profile-steps: expected 0 to --decode-steps ({args.decode_steps}) steps, got {args.profile_steps}"
        )
    if compiled and not modes:
        raise SystemExit("--compile-modes: at least one mode for the --compiled rows")
    results = {
        **run_info(args.commit),
        "rows": [],
        "setup": {
            "model": args.model,
            "layers": args.layers,
            "prefill": list(args.prefill),
            "reps": args.reps,
            "decode_batch": list(args.decode_batch),
            "decode_steps": args.decode_steps,
            "decode_prompt": args.decode_prompt,
            "profile_steps": args.profile_steps,
            "compiled": compiled,
            "compile_modes": modes,
            "compile_backend": args.compile_backend,
        },
    }
    stem = _free_stem(args.out, f"hf_bench_{args.model}_{results['date'][:10]}")
    model = build_model(args.model, args.layers, args.device, json.loads(args.config))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        prompts = inputs(model, args)[1]
        reference = model(next(iter(prompts.values()))).logits
        if impls:
            for prompt in prompts.values():
                _decode_rate(model, prompt, args.decode_steps)  # untimed: see _decode_rate
    for fmt in formats:
        if fmt == "fp8_block":
            hx.quantize_experts(model, "block")
        jobs = [(impl, None) for impl in impls] + [(impl, mode) for mode in modes for impl in compiled]
        for impl, mode in jobs:
            if time.monotonic() - start > args.deadline_s:
                row = {
                    "format": fmt,
                    "implementation": impl,
                    "status": f"skipped: past --deadline-s {args.deadline_s:g}",
                }
                if mode is not None:
                    row["compile"] = mode
            elif mode is None:
                row = measure(model, impl, fmt, args, reference)
            else:
                row = measure_compiled(model, impl, fmt, args, reference, mode, args.compile_backend)
            results["rows"].append(row)
            write(args.out, stem, results)
            print(f"{fmt:9s} {impl:11s} {mode or '':16s} {row['status']}", flush=True)
    results["seconds"] = time.monotonic() - start
    write(args.out, stem, results)
    return results


if __name__ == "__main__":
    main()

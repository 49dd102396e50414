"""The warm-up study: what one ``warmup`` call costs from empty caches, and that nothing compiles after it.

For every (backend, shape, format) the study starts a fresh Python process with empty Triton and
CuTe DSL caches (``TRITON_CACHE_DIR``, ``CUTE_DSL_CACHE_DIR``, set before anything compiles) and
there (1) times ``<backend>.warmup(E, K, I, top_k, quant, max_tokens)``: what it compiled, each
step's seconds; (2) sweeps T over :func:`sweep_tokens` calling ``fused_moe`` on fresh inputs and
records whether a call compiled anything and the first and second call's time. A case whose sweep
compiles after the warm-up is a FAIL. On a CPU the study is reduced: Triton as a dry run through its
interpreter (the keys a GPU would compile), CuTe compiling to PTX for real, its sweep checking that
every plan finds its kernels in the compile cache (:func:`cute_moe.warmup.compile_plan`). The main
job calls :func:`run_warm_study`; ``python -m compare.warm_study --out DIR`` writes its report
(``--count``: how many kernels each layer needs, compiling nothing).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from moe_spec import runinfo
from moe_spec.cli import ArgumentParser
from moe_spec.problem import MoEShape, draw_weights, get_shape, route
from moe_spec.quant import FORMATS, get_format, quantize_weight
from moe_spec.validate import MoEDims
from moe_spec.warmup import placeholder_inputs

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("triton_moe", "cute_moe")
MAX_TOKENS = 16384
#: The layer the CPU runs the study on by default: small enough for the interpreter, with enough
#: experts and top_k that T = 1 … 512 crosses every bucket of both backends' rules.
CPU_SHAPE = MoEShape("warm-tiny", 8, 2, 64, 32, "a reduced layer for the CPU form of the study")
CPU_MAX_TOKENS = 512
CASE_TIMEOUT_S = 600
#: Spacing of the sweep's odd values: each about 3 % above the previous one.
SWEEP_RATIO = 1.03


def sweep_tokens(max_tokens: int = MAX_TOKENS, ratio: float = SWEEP_RATIO) -> list[int]:
    """T values up to ``max_tokens``: every power of two, its odd neighbours 2ᵏ ± 1, and odd values
    spaced by ``ratio`` (247 values up to 16384: every odd T up to 83, then sparser); sorted."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected a positive int, got {max_tokens!r}")
    values, p = {1}, 1
    while p <= max_tokens:
        values.update((p, p - 1, p + 1))
        p *= 2
    v = 1.0
    while v <= max_tokens:
        values.add(int(v) | 1)
        v *= ratio
    return sorted(t for t in values if 1 <= t <= max_tokens)


# --- one case, in its own process -------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _inputs(shape: MoEShape, T: int, quant, weights, gen, device: str) -> dict:
    """A fresh batch of T tokens: x ~ N(0, 1), softmax top-k routing; the given weights."""
    x = torch.randn(T, shape.hidden, generator=gen, device=device).to(torch.bfloat16)
    topk_weights, topk_ids = route(torch.randn(T, shape.num_experts, generator=gen, device=device), shape.top_k)
    w1, w2, w1_scale, w2_scale = weights
    return dict(
        x=x,
        w1=w1,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
    )


def _weights(shape: MoEShape, quant, device: str, real: bool):
    """Real weights (N(0, 1/fan_in), quantized per ``quant``) for timed calls; placeholders for a dry run."""
    if not real:
        p = placeholder_inputs(shape.num_experts, shape.hidden, shape.intermediate, shape.top_k, quant, 1, device)
        return p.w1, p.w2, p.w1_scale, p.w2_scale
    w1, w2 = draw_weights(shape, 0, device)
    if not get_format(quant).quantized:
        return w1, w2, None, None
    (w1, s1), (w2, s2) = quantize_weight(w1, quant), quantize_weight(w2, quant)
    return w1, w2, s1, s2


def _timed_call(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _sweep(backend: str, mod, shape: MoEShape, quant, tokens, device: str, new_compilations) -> list[dict]:
    """Per T: compilations of the call (``new_compilations()`` before/after) and its first/second ms."""
    gpu = device == "cuda"
    weights = _weights(shape, quant, device, real=gpu)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for T in tokens:
        before = new_compilations()
        if backend == "cute_moe" and not gpu:  # no launch on a CPU: what the call would compile
            dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
            mod.compile_plan(mod.plan(dims, quant))
            rows.append({"T": T, "compiled": new_compilations() - before})
            continue
        inputs = _inputs(shape, T, quant, weights, gen, device)
        first = _timed_call(lambda: mod.fused_moe(**inputs), device)
        row = {"T": T, "compiled": new_compilations() - before}
        if gpu:
            second = _timed_call(lambda: mod.fused_moe(**inputs), device)
            row.update(first_ms=round(first, 3), second_ms=round(second, 3))
        rows.append(row)
    return rows


def _case(backend: str, shape: MoEShape, quant, tokens, device: str) -> dict:
    """Warm-up then sweep, in this process (``_worker`` runs it in a fresh one)."""
    start = time.perf_counter()
    mod = importlib.import_module(backend)
    out = {"import_s": round(time.perf_counter() - start, 3)}
    args = (shape.num_experts, shape.hidden, shape.intermediate, shape.top_k, quant)
    try:
        if backend == "triton_moe":
            from triton_moe.jit import count_compilations

            dry = device != "cuda"
            with count_compilations(dry_run=dry) as counter:  # around both: the sweep's keys vs the warm-up's
                report = mod.warmup(*args, max_tokens=max(tokens), device=device)
                counter.mark()
                new = (lambda: sum(counter.new_keys.values())) if dry else (lambda: len(counter.compilations))
                rows = _sweep(backend, mod, shape, quant, tokens, device, new)
                out["new_keys_after_warmup"] = dict(counter.new_keys)
        else:
            report = mod.warmup(*args, max_tokens=max(tokens), device=device)
            base = mod.compile_count()
            rows = _sweep(backend, mod, shape, quant, tokens, device, lambda: mod.compile_count() - base)
    except NotImplementedError as exc:
        return {**out, "status": f"not available: {exc}"}
    compiled_at = [r["T"] for r in rows if r["compiled"]]
    out.update(
        warmup=report.as_dict(),
        per_T=rows,
        compilations_after_warmup=sum(r["compiled"] for r in rows),
        compiled_at_T=compiled_at,
        status="ok" if not compiled_at else f"FAIL: compiled after the warm-up at T = {compiled_at[:10]}",
    )
    if device == "cuda":
        first = sorted(rows, key=lambda r: r["first_ms"])
        out.update(
            first_call_ms_max=first[-1]["first_ms"],
            first_call_ms_max_at_T=first[-1]["T"],
            first_call_ms_median=first[len(first) // 2]["first_ms"],
            second_call_ms_median=sorted(r["second_ms"] for r in rows)[len(rows) // 2],
        )
    return out


def _worker(spec_json: str) -> None:
    """Entry of the case process: run one case, write its result JSON to ``spec["result"]``."""
    spec = json.loads(spec_json)
    empty = all(
        not os.path.exists(d) or not os.listdir(d)
        for d in (os.environ["TRITON_CACHE_DIR"], os.environ["CUTE_DSL_CACHE_DIR"])
    )
    shape = MoEShape(**spec["shape"])
    result = {
        "caches_empty_at_start": empty,
        **_case(spec["backend"], shape, spec["quant"], spec["tokens"], spec["device"]),
    }
    Path(spec["result"]).write_text(json.dumps(result))


# --- the study ----------------------------------------------------------------------------------------------


def _shape(s) -> MoEShape:
    return s if isinstance(s, MoEShape) else get_shape(s)


def _run_case(backend: str, shape: MoEShape, quant, tokens, device: str, timeout: float) -> dict:
    base = {
        "backend": backend,
        "shape": shape.label,
        "quant": get_format(quant).label,
        "tokens": len(tokens),
        "max_tokens": max(tokens),
    }
    with tempfile.TemporaryDirectory(prefix="warm_study_") as tmp:
        env = dict(
            os.environ,
            TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
            CUTE_DSL_CACHE_DIR=os.path.join(tmp, "cute"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        )
        if device != "cuda":
            env["TRITON_INTERPRET"] = "1"
        result = os.path.join(tmp, "result.json")
        spec = {
            "backend": backend,
            "shape": asdict(shape),
            "quant": quant,
            "tokens": list(tokens),
            "device": device,
            "result": result,
        }
        start = time.perf_counter()
        try:
            run = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from compare.warm_study import _worker; _worker(sys.argv[1])",
                    json.dumps(spec),
                ],
                cwd=REPO_ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {**base, "status": f"error: the case process ran over {timeout:.0f} s"}
        wall = round(time.perf_counter() - start, 2)
        if run.returncode != 0 or not os.path.exists(result):
            tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
            return {**base, "status": f"error: the case process exited {run.returncode}: {tail[0]}"[:300]}
        return {**base, "process_s": wall, **json.loads(Path(result).read_text())}


def run_warm_study(
    shapes,
    quants,
    backends=BACKENDS,
    tokens=None,
    device: str = "cuda",
    *,
    timeout: float = CASE_TIMEOUT_S,
    command: str = "run_warm_study(...)",
    commit: str | None = None,
) -> dict:
    """Warm-up cost and compilations after it per (backend, shape, format), each case in a fresh
    process (module docstring). ``tokens``: the T sweep (default :func:`sweep_tokens`; the warm-up
    covers 1 … max(tokens)); ``device``: "cuda" or "cpu" (reduced). Returns ``{"meta", "cases"}``;
    a format a backend does not build is a case whose status says so."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' asked for, but no CUDA device is visible (device='cpu' runs the reduced form)")
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"backends: unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    for q in quants:
        get_format(q)
    tokens = sorted(set(tokens)) if tokens is not None else sweep_tokens()
    if not tokens or tokens[0] < 1:
        raise ValueError(f"tokens: expected positive token counts, got {tokens!r}")
    shapes = [_shape(s) for s in shapes]
    start = time.perf_counter()
    cases = [_run_case(b, s, q, tokens, device, timeout) for b in backends for s in shapes for q in quants]
    meta = runinfo.run_info(command, cuda=device == "cuda", commit=commit)
    meta.update(
        mode="gpu"
        if device == "cuda"
        else "cpu (reduced): Triton dry run through the interpreter (keys, no latency), CuTe compiled to PTX",
        tokens=tokens,
        wall_s=round(time.perf_counter() - start, 1),
    )
    return {"meta": meta, "cases": cases}


# --- reports ---------------------------------------------------------------------------------------------


def _cell(v, fmt="{}"):
    return "—" if v is None else fmt.format(v)


def to_markdown(study: dict) -> str:
    m = study["meta"]
    t = m["tokens"]
    lines = [
        "# Warm-up study: compile every kernel of a layer, then sweep T",
        "",
        f"- date: {m['date']}",
        f"- device: {m['device']}",
        f"- commit: `{m['commit']}`",
        f"- command: `{m['command']}`",
        f"- mode: {m['mode']}",
        f"- T swept: {len(t)} values from {t[0]} to {t[-1]} (powers of two, 2ᵏ ± 1, odd values "
        f"{(SWEEP_RATIO - 1) * 100:.0f} % apart); each case in a fresh process with empty Triton and CuTe caches",
        "",
        "| backend | shape | format | plans | kernels the warm-up compiled (dry run: would compile) | warm-up s "
        "| import backend s "
        "| compilations after warm-up | first call ms: max (at T) | median | second call ms median | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in study["cases"]:
        w = c.get("warmup") or {}
        at = f" (T = {c['first_call_ms_max_at_T']})" if "first_call_ms_max_at_T" in c else ""
        dry = w.get("mode", "").startswith("dry run")
        seconds = "dry run" if dry else _cell(w.get("seconds"), "{:.2f}")
        lines.append(
            f"| {c['backend']} | {c['shape']} | {c['quant']} | {_cell(w.get('plans') and len(w['plans']))} "
            f"| {_cell(w.get('compiled'))} | {seconds} | {_cell(c.get('import_s'))} "
            f"| {_cell(c.get('compilations_after_warmup'))} | {_cell(c.get('first_call_ms_max'))}{at} "
            f"| {_cell(c.get('first_call_ms_median'))} | {_cell(c.get('second_call_ms_median'))} "
            f"| {c['status']} |"
        )
    for c in study["cases"]:
        w = c.get("warmup")
        if not w:
            continue
        lines += [
            "",
            f"## {c['backend']}, {c['shape']}, {c['quant']}: the warm-up's steps ({w['mode']})",
            "",
            "| step | kernels | seconds |",
            "|---|---|---|",
        ]
        lines += [
            f"| {s['what']} | {len(s['compiled'])}: {', '.join(s['compiled']) or '(cached)'} | {s['seconds']:.3f} |"
            for s in w["steps"]
        ]
    return "\n".join(lines) + "\n"


def count_kernels(shapes, quants, backends=BACKENDS, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """How many kernels each layer needs per backend and format — the warm-ups' dry runs (nothing
    compiled; Triton's tile rule is this machine's: the tuned tables on their GPU, else the heuristic)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for b in backends:
        mod = importlib.import_module(b)
        for s in map(_shape, shapes):
            for q in quants:
                row = {"backend": b, "shape": s.label, "quant": get_format(q).label}
                try:
                    r = mod.warmup(
                        s.num_experts,
                        s.hidden,
                        s.intermediate,
                        s.top_k,
                        q,
                        max_tokens=max_tokens,
                        device=device,
                        dry_run=True,
                    )
                    row.update(plans=len(r.plans), kernels=r.count)
                except NotImplementedError as exc:
                    row.update(plans=None, kernels=None, note=str(exc))
                rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m compare.warm_study", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes",
        default=None,
        help="catalog shapes, comma-separated (default: qwen3-30b-a3b on a GPU, a reduced layer on a CPU)",
    )
    ap.add_argument(
        "--quants",
        default=None,
        help="bf16 and FP8 formats, comma-separated, or 'all' (default: bf16,fp8_tensor on a GPU, all on a CPU)",
    )
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument(
        "--max-tokens", type=int, default=None, help=f"largest T (default {MAX_TOKENS}; CPU {CPU_MAX_TOKENS})"
    )
    ap.add_argument(
        "--out", default=None, help="directory for warm_study.md and warm_study.json (required unless --count)"
    )
    ap.add_argument("--commit", default=None, help="commit to record [git rev-parse of this checkout]")
    ap.add_argument("--count", action="store_true", help="only print how many kernels each layer needs (no compile)")
    args = ap.parse_args(argv)
    if args.out is None and not args.count:
        ap.error("--out: required (a directory for warm_study.md and warm_study.json), or --count")
    gpu = torch.cuda.is_available()
    labels = {f.label: f.name for f in FORMATS.values()}
    quant_text = args.quants or ("bf16,fp8_tensor" if gpu else "all")
    names = list(labels) if quant_text == "all" else [q.strip() for q in quant_text.split(",")]
    if any(q not in labels for q in names):
        ap.error(f"--quants: expected some of {', '.join(labels)} or 'all', got {quant_text!r}")
    quants = [labels[q] for q in names]
    backends = [b.strip() for b in args.backends.split(",")]
    if any(b not in BACKENDS for b in backends):
        ap.error(f"--backends: expected some of {', '.join(BACKENDS)}, got {args.backends!r}")
    try:
        shapes = (
            [get_shape(s) for s in args.shapes.split(",")]
            if args.shapes
            else [get_shape("qwen3-30b-a3b") if gpu else CPU_SHAPE]
        )
    except ValueError as exc:
        ap.error(f"--shapes: {exc}")
    max_tokens = args.max_tokens or (MAX_TOKENS if gpu else CPU_MAX_TOKENS)
    if max_tokens < 1:
        ap.error(f"--max-tokens: expected a positive int, got {max_tokens}")
    if args.count:
        rule = (
            f"the tuned tables of this {torch.cuda.get_device_name()} where they exist, else the heuristic"
            if gpu
            else "the heuristic (no GPU here; the tuned tables are per device)"
        )
        print(
            f"kernels each layer needs for T = 1…{max_tokens} (the warm-ups' dry runs, nothing compiled; "
            f"Triton's tile rule: {rule})"
        )
        for r in count_kernels(shapes, quants, backends, max_tokens):
            what = f"{r['plans']} plans, {r['kernels']} kernels" if r["kernels"] is not None else r["note"]
            print(f"{r['backend']:10s} {r['shape']:18s} {r['quant']:11s} T = 1…{max_tokens}: {what}")
        return 0
    command = runinfo.command_line("python -m compare.warm_study", sys.argv[1:] if argv is None else argv)
    study = run_warm_study(
        shapes,
        quants,
        backends,
        sweep_tokens(max_tokens),
        "cuda" if gpu else "cpu",
        command=command,
        commit=args.commit,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warm_study.json").write_text(json.dumps(study, indent=1))
    (out / "warm_study.md").write_text(to_markdown(study))
    print(to_markdown(study).split("\n## ")[0])
    print(f"wrote {out / 'warm_study.md'} and {out / 'warm_study.json'}")
    return 0 if all(c["status"] == "ok" or c["status"].startswith("not available") for c in study["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())

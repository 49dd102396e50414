"""FP8 accumulation promotion, accuracy against cost: ``python -m triton_moe.lab.promotion --out DIR`` (GPU).

Hopper's FP8 WGMMA sums its products in fewer bits than fp32 (``triton_moe.kernels``, "FP8
accumulation"). The *promotion interval* n is how many elements of K the tensor core sums before
the partial sum is added into an fp32 register. Measured for n in :data:`INTERVALS` (never =
2**30, Triton's FP8 default on sm_90) under fp8_tensor and fp8_block:

* accuracy — one FP8 GEMM [M, K] × [N, K]ᵀ, M = N = 256, K = 1024 … 16384, fp32 out, run by
  :func:`promotion_gemm_kernel` (the layer's kernels promote by a fixed rule), against
  the fp64 product of the *dequantized* E4M3 operands — the W8A8 model exactly, so the rel L2 is
  the accumulation's error alone. A GEMM, not the layer: the layer's error also holds the
  re-quantization of its intermediate (a ~4e-3 floor, ``notes/triton_moe.md``) and two K at once.
* cost — the same kernel at M = N = 4096, K = 8192 (GEMM µs), and the whole layer as it runs
  (``triton_moe.fused_moe``, Mixtral-8x7B at T = 4096: GEMM1's K = 4096, GEMM2's K = 14336), in the
  row of the interval its kernels use (:func:`triton_moe.kernels.fp8_imprecise_acc`: each K step of
  at most 128, n = 0, else every 128 of K), CUDA-graph replays over rotated input sets
  (:func:`moe_spec.timing.time_cuda_graph`), and its rel L2 against the oracle. The layer has no
  other interval; the others are this GEMM's.

Each n (BLOCK_K = 128): 0 — ``acc += tl.dot(a, w)`` per K step (the layer's); ≤ 128 —
``tl.dot(a, w, acc, max_num_imprecise_acc=n)``; 256, 512 — a partial accumulator through n/128
dots, then one fp32 add; never — ``tl.dot(a, w, acc)``. 0 and 128 are one program after ptxas
(``notes/triton_moe.md``, "FP8 promotion"); fp8_block's scales change every 128 of K, so n > 128 is
"n/a" for it. The command prints, per format, the largest interval with rel L2 ≤ 1e-2 at every K
measured up to the catalog's largest GEMM K, and the largest within one K step (n ≤ 128). Writes
``promotion.md`` and ``.json`` to ``--out`` (new or empty) after every part; bad options and a used
``--out`` are refused in one line before any GPU work."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
import triton.language as tl

from moe_spec import runinfo, studyout
from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import CATALOG, draw_weights, get_shape, make_inputs
from moe_spec.quant import (
    FP8_BLOCK,
    dequantize_activation,
    dequantize_weight,
    get_format,
    quantize_activation,
    quantize_weight,
)
from moe_spec.studyout import UsageError
from moe_spec.timing import sets_for_cold_l2, time_cuda_graph
from moe_spec.validate import MoEDims
from triton_moe.jit import INTERPRET, launch

PROG = "python -m triton_moe.lab.promotion"
NEVER = 2**30
INTERVALS = (0, 32, 64, 128, 256, 512, NEVER)
KS = (1024, 2048, 4096, 8192, 16384)
FORMATS = ("fp8_tensor", "fp8_block")
BLOCK_K = FP8_BLOCK  # one K step = one scale block of fp8_block
ROWS = 256  # M = N of the accuracy GEMM
TIME_GEMM = (4096, 4096, 8192)  # M, N, K of the timed GEMM
LAYER_SHAPE, LAYER_T = "mixtral-8x7b", 4096
TIME_BUDGET_S = 120.0
TIMING = dict(replays=15, min_calls=10, warmup=2)
FILES = ("promotion.md", "promotion.json")
STEP, WITHIN, GROUPED, ALL_K = 0, 1, 2, 3  # how the kernel promotes (MODE)
label = lambda n: "never" if n >= NEVER else str(n)  # noqa: E731
_status = lambda exc: f"error: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"  # noqa: E731


def catalog_max_k() -> int:
    """The largest reduction length of any GEMM of a catalog layer: max(hidden, intermediate)."""
    return max(max(s.hidden, s.intermediate) for s in CATALOG.values())


def effective(n: int) -> int:
    """Elements of K summed in the tensor core between promotions (0: one K step)."""
    return BLOCK_K if n == 0 else n


def applies(n: int, quant: str) -> bool:
    """Whether interval n exists under ``quant`` (fp8_block promotes every K step: n ≤ BLOCK_K)."""
    return n <= BLOCK_K or not get_format(quant).scales_along_k


def mode_of(n: int, quant: str) -> int:
    """The kernel's MODE for interval n; ValueError (naming ``interval``) where the format has none."""
    if n not in INTERVALS:
        raise ValueError(f"interval: expected one of {', '.join(map(label, INTERVALS))}, got {n}")
    if not applies(n, quant):
        raise ValueError(
            f"interval: {label(n)} under {quant}: its scales change every {BLOCK_K} of K, so every "
            f"K step is promoted (n ≤ {BLOCK_K})"
        )
    return STEP if n == 0 else WITHIN if n <= BLOCK_K else ALL_K if n >= NEVER else GROUPED


@triton.jit
def _dot(a, w, acc, MODE: tl.constexpr, INTERVAL: tl.constexpr, INTERPRETER: tl.constexpr):
    """One K step: a·wᵀ (STEP), into ``acc`` promoted every INTERVAL (WITHIN) or never (else). The
    interpreter's E4M3 dot is not exact; widened to fp32, the products are."""
    if INTERPRETER:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if MODE == 0:
        return tl.dot(a, tl.trans(w))
    elif MODE == 1:
        return tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=INTERVAL)
    else:
        return tl.dot(a, tl.trans(w), acc)


@triton.jit
def promotion_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    BLOCKWISE: tl.constexpr,
    MODE: tl.constexpr,
    INTERVAL: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[M, N] fp32 = (a·s_a)(w·s_w)ᵀ for E4M3 a [M, K], w [N, K]; sizes multiples of the blocks.

    Per-tensor scales multiply after the loop; block scales (BLOCKWISE) every K step."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MODE == 2:  # a partial accumulator through INTERVAL // BLOCK_K dots, then one fp32 add
        for _k0 in range(0, K, INTERVAL):
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for _j in range(INTERVAL // BLOCK_K):
                part = _dot(tl.load(a_ptrs), tl.load(w_ptrs), part, MODE, INTERVAL, INTERPRETER)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            acc += part
    else:
        k_groups = K // BLOCK_K
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
            if BLOCKWISE:
                s_a = tl.load(a_scale_ptr + offs_m * k_groups + k0 // BLOCK_K)
                s_w = tl.load(w_scale_ptr + (offs_n // BLOCK_K) * k_groups + k0 // BLOCK_K)
                zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc += _dot(a, w, zero, MODE, INTERVAL, INTERPRETER) * (s_a[:, None] * s_w[None, :])
            elif MODE == 0:
                acc += _dot(a, w, acc, MODE, INTERVAL, INTERPRETER)
            else:
                acc = _dot(a, w, acc, MODE, INTERVAL, INTERPRETER)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if not BLOCKWISE:
        acc = acc * (tl.load(a_scale_ptr) * tl.load(w_scale_ptr))
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


def fp8_gemm(
    a,
    a_scale,
    w,
    w_scale,
    quant: str,
    interval: int,
    *,
    block_mn: int = 128,
    num_warps: int = 8,
    num_stages: int = 3,
    out=None,
) -> torch.Tensor:
    """fp32 [M, N] of E4M3 ``a`` [M, K] (scales of ``quantize_activation``) times E4M3 ``w`` [N, K]ᵀ
    (``quantize_weight`` of w[None]: scale [1] or [1, N/128, K/128]) with promotion ``interval``."""
    mode = mode_of(interval, quant)
    (M, K), N = a.shape, w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"w: expected [N, K={K}], got {tuple(w.shape)}")
    for name, v, m in (("M", M, block_mn), ("N", N, block_mn), ("K", K, BLOCK_K if mode != GROUPED else interval)):
        if v % m:
            raise ValueError(f"{name} = {v}: must be a multiple of {m} here")
    out = torch.empty(M, N, dtype=torch.float32, device=a.device) if out is None else out
    launch(
        promotion_gemm_kernel,
        (M // block_mn, N // block_mn),
        a,
        a_scale,
        w,
        w_scale,
        out,
        M,
        N,
        K,
        BLOCKWISE=get_format(quant).scales_along_k,
        MODE=mode,
        INTERVAL=interval,
        INTERPRETER=INTERPRET,
        BLOCK_M=block_mn,
        BLOCK_N=block_mn,
        BLOCK_K=BLOCK_K,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def gemm_problem(M: int, N: int, K: int, quant: str, seed: int, device) -> dict:
    """E4M3 operands of x ~ N(0, 1) [M, K] and w ~ N(0, 1/K) [N, K], and the fp64 reference of them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    a, a_scale = quantize_activation(torch.randn(M, K, generator=gen, device=device), quant)
    w, w_scale = quantize_weight(torch.randn(1, N, K, generator=gen, device=device) * K**-0.5, quant)
    return dict(a=a, a_scale=a_scale, w=w[0], w_scale=w_scale, quant=quant)


def reference(p: dict) -> torch.Tensor:
    a = dequantize_activation(p["a"], p["a_scale"], p["quant"], torch.float64)
    w = dequantize_weight(p["w"][None], p["w_scale"], p["quant"], torch.float64)[0]
    return a @ w.T


@dataclass
class Env:
    """What a run measures with (a CPU test passes stand-ins and small sizes)."""

    time: Callable = time_cuda_graph
    sync: Callable = field(default=lambda: torch.cuda.synchronize())
    device_name: Callable = field(default=lambda: torch.cuda.get_device_name())
    device: str = "cuda"
    rows: int = ROWS
    time_gemm: tuple = TIME_GEMM
    block_mn: int = 128
    layer_shape: Callable = field(default=lambda: get_shape(LAYER_SHAPE))
    layer_T: int = LAYER_T


def accuracy(quant: str, ks, env: Env, deadline: float, say=lambda text: None) -> list[dict]:
    """One row per interval: rel L2 per K (None: not applicable; a string: why not measured)."""
    rows = [{"quant": quant, "n": n, "effective": effective(n), "rel_l2": {}} for n in INTERVALS]
    for K in ks:
        p = gemm_problem(env.rows, env.rows, K, quant, seed=K, device=env.device)
        ref = reference(p)
        for row in rows:
            if not applies(row["n"], quant) or time.monotonic() >= deadline:
                row["rel_l2"][str(K)] = "skipped: time budget spent" if applies(row["n"], quant) else None
                continue
            try:
                out = fp8_gemm(p["a"], p["a_scale"], p["w"], p["w_scale"], quant, row["n"], block_mn=env.block_mn)
                row["rel_l2"][str(K)] = rel_l2(out, ref)
            except Exception as exc:  # noqa: BLE001 - a failed cell is a cell
                row["rel_l2"][str(K)] = _status(exc)
                env.sync()
        say(f"accuracy {quant} K={K}: " + ", ".join(f"{label(r['n'])} {_fmt(r['rel_l2'][str(K)])}" for r in rows))
    return rows


def gemm_cost(rows: list, quant: str, env: Env, deadline: float) -> None:
    """``gemm_us`` of each row: the study kernel at :data:`TIME_GEMM`, rotated operand sets (cold L2)."""
    M, N, K = env.time_gemm
    n_sets = sets_for_cold_l2(M * K + N * K)
    sets = [gemm_problem(M, N, K, quant, seed=i, device=env.device) for i in range(n_sets)]
    outs = [torch.empty(M, N, dtype=torch.float32, device=env.device) for _ in range(n_sets)]
    for row in rows:
        if not applies(row["n"], quant):
            continue
        if time.monotonic() >= deadline:
            row["gemm_us"] = "skipped: time budget spent"
            continue

        def call(i, n=row["n"]):
            return lambda: fp8_gemm(
                sets[i]["a"],
                sets[i]["a_scale"],
                sets[i]["w"],
                sets[i]["w_scale"],
                quant,
                n,
                block_mn=env.block_mn,
                out=outs[i],
            )

        try:
            row["gemm_us"] = env.time(call, n_sets, **TIMING).median_us
        except Exception as exc:  # noqa: BLE001
            row["gemm_us"] = _status(exc)
            env.sync()


def layer_cost(rows: list, quant: str, env: Env, deadline: float) -> dict:
    """``layer_us`` and ``layer_rel_l2`` of the layer as it runs, in the row of the interval its
    kernels use for its config's BLOCK_K (:func:`triton_moe.kernels.fp8_imprecise_acc`)."""
    from triton_moe.kernels import fp8_imprecise_acc
    from triton_moe.moe import fused_moe
    from triton_moe.plan import plan

    shape, T = env.layer_shape(), env.layer_T
    per_set = shape.num_experts * shape.weight_elements()
    n_sets = sets_for_cold_l2(per_set)
    sets = [
        make_inputs(shape, T, quant, seed=i, device=env.device, weights_bf16=draw_weights(shape, i, env.device))
        for i in range(n_sets)
    ]
    cfg = plan(MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k), quant).config
    ref = oracle(**sets[0].kwargs())
    n = fp8_imprecise_acc(cfg.BLOCK_K, quant)
    info = {"shape": shape.label, "T": T, "config": cfg.as_dict(), "n": n, "input_sets": n_sets}
    row = next(r for r in rows if r["n"] == n)
    if time.monotonic() >= deadline:
        row["layer_us"] = "skipped: time budget spent"
        return info
    try:
        row["layer_rel_l2"] = rel_l2(fused_moe(**sets[0].kwargs(), config=cfg), ref)
        call = lambda i: lambda: fused_moe(**sets[i].kwargs(), config=cfg)  # noqa: E731
        row["layer_us"] = env.time(call, n_sets, **TIMING).median_us
    except Exception as exc:  # noqa: BLE001
        row["layer_us"] = _status(exc)
        env.sync()
    return info


def verdict(rows: list, quant: str, ks, tol: float, max_k: int) -> dict:
    """The largest interval with rel L2 ≤ ``tol`` at every K measured up to the first K ≥ ``max_k``,
    and the largest within one K step (n ≤ BLOCK_K: what the layer's K step promotes within)."""
    ks = sorted(ks)
    judged = [k for k in ks if k <= max_k] + [k for k in ks if k >= max_k][:1]
    passing = [
        r
        for r in rows
        if r["quant"] == quant
        and judged
        and all(isinstance(v, float) and v <= tol for v in (r["rel_l2"].get(str(k)) for k in judged))
    ]
    best = max((r["effective"] for r in passing), default=None)
    config = max((r["effective"] for r in passing if r["n"] <= BLOCK_K), default=None)
    same = lambda e: [label(r["n"]) for r in passing if r["effective"] == e]  # noqa: E731
    return {
        "quant": quant,
        "tolerance": tol,
        "judged_ks": judged,
        "covers_catalog": bool(ks) and ks[-1] >= max_k,
        "largest": best,
        "largest_ns": same(best) if best else [],
        "config_largest": config,
        "config_ns": [n for n in same(config) if int(n) <= BLOCK_K] if config else [],
    }


def run(
    formats,
    ks,
    *,
    env: Env | None = None,
    layer: bool = True,
    time_budget_s: float = TIME_BUDGET_S,
    command: str = "run(...)",
    commit: str | None = None,
    write=lambda result: None,
    say=lambda text: None,
) -> dict:
    env = env or Env()
    deadline = time.monotonic() + time_budget_s
    meta = runinfo.run_info(command, cuda=env.device == "cuda", commit=commit, device=env.device_name())
    meta.update(
        rows=env.rows,
        time_gemm=list(env.time_gemm),
        block=[env.block_mn, env.block_mn, BLOCK_K],
        timing=TIMING,
        catalog_max_k=catalog_max_k(),
        time_budget_s=time_budget_s,
    )
    result = {"meta": meta, "rows": [], "layer": {}, "verdicts": []}
    for quant in formats:
        rows = accuracy(quant, ks, env, deadline, say)
        result["rows"] += rows
        result["verdicts"].append(verdict(rows, quant, ks, get_format(quant).tolerance, catalog_max_k()))
        write(result)
        say(f"time the GEMM, {quant}")
        gemm_cost(rows, quant, env, deadline)
        if layer:
            say(f"time the layer, {quant}")
            try:
                result["layer"][quant] = layer_cost(rows, quant, env, deadline)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the sets: the rest stands
                result["layer"][quant] = {"status": _status(exc)}
        if env.device == "cuda":
            torch.cuda.empty_cache()
        write(result)
    return result


def _fmt(v, spec="{:.2e}") -> str:
    return "n/a" if v is None else "—" if isinstance(v, str) else spec.format(v)


def table(result: dict) -> list[str]:
    ks = [k for k in result["rows"][0]["rel_l2"]] if result["rows"] else []
    lines = [
        "| format | n | promoted every | "
        + "".join(f"rel L2 K={k} | " for k in ks)
        + "GEMM µs | layer µs | layer rel L2 |",
        "|---" * (6 + len(ks)) + "|",
    ]
    for r in result["rows"]:
        every = "K step (128)" if r["n"] == 0 else "never" if r["n"] >= NEVER else f"{r['n']} of K"
        lines.append(
            f"| {r['quant']} | {label(r['n'])} | {every} | "
            + "".join(f"{_fmt(r['rel_l2'].get(k))} | " for k in ks)
            + f"{_fmt(r.get('gemm_us'), '{:.1f}')} | "
            f"{'—' if 'layer_us' not in r else _fmt(r['layer_us'], '{:.1f}')} | "
            f"{'—' if 'layer_rel_l2' not in r else _fmt(r['layer_rel_l2'])} |"
        )
    return lines


def verdict_lines(result: dict) -> list[str]:
    out = []
    for v in result["verdicts"]:
        ks = ", ".join(map(str, v["judged_ks"]))
        gap = (
            ""
            if v["covers_catalog"]
            else f" (the K measured stop below the catalog's largest, "
            f"{result['meta']['catalog_max_k']}: not a verdict for the catalog)"
        )
        largest = "none" if v["largest"] is None else f"{v['largest']} of K (n = {' or '.join(v['largest_ns'])})"
        config = "none" if v["config_largest"] is None else f"{v['config_largest']} (n = {' or '.join(v['config_ns'])})"
        out.append(
            f"- {v['quant']}: the largest interval with rel L2 ≤ {v['tolerance']:g} at K = {ks}: {largest}; "
            f"the largest within one K step: {config}{gap}"
        )
    return out


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        "# FP8 accumulation promotion: accuracy against cost",
        "",
        *studyout.header_lines(m),
        f"- rel L2: one FP8 GEMM [M={m['rows']}, K] × [N={m['rows']}, K]ᵀ (x ~ N(0, 1), w ~ N(0, 1/K), E4M3, "
        f"fp32 out, tile {m['block'][0]}×{m['block'][1]}×{m['block'][2]}) against the fp64 product of the "
        "dequantized E4M3 operands: the accumulation's error alone; n/a: fp8_block promotes every 128 of K",
        f"- GEMM µs: the same kernel at M, N, K = {', '.join(map(str, m['time_gemm']))}; layer µs: "
        "`triton_moe.fused_moe` as it runs, in the row of the interval its kernels use; layer rel "
        "L2 against `moe_spec.oracle`; both CUDA-graph replays over rotated input sets (cold L2), median",
        "",
    ]
    for quant, info in result["layer"].items():
        lines.insert(
            -1,
            f"- layer ({quant}): "
            + (
                info["status"]
                if "status" in info
                else f"{info['shape']}, T = {info['T']}, {info['input_sets']} input sets, config {info['config']}"
            ),
        )
    return (
        "\n".join(
            lines + table(result) + ["", "## The cheapest promotion within tolerance", ""] + verdict_lines(result)
        )
        + "\n"
    )


def write_outputs(result: dict, out: Path) -> None:
    studyout.write_files(out, dict(zip(FILES, (to_markdown(result), json.dumps(result, indent=1) + "\n"))))


def _names(option: str, text: str) -> list[str]:
    """A comma list, lower-cased, repeats dropped."""
    return list(dict.fromkeys(s.lower() for s in studyout.split_list(option, text)))


def parse_args(argv: list) -> argparse.Namespace:
    p = studyout.Parser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--out", help="a new or empty directory for promotion.md and promotion.json (required)")
    p.add_argument(
        "--ks", default=",".join(map(str, KS)), help="K of the accuracy GEMM, multiples of 512 [%(default)s]"
    )
    p.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)} [%(default)s]")
    p.add_argument("--no-layer", dest="layer", action="store_false", help="skip the layer's timing and rel L2")
    p.add_argument(
        "--time-budget",
        type=float,
        default=TIME_BUDGET_S,
        metavar="S",
        help="stop after S seconds; cells not reached say 'skipped' [%(default)s]",
    )
    p.add_argument("--commit", default=None, help="commit to record [git rev-parse of this checkout]")
    args = p.parse_args(argv)
    args.formats = _names("--formats", args.formats)
    if set(args.formats) - set(FORMATS):
        raise UsageError(
            f"--formats: unknown format {sorted(set(args.formats) - set(FORMATS))[0]!r}; known: {', '.join(FORMATS)}"
        )
    step = max(n for n in INTERVALS if n < NEVER)
    ks = _names("--ks", args.ks)
    if bad := [k for k in ks if not k.isdigit() or int(k) < 1 or int(k) % step]:
        raise UsageError(f"--ks: bad K {bad[0]!r}: expected positive multiples of {step} (the largest finite interval)")
    args.ks = tuple(sorted({int(k) for k in ks}))
    args.time_budget = studyout.number(
        "--time-budget", args.time_budget, lowest=0.0, allow_lowest=False, what="a finite number of seconds > 0"
    )
    args.out = studyout.check_out(args.out, FILES)
    return args


def _run(args: argparse.Namespace, argv: list) -> int:
    runinfo.require_cuda(PROG)
    start = time.monotonic()
    result = run(
        args.formats,
        args.ks,
        layer=args.layer,
        time_budget_s=args.time_budget,
        command=runinfo.command_line(PROG, argv),
        commit=args.commit,
        write=lambda r: write_outputs(r, args.out),
        say=studyout.progress(PROG),
    )
    print("\n".join(table(result) + [""] + verdict_lines(result)))
    print(f"wrote {', '.join(str(args.out / f) for f in FILES)} in {time.monotonic() - start:.0f} s")
    return 0


def main(argv=None) -> int:
    return studyout.run_command(PROG, argv, parse_args, _run, interrupted="what was measured is in {out}")


if __name__ == "__main__":
    sys.exit(main())

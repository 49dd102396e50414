"""The main job: every (shape, quant, T) case, every backend, numerics first, then time.

For one case the suite

1. builds the problem (:func:`moe_spec.problem.make_inputs`; weights drawn once per shape and
   reused across T, so the T sweep varies only the tokens and their routing);
2. evaluates the fp64 oracle on the *quantized* inputs (what the kernel was given) and, for an FP8
   case, on the unquantized bf16 problem as well: their gap is the quantization error, reported
   per case and per expert, separately from any kernel's error;
3. runs each backend, measures its output against the oracle (:mod:`compare.metrics`), checks the
   tolerance policy, reruns it to check bitwise determinism, attributes its error to experts, and
   compares the two kernels (CuTe vs Triton) with each other;
4. on a GPU, times each backend that passed with the CUDA-graph timer over rotated input sets
   (cold L2), times its alignment/permutation step alone, and places the call on this run's
   roofline (ceilings measured at the start of the run).

Without a GPU the shapes are scaled down (:func:`reduce_shape`) so the Triton interpreter runs
the whole table in a minute or two; such rows say "reduced (CPU interpreter)" and their timing
columns say "skipped: no GPU".

Everything lands in one plain dict (:func:`run_suite`), which :mod:`compare.report` renders and
:mod:`compare.router` turns into a routing table.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass

import torch

import compare.metrics as metrics
import moe_spec.problem as problem
from compare.backends import BASELINE, FALLBACK_BASELINE, KERNELS, Backend, load_backend
from compare.metrics import quant_name
from moe_spec.oracle import oracle_breakdown, rel_l2
from moe_spec.problem import MoEInputs, MoEShape, get_shape, make_inputs
from moe_spec.quant import weight_scale_shape
from moe_spec.validate import MoEDims

DEFAULT_SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
DEFAULT_TOKENS_GPU = (1, 8, 32, 128, 1024, 4096)
DEFAULT_TOKENS_CPU = (1, 8, 32)
DEFAULT_QUANTS = (None, "fp8_tensor")

# The CPU stand-in for a catalog shape: small enough for the Triton interpreter, still with
# several experts, top-k > 1, two fp8 groups along K and a real (masked) tail in every tile.
REDUCED_HIDDEN = 256
REDUCED_INTERMEDIATE = 128
REDUCED_MAX_EXPERTS = 8
REDUCED_MAX_TOP_K = 4
REDUCED_LABEL = "reduced (CPU interpreter)"
EXPERTS_KEPT = 3  # per error column, the worst experts kept in the results besides the flagged ones

# JIT study: warm up on every power of two, then sweep token counts never seen before.
JIT_WARMUP_T = tuple(2**i for i in range(13))  # 1 … 4096
JIT_SWEEP_T = (3, 5, 12, 24, 48, 96, 200, 384, 768, 1500, 3000)
JIT_SWEEP_T_QUICK = (3, 24, 200, 1500)


@dataclass
class SuiteSpec:
    """What to run. ``device`` is "cuda" or "cpu"; on the CPU shapes are reduced and nothing is timed."""

    shapes: tuple = DEFAULT_SHAPES
    tokens: tuple = DEFAULT_TOKENS_GPU
    quants: tuple = DEFAULT_QUANTS
    backends: tuple = ("cute_moe", "triton_moe", "torch_grouped", "torch_loop")
    device: str = "cuda"
    seed: int = 0
    quick: bool = False
    jit: bool = True
    ptx: bool = True  # CPU: compile the CuTe configs the GPU suite would use and list their WGMMA lines
    outlier_expert: float = 0.0  # > 0: multiply expert 0's W1 by this (the shared-scale FP8 failure demo)
    time_budget_s: float = 0.0  # > 0: cases that would start after this many seconds become "skipped" rows
    command: str = ""
    commit: str = ""  # recorded in the report; default: `git rev-parse` of this checkout
    started: float = dataclasses.field(default_factory=time.monotonic)

    def out_of_time(self) -> bool:
        return bool(self.time_budget_s) and time.monotonic() - self.started > self.time_budget_s

    @property
    def reduced(self) -> bool:
        return self.device != "cuda"

    @property
    def timed(self) -> bool:
        return self.device == "cuda"


def reduce_shape(shape: MoEShape) -> MoEShape:
    """The catalog shape scaled down for the CPU interpreter (same name, labelled by the suite)."""
    E = min(shape.num_experts, REDUCED_MAX_EXPERTS)
    return dataclasses.replace(shape, num_experts=E, top_k=min(shape.top_k, REDUCED_MAX_TOP_K, E),
                               hidden=REDUCED_HIDDEN, intermediate=REDUCED_INTERMEDIATE)


def draw_weights(shape: MoEShape, seed: int, device: str, outlier: float = 0.0):
    """The catalog's bf16 weights (moe_spec.problem.draw_weights), with ``outlier`` × expert 0's W1."""
    w1, w2 = problem.draw_weights(shape, seed, device)
    if outlier:
        w1[0] = (w1[0].float() * outlier).to(torch.bfloat16)
    return w1, w2


def dims_of(shape: MoEShape, T: int) -> MoEDims:
    return MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)


# --- one backend on one case: numerics ----------------------------------------------------------


def _describe(backend: Backend, dims: MoEDims, quant) -> str:
    try:
        return backend.describe(dims, quant)
    except Exception as exc:  # noqa: BLE001 - a config we cannot name is reported, not fatal
        return f"(config unknown: {type(exc).__name__})"


def _run(backend: Backend, inputs: MoEInputs):
    out = backend.fused_moe(**inputs.kwargs())
    if inputs.x.is_cuda:
        torch.cuda.synchronize()
    return out


def _refusal(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    # The suite only builds valid problems: a backend may decline a format it does not implement
    # (NotImplementedError), but a ValueError/TypeError on valid input is a bug, reported as one.
    kind = "not available" if isinstance(exc, NotImplementedError) else "error"
    return f"{kind}: {type(exc).__name__}: {msg}"[:240]


def _numerics(backend: Backend, inputs: MoEInputs, ref, ref_bf16, quant, num_experts: int) -> tuple[dict, object]:
    """Run, measure, check, rerun. Returns (row fields, output or None)."""
    try:
        out = _run(backend, inputs)
        again = _run(backend, inputs)  # the determinism check
    except Exception as exc:  # noqa: BLE001 - every refusal or crash becomes an explicit row
        return {"status": _refusal(exc)}, None
    err = metrics.errors(out, ref.out)
    passed, why = metrics.check(err, quant)
    row = {"status": "ok" if passed else "FAIL", "check": why, **err.as_dict(),
           "deterministic": metrics.bitwise_equal(out, again),
           "err_vs_bf16": rel_l2(out, ref_bf16.out) if quant is not None else None,
           "expert_errors": metrics.kernel_error_by_expert(out, ref.out, inputs.topk_ids, num_experts)}
    return row, out


def _expert_table(ref, ref_bf16, rows: dict, quant, num_experts: int) -> list[dict]:
    """Per expert: pairs routed, quantization error (exact, from the oracle's per-pair outputs),
    each backend's attributed kernel error; flagged when one stands out (metrics.flag_outliers)."""
    tol = metrics.tolerance_for(quant)
    ids = ref.topk_ids
    quant_err: list = []
    for e in range(num_experts):
        mask = ids == e
        if quant is None or not bool(mask.any()):
            quant_err.append(None)
        else:
            quant_err.append(rel_l2(ref.pair_output[mask], ref_bf16.pair_output[mask]))
    flags_by_source = {"quant": metrics.flag_outliers(quant_err, factor=3.0, bound=tol.quant_error)}
    for name, r in rows.items():
        if "expert_errors" in r:
            flags_by_source[name] = metrics.flag_outliers(r["expert_errors"], factor=4.0, bound=tol.rel_l2)
    table = []
    for e in range(num_experts):
        pairs = int((ids == e).sum())
        if not pairs:
            continue
        table.append({"expert": e, "pairs": pairs, "quant_error": quant_err[e],
                      "kernel_error": {name: r["expert_errors"][e] for name, r in rows.items() if "expert_errors" in r},
                      "flags": {src: f[e] for src, f in flags_by_source.items() if f[e]}})
    return table


def _median(values):
    present = sorted(v for v in values if v is not None)
    return present[len(present) // 2] if present else None


def _notable(experts: list, keep: int) -> list:
    """The experts worth printing: every flagged one, and the ``keep`` worst by each error column
    (a DeepSeek case routes to 256 experts; the full table would dwarf the report)."""
    chosen = {e["expert"] for e in experts if e["flags"]}
    columns = [lambda e: e["quant_error"]] + [
        (lambda name: lambda e: e["kernel_error"].get(name))(name) for name in (experts[0]["kernel_error"] if experts else {})]
    for column in columns:
        ranked = sorted((e for e in experts if column(e) is not None), key=column, reverse=True)
        chosen.update(e["expert"] for e in ranked[:keep])
    return [e for e in experts if e["expert"] in chosen]


# --- one backend on one case: time --------------------------------------------------------------


def _clone(inputs: MoEInputs) -> MoEInputs:
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return MoEInputs(c(inputs.x), c(inputs.w1), c(inputs.w2), c(inputs.topk_weights), c(inputs.topk_ids),
                     inputs.quant, c(inputs.w1_scale), c(inputs.w2_scale))


def _timer_options(quick: bool) -> dict:
    return dict(replays=6, min_calls=4, warmup=1) if quick else dict(replays=20, min_calls=10, warmup=2)


def _time(make_call, n_sets: int, capturable: bool, quick: bool):
    """(Timing, note). A graph capture that fails falls back to eager timing, and says so."""
    from moe_spec.timing import time_cuda_graph

    if capturable:
        try:
            return time_cuda_graph(make_call, n_sets, **_timer_options(quick)), "graph"
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            note = f"eager (graph capture failed: {type(exc).__name__})"
    else:
        note = "eager (host-synchronizing loop)"
    return time_cuda_graph(make_call, n_sets, use_graph=False, **_timer_options(quick)), note


def _scale_bytes(quant, dims: MoEDims) -> int:
    """fp32 scale bytes of one expert's W1 and W2 (shapes from moe_spec.quant)."""
    if quant is None:
        return 0
    w1 = math.prod(weight_scale_shape(quant, 1, 2 * dims.I, dims.K))
    w2 = math.prod(weight_scale_shape(quant, 1, dims.K, dims.I))
    return 4 * (w1 + w2)


def _timing(backend: Backend, sets: list, dims: MoEDims, quant, ceilings, quick: bool) -> dict:
    from moe_spec.timing import moe_traffic, roofline

    t, note = _time(lambda i: (lambda: backend.fused_moe(**sets[i].kwargs())), len(sets), backend.capturable, quick)
    hit = int(torch.unique(sets[0].topk_ids).numel())
    weight_bytes = 1 if quant else 2
    nbytes, flops = moe_traffic(dims.T, dims.K, dims.I, dims.top_k, hit, weight_bytes, _scale_bytes(quant, dims))
    roof = roofline(nbytes, flops, ceilings, "fp8" if quant else "bf16", t.median_us)
    row = {"us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us, "timing": note,
           "weight_tbps": hit * 3 * dims.I * dims.K * weight_bytes / (t.median_us * 1e-6) / 1e12,
           "tflops": roof["tflops"], "pct_floor": roof["pct_of_floor"], "floor_us": roof["floor_us"],
           "bound": roof["bound"], "experts_hit": hit}
    if backend.prepare is not None:
        try:
            prep, _ = _time(lambda i: backend.prepare(sets[i], dims), len(sets), True, quick)
            row["prep_us"] = prep.median_us
        except Exception as exc:  # noqa: BLE001
            row["prep_us"] = None
            row["timing"] += f"; prep not timed ({type(exc).__name__})"
    return row


# --- the JIT study -------------------------------------------------------------------------------


def _jit_study(backend: Backend, shape: MoEShape, quant, spec: SuiteSpec, weights) -> dict:
    """Compilations caused by never-seen T after a warm-up over powers of two; first-call latency."""
    sweep = JIT_SWEEP_T_QUICK if spec.quick else JIT_SWEEP_T
    study = {"backend": backend.name, "shape": shape.label, "quant": quant_name(quant),
             "warmup_T": list(JIT_WARMUP_T), "sweep_T": list(sweep)}
    if backend.compile_counter is None:
        return {**study, "status": "not available: the backend exposes no compile counter"}
    if backend.unavailable(quant, spec.device):
        return {**study, "status": f"not available: {backend.unavailable(quant, spec.device)}"}
    dry = not spec.timed
    try:
        with backend.compile_counter(dry) as counter:
            for T in JIT_WARMUP_T:
                _run(backend, make_inputs(shape, T, quant, seed=spec.seed, device=spec.device, weights_bf16=weights))
            counter.mark()
            first, second = [], []
            for T in sweep:
                inputs = make_inputs(shape, T, quant, seed=spec.seed, device=spec.device, weights_bf16=weights)
                start = time.perf_counter()
                _run(backend, inputs)
                first.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                _run(backend, inputs)
                second.append((time.perf_counter() - start) * 1e3)
            compiles = counter.new_compilations()
    except NotImplementedError as exc:
        return {**study, "status": f"not available: {exc}"}
    except Exception as exc:  # noqa: BLE001
        return {**study, "status": f"error: {type(exc).__name__}: {exc}"[:240]}
    study.update(status="ok" if compiles == 0 else f"FAIL: {compiles} compilations after warm-up",
                 compilations_after_warmup=compiles)
    if dry:
        study["mode"] = "dry run: specialization keys recorded, kernels not launched (interpreter)"
    else:
        study.update(mode="gpu", first_call_ms_max=max(first), first_call_ms_median=sorted(first)[len(first) // 2],
                     steady_call_ms_median=sorted(second)[len(second) // 2])
    return study


# --- the CuTe configs and their PTX (CPU report) -----------------------------------------------


def _wgmma_lines(ptx: str) -> dict:
    """Distinct WGMMA instructions of a PTX text (operands stripped) with their counts."""
    found: dict = {}
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("wgmma.mma_async"):
            op = line.split()[0]
            found[op] = found.get(op, 0) + 1
    return found


def cute_ptx_summary(shapes, tokens) -> dict:
    """The configs cute_moe would run for the GPU suite, compiled here, with their WGMMA lines."""
    try:
        import cute_moe
    except Exception as exc:  # noqa: BLE001
        return {"status": f"not available: import cute_moe failed: {type(exc).__name__}: {exc}"[:240]}
    layer_configs = getattr(cute_moe, "layer_configs", None)
    compile_ptx = getattr(cute_moe, "compile_ptx", None)
    if layer_configs is None or compile_ptx is None:
        return {"status": "not available: cute_moe exposes no layer_configs/compile_ptx"}
    used: dict = {}
    for spec in shapes:
        shape = get_shape(spec)
        for T in tokens:
            g1, g2 = layer_configs(T, shape.num_experts, shape.hidden, shape.intermediate, shape.top_k)
            for gemm, cfg in (("G1", g1), ("G2", g2)):
                used.setdefault(cfg, []).append(f"{shape.label} T={T} {gemm}")
    configs = []
    for cfg, where in used.items():
        entry = {"config": cfg.as_dict() if hasattr(cfg, "as_dict") else repr(cfg), "used_by": where}
        start = time.perf_counter()
        try:
            ptx = compile_ptx(cfg)
            entry.update(wgmma=_wgmma_lines(ptx), ptx_lines=ptx.count("\n"),
                         compile_s=round(time.perf_counter() - start, 2))
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"[:240]
        configs.append(entry)
    return {"status": "ok", "configs": configs}


# --- the whole suite -----------------------------------------------------------------------------


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _meta(spec: SuiteSpec) -> dict:
    import triton

    device = torch.cuda.get_device_name() if spec.timed else f"CPU ({platform.processor() or platform.machine()})"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device, "commit": spec.commit or _git_commit(), "command": spec.command,
            "mode": "gpu" if spec.timed else REDUCED_LABEL, "torch": torch.__version__, "triton": triton.__version__,
            "shapes": list(spec.shapes), "tokens": list(spec.tokens), "quants": [quant_name(q) for q in spec.quants],
            "backends": list(spec.backends), "seed": spec.seed, "quick": spec.quick,
            "outlier_expert": spec.outlier_expert, "time_budget_s": spec.time_budget_s}


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, disable=not enabled, unit="run", dynamic_ncols=True, leave=False)
    except ImportError:  # tqdm is a declared dependency; degrade to no bar rather than fail
        class _Null:
            def update(self, n=1): ...
            def set_description_str(self, s): ...
            def close(self): ...
        return _Null()


def run_suite(spec: SuiteSpec, progress: bool = True) -> dict:
    """Run every case of ``spec``; return the results dict (meta, ceilings, rows, experts, jit, ptx)."""
    result: dict = {"meta": _meta(spec), "ceilings": None, "rows": [], "cases": [], "jit": [], "jit_demo": None,
                    "cute_ptx": None}
    if spec.timed:
        from moe_spec.timing import measure_ceilings

        result["ceilings"] = measure_ceilings().as_dict()
    backends = {name: load_backend(name) for name in spec.backends}
    bar = _progress(len(spec.shapes) * len(spec.tokens) * len(spec.quants) * len(backends), progress)
    try:
        for position, shape_spec in enumerate(spec.shapes):
            full = get_shape(shape_spec)
            shape = reduce_shape(full) if spec.reduced else full
            weights = draw_weights(shape, spec.seed + position, spec.device, spec.outlier_expert)
            for quant in spec.quants:
                for T in spec.tokens:
                    if spec.out_of_time():
                        _skip_case(spec, full, shape, quant, T, backends, result,
                                   f"skipped: time budget ({spec.time_budget_s:g} s) spent")
                    else:
                        _run_case(spec, full, shape, weights, quant, T, backends, result, bar)
                    bar.update(len(backends))
            if spec.jit and shape_spec == spec.shapes[0] and not spec.out_of_time():
                for name in KERNELS:
                    if name in backends:
                        for quant in spec.quants:
                            bar.set_description_str(f"JIT {name} {quant_name(quant)}")
                            result["jit"].append(_jit_study(backends[name], shape, quant, spec, weights))
            del weights
            if spec.timed:
                torch.cuda.empty_cache()
    finally:
        bar.close()
    if spec.jit:
        from compare.jitdemo import run_demo

        result["jit_demo"] = run_demo()
    if spec.reduced and spec.ptx and "cute_moe" in spec.backends:
        result["cute_ptx"] = cute_ptx_summary(spec.shapes, DEFAULT_TOKENS_GPU)
    return result


def _case_base(spec, full: MoEShape, shape: MoEShape, quant, T: int) -> dict:
    return {"shape": full.label, "shape_note": REDUCED_LABEL if spec.reduced else "", "E": shape.num_experts,
            "K": shape.hidden, "I": shape.intermediate, "top_k": shape.top_k, "T": T, "quant": quant_name(quant)}


def _skip_case(spec, full, shape, quant, T, backends, result, status: str):
    """One explicit row per backend for a case that did not run."""
    base = _case_base(spec, full, shape, quant, T)
    for name in backends:
        result["rows"].append({**base, "backend": name, "config": "", "status": status, "timing": status})


def _run_case(spec, full: MoEShape, shape: MoEShape, weights, quant, T: int, backends: dict, result: dict, bar):
    dims = dims_of(shape, T)
    base = _case_base(spec, full, shape, quant, T)
    try:
        inputs_bf16 = make_inputs(shape, T, None, seed=spec.seed, device=spec.device, weights_bf16=weights)
        ref_bf16 = oracle_breakdown(**inputs_bf16.kwargs())
        if quant is None:
            inputs, ref = inputs_bf16, ref_bf16
        else:
            inputs = make_inputs(shape, T, quant, seed=spec.seed, device=spec.device, weights_bf16=weights)
            ref = oracle_breakdown(**inputs.kwargs())
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: this case is reported, the run goes on
        if spec.timed:
            torch.cuda.empty_cache()
        _skip_case(spec, full, shape, quant, T, backends, result,
                   f"error: building the problem or its oracle failed: {type(exc).__name__}: {exc}"[:240])
        return
    quant_error = rel_l2(ref.out, ref_bf16.out) if quant is not None else None

    rows, outputs = {}, {}
    for name, backend in backends.items():
        bar.set_description_str(f"{full.label} {quant_name(quant)} T={T} {name}")
        row = {**base, "backend": name, "config": _describe(backend, dims, quant) if not backend.missing else ""}
        reason = backend.unavailable(quant, spec.device)
        if reason:
            row["status"] = f"not available: {reason}"
        else:
            fields, out = _numerics(backend, inputs, ref, ref_bf16, quant, dims.E)
            row.update(fields)
            if out is not None and name in KERNELS:
                outputs[name] = out
        rows[name] = row

    if len(outputs) == 2:  # the two kernels against each other
        diff = rel_l2(*(outputs[k] for k in KERNELS))
        for k in KERNELS:
            rows[k]["xdiff"] = diff
            rows[k]["xdiff_ok"] = diff <= metrics.cross_backend_tolerance(quant)

    experts = _expert_table(ref, ref_bf16, rows, quant, dims.E)
    flagged = [e for e in experts if e["flags"]]
    result["cases"].append({**base, "quant_error": quant_error, "experts_hit": len(experts),
                            "median_expert_quant_error": _median(e["quant_error"] for e in experts),
                            "flagged_experts": [e["expert"] for e in flagged],
                            "experts": _notable(experts, EXPERTS_KEPT)})

    if spec.timed:
        _time_case(spec, rows, backends, inputs, dims, quant, result["ceilings"], bar)
    for name, row in rows.items():
        row.pop("expert_errors", None)
        row["quant_error"] = quant_error
        row["flagged_experts"] = sum(name in e["flags"] for e in flagged)
        if not spec.timed:
            row["timing"] = "skipped: no GPU"
        result["rows"].append(row)
    del inputs, inputs_bf16, ref, ref_bf16, outputs


def _time_case(spec, rows, backends, inputs, dims, quant, ceilings_dict, bar):
    from moe_spec.timing import Ceilings, sets_for_cold_l2

    ceilings = Ceilings(**ceilings_dict)
    set_bytes = sum(t.numel() * t.element_size() for t in (inputs.w1, inputs.w2))
    n_sets = 2 if spec.quick else sets_for_cold_l2(set_bytes)
    sets = [inputs] + [_clone(inputs) for _ in range(n_sets - 1)]
    for name, row in rows.items():
        if row.get("status") not in ("ok", "FAIL"):
            row["timing"] = "skipped: " + row.get("status", "not run")
            continue
        if name == "torch_loop" and quant is not None:
            row["timing"] = "not timed: the FP8 loop is the W8A8 model in fp32 matmuls, a numerics reference"
            continue
        bar.set_description_str(f"time {row['shape']} {row['quant']} T={dims.T} {name}")
        try:
            row.update(_timing(backends[name], sets, dims, quant, ceilings, spec.quick))
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            row["timing"] = f"error: {type(exc).__name__}: {exc}"[:240]
    base = next((b for b in (BASELINE, FALLBACK_BASELINE) if rows.get(b, {}).get("us")), None)
    for row in rows.values():
        if base and row.get("us"):
            row["speedup"] = rows[base]["us"] / row["us"]
            row["speedup_vs"] = base
    del sets

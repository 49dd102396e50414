"""What gets compiled: the JIT study of both kernels, and the CuTe configs' PTX on a CPU.

**JIT study** (:func:`jit_study`). A serving stack sees a different token count T at every step; a
kernel that compiles per T class adds hundreds of milliseconds to some request's first token. The
study warms a backend up on every power of two (:data:`JIT_WARMUP_T`), then sweeps token counts
never seen before (:data:`JIT_SWEEP_T`) and counts the compilations the sweep caused (the
backend's own compile counter, :attr:`compare.backends.Backend.compile_counter`). On a GPU it
also records the first-call and steady latency; on the CPU the Triton counter runs dry (the keys
Triton *would* compile, nothing launched).

**CuTe PTX** (:func:`cute_ptx_summary`). Without a GPU cute_moe cannot run, but it compiles: the
configs it would choose for the GPU suite are compiled to PTX here, and their WGMMA instructions
listed — the tile each warpgroup issues, visible on a laptop.
"""

from __future__ import annotations

import time

from compare.backends import Backend
from compare.metrics import quant_name
from compare.numerics import call, refusal, unavailable
from moe_spec.problem import MoEShape, get_shape, make_inputs
from moe_spec.validate import MoEDims

# Warm up on every power of two, then sweep token counts never seen before.
JIT_WARMUP_T = tuple(2**i for i in range(13))  # 1 … 4096
JIT_SWEEP_T = (3, 5, 12, 24, 48, 96, 200, 384, 768, 1500, 3000)
JIT_SWEEP_T_QUICK = (3, 24, 200, 1500)


def jit_study(backend: Backend, shape: MoEShape, quant, weights, *, device: str, seed: int, quick: bool) -> dict:
    """Compilations caused by never-seen T after a warm-up over powers of two; first-call latency."""
    sweep = JIT_SWEEP_T_QUICK if quick else JIT_SWEEP_T
    study = {"backend": backend.name, "shape": shape.label, "quant": quant_name(quant),
             "warmup_T": list(JIT_WARMUP_T), "sweep_T": list(sweep)}

    def inputs(T):
        return make_inputs(shape, T, quant, seed=seed, device=device, weights_bf16=weights)

    declined = unavailable(backend, inputs(0), device)
    if declined:
        return {**study, "status": declined}
    if backend.compile_counter is None:
        return {**study, "status": "not available: the backend exposes no compile counter"}
    dry = device != "cuda"
    try:
        with backend.compile_counter(dry) as counter:
            for T in JIT_WARMUP_T:
                call(backend, inputs(T))
            counter.mark()
            first, second = [], []
            for T in sweep:
                problem = inputs(T)
                start = time.perf_counter()
                call(backend, problem)
                first.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                call(backend, problem)
                second.append((time.perf_counter() - start) * 1e3)
            compiles = counter.new_compilations()
    except Exception as exc:  # noqa: BLE001 - reported in the study's row
        return {**study, "status": refusal(exc)}
    study.update(status="ok" if compiles == 0 else f"FAIL: {compiles} compilations after warm-up",
                 compilations_after_warmup=compiles)
    if dry:
        study["mode"] = "dry run: specialization keys recorded, kernels not launched (interpreter)"
    else:
        study.update(mode="gpu", first_call_ms_max=max(first), first_call_ms_median=sorted(first)[len(first) // 2],
                     steady_call_ms_median=sorted(second)[len(second) // 2])
    return study


# --- the CuTe configs and their PTX (CPU report) -----------------------------------------------


def wgmma_lines(ptx: str) -> dict:
    """Distinct WGMMA instructions of a PTX text (operands stripped) with their counts."""
    found: dict = {}
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("wgmma.mma_async"):
            op = line.split()[0]
            found[op] = found.get(op, 0) + 1
    return found


def cute_ptx_summary(shapes, tokens, quants=(None,)) -> dict:
    """The configs cute_moe's own plan picks for the GPU suite, compiled here, with their WGMMA lines.

    Each (shape, T, format) goes through ``cute_moe.plan`` — the backend's one decision — so this
    listing cannot drift from what ``fused_moe`` runs; a format the backend refuses is listed as such.
    """
    try:
        import cute_moe
    except Exception as exc:  # noqa: BLE001
        return {"status": f"not available: import cute_moe failed: {type(exc).__name__}: {exc}"[:240]}
    used: dict = {}
    refused: dict = {}
    for spec in shapes:
        shape = get_shape(spec)
        for quant in quants:
            for T in tokens:
                dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
                try:
                    p = cute_moe.plan(dims, quant)
                except (NotImplementedError, ValueError) as exc:
                    refused.setdefault(quant_name(quant), str(exc))
                    break
                for gemm, cfg in (("G1", p.gemm1), ("G2", p.gemm2)):
                    used.setdefault(cfg, []).append(f"{shape.label} {quant_name(quant)} T={T} {gemm}")
    configs = []
    for cfg, where in used.items():
        entry = {"config": cfg.as_dict() if hasattr(cfg, "as_dict") else repr(cfg), "used_by": where}
        start = time.perf_counter()
        try:
            ptx = cute_moe.compile_ptx(cfg)
            entry.update(wgmma=wgmma_lines(ptx), ptx_lines=ptx.count("\n"),
                         compile_s=round(time.perf_counter() - start, 2))
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"[:240]
        configs.append(entry)
    return {"status": "ok", "configs": configs, "refused": refused}

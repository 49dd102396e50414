"""Why a serving stack cares about ``do_not_specialize``: one small Triton kernel, compiled two ways.

Triton compiles a kernel once per *specialization key*. Part of the key is derived from the
integer arguments: an int equal to 1, or divisible by 16, gets its own binary (the compiler can
then drop a mask or prove an alignment). For a token count ``T`` that varies every step, each
new class of T means a compilation in the serving path — hundreds of milliseconds added to one
request's time to first token. Listing the argument in ``@triton.jit(do_not_specialize=["T"])``
gives up that (small) optimisation and compiles exactly once.

:func:`run_demo` sweeps T through both variants of :func:`_scale_rows` (``y = x · w`` row by row —
the combine step of an MoE layer in miniature) with a fresh Triton cache, and records for each T
whether the call compiled and how long the first call took. On a machine without a GPU the
interpreter compiles nothing, so the demo reports the specialization keys Triton *would* compile
(computed with Triton's own argument binder) and no latencies.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch
import triton
import triton.language as tl

SWEEP_T = (1, 2, 3, 8, 16, 17, 32, 48, 100, 128, 1000, 1024, 4096)
ROW_WIDTH = 256  # D: a constexpr, fixed by the model like the hidden size
BLOCK_T = 16


def _scale_rows(x_ptr, w_ptr, y_ptr, T, D: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    inside = rows < T
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=inside[:, None], other=0.0)
    w = tl.load(w_ptr + rows, mask=inside, other=0.0)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], x * w[:, None], mask=inside[:, None])


VARIANTS = {
    "specialized (default @triton.jit)": triton.jit(_scale_rows),
    'do_not_specialize=["T"]': triton.jit(do_not_specialize=["T"])(_scale_rows),
}


@contextlib.contextmanager
def _fresh_cache():
    """A private, empty Triton cache dir, so a compilation is a compilation (not a disk-cache hit)."""
    old = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="jitdemo_") as d:
        os.environ["TRITON_CACHE_DIR"] = d
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old


@contextlib.contextmanager
def _compile_log(kernel):
    """Collect one entry per compilation of ``kernel`` (Triton's post-compile hook)."""
    log: list = []
    previous = triton.knobs.runtime.jit_post_compile_hook

    def hook(*, fn, **kwargs):
        if fn.jit_function is kernel:
            log.append(kwargs.get("key"))
        return previous(fn=fn, **kwargs) if previous else None

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        yield log
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous


def _launch(kernel, T: int, device: str):
    x = torch.ones(T, ROW_WIDTH, device=device)
    w = torch.full((T,), 2.0, device=device)
    y = torch.empty_like(x)
    kernel[(triton.cdiv(T, BLOCK_T),)](x, w, y, T, D=ROW_WIDTH, BLOCK_T=BLOCK_T)
    return y


def _gpu_sweep(kernel, sweep) -> dict:
    per_t = []
    with _fresh_cache(), _compile_log(kernel) as log:
        for T in sweep:
            before = len(log)
            start = time.perf_counter()
            _launch(kernel, T, "cuda")
            torch.cuda.synchronize()
            first_ms = (time.perf_counter() - start) * 1e3
            start = time.perf_counter()
            _launch(kernel, T, "cuda")
            torch.cuda.synchronize()
            again_ms = (time.perf_counter() - start) * 1e3
            per_t.append(
                {
                    "T": T,
                    "compiled": len(log) > before,
                    "first_call_ms": round(first_ms, 3),
                    "second_call_ms": round(again_ms, 3),
                }
            )
    return {
        "compilations": sum(r["compiled"] for r in per_t),
        "per_T": per_t,
        "worst_first_call_ms": max(r["first_call_ms"] for r in per_t),
    }


def _key_sweep(kernel, sweep) -> dict:
    """CPU: the distinct keys Triton's binder gives the sweep (what a GPU would compile)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):  # the interpreter's wrapper: rebuild the JITFunction
        kernel = JITFunction(kernel.fn, do_not_specialize=kernel.kwargs.get("do_not_specialize"))
    bind = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    seen, per_t = set(), []
    for T in sweep:
        x = torch.ones(T, ROW_WIDTH)
        _, spec, _ = bind(x, x[:, 0].contiguous(), x, T, D=ROW_WIDTH, BLOCK_T=BLOCK_T)
        key = repr(spec)
        per_t.append({"T": T, "compiled": key not in seen, "first_call_ms": None, "second_call_ms": None})
        seen.add(key)
    return {"compilations": len(seen), "per_T": per_t, "worst_first_call_ms": None}


def run_demo(sweep=SWEEP_T) -> dict:
    """Both variants over ``sweep``: compilations and first-call latency per T (GPU), keys (CPU)."""
    on_gpu = torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") == "1"
    result = {
        "mode": "gpu"
        if on_gpu
        else "cpu: specialization keys from Triton's binder (nothing compiles "
        "in the interpreter; latencies need a GPU)",
        "sweep": list(sweep),
        "variants": {},
    }
    for name, kernel in VARIANTS.items():
        try:
            result["variants"][name] = _gpu_sweep(kernel, sweep) if on_gpu else _key_sweep(kernel, sweep)
        except Exception as exc:  # noqa: BLE001 - the demo must not sink the run; say why instead
            result["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return result

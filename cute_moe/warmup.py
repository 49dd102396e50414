"""Warm up one layer: compile every CuTe kernel it can use for T = 1 … max_tokens, in one call.

A CuTe kernel here is compiled once per :class:`~cute_moe.config.GemmConfig` (and SM count):
every batch-dependent extent is a symbolic integer (:mod:`cute_moe.cache`), so T, the routing and
the expert loads never recompile anything. What changes with T is the config the path rule picks
(:func:`~cute_moe.plan.path_rule`: the swap-AB token tile 8, 16, 32, 64, then the normal path),
each GEMM's config of its own (GEMM2 applies the routing weights in its epilogue). So the warm-up
compiles the distinct GEMM configs of the plans :func:`~cute_moe.plan.plans_for` lists, then the
row kernels (gather, SiLU·mul, combine), then passes every plan through
:func:`compile_plan` — the owner of the list of what a plan runs — so that a kernel
a plan needs and the steps above did not name is compiled too (and reported). The alignment is
torch code (:func:`moe_spec.align.align`): nothing to compile. On a GPU it finally runs every plan
once on a one-token placeholder call: the DSL binds a compiled kernel to the device at its first
call and CUDA loads modules lazily, at their first launch — work a serving call should not do.

It compiles into the process's compile cache (:mod:`cute_moe.cache`) for the SM
count of ``device`` (:func:`moe_spec.hopper.sm_count`; on a CPU, ``device="cpu"`` compiles for
the H200's), which is where ``fused_moe`` looks its kernels up.
"""

from __future__ import annotations

import time

import torch

from moe_spec.hopper import sm_count
from moe_spec.quant import FORMATS, check_quant
from moe_spec.warmup import (
    WarmupReport,
    WarmupStep,
    check_layer,
    check_options,
    layer_plans,
    placeholder_inputs,
    warmup_device,
)

from .cache import compile_count
from .config import QUANT_FORMATS, GemmConfig
from .gemm_plan import compile_gemm
from .moe import LIMITS, fused_moe
from .plan import MAX_TOKENS, _tile_text, plans_for
from .quantops import compile_quant_kernels
from .rowops import compile_row_kernels, compile_unfused_kernels

#: The row kernels :func:`~cute_moe.rowops.compile_row_kernels` builds, by name.
ROW_KERNELS = ("gather", "silu_mul", "combine")


def compile_plan(plan, num_ctas: int | None = None) -> int:
    """Compile everything a layer plan (:class:`cute_moe.plan.LayerPlan`) runs — its two GEMMs, the
    row kernels, an FP8 format's quantization kernels and the unfused pipeline's passes — ahead of
    the first call: a warm-up compiles every plan of ``plans_for``.
    Returns how many kernels this call compiled (0 when all were cached)."""
    before = compile_count()
    for cfg in (plan.gemm1, plan.gemm2):
        compile_gemm(cfg, num_ctas)
    compile_row_kernels(num_ctas)
    if plan.quant is not None:
        compile_quant_kernels(plan.quant, num_ctas)
    if plan.fusion == "separate":
        compile_unfused_kernels(plan.quant, num_ctas)
    return compile_count() - before


def check_format(quant) -> str | None:
    """``quant`` when this backend builds it; ValueError for an unknown format, NotImplementedError
    naming the formats it implements for one it does not build."""
    if check_quant(quant) not in QUANT_FORMATS:
        implemented = ", ".join(FORMATS[q].label for q in QUANT_FORMATS)
        raise NotImplementedError(f"quant: cute_moe implements {implemented}, got {quant!r}")
    return quant


def gemm_name(cfg: GemmConfig) -> str:
    """``GEMM1 swap-AB W128xT8 k64 s8``: which GEMM of the layer (GEMM2 carries the row scale) and its tile."""
    return f"GEMM{2 if cfg.row_scale else 1} {_tile_text(cfg)}"


def _num_ctas(device) -> int:
    try:
        dev = warmup_device(device)
    except ValueError as exc:
        raise ValueError(f"{exc} (device='cpu' compiles on the CPU for an H200's SM count)") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device: expected a CUDA device, or 'cpu' to compile for an H200's SM count, got {device!r}")
    return sm_count(dev)


def _step(what: str, names: tuple, compile_fn, dry_run: bool) -> WarmupStep:
    if dry_run:
        return WarmupStep(what, names, 0.0)
    before, start = compile_count(), time.perf_counter()
    compile_fn()
    seconds = time.perf_counter() - start
    return WarmupStep(what, names if compile_count() > before else (), seconds)


def _first_launch(p, E, K, I, top_k, quant, device) -> WarmupStep:  # noqa: E741
    """Run plan ``p`` once on a one-token placeholder call: the DSL binds each compiled kernel to the
    device at its first call (and CUDA loads modules lazily, at their first launch), so a serving
    call should not be the first."""
    inputs = placeholder_inputs(E, K, I, top_k, quant, 1, device)
    before, start = compile_count(), time.perf_counter()
    fused_moe(**inputs.kwargs(), configs=(p.gemm1, p.gemm2))
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return WarmupStep(f"first launch of {p.describe()} (T = 1)",
                      ("kernel compiled at its first launch",) * (compile_count() - before), seconds)


def warmup(E: int, K: int, I: int, top_k: int, quant: str | None = None,  # noqa: E741
           max_tokens: int = MAX_TOKENS, device="cuda", *, dry_run: bool = False, **options) -> WarmupReport:
    """Compile every kernel ``fused_moe`` can launch for this layer at T = 1 … ``max_tokens``.

    ``options`` are ``fused_moe``'s (``swap_ab``, ``configs``): the warm-up covers the calls made
    with the same ones. ``dry_run=True`` lists the kernels a fresh process would compile, without
    compiling. Returns a :class:`~moe_spec.warmup.WarmupReport`: one step per GEMM config, one for
    the row kernels and, on a GPU, one per plan's first launch, each with its seconds. Raises
    TypeError / ValueError naming a bad argument, NotImplementedError for a format this backend
    does not build, before anything is compiled.
    """
    check_layer(E, K, I, top_k, max_tokens, LIMITS)  # fused_moe's limits, before anything is compiled
    check_format(quant)
    check_options(options, fused_moe, "cute_moe.warmup")
    num_ctas = _num_ctas(device)
    plans = layer_plans(plans_for, E, K, I, top_k, quant, max_tokens, **options)
    configs = tuple(dict.fromkeys(cfg for p in plans for cfg in (p.gemm1, p.gemm2)))
    steps = [_step(gemm_name(cfg), (gemm_name(cfg),), lambda cfg=cfg: compile_gemm(cfg, num_ctas), dry_run)
             for cfg in configs]
    steps.append(_step("row kernels", ROW_KERNELS, lambda: compile_row_kernels(num_ctas), dry_run))
    if not dry_run:
        for p in plans:  # anything else a plan runs (compile_plan owns that list)
            start = time.perf_counter()
            extra = compile_plan(p, num_ctas)
            if extra:
                steps.append(WarmupStep(f"other kernels of {p.describe()}", ("compile_plan kernel",) * extra,
                                        time.perf_counter() - start))
        if torch.device(device).type == "cuda":
            steps += [_first_launch(p, E, K, I, top_k, quant, device) for p in plans]
    mode = "dry run: listed, nothing compiled" if dry_run else "compiled"
    return WarmupReport("cute_moe", E, K, I, top_k, quant, max_tokens, mode, tuple(p.describe() for p in plans),
                        tuple(steps), frozenset([("grouped_gemm", cfg) for cfg in configs]
                                             + [(name, num_ctas) for name in ROW_KERNELS]))

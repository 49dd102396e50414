"""Warm up one layer: compile every CuTe kernel it can use for T = 1 … max_tokens, in one call.

A CuTe kernel here is compiled once per :class:`~cute_moe.config.GemmConfig` (and SM count):
every batch-dependent extent is a symbolic integer (:mod:`cute_moe.cache`), so T, the routing and
the expert loads never recompile anything. What changes with T is the config the path rule picks
(:func:`~cute_moe.plan.path_rule`: the swap-AB token tile 8, 16, 32, 64, then the normal path),
each GEMM's config of its own (GEMM2 applies the routing weights in its epilogue). So the warm-up
compiles the distinct GEMM configs of the plans :func:`~cute_moe.plan.plans_for` lists, then the
row kernels (gather, SiLU·mul, combine), then the alignment's two CuTe kernels
(:mod:`cute_moe.alignops`) once per ``topk_ids`` dtype — they read the ids, so int32 and int64 are
two compiles, both warmed unless ``ids_dtypes`` says which one the caller passes — then passes
every plan through :func:`compile_plan` — the owner of the list of what a plan runs — so that a
kernel a plan needs and the steps above did not name is compiled too (and reported). Where the path
rule (:func:`~cute_moe.plan.one_launch`) sends the smallest T to the one-launch decode kernel
(:mod:`cute_moe.decode`), that kernel is compiled once per ids dtype too (one step each), and the grouped
pipeline's kernels only for the plans that use it. On a GPU it
finally runs every plan once on a one-token placeholder call (and the alignment and the one launch once
more per further ids dtype): the DSL binds a compiled kernel to the device at its first call and CUDA loads
modules lazily, at their first launch — work a serving call should not do.

``static=True`` warms the calls that pass static activation scales (``a1_scale``, ``a2_scale``:
fp8_tensor): their plans (``plans_for(..., static=True)``: a gated GEMM1 then quantizes by the given
scale in its epilogue, ``GemmConfig.epilogue_quant``) and their quantize kernels
(:class:`~cute_moe.quantops.StaticQuantizeRows`, no amax) are compiled, and the first launches pass the
placeholder scales 1.  The GEMM configs a plan lists carry the epilogue's variant (its fused
quantization, :func:`~cute_moe.plan.epilogue_quant`), so the warm-up compiles the variants the layer uses.

It compiles into the process's compile cache (:mod:`cute_moe.cache`) for the SM
count of ``device`` (:func:`moe_spec.hopper.sm_count`; on a CPU, ``device="cpu"`` compiles for
the H200's), which is where ``fused_moe`` looks its kernels up.
"""

from __future__ import annotations

import time

import torch

from moe_spec.hopper import sm_count
from moe_spec.quant import FORMATS, check_quant
from moe_spec.validate import STATIC_SCALE_FORMAT
from moe_spec.warmup import (
    WarmupReport,
    WarmupStep,
    check_layer,
    check_options,
    layer_plans,
    placeholder_inputs,
    warmup_device,
)

from .alignops import ID_DTYPES, compile_align_kernels
from .cache import compile_count
from .config import QUANT_FORMATS, GemmConfig
from .decode import compile_decode
from .gemm_plan import compile_gemm
from .moe import LIMITS, fused_moe
from .plan import MAX_TOKENS, _tile_text, plans_for
from .quantops import compile_gather_quantize, compile_quant_kernels
from .rowops import compile_row_kernels, compile_unfused_kernels

#: The row kernels :func:`~cute_moe.rowops.compile_row_kernels` builds, by name.
ROW_KERNELS = ("gather", "silu_mul", "combine")
#: The ``topk_ids`` dtypes the layer accepts; the alignment kernels compile once per dtype.
IDS_DTYPES = tuple(ID_DTYPES)
#: The quantize kernels of static activation scales (``compile_quant_kernels(..., static=True)``).
STATIC_QUANT_KERNELS = ("x_quantize_static", "silu_quantize_static", "a_quantize_static")
#: The alignment's launches :func:`~cute_moe.alignops.compile_align_kernels` builds per ids dtype.
ALIGN_KERNELS = ("count", "place")


def check_ids_dtypes(ids_dtypes) -> tuple:
    """``ids_dtypes`` without repeats: a non-empty tuple (or list) of :data:`IDS_DTYPES` — TypeError or
    ValueError naming the argument otherwise (triton_moe.warmup's words)."""
    if not isinstance(ids_dtypes, (tuple, list)):
        raise TypeError(
            f"ids_dtypes: expected a non-empty tuple of dtypes from {IDS_DTYPES}, e.g. "
            f"(torch.int32,), got {ids_dtypes!r}"
        )
    if not ids_dtypes or any(d not in IDS_DTYPES for d in ids_dtypes):
        raise ValueError(f"ids_dtypes: expected a non-empty tuple of {IDS_DTYPES}, got {ids_dtypes!r}")
    return tuple(dict.fromkeys(ids_dtypes))


def _align_names(ids_dtype) -> tuple[str, ...]:
    return tuple(f"align {name} ({_ids_name(ids_dtype)} ids)" for name in ALIGN_KERNELS)


def _ids_name(ids_dtype) -> str:
    return str(ids_dtype).removeprefix("torch.")


def decode_name(ids_dtype) -> str:
    """``decode 1-launch (int32 ids)``: the one-launch kernel compiled for one ``topk_ids`` dtype."""
    return f"decode 1-launch ({_ids_name(ids_dtype)} ids)"


def compile_plan(plan, num_ctas: int | None = None, ids_dtypes=IDS_DTYPES, static: bool = False) -> int:
    """Compile everything a layer plan (:class:`cute_moe.plan.LayerPlan`) runs — its two GEMMs, the
    row kernels, the alignment's kernels for each ``topk_ids`` dtype of ``ids_dtypes``, an FP8
    format's quantization kernels (``static``: also those of static activation scales; the gathering
    quantize where the plan's ``gather_quant``) and the
    unfused pipeline's passes; a plan whose path is "decode" runs only the one-launch kernel, one per ids
    dtype — ahead of the first call: a warm-up compiles every plan of ``plans_for``.
    Returns how many kernels this call compiled (0 when all were cached)."""
    ids_dtypes = check_ids_dtypes(ids_dtypes)
    if static and plan.quant != STATIC_SCALE_FORMAT:
        raise ValueError(
            f"static: static activation scales need a {STATIC_SCALE_FORMAT} plan, got quant={plan.quant!r}"
        )
    before = compile_count()
    if plan.path == "decode":
        for ids_dtype in ids_dtypes:
            compile_decode(_ids_name(ids_dtype), plan.quant, static)
        return compile_count() - before
    for ids_dtype in ids_dtypes:
        compile_align_kernels(ids_dtype)
    for cfg in (plan.gemm1, plan.gemm2):
        compile_gemm(cfg, num_ctas)
    compile_row_kernels(num_ctas)
    if plan.quant is not None:
        compile_quant_kernels(plan.quant, num_ctas)
    if plan.gather_quant:  # x quantized where its rows are gathered (cute_moe.plan.GATHER_QUANT)
        compile_gather_quantize(plan.quant, num_ctas)
    if static:
        compile_quant_kernels(plan.quant, num_ctas, static=True)
        if plan.gather_quant:
            compile_gather_quantize(plan.quant, num_ctas, static=True)
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


def _first_launch(p, E, K, I, top_k, quant, device, ids_dtype, static: bool = False) -> WarmupStep:  # noqa: E741
    """Run plan ``p`` once on a one-token placeholder call with ``ids_dtype`` ids (``static``: with
    static activation scales 1): the DSL binds each compiled kernel to the device at its first call
    (and CUDA loads modules lazily, at their first launch), so a serving call should not be the first."""
    inputs = placeholder_inputs(E, K, I, top_k, quant, 1, device, ids_dtype)
    scales = {}
    if static:
        scales = {name: torch.ones(1, dtype=torch.float32, device=device) for name in ("a1_scale", "a2_scale")}
    before, start = compile_count(), time.perf_counter()
    if p.path == "decode":  # the plan of T = 1 (plans_for's first): the call a server makes, so
        fused_moe(**inputs.kwargs(), **scales)  # fused_moe's own binding of the one launch is made here too
    else:
        fused_moe(**inputs.kwargs(), configs=(p.gemm1, p.gemm2), **scales)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return WarmupStep(
        f"first launch of {p.describe()} (T = 1, {_ids_name(ids_dtype)} ids)",
        ("kernel compiled at its first launch",) * (compile_count() - before),
        seconds,
    )


def warmup(
    E: int,
    K: int,
    I: int,
    top_k: int,
    quant: str | None = None,  # noqa: E741
    max_tokens: int = MAX_TOKENS,
    device="cuda",
    *,
    dry_run: bool = False,
    ids_dtypes=IDS_DTYPES,
    static: bool = False,
    **options,
) -> WarmupReport:
    """Compile every kernel ``fused_moe`` can launch for this layer at T = 1 … ``max_tokens``.

    ``options`` are ``fused_moe``'s (``swap_ab``, ``configs``): the warm-up covers the calls made
    with the same ones. ``dry_run=True`` lists the kernels a fresh process would compile, without
    compiling. ``ids_dtypes``: the ``topk_ids`` dtypes the calls will pass (default: both the
    contract accepts). ``static``: the calls pass static activation scales (``a1_scale``,
    ``a2_scale``; fp8_tensor only): their quantize kernels are compiled too (one more step). Returns
    a :class:`~moe_spec.warmup.WarmupReport`: one step per GEMM config, one for the row kernels, one
    per ids dtype for the alignment's kernels, one per ids dtype for the one-launch kernel where a plan
    takes it and, on a GPU, one per plan's first launch (and more per further ids dtype), each with its seconds. Raises
    TypeError / ValueError naming a bad argument, NotImplementedError for a format this backend
    does not build, before anything is compiled.
    """
    check_layer(E, K, I, top_k, max_tokens, LIMITS)  # fused_moe's limits, before anything is compiled
    check_format(quant)
    check_options(options, fused_moe, "cute_moe.warmup")
    ids_dtypes = check_ids_dtypes(ids_dtypes)
    if type(static) is not bool:
        raise TypeError(f"static: expected a bool, got {static!r}")
    if static and quant != STATIC_SCALE_FORMAT:
        raise ValueError(f"static: static activation scales need quant={STATIC_SCALE_FORMAT!r}, got quant={quant!r}")
    if static and options.get("fusion", "fused") != "fused":
        raise ValueError(f"fusion: static activation scales need the fused pipeline, got fusion={options['fusion']!r}")
    num_ctas = _num_ctas(device)
    # static: the plans of static calls (a gated GEMM1 quantizing by the given scale in its epilogue)
    plans = layer_plans(plans_for, E, K, I, top_k, quant, max_tokens, static=static, **options)
    grouped = [p for p in plans if p.path == "grouped"]
    # the one launch (cute_moe.plan.one_launch) serves the smallest T: its kernel per ids dtype, else nothing
    decode_dtypes = ids_dtypes if len(grouped) < len(plans) else ()
    align_dtypes, row_kernels = (ids_dtypes, ROW_KERNELS) if grouped else ((), ())
    configs = tuple(dict.fromkeys(cfg for p in grouped for cfg in (p.gemm1, p.gemm2)))
    steps = [
        _step(gemm_name(cfg), (gemm_name(cfg),), lambda cfg=cfg: compile_gemm(cfg, num_ctas), dry_run)
        for cfg in configs
    ]
    if grouped:
        steps.append(_step("row kernels", ROW_KERNELS, lambda: compile_row_kernels(num_ctas), dry_run))
    steps += [
        _step(
            f"alignment kernels, {_ids_name(dt)} ids",
            _align_names(dt),
            lambda dt=dt: compile_align_kernels(dt),
            dry_run,
        )
        for dt in align_dtypes
    ]
    steps += [
        _step(decode_name(dt), (decode_name(dt),), lambda dt=dt: compile_decode(_ids_name(dt), quant, static), dry_run)
        for dt in decode_dtypes
    ]
    if static:
        names = STATIC_QUANT_KERNELS
        steps.append(
            _step(
                "static-scale quantize kernels",
                names,
                lambda: compile_quant_kernels(quant, num_ctas, static=True),
                dry_run,
            )
        )
    if not dry_run:
        for p in plans:  # anything else a plan runs (compile_plan owns that list)
            start = time.perf_counter()
            extra = compile_plan(p, num_ctas, ids_dtypes, static)
            if extra:
                steps.append(
                    WarmupStep(
                        f"other kernels of {p.describe()}",
                        ("compile_plan kernel",) * extra,
                        time.perf_counter() - start,
                    )
                )
        if torch.device(device).type == "cuda":
            steps += [_first_launch(p, E, K, I, top_k, quant, device, ids_dtypes[0], static) for p in plans]
            # the ids dtype changes the alignment kernels and the one launch: one more call of each per dtype
            again = [p for p in plans if p.path == "decode"] + grouped[:1]
            steps += [
                _first_launch(p, E, K, I, top_k, quant, device, dt, static) for dt in ids_dtypes[1:] for p in again
            ]
    mode = "dry run: listed, nothing compiled" if dry_run else "compiled"
    return WarmupReport(
        "cute_moe",
        E,
        K,
        I,
        top_k,
        quant,
        max_tokens,
        mode,
        tuple(p.describe() for p in plans),
        tuple(steps),
        frozenset(
            [("grouped_gemm", cfg) for cfg in configs]
            + [(name, num_ctas) for name in row_kernels]
            + [("align", dt) for dt in align_dtypes]
            + [("decode", dt) for dt in decode_dtypes]
            + [(name, num_ctas) for name in (STATIC_QUANT_KERNELS if static else ())]
        ),
    )

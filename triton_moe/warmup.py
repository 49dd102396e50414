"""Warm up one layer: compile every Triton kernel it can use for T = 1 … max_tokens, in one call.

What Triton compiles is one binary per *specialization key* of a kernel (:mod:`triton_moe.jit`):
the constexprs and launch options, the dtype of every argument, whether each pointer is 16-byte
aligned and each specialized integer equals 1 or is divisible by 16. For one layer those are
fixed by:

* the plan's :class:`~triton_moe.config.TritonConfig` — tiles, warps, stages, swap-AB — which
  changes with T from bucket to bucket (:func:`~triton_moe.plan.plans_for` lists them);
* the layer (E, K, I, top_k) and the format: constexprs, scale layouts, whether there is a
  combine (not with top_k = 1), the alignment of ``expert_end[-1:]``;
* the dtype of ``topk_ids``: the contract accepts int32 and int64, and the alignment kernels
  read it, so both are warmed unless ``ids_dtypes`` says which one the caller passes.

Not by T: every argument that varies with T (``num_pairs``, ``num_rows``, ``num_tokens``,
``num_chunks``, ``num_blocks``) is in ``do_not_specialize``, and a token count the contract
accepts keeps them far below 2³¹, where their key would change from i32 to i64.
So running each plan once, on a one-token placeholder call (:func:`moe_spec.warmup.placeholder_inputs`)
with that plan's config, produces every key the layer will ever look up: GEMM1 and GEMM2, the
two alignment kernels (one binary each serves both chunk widths, :mod:`triton_moe.align`), the
FP8 amax and quantize kernels, the combine.  The tests sweep T densely afterwards and find no
key the warm-up missed (``tests/test_warmup.py``).

Tensors are assumed fresh torch allocations (16-byte aligned), as the placeholder's are: a view
that starts at an odd offset would be a new key.  Under ``TRITON_INTERPRET=1`` nothing is ever
compiled, so the warm-up records the keys a GPU would compile (``dry_run``) instead of running.
"""

from __future__ import annotations

import time

import torch

from moe_spec.quant import check_quant
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
from triton_moe.jit import INTERPRET, count_compilations
from triton_moe.moe import LIMITS, fused_moe
from triton_moe.plan import MAX_TOKENS, plans_for

#: The ``topk_ids`` dtypes of the contract; each is a key of the alignment kernels.
IDS_DTYPES = (torch.int32, torch.int64)


def _device(device, dry_run: bool) -> torch.device:
    try:
        dev = warmup_device(device)
    except ValueError as exc:
        raise ValueError(f"{exc} (on a CPU: device='cpu' with dry_run=True, or under TRITON_INTERPRET=1)") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device: expected a CUDA device, or 'cpu' for a dry run, got {device!r}")
    if dev.type != "cuda" and not (dry_run or INTERPRET):
        raise ValueError(
            f"device: Triton compiles for a CUDA device, got {device!r}; "
            f"dry_run=True records the keys without compiling"
        )
    return dev


def warmup(
    E: int,
    K: int,
    I: int,
    top_k: int,
    quant: str | None = None,  # noqa: E741
    max_tokens: int = MAX_TOKENS,
    device="cuda",
    *,
    dry_run: bool | None = None,
    ids_dtypes=IDS_DTYPES,
    static: bool = False,
    **options,
) -> WarmupReport:
    """Compile every kernel ``fused_moe`` can launch for this layer at T = 1 … ``max_tokens``.

    ``options`` are ``fused_moe``'s (``config``, ``swap_ab``): the warm-up covers the calls made
    with the same ones. ``dry_run`` (default: True under the interpreter) records what a fresh
    process would compile without compiling or launching. ``static``: the calls pass static
    activation scales (``a1_scale``, ``a2_scale``: fp8_tensor), whose GEMM1 quantizes the
    intermediate in its epilogue (:func:`~triton_moe.plan.epilogue_quant`) and, where its switch is
    on, x in its A load (:func:`~triton_moe.plan.x_quant_in_gemm1`): kernels of their own.
    Returns a
    :class:`~moe_spec.warmup.WarmupReport`: one step per (plan, ``topk_ids`` dtype) — the kernels it
    compiled and its seconds, which on a GPU include the one-token call itself (microseconds).
    Raises TypeError / ValueError naming a bad argument before anything is compiled.
    """
    check_layer(E, K, I, top_k, max_tokens, LIMITS)  # fused_moe's limits, before anything is allocated
    check_quant(quant)
    check_options(options, fused_moe, "triton_moe.warmup")
    if type(static) is not bool:
        raise TypeError(f"static: expected a bool, got {static!r}")
    if static and quant != STATIC_SCALE_FORMAT:
        raise ValueError(f"static: static activation scales need quant={STATIC_SCALE_FORMAT!r}, got quant={quant!r}")
    dry_run = INTERPRET if dry_run is None else bool(dry_run)
    dev = _device(device, dry_run)
    if not isinstance(ids_dtypes, (tuple, list)):
        raise TypeError(
            f"ids_dtypes: expected a non-empty tuple of dtypes from {IDS_DTYPES}, e.g. "
            f"(torch.int32,), got {ids_dtypes!r}"
        )
    if not ids_dtypes or any(d not in IDS_DTYPES for d in ids_dtypes):
        raise ValueError(f"ids_dtypes: expected a non-empty tuple of {IDS_DTYPES}, got {ids_dtypes!r}")
    plans = layer_plans(plans_for, E, K, I, top_k, quant, max_tokens, **options)
    compiling = not (dry_run or INTERPRET)  # only then does Triton's cache hook report compilations
    steps = []
    with count_compilations(dry_run) as counter:
        for p in plans:
            for ids_dtype in ids_dtypes:
                inputs = placeholder_inputs(E, K, I, top_k, quant, 1, dev, ids_dtype)
                scales = {}
                if static:
                    scales = {name: torch.ones(1, dtype=torch.float32, device=dev) for name in ("a1_scale", "a2_scale")}
                known = {name: set(keys) for name, keys in counter.keys.items()}
                done = len(counter.compilations)
                start = time.perf_counter()
                fused_moe(**inputs.kwargs(), config=p.config, **scales)
                if compiling:
                    torch.cuda.synchronize(dev)
                seconds = time.perf_counter() - start
                if compiling:
                    compiled = counter.compilations[done:]
                else:  # the keys first met here: what a fresh process compiles at this step
                    compiled = [name for name, keys in counter.keys.items() for _ in keys - known.get(name, set())]
                steps.append(
                    WarmupStep(
                        f"{p.describe()}, topk_ids {str(ids_dtype).removeprefix('torch.')}",
                        tuple(sorted(compiled)),
                        seconds,
                    )
                )
        covered = frozenset((name, key) for name, keys in counter.keys.items() for key in keys)
    mode = (
        "compiled"
        if compiling
        else "dry run: specialization keys recorded, nothing compiled"
        if dry_run
        else "interpreter: kernels ran, specialization keys recorded, nothing compiled"
    )
    return WarmupReport(
        "triton_moe", E, K, I, top_k, quant, max_tokens, mode, tuple(p.describe() for p in plans), tuple(steps), covered
    )

"""Input validation shared by both backends: every bad argument is named, and none is read back.

:func:`validate_moe_args` checks types, dtypes, shapes, devices and strides against the contract
in :mod:`moe_spec.problem` and returns the problem's sizes. Type problems raise ``TypeError``;
wrong shapes or values raise ``ValueError``. Each message starts with the argument's name and says
what was expected.

The layer's sizes have one check, :func:`check_sizes`, which every surface of the backends runs
(``fused_moe`` here, a warm-up on its arguments, the transformers forward, the sharded layers) with
the backend's :class:`Limits`, each naming its own argument (:class:`SizeNames`).

Two kinds of checks:

* **On the host**, from the tensors' metadata alone, always, before any launch: types, dtypes
  (the weight dtype is the format's, :data:`moe_spec.quant.FORMATS`), shapes and scale shapes, the
  int32 limits that remain (one expert's matrix, the sorted activation copies: W1 and W2 as a
  whole are indexed in 64 bits), a backend's expert limit, then no meta tensor (shape but no data: refused by
  name before anything tries to read it), one device, contiguity. These are a function of the
  metadata, so their verdict is cached per signature (dtypes, shapes, strides, devices, options):
  a repeated call pays a dictionary lookup.
* **On the data** — ids in [0, E), no repeated expert in a row, finite routing weights, finite
  positive scales (weight scales, and the static activation scales ``a1_scale`` / ``a2_scale`` of
  fp8_tensor, whose host checks are :func:`_static_scales`). Reading data on the host is a
  device→host copy that waits for the GPU, so by
  default (the ``"device"`` check mode) these checks run *inside the backend's kernels*, which
  read that data anyway: a failed check sets a bit of the device's **error word**
  (:func:`error_word`, one int32 per device, sticky) and the bad value is made harmless
  (:data:`DATA_CHECKS` says what each one produces; :mod:`moe_spec.contract`
  tells the whole story). Without a sync, the next ``fused_moe`` call raises it
  (:func:`surface_errors`, from a host copy of the word) and :func:`poll` raises it when you ask;
  :func:`check` reads the word itself (one sync, when *you* choose), clears it
  and raises ``ValueError`` naming the argument. The ``"sync"`` mode — ``MOE_CHECK=sync`` in
  the environment, :func:`set_check_mode` or ``with checks("sync"):`` — also reads the data in
  :func:`validate_moe_args` and raises before any launch, for debugging (a few syncs a call). It is
  skipped while a CUDA graph is being captured (a sync is illegal there).

:func:`guard_routing` is the data checks in torch ops (no sync): what a backend does with bad
routing data, for backends without a kernel of their own for it, and as the tests' reference.

The activations ``x`` and the weights are not scanned: a NaN or inf there is data, and it
propagates to the output as the oracle says (``notes/numerics.md``).
"""

from __future__ import annotations

import torch

import moe_spec.errorword as _errorword
from moe_spec.errorword import (  # noqa: F401  (re-exported: the names the backends and tests import from here)
    BAD_A1_SCALE,
    BAD_A2_SCALE,
    BAD_ID,
    BAD_W1_SCALE,
    BAD_W2_SCALE,
    BAD_WEIGHT,
    CHECK_MODES,
    COPY_INTERVAL_S,
    DATA_CHECKS,
    REPEATED_ID,
    DataCheck,
    _mode_from,
    check,
    check_mode,
    checks,
    error_word,
    failed_checks,
    guard_routing,
    poll,
    set_check_mode,
    surface_errors,
)
from moe_spec.quant import get_format
from moe_spec.sizes import (  # noqa: F401  (re-exported)
    CALL_NAMES,
    INT32_MAX,
    WARMUP_NAMES,
    Limits,
    MoEDims,
    SizeNames,
    as_device,
    check_runs_on,
    check_sizes,
)

# --- the host checks ---------------------------------------------------------------------------------


def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _dtype(name, t, allowed, why=""):
    if t.dtype not in allowed:
        want = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name}: expected dtype {want}{why}, got {str(t.dtype).replace('torch.', '')}")


def _shape(name, t, expected):
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def _contiguous(name, t):
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous (row-major) tensor, got strides {t.stride()}")


def _scale(name, s, expected_shape):
    if s is None:
        raise ValueError(f"{name}: required for an fp8 quant format, expected float32 of shape {expected_shape}")
    _tensor(name, s)
    _dtype(name, s, (torch.float32,))
    _shape(name, s, expected_shape)
    _contiguous(name, s)  # kernels index scales as dense row-major arrays


#: Shapes a static activation scale may have: 0-d (vLLM's ``input_scale.max()``) or [1].
STATIC_SCALE_SHAPES = ((), (1,))
#: The one format that takes static activation scales: a single scale per activation tensor.
STATIC_SCALE_FORMAT = "fp8_tensor"


def _static_scales(quant, a1_scale, a2_scale, device) -> None:
    """Host checks of ``a1_scale`` / ``a2_scale``, the static (calibrated) activation scales of x and
    of the intermediate: ``quant="fp8_tensor"`` only, both or neither, fp32 with one element (shape
    [] or [1]) with data on the device of x."""
    given = [(n, s) for n, s in (("a1_scale", a1_scale), ("a2_scale", a2_scale)) if s is not None]
    if not given:
        return
    if quant != STATIC_SCALE_FORMAT:
        raise ValueError(
            f"{given[0][0]}: static activation scales need quant={STATIC_SCALE_FORMAT!r} (one scale "
            f"per activation tensor), got quant={quant!r}"
        )
    if len(given) == 1:
        missing = "a2_scale" if given[0][0] == "a1_scale" else "a1_scale"
        raise ValueError(
            f"{missing}: required when {given[0][0]} is given (static scales come as a pair: "
            "x's and the intermediate's; with neither, both are dynamic)"
        )
    for name, s in given:
        _tensor(name, s)
        _dtype(name, s, (torch.float32,))
        if tuple(s.shape) not in STATIC_SCALE_SHAPES:
            raise ValueError(f"{name}: expected one scale, shape () or (1,), got {tuple(s.shape)}")
        if s.is_meta:
            raise ValueError(f"{name}: expected a tensor with data, got a meta tensor (the backend reads its value)")
        if s.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got {s.device}")


def _host_checks(
    x, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale, limits, a1_scale=None, a2_scale=None
) -> MoEDims:
    for name, t in (("x", x), ("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        _tensor(name, t)
    fmt = get_format(quant)

    _dtype("x", x, (torch.bfloat16,))
    why = f" (quant={quant!r})"
    _dtype("w1", w1, (fmt.weight_dtype,), why)
    _dtype("w2", w2, (fmt.weight_dtype,), why)
    _dtype("topk_weights", topk_weights, (torch.float32,))
    _dtype("topk_ids", topk_ids, (torch.int32, torch.int64))

    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, K] tensor, got shape {tuple(x.shape)}")
    if w1.dim() != 3:
        raise ValueError(f"w1: expected a 3-D [E, 2I, K] tensor, got shape {tuple(w1.shape)}")
    if w2.dim() != 3:
        raise ValueError(f"w2: expected a 3-D [E, K, I] tensor, got shape {tuple(w2.shape)}")
    T, K = x.shape
    E, two_i, k1 = w1.shape
    if k1 != K:
        raise ValueError(f"w1: expected shape [E, 2I, K={K}] (K from x), got {tuple(w1.shape)}")
    if two_i % 2 or not two_i or (two_i == w2.shape[2] and tuple(w2.shape[:2]) == (E, K)):
        # an odd row count, or w1 with w2's I rows ([E, I, K]: the gate or the up half alone) — w1 is
        # the one that is wrong, not the w2 its half would imply
        raise ValueError(
            f"w1: expected shape [E, 2I, K] = ({E}, {2 * w2.shape[2]}, {K}) — the gate rows, then "
            f"the up rows, I = w2.shape[2] = {w2.shape[2]} — got {tuple(w1.shape)}"
        )
    I = two_i // 2  # noqa: E741
    if tuple(w2.shape) != (E, K, I):
        raise ValueError(
            f"w2: expected shape [E, K, I] = {(E, K, I)} (E and 2I from w1, K from x), got {tuple(w2.shape)}"
        )
    if topk_weights.dim() != 2 or topk_weights.shape[0] != T:
        raise ValueError(f"topk_weights: expected shape [T={T}, top_k], got {tuple(topk_weights.shape)}")
    top_k = topk_weights.shape[1]
    _shape("topk_ids", topk_ids, (T, top_k))
    # the sizes and their limits: the same check as every other surface's (warm-up, transformers, sharded)
    dims = check_sizes(E, K, I, top_k, T, limits=limits, names=CALL_NAMES)

    tensors = (
        ("x", x),
        ("w1", w1),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
        ("w1_scale", w1_scale),
        ("w2_scale", w2_scale),
    )
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.is_meta:
            raise ValueError(f"{name}: expected a tensor with data, got a meta tensor (the backend reads its values)")
    device = x.device
    for name, t in tensors[1:]:
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got {t.device}")
    for name, t in tensors[:5]:
        _contiguous(name, t)

    for name, s, shape in (("w1_scale", w1_scale, (E, two_i, K)), ("w2_scale", w2_scale, (E, K, I))):
        if fmt.quantized:
            _scale(name, s, fmt.weight_scale_shape(*shape))
        elif s is not None:
            raise ValueError(f"{name}: must be None when quant={quant!r} (bf16 weights carry no scale)")
    _static_scales(quant, a1_scale, a2_scale, device)
    return dims


def _data_checks_now(dims: MoEDims, topk_weights, topk_ids, w1_scale, w2_scale, a1_scale=None, a2_scale=None) -> None:
    """The data checks on the host: they read device memory (a sync) and raise before any launch."""
    for name, s in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if s is not None and s.numel() and not bool(torch.isfinite(s).all() and (s > 0).all()):
            rule = "a finite, positive static activation scale" if name[0] == "a" else "finite, positive scales"
            raise ValueError(f"{name}: expected {rule}")
    if not dims.T:
        return
    ids = topk_ids.long()
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= dims.E:
        raise ValueError(f"topk_ids: expected ids in [0, E={dims.E}), got values in [{lo}, {hi}]")
    if dims.top_k > 1:
        s = ids.sort(dim=1).values
        if bool((s[:, 1:] == s[:, :-1]).any()):
            raise ValueError("topk_ids: an expert appears twice in one token's row; expected distinct ids")
    if not bool(torch.isfinite(topk_weights).all()):
        raise ValueError("topk_weights: expected finite routing weights")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _signature(t):
    """What the host checks read of one argument, or None: not a plain tensor (checked every time)."""
    if t is None:
        return ()
    if type(t) not in _PLAIN:  # a list, a tensor subclass (FakeTensor, …): no cached verdict
        return None
    return t.dtype, t.shape, t.stride(), t.device


_verdicts: dict = {}  # signature of a call that passed -> its MoEDims
_VERDICTS_MAX = 4096


def validate_moe_args(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    *,
    quant=None,
    w1_scale=None,
    w2_scale=None,
    max_experts=None,
    data_checks: str | None = None,
    a1_scale=None,
    a2_scale=None,
    limits: Limits | None = None,
) -> MoEDims:
    """Check every argument of ``fused_moe`` and return the problem's sizes.

    ``a1_scale`` / ``a2_scale``: static activation scales of x and of the intermediate
    (``quant="fp8_tensor"`` only, both or neither; :mod:`moe_spec.contract`).
    ``limits``: a backend's :class:`Limits` (its expert limit is refused naming ``w1``; its device
    rule is the backend's to apply, :func:`check_runs_on`, after its options); ``max_experts``
    alone is ``Limits("this backend", max_experts)``.
    ``data_checks``: None follows :func:`check_mode`; ``"sync"`` reads the data now and raises
    (for callers that index with the ids on the host, such as the oracle); ``"device"`` leaves
    the data to the backend's kernels (see the module docstring).
    """
    if limits is None and max_experts is not None:
        limits = Limits("this backend", max_experts)
    key = (quant, limits) + tuple(
        map(_signature, (x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, a1_scale, a2_scale))
    )
    if None in key[2:] or not (quant is None or type(quant) is str):
        key = None
    dims = _verdicts.get(key) if key is not None else None
    if dims is None:
        dims = _host_checks(x, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale, limits, a1_scale, a2_scale)
        if key is not None:
            if len(_verdicts) >= _VERDICTS_MAX:
                _verdicts.clear()
            _verdicts[key] = dims
    mode = (_errorword._mode or check_mode()) if data_checks is None else _mode_from(data_checks, "data_checks")
    if mode == "sync" and not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _data_checks_now(dims, topk_weights, topk_ids, w1_scale, w2_scale, a1_scale, a2_scale)
    return dims

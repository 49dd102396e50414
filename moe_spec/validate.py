"""Input validation shared by both backends: every bad argument is named, and none is read back.

:func:`validate_moe_args` checks types, dtypes, shapes, devices and strides against the contract
in :mod:`moe_spec.problem` and returns the problem's sizes. Type problems raise ``TypeError``;
wrong shapes or values raise ``ValueError``. Each message starts with the argument's name and says
what was expected.

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
  (:func:`error_word`, one int32 per device, sticky) and the bad value is made harmless, never
  silently wrong (:data:`DATA_CHECKS` says what each one produces; :mod:`moe_spec.contract`
  tells the whole story). :func:`check` reads the word (one sync, when *you* choose), clears it
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

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from moe_spec.quant import get_format

#: Largest element offset a kernel may form in int32 arithmetic (inside one expert's matrix, inside
#: the sorted activation copies).
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class MoEDims:
    """Sizes of a validated problem."""

    T: int
    E: int
    K: int
    I: int  # noqa: E741  (the domain's name)
    top_k: int


# --- the data checks, their bits and their effect ------------------------------------------------


@dataclass(frozen=True)
class DataCheck:
    """One check of the data: its bit in the error word, the argument it names, what it requires,
    and what a backend computes when the data breaks it (checked on the device)."""

    bit: int
    argument: str
    rule: str
    effect: str


#: The data checks, in argument order (the first set bit names the argument :func:`check` raises for).
DATA_CHECKS = (
    DataCheck(1, "topk_ids", "expected ids in [0, E)",
              "the pair was aligned with its id clamped into range and weighted NaN, so its token's output "
              "row is NaN (under FP8 its intermediate is zeroed: no shared scale sees it)"),
    DataCheck(2, "topk_ids", "expected distinct ids in each token's row",
              "the repeated expert was computed for each slot and summed, as the formula reads"),
    DataCheck(4, "topk_weights", "expected finite routing weights",
              "the non-finite weight multiplied its pair: the token's output row is not finite"),
    DataCheck(8, "w1_scale", "expected finite, positive scales",
              "the scale was used as given (NaN, inf, zero or a sign flip in the output)"),
    DataCheck(16, "w2_scale", "expected finite, positive scales",
              "the scale was used as given (NaN, inf, zero or a sign flip in the output)"),
    DataCheck(32, "a1_scale", "expected a finite, positive static activation scale",
              "the scale was used as given (NaN, inf, zero or a sign flip in the output)"),
    DataCheck(64, "a2_scale", "expected a finite, positive static activation scale",
              "the scale was used as given (NaN, inf, zero or a sign flip in the output)"),
)
BAD_ID, REPEATED_ID, BAD_WEIGHT, BAD_W1_SCALE, BAD_W2_SCALE, BAD_A1_SCALE, BAD_A2_SCALE = (c.bit for c in DATA_CHECKS)

CHECK_MODES = ("device", "sync")


def _mode_from(value: str, name: str) -> str:
    if value not in CHECK_MODES:
        raise ValueError(f"{name}: expected one of {CHECK_MODES}, got {value!r}")
    return value


_mode = _mode_from(os.environ.get("MOE_CHECK", "device"), "MOE_CHECK")


def check_mode() -> str:
    """The current data-check mode: ``"device"`` (default) or ``"sync"`` (``MOE_CHECK``)."""
    return _mode


def set_check_mode(mode: str) -> str:
    """Set the data-check mode for the process; returns the previous one."""
    global _mode
    previous, _mode = _mode, _mode_from(mode, "mode")
    return previous


@contextlib.contextmanager
def checks(mode: str):
    """``with checks("sync"): ...`` — the data-check mode inside the block."""
    previous = set_check_mode(mode)
    try:
        yield
    finally:
        set_check_mode(previous)


# --- the error word --------------------------------------------------------------------------------

_words: dict = {}
_words_lock = threading.Lock()
_bits: dict = {}  # per device: int32 [BAD_ID, BAD_WEIGHT, REPEATED_ID] for guard_routing, made with the word


def _device_key(device) -> torch.device:
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.index is None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def error_word(device) -> torch.Tensor:
    """int32 [1] on ``device``: the OR of the :data:`DATA_CHECKS` bits that failed since the last
    :func:`check`. Kernels OR bits into it (never clear it); one per device, kept for the
    process, so a captured CUDA graph may hold its address.

    It is allocated (zeroed, one sync) at the first call on a device, which must not happen during
    a CUDA graph capture: run one call (the usual warm-up) before capturing."""
    word = _words.get(device)  # the common case: the device of a tensor, with its index
    if word is not None:
        return word
    key = _device_key(device)
    word = _words.get(key)
    if word is None:
        with _words_lock:
            word = _words.get(key)
            if word is None:
                if key.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(f"moe_spec.validate.error_word: the error word of {key} is allocated at the "
                                       "first call outside a CUDA graph capture; run one call before capturing")
                word = torch.zeros(1, dtype=torch.int32, device=key)
                _bits[key] = torch.tensor([BAD_ID, BAD_WEIGHT, REPEATED_ID], dtype=torch.int32, device=key)
                if key.type == "cuda":
                    torch.cuda.current_stream(key).synchronize()  # zeroed before any stream uses it
                _words[key] = word
    return word


def failed_checks(bits: int) -> list:
    """The :data:`DATA_CHECKS` whose bit is set in ``bits``, in order."""
    return [c for c in DATA_CHECKS if bits & c.bit]


def check(device=None) -> None:
    """Raise ``ValueError`` if a data check failed on ``device`` (default: every device that has an
    error word) since the last ``check``; the message starts with the argument's name.

    Reads the word (a device→host copy: one sync of the current stream — kernels of ``fused_moe``
    calls on other streams must be ordered before it) and clears it."""
    keys = [_device_key(device)] if device is not None else list(_words)
    for key in keys:
        word = _words.get(key)
        bits = int(word.item()) if word is not None else 0
        if not bits:
            continue
        word.zero_()
        first, *more = failed_checks(bits)
        also = f" (also failed: {', '.join(c.argument + ' ' + c.rule for c in more)})" if more else ""
        raise ValueError(f"{first.argument}: {first.rule}; a fused_moe call on {key} since the last check broke "
                         f"this: {first.effect}{also}")


def guard_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, word: torch.Tensor):
    """The routing data checks in torch ops, without a sync: ORs :data:`BAD_ID`, :data:`REPEATED_ID`
    and :data:`BAD_WEIGHT` into ``word`` when they fail, and returns ``(ids, weights)`` safe to
    align and compute with — ids clamped into [0, E), and NaN as the routing weight of a pair whose
    id was out of range (so its token's output row is NaN, :data:`DATA_CHECKS`). Fourteen small
    kernels; ``word`` must come from :func:`error_word`."""
    ids = topk_ids.clamp(0, num_experts - 1)
    bad_id = ids != topk_ids
    weights = topk_weights.masked_fill(bad_id, float("nan"))
    nonfinite = (topk_weights - topk_weights) != 0  # w − w: 0 when finite, NaN for ±inf and NaN
    faults = [bad_id.any(), nonfinite.any()]
    if topk_ids.shape[1] > 1:
        s = topk_ids.sort(dim=1).values
        faults.append((s[:, 1:] == s[:, :-1]).any())
    bits = _bits[_device_key(word.device)][: len(faults)]  # BAD_ID, BAD_WEIGHT, REPEATED_ID
    word.bitwise_or_((torch.stack(faults) * bits).sum(dtype=torch.int32))
    return ids, weights


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
        raise ValueError(f"{given[0][0]}: static activation scales need quant={STATIC_SCALE_FORMAT!r} (one scale "
                         f"per activation tensor), got quant={quant!r}")
    if len(given) == 1:
        missing = "a2_scale" if given[0][0] == "a1_scale" else "a1_scale"
        raise ValueError(f"{missing}: required when {given[0][0]} is given (static scales come as a pair: "
                         "x's and the intermediate's; with neither, both are dynamic)")
    for name, s in given:
        _tensor(name, s)
        _dtype(name, s, (torch.float32,))
        if tuple(s.shape) not in STATIC_SCALE_SHAPES:
            raise ValueError(f"{name}: expected one scale, shape () or (1,), got {tuple(s.shape)}")
        if s.is_meta:
            raise ValueError(f"{name}: expected a tensor with data, got a meta tensor (the backend reads its value)")
        if s.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got {s.device}")


def _host_checks(x, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale, max_experts,
                 a1_scale=None, a2_scale=None) -> MoEDims:
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
    if two_i == 0 or two_i % 2:
        raise ValueError(f"w1: expected an even, non-zero 2I (gate rows then up rows), got {two_i}")
    if E == 0 or K == 0:
        raise ValueError(f"w1: expected E > 0 and K > 0, got shape {tuple(w1.shape)}")
    I = two_i // 2  # noqa: E741
    _shape("w2", w2, (E, K, I))
    if topk_weights.dim() != 2 or topk_weights.shape[0] != T:
        raise ValueError(f"topk_weights: expected shape [T={T}, top_k], got {tuple(topk_weights.shape)}")
    top_k = topk_weights.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"topk_weights: expected 1 <= top_k <= E={E}, got top_k={top_k}")
    _shape("topk_ids", topk_ids, (T, top_k))

    # What 32-bit index arithmetic remains (the weights' expert bases are 64-bit in both backends,
    # so W1 and W2 as a whole have no limit): offsets inside one expert's matrix (W1[e] is the
    # larger, 2I·K), and the sorted activation copies (T·top_k rows of up to max(K, 2I) columns)
    # with their int32 row indexes and work counters.
    if two_i * K > INT32_MAX:
        raise ValueError(f"w1: one expert's matrix holds 2I·K = {two_i}·{K} = {two_i * K} elements, more than "
                         f"the int32 offset limit {INT32_MAX} inside an expert; shard the experts (tensor parallel)")
    if T * top_k * max(K, two_i) > INT32_MAX:
        raise ValueError(f"x: the sorted activation copies hold T·top_k·max(K, 2I) = {T}·{top_k}·{max(K, two_i)} = "
                         f"{T * top_k * max(K, two_i)} elements, more than the int32 limit {INT32_MAX}; "
                         "pass fewer tokens per call")
    if max_experts is not None and E > max_experts:
        raise ValueError(f"w1: at most {max_experts} experts (w1.shape[0]) are supported by this backend, got {E}")

    tensors = (("x", x), ("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
               ("w1_scale", w1_scale), ("w2_scale", w2_scale))
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.is_meta:
            raise ValueError(f"{name}: expected a tensor with data, got a meta tensor (the backend reads its values)")
    device = x.device
    for name, t in tensors[1:]:
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got {t.device}")
    for name, t in tensors[:5]:
        _contiguous(name, t)

    for name, s, dims in (("w1_scale", w1_scale, (E, two_i, K)), ("w2_scale", w2_scale, (E, K, I))):
        if fmt.quantized:
            _scale(name, s, fmt.weight_scale_shape(*dims))
        elif s is not None:
            raise ValueError(f"{name}: must be None when quant={quant!r} (bf16 weights carry no scale)")
    _static_scales(quant, a1_scale, a2_scale, device)
    return MoEDims(T=T, E=E, K=K, I=I, top_k=top_k)


def _data_checks_now(dims: MoEDims, topk_weights, topk_ids, w1_scale, w2_scale, a1_scale=None,
                     a2_scale=None) -> None:
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


def validate_moe_args(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None,
                      w2_scale=None, max_experts=None, data_checks: Optional[str] = None,
                      a1_scale=None, a2_scale=None) -> MoEDims:
    """Check every argument of ``fused_moe`` and return the problem's sizes.

    ``a1_scale`` / ``a2_scale``: static activation scales of x and of the intermediate
    (``quant="fp8_tensor"`` only, both or neither; :mod:`moe_spec.contract`).
    ``max_experts``: a backend's limit on E (None: no limit), refused naming ``w1``.
    ``data_checks``: None follows :func:`check_mode`; ``"sync"`` reads the data now and raises
    (for callers that index with the ids on the host, such as the oracle); ``"device"`` leaves
    the data to the backend's kernels (see the module docstring).
    """
    key = (quant, max_experts) + tuple(map(_signature, (x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale,
                                                        a1_scale, a2_scale)))
    if None in key[2:] or not (quant is None or type(quant) is str):
        key = None
    dims = _verdicts.get(key) if key is not None else None
    if dims is None:
        dims = _host_checks(x, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale, max_experts,
                            a1_scale, a2_scale)
        if key is not None:
            if len(_verdicts) >= _VERDICTS_MAX:
                _verdicts.clear()
            _verdicts[key] = dims
    mode = _mode if data_checks is None else _mode_from(data_checks, "data_checks")
    if mode == "sync" and not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _data_checks_now(dims, topk_weights, topk_ids, w1_scale, w2_scale, a1_scale, a2_scale)
    return dims

"""The data checks' error word: the device-side half of the contract's checks, and how it reaches the caller.

By default (the ``"device"`` check mode) the data of a call — ids, routing weights, scales — is
checked by the kernels that read it anyway, without a sync: a failed check ORs its bit
(:data:`DATA_CHECKS`) into the device's **error word** (:func:`error_word`, one int32 per device,
sticky). The caller learns of it without a sync from the next call (:func:`surface_errors`, which
each backend's ``fused_moe`` runs) or from :func:`poll`, both of which read a host copy of the
word; :func:`check` reads the word itself (one sync). :func:`guard_routing` is the routing checks
in torch ops. The ``"sync"`` mode (``MOE_CHECK``, :func:`set_check_mode`, :func:`checks`) makes
:func:`moe_spec.validate.validate_moe_args` read the data before any launch instead.
:mod:`moe_spec.contract` tells the whole story.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

import torch

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
    DataCheck(
        1,
        "topk_ids",
        "expected ids in [0, E)",
        "the pair was aligned with its id clamped into range and weighted NaN, so its token's output "
        "row is NaN (under FP8 its intermediate is zeroed: no shared scale sees it)",
    ),
    DataCheck(
        2,
        "topk_ids",
        "expected distinct ids in each token's row",
        "the repeated expert was computed for each slot and summed, as the formula reads",
    ),
    DataCheck(
        4,
        "topk_weights",
        "expected finite routing weights",
        "the non-finite weight multiplied its pair: the token's output row is not finite",
    ),
    DataCheck(
        8,
        "w1_scale",
        "expected finite, positive scales",
        "the scale was used as given (NaN, inf, zero or a sign flip in the output)",
    ),
    DataCheck(
        16,
        "w2_scale",
        "expected finite, positive scales",
        "the scale was used as given (NaN, inf, zero or a sign flip in the output)",
    ),
    DataCheck(
        32,
        "a1_scale",
        "expected a finite, positive static activation scale",
        "the scale was used as given (NaN, inf, zero or a sign flip in the output)",
    ),
    DataCheck(
        64,
        "a2_scale",
        "expected a finite, positive static activation scale",
        "the scale was used as given (NaN, inf, zero or a sign flip in the output)",
    ),
)
BAD_ID, REPEATED_ID, BAD_WEIGHT, BAD_W1_SCALE, BAD_W2_SCALE, BAD_A1_SCALE, BAD_A2_SCALE = (c.bit for c in DATA_CHECKS)

CHECK_MODES = ("device", "sync")


def _mode_from(value: str, name: str) -> str:
    if value not in CHECK_MODES:
        raise ValueError(f"{name}: expected one of {CHECK_MODES}, got {value!r}")
    return value


def _mode_of_environment() -> str | None:
    """``MOE_CHECK``, any case and spacing (``SYNC`` is ``sync``); None when it names no mode — then
    the first call that needs the mode raises, naming ``MOE_CHECK`` (an import never fails on it, so
    ``--help`` and every tool that checks nothing still run)."""
    value = os.environ.get("MOE_CHECK", "device").strip().lower() or "device"
    return value if value in CHECK_MODES else None


_mode = _mode_of_environment()


def check_mode() -> str:
    """The current data-check mode: ``"device"`` (default) or ``"sync"`` (``MOE_CHECK``). ValueError
    naming ``MOE_CHECK`` when the environment's value is none of :data:`CHECK_MODES`."""
    if _mode is None:
        raise ValueError(
            f"MOE_CHECK: expected one of {CHECK_MODES} (any case), got "
            f"{os.environ.get('MOE_CHECK')!r}; fix or unset it (the default is 'device')"
        )
    return _mode


def set_check_mode(mode: str) -> str:
    """Set the data-check mode for the process; returns the previous one (None when ``MOE_CHECK``
    named no mode)."""
    global _mode
    previous, _mode = _mode, _mode_from(mode, "mode")
    return previous


@contextlib.contextmanager
def checks(mode: str):
    """``with checks("sync"): ...`` — the data-check mode inside the block."""
    global _mode
    previous = set_check_mode(mode)
    try:
        yield
    finally:
        _mode = previous  # as it was, a bad MOE_CHECK (None) included


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
                    raise RuntimeError(
                        f"moe_spec.validate.error_word: the error word of {key} is allocated at the "
                        "first call outside a CUDA graph capture; run one call before capturing"
                    )
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
        copy = _copies.get(key)
        if copy is not None and copy[1] is not None:
            torch.cuda.synchronize(key)  # copies of the word still in flight land before it is cleared
        word.zero_()
        if copy is not None:
            copy[0][0] = 0
        first, *more = failed_checks(bits)
        also = f" (also failed: {', '.join(c.argument + ' ' + c.rule for c in more)})" if more else ""
        raise ValueError(
            f"{first.argument}: {first.rule}; a fused_moe call on {key} since the last check broke "
            f"this: {first.effect}{also}"
        )


#: Seconds between two copies of a CUDA device's error word to pinned host memory
#: (:func:`surface_errors`): a copy costs the stream a few microseconds, so calls share one.
COPY_INTERVAL_S = 1e-3

_copies: dict = {}  # device -> [numpy view of the word's host copy, pinned tensor (CUDA) or None, last copy's time]


def _copy_of(device) -> list:
    copy = _copies.get(device)
    if copy is None:
        key = _device_key(device)
        word = error_word(key)
        with _words_lock:
            copy = _copies.get(key)
            if copy is None:
                if key.type == "cuda":
                    pinned = torch.zeros(1, dtype=torch.int32, pin_memory=True)
                    copy = [pinned.numpy(), pinned, float("-inf")]
                else:  # the word is host memory already: read it in place
                    copy = [word.numpy(), None, 0.0]
                _copies[key] = copy
    return copy


def poll(device=None) -> None:
    """Raise what :func:`check` raises if the *host copy* of the error word of ``device`` (default:
    every device with one) shows a failed data check — without a sync: it reads host memory, which
    :func:`surface_errors` refreshes with non-blocking copies (on a CPU, the word itself). So it
    sees what the device had finished a copy ago; only when it raises does it sync (through
    :func:`check`, which clears the word and its copy)."""
    keys = [_device_key(device)] if device is not None else list(_copies)
    for key in keys:
        copy = _copies.get(key)
        if copy is not None and copy[0][0]:
            check(key)
            copy[0][0] = 0  # the word was cleared behind the copy's back (nothing to raise)


def surface_errors(device) -> None:
    """The default mode's error path, called by each backend's ``fused_moe`` once its arguments
    passed: :func:`poll` this device — the call raises the ValueError of an earlier call's failed
    data check, naming the argument, once the device has finished that call and a copy of the word
    has landed — then, on a CUDA device, at most once per :data:`COPY_INTERVAL_S` and never while
    a CUDA graph is being captured, enqueue a non-blocking copy of the word to pinned host memory on
    the current stream (after the earlier calls' kernels). No sync on the way: a dictionary lookup,
    a read of host memory and a clock read per call, a 4-byte copy per interval."""
    copy = _copies.get(device) or _copy_of(device)
    if copy[0][0]:
        poll(device)
    pinned = copy[1]
    if pinned is not None:
        now = time.monotonic()
        if now - copy[2] >= COPY_INTERVAL_S and not torch.cuda.is_current_stream_capturing():
            pinned.copy_(error_word(device), non_blocking=True)
            copy[2] = now


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

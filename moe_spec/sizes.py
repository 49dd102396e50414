"""The layer's sizes and device: one check that every surface of both backends runs.

``fused_moe`` (through :func:`moe_spec.validate.validate_moe_args`), ``fused_experts``, both
warm-ups, the transformers experts forward (``compare.hf_experts``) and the sharded layers
(``compare.distributed``) check a layer's sizes — E, K, I, top_k and the tokens of a call (a
warm-up: the most it covers) — with :func:`check_sizes` and a backend's :class:`Limits`, before they
allocate or compile anything. So they refuse the same layers with the same words; each names its
own argument (:class:`SizeNames`: ``w1`` in ``fused_moe``, ``E`` in a warm-up). A device is parsed
by :func:`as_device` and refused by :func:`check_runs_on` where the backend cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class Limits:
    """What a backend adds to the contract, checked by every surface of it (``fused_moe``,
    ``fused_experts``, ``warmup``, the transformers forward, the sharded layers) with the same words:
    ``max_experts`` (None: no limit), and ``cpu`` — None when the backend runs on CPU tensors, else
    what to do on a CPU instead, the end of a one-line refusal (not a driver's traceback). A backend's
    ``fused_moe`` carries its limits as the attribute ``limits``, so a caller holding only the
    function checks them too."""

    backend: str
    max_experts: int | None = None
    cpu: str | None = None


@dataclass(frozen=True)
class SizeNames:
    """The argument a surface names when it refuses one of the layer's sizes: ``fused_moe`` names the
    tensor a size comes from, a warm-up the size itself. ``matrix`` is the argument of the limit on
    one expert's W1 (2I·K elements); None: whichever of K and I is the larger part of it."""

    E: str
    K: str
    I: str  # noqa: E741  (the domain's name)
    top_k: str
    T: str
    device: str
    matrix: str | None = None


#: ``fused_moe``'s arguments (and so ``fused_experts``', the sharded layers')
CALL_NAMES = SizeNames(E="w1", K="x", I="w2", top_k="topk_weights", T="x", device="x", matrix="w1")
#: ``warmup(E, K, I, top_k, quant, max_tokens, device)``
WARMUP_NAMES = SizeNames(E="E", K="K", I="I", top_k="top_k", T="max_tokens", device="device")


def _int(name, v):
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name}: expected an int, got {v!r} ({type(v).__name__})")


def check_sizes(
    E,
    K,
    I,
    top_k,
    T,
    *,
    limits: Limits | None = None,
    names: SizeNames = CALL_NAMES,  # noqa: E741
    min_tokens: int = 0,
) -> MoEDims:
    """The one check of a layer's sizes, which every surface runs before it allocates or compiles
    anything — so a warm-up, a transformers forward or a sharded layer refuses exactly the sizes
    ``fused_moe`` refuses, with the same words after the argument's name (``names``):

    ints; E ≥ 1, K ≥ 1, I ≥ 1, 1 ≤ top_k ≤ E, T ≥ ``min_tokens`` (a call may be empty, a warm-up's
    ``max_tokens`` may not); the int32 offsets that remain inside the kernels — one expert's W1,
    2I·K elements, and the sorted activation copies, T·top_k·max(K, 2I) elements (W1 and W2 as a
    whole are addressed with 64-bit expert offsets); the backend's ``limits.max_experts``.
    T is the tokens of one call — for a warm-up, the most it covers. Returns the sizes."""
    for size, v in (("E", E), ("K", K), ("I", I), ("top_k", top_k), ("T", T)):
        _int(getattr(names, size), v)
    for size, v, what in (
        ("E", E, "at least 1 expert (E)"),
        ("K", K, "a hidden size K >= 1"),
        ("I", I, "an intermediate size I >= 1"),
    ):
        if v < 1:
            raise ValueError(f"{getattr(names, size)}: expected {what}, got {v}")
    if not 1 <= top_k <= E:
        raise ValueError(f"{names.top_k}: expected 1 <= top_k <= E={E}, got top_k={top_k}")
    if T < min_tokens:
        raise ValueError(f"{names.T}: expected at least {min_tokens} tokens (T), got {T}")
    two_i = 2 * I
    if two_i * K > INT32_MAX:
        name = names.matrix or (names.K if K >= two_i else names.I)
        raise ValueError(
            f"{name}: one expert's matrix holds 2I·K = {two_i}·{K} = {two_i * K} elements, more than "
            f"the int32 offset limit {INT32_MAX} inside an expert; shard the experts (tensor parallel)"
        )
    if T * top_k * max(K, two_i) > INT32_MAX:
        raise ValueError(
            f"{names.T}: the sorted activation copies hold T·top_k·max(K, 2I) = {T}·{top_k}·"
            f"{max(K, two_i)} = {T * top_k * max(K, two_i)} elements, more than the int32 limit "
            f"{INT32_MAX}; pass fewer tokens per call"
        )
    if limits is not None and limits.max_experts is not None and E > limits.max_experts:
        raise ValueError(
            f"{names.E}: at most {limits.max_experts} experts (E) are supported by {limits.backend}, got E={E}"
        )
    return MoEDims(T=T, E=E, K=K, I=I, top_k=top_k)


def as_device(device, name: str = "device") -> torch.device:
    """``device`` (a ``torch.device``, a string such as ``"cuda:1"``, or a CUDA index) as a
    ``torch.device``; TypeError / ValueError naming ``name`` for anything else, and for a CUDA
    device this machine does not have."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"{name}: expected a torch.device, a string such as 'cuda' or 'cpu', or a CUDA index, got {device!r}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name}: expected a device such as 'cuda', 'cuda:1' or 'cpu', got {device!r}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count or (dev.index or 0) >= count:
            raise ValueError(f"{name}: {str(dev)!r} asked for, but this machine has {count} visible CUDA devices")
    return dev


def check_runs_on(device: torch.device, limits: Limits | None, name: str = "x") -> None:
    """Refuse a device the backend cannot run on (``limits.cpu``), naming ``name``: one line that
    says what to do, before anything is launched — for every T, the empty batch included."""
    if limits is not None and limits.cpu is not None and device.type != "cuda":
        raise ValueError(f"{name}: {limits.backend} runs on a CUDA device, got a tensor on {device.type}; {limits.cpu}")

"""Input validation shared by both backends: every bad argument is named before any kernel runs.

:func:`validate_moe_args` checks types, dtypes, shapes, devices, strides, index ranges and scales
against the contract in :mod:`moe_spec.problem`, and returns the problem's sizes. Type problems
raise ``TypeError``; wrong shapes or values raise ``ValueError``. Each message starts with the
argument's name and says what was expected.

Two kinds of checks, in this order:

* on the host, from the tensors' metadata alone (no sync, nothing read): types, dtypes (the weight
  dtype is the format's, :data:`moe_spec.quant.FORMATS`), shapes and scale shapes, the int32
  offset limit, a backend's expert limit, then no meta tensor (a meta tensor has shape but no
  data: it is refused by name before anything tries to read it), one device, contiguity;
* on the data: ids in [0, E), no repeated expert in a row, finite routing weights, finite
  positive scales. These read device memory and so synchronize with the host; they are skipped
  while a CUDA graph is being captured, where a sync is illegal (the graph replays on inputs
  that were validated when it was built).

The activations ``x`` and the weights are not scanned: a NaN or inf there is data, and it
propagates to the output as the oracle says (``notes/numerics.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_spec.quant import get_format

#: Largest element offset a kernel may form in int32 arithmetic.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class MoEDims:
    """Sizes of a validated problem."""

    T: int
    E: int
    K: int
    I: int  # noqa: E741  (the domain's name)
    top_k: int


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


def _scale(name, s, expected_shape, capturing):
    if s is None:
        raise ValueError(f"{name}: required for an fp8 quant format, expected float32 of shape {expected_shape}")
    _tensor(name, s)
    _dtype(name, s, (torch.float32,))
    _shape(name, s, expected_shape)
    _contiguous(name, s)  # kernels index scales as dense row-major arrays
    if not capturing and s.numel() and not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"{name}: expected finite, positive scales")


def validate_moe_args(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None,
                      w2_scale=None, max_experts=None) -> MoEDims:
    """Check every argument of ``fused_moe`` and return the problem's sizes.

    ``max_experts``: a backend's limit on E (None: no limit), refused naming ``w1``.
    """
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

    # Flat offsets a kernel forms: a weight element of the last expert, a token-row element of the
    # sorted (T·k) copies. Larger problems would overflow 32-bit index arithmetic.
    for name, n in (("w1", w1.numel()), ("w2", w2.numel()), ("x", T * top_k * max(K, two_i))):
        if n > INT32_MAX:
            raise ValueError(f"{name}: {n} elements per flat index exceed the int32 offset limit {INT32_MAX}; "
                             "split the problem (fewer tokens per call or tensor-parallel shards)")
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

    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    for name, s, dims in (("w1_scale", w1_scale, (E, two_i, K)), ("w2_scale", w2_scale, (E, K, I))):
        if fmt.quantized:
            _scale(name, s, fmt.weight_scale_shape(*dims), capturing)
        elif s is not None:
            raise ValueError(f"{name}: must be None when quant={quant!r} (bf16 weights carry no scale)")

    if T and not capturing:
        ids = topk_ids.long()
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"topk_ids: expected ids in [0, E={E}), got values in [{lo}, {hi}]")
        if top_k > 1:
            s = ids.sort(dim=1).values
            if bool((s[:, 1:] == s[:, :-1]).any()):
                raise ValueError("topk_ids: an expert appears twice in one token's row; expected distinct ids")
        if not bool(torch.isfinite(topk_weights).all()):
            raise ValueError("topk_weights: expected finite routing weights")
    return MoEDims(T=T, E=E, K=K, I=I, top_k=top_k)

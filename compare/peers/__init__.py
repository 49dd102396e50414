"""The MoE kernels of serving stacks, each behind a small adapter to this project's contract.

A peer is another project's fused-MoE entry point: ``vllm`` (``fused_experts``), ``sglang`` (its
Triton ``fused_experts``), ``flashinfer`` (``cutlass_fused_moe``), ``sonicmoe``
(``moe_general_routing_inputs``). Its adapter module (``compare/peers/<name>.py``) holds:

* ``PEER``: a :class:`Peer` — the package, the entry point, the formats the adapter maps;
* ``load()``: the entry point, imported only now (ImportError when the peer is not installed);
* ``make(entry)``: a function with the contract's signature (``fused_moe(x, w1, w2, topk_weights,
  topk_ids, *, quant, w1_scale, w2_scale)``) that converts our inputs to the peer's layout and calls
  it;
* ``converted(quant)``: one line saying what that conversion does, written into every row.

A conversion of the inputs (a weight layout, a scale's shape, the routing's spelling) is done once per
input tensor and cached (:class:`Converted`): the suite's first call of an input set — numerics, or
the timer's warm-up before it captures its CUDA graph — pays for it, the timed calls do not. Work a
layer must do on every batch (quantizing the activations, for a peer that takes them quantized) stays
in the call and is timed. A format a peer does not take is declined with NotImplementedError before
anything runs, as the contract declines one; ``T = 0`` returns an empty [0, K] output without calling
the peer.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_spec.quant import get_format

#: the named peers, in the order the CLI lists them
PEERS = ("vllm", "sglang", "flashinfer", "sonicmoe")


@dataclass(frozen=True)
class Peer:
    """What an adapter wraps."""

    name: str
    package: str  # what ``pip install`` takes
    entry: str  # "module:function" of the entry point
    quants: tuple  # the contract formats the adapter maps (None: bf16)
    needs_cuda: bool = True

    def declines(self, quant) -> str | None:
        """Why the adapter does not take ``quant`` (None: it does)."""
        if quant in self.quants:
            return None
        taken = ", ".join(get_format(q).label for q in self.quants)
        return f"{self.name}'s adapter maps {taken}, not {get_format(quant).label}"


def adapter(name: str):
    """The adapter module of peer ``name`` (importing it imports nothing of the peer)."""
    if name not in PEERS:
        raise ValueError(f"peer: expected one of {', '.join(PEERS)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def entry_point(peer: Peer) -> Callable:
    """The peer's entry point, imported now (ImportError or AttributeError when it is not there)."""
    module, _, function = peer.entry.partition(":")
    return getattr(importlib.import_module(module), function)


def signature(fn):
    """``fn``'s own signature — not the one ``functools.wraps`` points to, which a wrapper with
    parameters of its own (moe_spec.contract's fused_experts) does not have — unless it takes only
    ``*args, **kwargs`` (a transparent decorator). None when Python cannot read it."""
    import inspect

    try:
        own = inspect.signature(fn, follow_wrapped=False)
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if own.parameters and all(p.kind in variadic for p in own.parameters.values()):
            return inspect.signature(fn)
        return own
    except (TypeError, ValueError):
        return None


def parameters(fn) -> tuple:
    """The parameter names of ``fn`` (:func:`signature`; empty when Python cannot read it)."""
    sig = signature(fn)
    return tuple(sig.parameters) if sig is not None else ()


@functools.lru_cache(maxsize=256)
def _accepted(fn) -> frozenset | None:
    """The keyword names ``fn`` takes; None when it takes any (``**kwargs``) or its signature is unreadable.
    Read once per function: a signature costs tens of µs, which the eager column would count."""
    import inspect

    sig = signature(fn)
    if sig is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return frozenset(sig.parameters)


def takes(fn, **kwargs) -> dict:
    """``kwargs`` cut to the parameters ``fn`` has (every one when it takes ``**kwargs``). A value that
    would be dropped although it asks for something (not None, not False) is refused: a kernel without
    ``per_channel_quant`` cannot be handed a per-channel format silently."""
    accepted = _accepted(fn)
    if accepted is None:
        return kwargs
    lost = [k for k, v in kwargs.items() if k not in accepted and v is not None and v is not False]
    if lost:
        raise NotImplementedError(
            f"{lost[0]}: {getattr(fn, '__name__', 'the kernel')} has no such parameter, so it cannot take this format"
        )
    return {k: v for k, v in kwargs.items() if k in accepted}


def _storages(value) -> set:
    """The storages (data pointers) of every tensor in ``value`` (a tensor, or tuples / lists of them)."""
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    if isinstance(value, (tuple, list)):
        return set().union(*(_storages(v) for v in value)) if value else set()
    return set()


class Converted:
    """Conversions of input tensors, each made once and reused while its tensors live unchanged.

    ``get(tag, tensors, make)`` returns ``make()``'s value for these tensors (identity and version
    counter: an in-place write into one makes it convert again); an entry is dropped as soon as one
    of its tensors is freed, so a case's converted copies go with the case. A value that shares
    storage with its tensors (a view, the tensor itself) is not kept — it would keep them alive —
    and is made again on the next call: such a conversion costs no copy.
    """

    def __init__(self):
        self._entries: dict = {}

    def get(self, tag: str, tensors: tuple, make: Callable):
        key = (tag,) + tuple(id(t) for t in tensors)
        versions = tuple(getattr(t, "_version", None) for t in tensors)
        entry = self._entries.get(key)
        if entry is not None:
            refs, seen, value = entry
            if seen == versions and all(r() is t for r, t in zip(refs, tensors)):
                return value
        value = make()
        if _storages(value) & _storages(tuple(t for t in tensors if isinstance(t, torch.Tensor))):
            return value
        drop = lambda _ref, key=key, entries=self._entries: entries.pop(key, None)  # noqa: E731
        refs = tuple(weakref.ref(t, drop) if isinstance(t, torch.Tensor) else (lambda t=t: t) for t in tensors)
        self._entries[key] = (refs, versions, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)


def empty_output(x: torch.Tensor) -> torch.Tensor:
    """The contract's answer for T = 0: an empty [0, K] bf16 tensor."""
    return torch.empty(0, x.shape[1], dtype=torch.bfloat16, device=x.device)


def split_gate_up(w1: torch.Tensor) -> tuple:
    """(gate rows, up rows) of a [E, 2I, K] W1 (ours: gate rows 0..I-1, then up rows)."""
    half = w1.shape[1] // 2
    return w1[:, :half], w1[:, half:]


def per_channel_3d(scale: torch.Tensor) -> torch.Tensor:
    """A per-channel weight scale [E, N] in the [E, N, 1] layout vLLM and SGLang keep."""
    return scale.reshape(*scale.shape, 1)

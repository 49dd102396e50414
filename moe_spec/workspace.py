"""The buffers a backend's eager calls reuse: one set per (sizes, CUDA stream, thread).

Launches on one stream run in order, so the calls of one stream and thread can share their
intermediate buffers: a call's kernels finish with a buffer before the next call's kernels touch
it, and the returned output is always a new tensor. Two kinds of call take fresh buffers instead:

* a call during a CUDA graph capture: the graph owns what it was captured with, and its replays
  (on one stream) reuse it;
* a call through the backend's torch op (:func:`moe_spec.ops.through_op`) on any stream but the
  device's default one: a CUDA-graph tree (``torch.compile(mode="reduce-overhead")``) runs its
  warm-up on a stream of its own with every allocation in the graph's private pool, and a cached
  buffer left alive there is one the tree does not track. A compiled graph without CUDA graphs
  calls the op on the default stream, as an eager model does, and reuses the cached buffers.

Both backends (the grouped pipelines and the one-launch decode kernels) keep their workspaces in a
:class:`Workspaces`, so the rule is written once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from .ops import through_op


class Workspaces:
    """An LRU map from (sizes, device stream, thread) to the buffers :meth:`get`'s ``make`` built.

    ``capacity`` sets are kept; the least recently used is dropped first (its memory returns to
    torch's allocator once no launch in flight holds it: the stream orders every use before the drop).
    """

    def __init__(self, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: expected at least 1 workspace, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sizes, device, make: Callable[[], dict]) -> dict:
        """The cached buffers of ``sizes`` on ``device`` for this stream and thread, made by
        ``make()`` on first use; fresh (not cached) during a graph capture, and in a call through an
        op on a stream other than the device's default (the module docstring)."""
        device = torch.device(device)
        stream = None
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return make()
            current = torch.cuda.current_stream(device)
            if through_op() and current != torch.cuda.default_stream(device):
                return make()
            stream = current.cuda_stream
        key = (sizes, device, stream, threading.get_ident())
        with self._lock:
            buffers = self._lru.get(key)
            if buffers is None:
                buffers = self._lru[key] = make()
                if len(self._lru) > self.capacity:
                    self._lru.popitem(last=False)
            else:
                self._lru.move_to_end(key)
        return buffers

    def values(self) -> list:
        """The cached buffer sets, least recently used first."""
        with self._lock:
            return list(self._lru.values())

    def clear(self) -> None:
        """Drop every cached set."""
        with self._lock:
            self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)

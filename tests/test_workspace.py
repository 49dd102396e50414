"""moe_spec.workspace.Workspaces, the per-(sizes, stream, thread) buffer cache both backends keep (CPU)."""

import threading

import pytest
import torch

from moe_spec.ops import _op_call
from moe_spec.workspace import Workspaces


def _maker(log: list):
    def make():
        buffers = {"h": torch.empty(4)}
        log.append(buffers)
        return buffers

    return make


def test_same_sizes_reuse_and_new_sizes_make():
    made: list = []
    ws = Workspaces(capacity=4)
    a = ws.get((1, 2), "cpu", _maker(made))
    assert ws.get((1, 2), torch.device("cpu"), _maker(made)) is a
    b = ws.get((1, 3), "cpu", _maker(made))
    assert b is not a and len(made) == 2 and len(ws) == 2


def test_least_recently_used_is_dropped_first():
    made: list = []
    ws = Workspaces(capacity=2)
    first = ws.get("a", "cpu", _maker(made))
    ws.get("b", "cpu", _maker(made))
    assert ws.get("a", "cpu", _maker(made)) is first  # "a" is now the most recent
    ws.get("c", "cpu", _maker(made))  # drops "b"
    assert ws.get("a", "cpu", _maker(made)) is first
    assert len(made) == 3
    ws.get("b", "cpu", _maker(made))
    assert len(made) == 4 and len(ws) == 2


def test_threads_get_their_own_buffers():
    made: list = []
    ws = Workspaces()
    mine = ws.get("s", "cpu", _maker(made))
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(ws.get("s", "cpu", _maker(made))))
    t.start()
    t.join()
    assert theirs[0] is not mine and len(made) == 2


def test_values_and_clear():
    ws = Workspaces()
    a = ws.get("a", "cpu", lambda: {"a": 1})
    b = ws.get("b", "cpu", lambda: {"b": 2})
    assert ws.values() == [a, b]
    ws.clear()
    assert len(ws) == 0 and ws.values() == []


def test_capacity_is_checked():
    with pytest.raises(ValueError, match="capacity"):
        Workspaces(capacity=0)


class _Stream:
    def __init__(self, handle):
        self.cuda_stream = handle

    def __eq__(self, other):
        return self.cuda_stream == other.cuda_stream

    __hash__ = None


@pytest.mark.parametrize("capturing", [False, True])
def test_the_rule_of_a_call_through_the_op(monkeypatch, capturing):
    """On a stand-in CUDA device: an eager call caches; a call through the op caches on the default
    stream (a compiled graph without CUDA graphs) and takes fresh buffers on another stream (a
    CUDA-graph tree's warm-up, whose allocations go to its private pool); a capture always takes
    fresh ones."""
    current = {"stream": _Stream(0)}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: _Stream(0))
    made: list = []
    ws = Workspaces()
    cached = ws.get("s", "cuda", _maker(made))
    _op_call.depth = 1
    try:
        through_default = ws.get("s", "cuda", _maker(made))
        current["stream"] = _Stream(7)
        through_side = ws.get("s", "cuda", _maker(made))
        assert through_side is not cached and through_side is not through_default
    finally:
        _op_call.depth = 0
    eager_side = ws.get("s", "cuda", _maker(made))
    if capturing:
        assert len(ws) == 0 and len(made) == 4  # every call fresh
    else:
        assert through_default is cached and len(made) == 3
        assert eager_side is not cached and ws.get("s", "cuda", _maker(made)) is eager_side  # its stream's set
        assert len(ws) == 2


@pytest.mark.gpu
def test_a_call_through_the_op_on_a_side_stream_gets_fresh_buffers():
    made: list = []
    ws = Workspaces()
    cached = ws.get("s", "cuda", _maker(made))
    _op_call.depth = 1
    try:
        assert ws.get("s", "cuda", _maker(made)) is cached  # the default stream: a compiled graph's call
        with torch.cuda.stream(torch.cuda.Stream()):  # a CUDA-graph tree warms up on its own stream
            assert ws.get("s", "cuda", _maker(made)) is not cached
    finally:
        _op_call.depth = 0
    assert ws.get("s", "cuda", _maker(made)) is cached and len(ws) == 1

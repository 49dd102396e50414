"""The host side of the one-launch decode kernel (:mod:`triton_moe.decode`): its task count and
grid, its self-resetting counter blocks and its workspaces (h, y, under FP8 the E4M3 operands of
phases Q1 and Q2 with their scales and, with ``SPLIT`` > 1, GEMM1's partials and arrival counters).
"""

from __future__ import annotations

import functools
import threading

import torch

from moe_spec.ops import through_op
from moe_spec.quant import FP8_BLOCK as FP8_GROUP
from moe_spec.quant import get_format
from moe_spec.workspace import Workspaces
from triton_moe.config import DecodeConfig
from triton_moe.decode_tasks import HEADER, QUANT_CHUNK

#: The pair lanes the kernel holds in registers (a power of two): the most (token, slot) pairs one
#: launch serves. The path rule (triton_moe.plan.DECODE_MAX_PAIRS) picks the kernel below this.
PAIR_LANES = 64
#: Programs per SM at most (the grid is min(tasks, SMs × this, what shared memory allows)).
PROGRAMS_PER_SM = 2
#: Programs of an interpreted launch: program 0 claims every task, the others exercise the exit.
INTERPRET_PROGRAMS = 3
#: Workspaces kept (least recently used dropped first): one per (sizes, device, stream, thread).
WORKSPACES = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_tasks(T: int, top_k: int, K: int, I: int, quant, static: bool, cfg: DecodeConfig) -> int:  # noqa: E741
    """The tasks of one launch (the kernel's numbering)."""
    P, ntb = T * top_k, _cdiv(T, cfg.BLOCK_T)
    phase0 = ntb if (quant == "fp8_tensor" and not static) else 0
    chunk = QUANT_CHUNK.value
    quantize = T * _cdiv(K, chunk) + P * _cdiv(I, chunk) if get_format(quant).quantized else 0
    return phase0 + quantize + P * _cdiv(I, cfg.BLOCK_N) * cfg.SPLIT + (P + ntb) * _cdiv(K, cfg.block_n2)


def counter_words(K: int, cfg: DecodeConfig) -> int:
    """int32 words of one counter block: the header, done1 and doneq2 per pair lane, done2 per k-tile."""
    return HEADER.value + 2 * PAIR_LANES + _cdiv(K, cfg.block_n2)


@functools.lru_cache(maxsize=16)
def _resident_programs(device_index: int, smem_bytes: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    per_sm = max(1, min(PROGRAMS_PER_SM, props.shared_memory_per_multiprocessor // max(smem_bytes, 1)))
    return props.multi_processor_count * per_sm


def grid_size(tasks: int, quant, cfg: DecodeConfig, device) -> int:
    """min(tasks, the programs that can be resident): SMs × programs per SM as shared memory allows."""
    if device.type != "cuda":
        return min(tasks, INTERPRET_PROGRAMS)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return min(tasks, _resident_programs(index, cfg.smem_bytes(quant)))


_counter_blocks: dict = {}
_counter_lock = threading.Lock()


def counter_block(device, words: int) -> torch.Tensor:
    """The int32 counters of a launch on ``device`` (zeroed once when made; every launch leaves
    them zero). Eager calls use their stream's block (launches on one stream never overlap); a
    call during a CUDA graph capture, or through the torch op, uses the device's graph block,
    made together with the first eager block so that a capture finds it (a graph replays its
    launches in order; two graphs replayed at once on two streams would share it)."""
    graph = device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or through_op())
    stream = None
    if device.type == "cuda" and not graph:
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, "graph" if graph else stream, words)
    block = _counter_blocks.get(key)
    if block is None:
        with _counter_lock:
            block = _counter_blocks.get(key)
            if block is None:
                block = _counter_blocks[key] = torch.zeros(words, dtype=torch.int32, device=device)
                graph_key = (device, "graph", words)
                if graph_key not in _counter_blocks and not graph:
                    _counter_blocks[graph_key] = torch.zeros(words, dtype=torch.int32, device=device)
    return block


def _buffers(T: int, top_k: int, K: int, I: int, quant, device, split: tuple | None) -> dict:  # noqa: E741
    P = T * top_k
    fp8 = get_format(quant).quantized
    b = dict(
        h=torch.empty((P, I), dtype=torch.float32 if fp8 else torch.bfloat16, device=device),
        y=torch.empty((P, K), dtype=torch.bfloat16, device=device),
    )
    if fp8:  # the E4M3 operands of phases Q1 and Q2 and their scales (per row or per 1×128 group)
        b.update(
            xq=torch.empty((T, K), dtype=torch.float8_e4m3fn, device=device),
            xs=torch.empty((T, _cdiv(K, FP8_GROUP)), dtype=torch.float32, device=device),
            hq=torch.empty((P, I), dtype=torch.float8_e4m3fn, device=device),
            hs=torch.empty((P, _cdiv(I, FP8_GROUP)), dtype=torch.float32, device=device),
        )
    if split is not None:  # (SPLIT, n-tiles of I): GEMM1's fp32 partials, its parts arrived per (pair, n-tile)
        b.update(
            part=torch.empty((split[0], P, I), dtype=torch.float32, device=device),
            arrive=torch.zeros(P * split[1], dtype=torch.int32, device=device),  # zeroed once: finishers reset it
        )
    return b


_workspaces = Workspaces(WORKSPACES)


def decode_workspace(T: int, top_k: int, K: int, I: int, quant, device, cfg: DecodeConfig) -> dict:  # noqa: E741
    """h, y and the counters of one call: h and y kept as
    :class:`moe_spec.workspace.Workspaces` says, the counters of :func:`counter_block`. With
    ``SPLIT`` > 1 also ``part`` (fp32 [SPLIT, P, I]) and ``arrive`` (int32 [P · n-tiles of I],
    zero when made; each tile's finisher zeroes its word, so every launch leaves it zero)."""
    counters = counter_block(device, counter_words(K, cfg))
    split = (cfg.SPLIT, _cdiv(I, cfg.BLOCK_N)) if cfg.SPLIT > 1 else None
    sizes = (T, top_k, K, I, quant, device, split)
    return {**_workspaces.get(sizes, device, lambda: _buffers(*sizes)), "counters": counters}

"""Token alignment in Triton: the project's :class:`moe_spec.align.Alignment`, computed fast.

The grouped GEMM gives every program BLOCK_M rows of ONE expert. :func:`align_block_size` sorts
the (token, slot) pairs by expert and pads each expert's run to a multiple of BLOCK_M, entirely on
the device (no host synchronisation, so the whole layer can be captured in a CUDA graph), and
returns the same :class:`~moe_spec.align.Alignment` — ``sorted_ids``, ``expert_of_block``,
``expert_end``, ``num_padded`` — as the reference routine :func:`moe_spec.align.align`, bit for
bit (``tests/test_triton_align.py``). Its buffers have the reference's worst-case size
(:func:`moe_spec.align.max_rows`); the GEMM grid covers that many blocks and programs past
``num_padded`` exit at once.

Three Triton kernels, stable and deterministic (no atomics):

1. ``_count_kernel``: pairs are cut into chunks of CHUNK; each program histograms its chunk into
   ``counts[chunk, e]``.
2. ``_scan_kernel`` (one program, one lane per expert: E ≤ MAX_EXPERTS = 1024): walks the chunks in order keeping a running
   count per expert, which turns ``counts`` into each chunk's offset inside its expert's run;
   then the padded run lengths and their prefix sums: ``expert_start`` (exclusive, internal) and
   ``expert_end`` (inclusive; its last entry is ``num_padded``).
3. ``_scatter_kernel``: pair i of chunk c goes to
   ``expert_start[e] + offset[c, e] + #{earlier pairs of chunk c with the same expert}``;
   the last term is a CHUNK×CHUNK comparison. The same launch labels the M-blocks: block b
   belongs to the expert whose padded run contains row b·BLOCK_M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_spec.align import Alignment, max_rows
from triton_moe.jit import launch

#: Pairs per program in the count and scatter kernels (the rank needs a CHUNK² comparison).
CHUNK = 256
#: Chunks per step of the single-program scan.
SCAN_ROWS = 16
#: M-blocks labelled per program of the scatter launch.
BLOCKS_PER_PROGRAM = 64
#: Largest supported expert count (one program's lanes in the scan).
MAX_EXPERTS = 1024


def check_num_experts(num_experts: int) -> None:
    """The alignment's one limit: the scan keeps one lane per expert in a single program."""
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts: at most {MAX_EXPERTS} experts are supported, got {num_experts}")


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(topk_ids_ptr, counts_ptr, num_pairs, E: tl.constexpr, E_POW2: tl.constexpr,
                  CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_pairs
    experts = tl.load(topk_ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    hist = tl.histogram(experts, E_POW2, mask=valid)
    lanes = tl.arange(0, E_POW2)
    tl.store(counts_ptr + chunk * E + lanes, hist, mask=lanes < E)


@triton.jit(do_not_specialize=["num_chunks"])
def _scan_kernel(counts_ptr, expert_start_ptr, expert_end_ptr, num_chunks, E: tl.constexpr,
                 E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SCAN_ROWS: tl.constexpr):
    lanes = tl.arange(0, E_POW2)
    lane_ok = lanes < E
    running = tl.zeros([E_POW2], dtype=tl.int32)
    for c0 in range(0, num_chunks, SCAN_ROWS):
        rows = c0 + tl.arange(0, SCAN_ROWS)
        ptrs = counts_ptr + rows[:, None] * E + lanes[None, :]
        mask = (rows[:, None] < num_chunks) & lane_ok[None, :]
        c = tl.load(ptrs, mask=mask, other=0)
        # counts → offset of each chunk inside its expert's run (exclusive prefix over chunks)
        offsets = tl.cumsum(c, axis=0) - c + running[None, :]
        tl.store(ptrs, offsets, mask=mask)
        running += tl.sum(c, axis=0)
    padded = tl.cdiv(running, BLOCK_M) * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    tl.store(expert_start_ptr + lanes, end - padded, mask=lane_ok)
    tl.store(expert_end_ptr + lanes, end, mask=lane_ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _scatter_kernel(topk_ids_ptr, offsets_ptr, expert_start_ptr, num_padded_ptr, sorted_ids_ptr,
                    expert_of_block_ptr, num_pairs, num_blocks, E: tl.constexpr, E_POW2: tl.constexpr,
                    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
    pid = tl.program_id(0)

    # Part 1: place the pairs of chunk `pid` (programs past the last chunk skip it).
    idx = tl.arange(0, CHUNK)
    offs = pid * CHUNK + idx
    valid = offs < num_pairs
    experts = tl.load(topk_ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    same_before = (experts[:, None] == experts[None, :]) & (idx[None, :] < idx[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    base = tl.load(expert_start_ptr + experts, mask=valid, other=0)
    chunk_offset = tl.load(offsets_ptr + pid * E + experts, mask=valid, other=0)
    tl.store(sorted_ids_ptr + base + chunk_offset + rank, offs, mask=valid)

    # Part 2: label M-blocks [pid·BLOCKS_PER_PROGRAM, …) with their expert.
    blocks = pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    lanes = tl.arange(0, E_POW2)
    starts = tl.load(expert_start_ptr + lanes, mask=lanes < E, other=2147483647)
    # the expert of row r is the last one whose run starts at or before r (empty runs share a
    # start with the next expert, which is the later one and wins)
    owner = tl.sum((starts[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1) - 1
    num_padded = tl.load(num_padded_ptr)
    owner = tl.where(blocks * BLOCK_M < num_padded, owner, -1)
    tl.store(expert_of_block_ptr + blocks, owner, mask=blocks < num_blocks)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort pairs by expert and pad to ``block_m``: :func:`moe_spec.align.align`'s result, in Triton.

    ``topk_ids`` [T, top_k] int32 or int64 with ids in [0, num_experts). No host sync. Raises
    ValueError before any launch when ``num_experts`` exceeds :data:`MAX_EXPERTS`.
    """
    check_num_experts(num_experts)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    rows = max_rows(num_pairs, num_experts, block_m)
    num_blocks = rows // block_m
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    e_pow2 = triton.next_power_of_2(num_experts)

    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    expert_of_block = torch.empty((num_blocks,), dtype=torch.int32, device=device)
    expert_end = torch.empty((num_experts,), dtype=torch.int32, device=device)
    counts = torch.empty((max(num_chunks, 1), num_experts), dtype=torch.int32, device=device)
    expert_start = torch.empty((num_experts,), dtype=torch.int32, device=device)
    flat_ids = topk_ids.reshape(-1)
    num_padded = expert_end[-1:]

    launch(_count_kernel, (num_chunks,), flat_ids, counts, num_pairs, E=num_experts, E_POW2=e_pow2,
           CHUNK=CHUNK)
    launch(_scan_kernel, (1,), counts, expert_start, expert_end, num_chunks, E=num_experts,
           E_POW2=e_pow2, BLOCK_M=block_m, SCAN_ROWS=SCAN_ROWS)
    grid = (max(num_chunks, triton.cdiv(num_blocks, BLOCKS_PER_PROGRAM)),)
    launch(_scatter_kernel, grid, flat_ids, counts, expert_start, num_padded, sorted_ids, expert_of_block,
           num_pairs, num_blocks, E=num_experts, E_POW2=e_pow2, BLOCK_M=block_m, CHUNK=CHUNK,
           BLOCKS_PER_PROGRAM=BLOCKS_PER_PROGRAM)
    return Alignment(tile=block_m, num_pairs=num_pairs, sorted_ids=sorted_ids, expert_of_block=expert_of_block,
                     expert_end=expert_end)

"""The token alignment every grouped GEMM of this project starts from — the reference routine.

With ``T`` tokens routed to ``top_k`` experts each there are ``P = T·top_k`` (token, slot) pairs;
pair ``p = t·top_k + j`` is token ``t``'s ``j``-th choice, ``topk_ids.flatten()[p]``. A grouped
GEMM wants every expert's pairs in one contiguous run of rows, and every run padded to a multiple
of its row ``tile`` so that each block of ``tile`` rows belongs to one expert. :func:`align` does
that with torch ops, on the CPU or on a GPU, without reading anything back to the host (so it can
be captured in a CUDA graph), and returns an :class:`Alignment`:

``sorted_ids``       int32 [rows]: the pair at each sorted row — the pairs of expert 0 in
                     ascending pair order, padding, expert 1's, … (a stable sort by expert);
                     padding rows and the rows past the used ones hold the sentinel ``P``;
``expert_of_block``  int32 [rows / tile]: the expert owning each block of ``tile`` rows;
                     −1 for the blocks past the used rows;
``expert_end``       int32 [E]: the end (exclusive) of each expert's padded run — the inclusive
                     prefix sum of the padded counts ⌈count_e / tile⌉·tile;
``num_padded``       int32 [1]: the rows in use, ``expert_end[-1]`` (a view of it).

This is vLLM's ``moe_align_block_size`` contract (its ``sorted_token_ids``, ``expert_ids``,
``num_tokens_post_padded``). The host cannot know ``num_padded`` without a sync, so ``rows`` is
the worst case :func:`max_rows`: at most ``min(E, P)`` experts are non-empty and each wastes at
most ``tile − 1`` rows.

Who uses it: ``cute_moe`` runs this routine itself; ``triton_moe.align`` computes the same
:class:`Alignment` with three Triton kernels (faster) and is tested bit for bit against it;
``compare.baselines`` feeds ``torch._grouped_mm`` from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def max_rows(num_pairs: int, num_experts: int, tile: int) -> int:
    """Host-side worst case of the padded row count, rounded up to ``tile``."""
    worst = num_pairs + min(num_experts, num_pairs) * (tile - 1)
    return -(-worst // tile) * tile


@dataclass(frozen=True)
class Alignment:
    """The (token, slot) pairs sorted by expert, each expert's run padded to a multiple of ``tile``
    (the module docstring defines every field). All tensors live on the device of ``topk_ids``."""

    tile: int
    num_pairs: int
    sorted_ids: torch.Tensor
    expert_of_block: torch.Tensor
    expert_end: torch.Tensor

    @property
    def rows(self) -> int:
        """Allocated rows (:func:`max_rows`); the used ones are ``num_padded``."""
        return self.sorted_ids.numel()

    @property
    def num_padded(self) -> torch.Tensor:
        """int32 [1]: the rows in use (a view of ``expert_end[-1]``, never a host value)."""
        return self.expert_end[-1:]

    def row_of_pair(self) -> torch.Tensor:
        """int64 [P]: the sorted row holding each pair (the inverse of ``sorted_ids``)."""
        rows = torch.arange(self.rows, device=self.sorted_ids.device)
        # padding rows all write to the extra slot P, which is dropped: every pair is written once
        inverse = torch.empty(self.num_pairs + 1, dtype=torch.int64, device=self.sorted_ids.device)
        return inverse.scatter_(0, self.sorted_ids.long(), rows)[: self.num_pairs]

    def token_of_row(self, top_k: int) -> torch.Tensor:
        """int64 [rows]: the token feeding each row; ``T`` (one past the last token) at padding rows."""
        return self.sorted_ids.long() // top_k

    def weight_of_row(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """fp32 [rows]: the routing weight of each row's pair; 0 at padding rows."""
        flat = topk_weights.reshape(-1).float()
        return torch.cat([flat, flat.new_zeros(1)])[self.sorted_ids.long()]

    def holds_pair(self) -> torch.Tensor:
        """bool [rows]: the row holds a pair (not padding)."""
        return self.sorted_ids < self.num_pairs


def align(topk_ids: torch.Tensor, num_experts: int, tile: int) -> Alignment:
    """Sort the (token, slot) pairs of ``topk_ids`` [T, top_k] by expert and pad every expert's run
    to a multiple of ``tile`` rows (see the module docstring). No host synchronisation."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    rows = max_rows(num_pairs, num_experts, tile)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + tile - 1) // tile * tile
    expert_end = torch.cumsum(padded, 0)
    run_start = expert_end - padded
    order = torch.argsort(flat, stable=True)  # sorted position -> pair
    expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert]
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, run_start[expert] + rank, order)
    # block b starts at row b·tile; its expert is the first whose run ends after that row
    block_start = torch.arange(0, rows, tile, device=device)
    owner = torch.searchsorted(expert_end, block_start, right=True)
    expert_of_block = torch.where(block_start < expert_end[-1], owner, -1)
    return Alignment(
        tile=tile,
        num_pairs=num_pairs,
        sorted_ids=sorted_ids.to(torch.int32),
        expert_of_block=expert_of_block.to(torch.int32),
        expert_end=expert_end.to(torch.int32),
    )

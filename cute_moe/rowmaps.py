"""The host side of the alignment: the row maps the layer's kernels read, their reference, their buffers.

:func:`sort_rows_on_device` (``moe.sort_rows`` on a GPU) runs the two launches of
:mod:`cute_moe.alignops` and returns a :class:`SortedRows`: the :class:`~moe_spec.align.Alignment`
of the reference routine :func:`moe_spec.align.align`, bit for bit — every expert's pairs in
ascending pair order (a *stable* sort), each run padded to a multiple of ``tile`` with the sentinel
``P``, the rows past the used ones ``P``, the blocks past them −1 — with the maps the later
kernels read, all written by the same launches (one when the pairs fit a single chunk: decode),
without a host synchronisation, so the whole layer can be captured in a CUDA graph:

* ``token_of_row`` int64 [rows]: the token gathered into each row (padding rows: the last token —
  a real, finite row; its weight is 0);
* ``weight_of_row`` fp32 [rows]: the routing weight of each row's pair (padding 0; a pair whose id
  was out of range: NaN);
* ``row_of_pair`` int64 [P]: the row of each pair; ``weight_of_pair`` fp32 [P]: the routing
  weights as the layer uses them (NaN where the id was out of range: the unfused pipeline's
  weighted combine reads them); ``row_mask`` int32 [rows]: 1 where a row holds a pair whose id was
  in range — the rows the FP8 intermediate's amax counts (padding rows and a clamped pair's row
  are skipped: no shared scale sees a bad pair, as ``moe_spec.contract`` says);
* for each GEMM token tile ``t`` (dividing ``tile``): the expert of every ``t``-row block (−1 past
  the used rows) and the number of used blocks, ``num_padded / t``, an int32 device scalar.

The routing data checks of :mod:`moe_spec.validate` run in the same pass, with
:func:`moe_spec.validate.guard_routing`'s meaning: an id outside ``[0, E)``, a repeated id in a
token's row (raw ids compared) and a non-finite routing weight set
:data:`~moe_spec.validate.BAD_ID`, :data:`~moe_spec.validate.REPEATED_ID` and
:data:`~moe_spec.validate.BAD_WEIGHT` in the device's error word; a bad id is clamped into
``[0, E)`` wherever it addresses memory and its pair's weight is NaN, so nothing is read out of
bounds and its token's output row is NaN.  :func:`reference_rows` is all of that in torch ops
(the specification the tests compare the kernels with, and the CPU path).

Host cost: the buffers of one shape are a :class:`RowBuffers`, and ``fused_moe`` keeps one per
(sizes, device, stream, thread) (``moe.py``); the launches take them, and the routing tensors as
two addresses, as they are (:mod:`cute_moe.runtime`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_spec.align import Alignment, align, max_rows
from moe_spec.validate import error_word, guard_routing

from .alignops import CHUNK, GEMM_TILES, ID_DTYPES, MAX_EXPERTS, WARPS, compile_align_kernels, place_ctas
from .runtime import on_gpu


def check_align_args(topk_ids: torch.Tensor, num_experts: int, tile: int) -> None:
    """The host checks of the alignment (TypeError / ValueError naming the argument)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"topk_ids: expected int32 or int64 ids, got {topk_ids.dtype}")
    for name, v in (("num_experts", num_experts), ("tile", tile)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(
            f"num_experts: expected 1 <= num_experts <= {MAX_EXPERTS} (the alignment kernels keep "
            f"a [{WARPS}, E] table of counts in shared memory), got {num_experts}"
        )
    if tile < 1:
        raise ValueError(f"tile: expected a positive row tile, got {tile}")


def check_gemm_tiles(tile: int, gemm_tiles) -> tuple:
    """``gemm_tiles``: GEMM token tiles, each dividing the alignment ``tile`` (a block of a GEMM lies
    inside one expert's run); returns them as a tuple of :data:`GEMM_TILES` (the last repeated)."""
    tiles = tuple(gemm_tiles) if gemm_tiles else (tile,)
    if not 1 <= len(tiles) <= GEMM_TILES:
        raise ValueError(f"gemm_tiles: expected 1 to {GEMM_TILES} token tiles, got {tiles}")
    for t in tiles:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1 or tile % t:
            raise ValueError(f"gemm_tiles: tokens_tile={t} does not divide the alignment tile {tile}")
    return tiles + (tiles[-1],) * (GEMM_TILES - len(tiles))


@dataclass(frozen=True)
class SortedRows:
    """The shared alignment and the row maps the CuTe kernels read (device tensors; the module
    docstring defines each).

    Attributes:
        alignment: :class:`moe_spec.align.Alignment` of the (token, slot) pairs.
        token_of_row: int64 [rows]; weight_of_row: fp32 [rows]; row_of_pair: int64 [T·top_k];
        weight_of_pair: fp32 [T·top_k] (the routing weights, NaN where the id was out of range);
        row_mask: int32 [rows] (1: the row holds a pair whose id was in range).
        blocks: ``{tokens_tile: (expert of every block int32 [rows / tokens_tile], used blocks int32 [1])}``
            for the GEMM token tiles the maps were written for.
    """

    alignment: Alignment
    token_of_row: torch.Tensor
    weight_of_row: torch.Tensor
    row_of_pair: torch.Tensor
    weight_of_pair: torch.Tensor
    row_mask: torch.Tensor
    blocks: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.alignment.rows


def split_blocks(alignment: Alignment, tokens_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of every ``tokens_tile``-row block, used blocks int32 [1]) from an alignment, in torch
    ops: what the place kernel writes for a GEMM tile (the reference; ``moe.gemm_blocks``)."""
    if alignment.tile % tokens_tile:
        raise ValueError(f"tokens_tile={tokens_tile} does not divide the alignment tile {alignment.tile}")
    per_block = alignment.tile // tokens_tile
    experts = alignment.expert_of_block
    if per_block > 1:
        experts = experts.repeat_interleave(per_block)
    return experts, alignment.num_padded // tokens_tile


def reference_rows(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    tile: int,
    gemm_tiles=(),
    word: torch.Tensor | None = None,
) -> SortedRows:
    """What the two launches compute, in torch ops (the specification; the CPU path of
    ``moe.sort_rows``): :func:`moe_spec.validate.guard_routing` (bits into ``word``, default the
    device's error word), :func:`moe_spec.align.align` of the clamped ids, and the maps."""
    check_align_args(topk_ids, num_experts, tile)
    tiles = check_gemm_tiles(tile, gemm_tiles)
    device_word = error_word(topk_ids.device)  # also makes guard_routing's bit constants
    word = device_word if word is None else word
    T, top_k = topk_ids.shape
    ids, weights = guard_routing(topk_ids, topk_weights, num_experts, word)
    al = align(ids, num_experts, tile)
    token_of_row = al.token_of_row(top_k).clamp_(max=max(T - 1, 0))  # the padding sentinel is T
    blocks = {t: split_blocks(al, t) for t in dict.fromkeys(tiles)}
    weight_of_row = al.weight_of_row(weights)
    bad_pair = torch.cat([ids.reshape(-1) != topk_ids.reshape(-1), ids.new_zeros(1, dtype=torch.bool)])
    row_mask = al.holds_pair() & ~bad_pair[al.sorted_ids.long()]  # a clamped pair counts in no amax
    return SortedRows(
        al, token_of_row, weight_of_row, al.row_of_pair(), weights.reshape(-1), row_mask.to(torch.int32), blocks
    )


class RowBuffers:
    """Every output of the two launches for one shape (``T·top_k`` pairs, E, tile, the GEMM tiles)
    on one device: a workspace's row maps.  ``zeroed``: fp32
    elements of ``scratch`` the place kernel zeroes (the FP8 layer's amax buffers).  ``ctas``: the
    place launch's grid (:func:`~cute_moe.alignops.place_ctas` of the sizes; any grid of at least one
    CTA per chunk gives the same maps, which the tests use)."""

    def __init__(self, T: int, top_k: int, num_experts: int, tile: int, gemm_tiles, device, zeroed: int = 0):
        check_align_args(torch.empty(0, dtype=torch.int32), num_experts, tile)
        self.shape = (T, top_k, num_experts, tile, check_gemm_tiles(tile, gemm_tiles))
        self.tiles = self.shape[-1]
        P = T * top_k
        rows = max_rows(P, num_experts, tile)
        new = lambda n, dtype=torch.int32: torch.empty(n, dtype=dtype, device=device)  # noqa: E731
        self.ctas = place_ctas(P, rows) if P else 0
        self.counts = new(max(-(-P // CHUNK), 1) * num_experts)
        self.block_counts = new(GEMM_TILES)
        self.scratch = new(max(zeroed, 1), torch.float32)
        self.out = dict(
            sorted_ids=new(rows),
            expert_of_block=new(rows // tile),
            expert_end=new(num_experts),
            token_of_row=new(rows, torch.int64),
            weight_of_row=new(rows, torch.float32),
            row_of_pair=new(P, torch.int64),
            weight_of_pair=new(P, torch.float32),
            row_mask=new(rows),
            blocks0=new(rows // self.tiles[0]),
            blocks1=new(rows // self.tiles[1]),
        )
        o = self.out
        al = Alignment(
            tile=tile,
            num_pairs=P,
            sorted_ids=o["sorted_ids"],
            expert_of_block=o["expert_of_block"],
            expert_end=o["expert_end"],
        )
        blocks = {}
        for i, t in enumerate(self.tiles):
            blocks.setdefault(t, (o[f"blocks{i}"], self.block_counts[i : i + 1]))
        self.rows = SortedRows(
            al, o["token_of_row"], o["weight_of_row"], o["row_of_pair"], o["weight_of_pair"], o["row_mask"], blocks
        )

    def outputs(self) -> tuple:
        """The place kernel's output buffers, in its argument order (``counts`` … ``scratch``)."""
        o = self.out
        return (
            self.counts,
            o["sorted_ids"],
            o["expert_of_block"],
            o["expert_end"],
            o["token_of_row"],
            o["weight_of_row"],
            o["row_of_pair"],
            o["weight_of_pair"],
            o["row_mask"],
            o["blocks0"],
            o["blocks1"],
            self.block_counts,
        )


def launch_rows(topk_ids: torch.Tensor, topk_weights: torch.Tensor, bufs: RowBuffers, word: torch.Tensor) -> SortedRows:
    """The launches on the current stream (launch 1 only for more than one chunk) into ``bufs``.

    ``topk_ids`` [T, top_k] int32/int64 and ``topk_weights`` fp32 [T, top_k], contiguous, on the
    CUDA device of ``bufs`` with its shape; ``word``: the error word (int32 [1]).  Checked on the host,
    naming the argument, before any launch."""
    T, top_k, num_experts, tile, tiles = bufs.shape
    routing = (("topk_ids", topk_ids, tuple(ID_DTYPES)), ("topk_weights", topk_weights, (torch.float32,)))
    for name, t, dtypes in routing:
        if t.dtype not in dtypes or tuple(t.shape) != (T, top_k) or not t.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous [{T}, {top_k}] tensor of {dtypes}, got {t.dtype} "
                f"{list(t.shape)} (strides {t.stride()})"
            )
    for name, t, _ in routing:
        if not on_gpu(t) or t.device != bufs.counts.device:
            raise ValueError(
                f"{name}: the alignment kernels run on the CUDA device of the buffers "
                f"({bufs.counts.device}), got a tensor on {t.device}"
            )
    if word.dtype != torch.int32 or word.numel() != 1 or word.device != bufs.counts.device:
        raise ValueError(f"word: expected the int32 [1] error word on {bufs.counts.device}")
    P = T * top_k
    if P == 0:  # no pairs: every run is empty, nothing to sort, nothing to check
        bufs.out["expert_end"].zero_()
        bufs.block_counts.zero_()
        bufs.scratch.zero_()
        return bufs.rows
    if bufs.ctas < -(-P // CHUNK):
        raise ValueError(f"bufs.ctas: the place launch needs a CTA per chunk of {CHUNK} pairs, got {bufs.ctas}")
    kernels = compile_align_kernels(topk_ids.dtype)
    place_rows(kernels["count"], kernels["place"], topk_ids.data_ptr(), topk_weights.data_ptr(), bufs, word)
    return bufs.rows


def place_rows(count, place, ids: int, weights: int, bufs: RowBuffers, word: torch.Tensor) -> None:
    """The launches of :func:`launch_rows` without its checks (``fused_moe``'s, whose validated
    sizes imply them): ``count`` and ``place`` the compiled launches for the ids' dtype, ``ids``
    and ``weights`` the routing tensors' addresses, ``bufs`` of at least one pair."""
    T, top_k, num_experts, tile, tiles = bufs.shape
    P = T * top_k
    if P > CHUNK:  # a single chunk: launch 2 counts it itself
        count(ids, P, bufs.counts, num_experts)
    place(ids, weights, P, *bufs.outputs(), word, bufs.scratch, num_experts, tile, top_k, tiles[0], tiles[1], bufs.ctas)


def sort_rows_on_device(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    tile: int,
    gemm_tiles=(),
    *,
    word: torch.Tensor | None = None,
    buffers: RowBuffers | None = None,
) -> SortedRows:
    """:func:`reference_rows` computed by the two kernels of this module, bit for bit.

    On a CUDA device: at most two launches on the current stream, no host sync, CUDA-graph
    capturable; ``buffers`` (a :class:`RowBuffers` of this shape) are reused, else new ones are
    made.  Elsewhere (the CPU has no CuTe launches) :func:`reference_rows` runs instead.  Raises
    TypeError / ValueError naming a bad argument before any launch."""
    check_align_args(topk_ids, num_experts, tile)
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected a 2-D [T, top_k] tensor, got shape {tuple(topk_ids.shape)}")
    T, top_k = topk_ids.shape
    shape = (T, top_k, num_experts, tile, check_gemm_tiles(tile, gemm_tiles))
    if buffers is not None and buffers.shape != shape:
        raise ValueError(f"buffers: made for (T, top_k, E, tile, gemm tiles) = {buffers.shape}, the call has {shape}")
    if not on_gpu(topk_ids):
        return reference_rows(topk_ids, topk_weights, num_experts, tile, gemm_tiles, word)
    if buffers is None:
        buffers = RowBuffers(T, top_k, num_experts, tile, gemm_tiles, topk_ids.device)
    return launch_rows(topk_ids, topk_weights, buffers, error_word(topk_ids.device) if word is None else word)


def align_on_device(topk_ids: torch.Tensor, num_experts: int, tile: int) -> Alignment:
    """:func:`moe_spec.align.align` by the two kernels (the alignment alone, for its benchmark and
    tests): ids outside [0, E) are clamped into range, as the layer aligns them; the data checks
    go into a word of its own (never the device's error word), the weights are zeros (a fill).
    ``topk_ids`` of any shape: its elements in order are the pairs.  On the CPU: the reference."""
    check_align_args(topk_ids, num_experts, tile)
    if not on_gpu(topk_ids):
        return align(topk_ids.clamp(0, num_experts - 1), num_experts, tile)
    ids = topk_ids.reshape(-1, 1) if topk_ids.dim() != 2 else topk_ids.contiguous()
    weights = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    word = torch.zeros(1, dtype=torch.int32, device=ids.device)
    return sort_rows_on_device(ids, weights, num_experts, tile, word=word).alignment

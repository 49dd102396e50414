"""The persistent tile order of the grouped GEMM, shared by its producers and its consumers."""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402


def tile_coordinates(tile, n_token_blocks, n_weight_blocks, group_tokens: int):
    """Rasterization: persistent tile id → (token block, weight block).

    Tile ids walk ``group_tokens`` token blocks (fastest) before the next weight block, one group
    of token blocks at a time, so the CTAs resident together share a few weight tiles and token
    blocks through L2. The producer and the consumers both call this — they must agree on every
    tile — and it is traced inline into the kernel (plain arithmetic on DSL integers).
    """
    group_span = group_tokens * n_weight_blocks
    first_block = (tile // group_span) * group_tokens
    group_size = cutlass.min(n_token_blocks - first_block, group_tokens)
    in_group = tile % group_span
    return first_block + in_group % group_size, in_group // group_size

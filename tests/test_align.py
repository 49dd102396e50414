"""moe_spec.align, the reference alignment: its invariants on varied routings (CPU)."""

import pytest
import torch

from moe_spec.align import align, max_rows


def routing(T, top_k, E, seed, skew=False):
    """[T, top_k] distinct expert ids per row; ``skew`` piles the tokens onto a few experts."""
    g = torch.Generator().manual_seed(seed)
    if skew:
        logits = torch.randn(T, E, generator=g) - 6.0 * torch.arange(E) / E
        return logits.topk(top_k, dim=1).indices.to(torch.int32)
    return (
        torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
        if T
        else torch.zeros(0, top_k, dtype=torch.int32)
    )


CASES = [
    (0, 2, 4, 16),
    (1, 1, 4, 16),
    (1, 8, 512, 16),
    (5, 2, 8, 1),
    (37, 2, 8, 16),
    (37, 4, 16, 8),
    (64, 8, 8, 64),
    (300, 8, 64, 64),
    (130, 2, 6, 48),
]


@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("T, top_k, E, tile", CASES)
def test_every_pair_sits_once_in_its_expert_s_padded_run(T, top_k, E, tile, skew):
    ids = routing(T, top_k, E, seed=T + E, skew=skew and T > 0)
    al = align(ids, E, tile)
    P = T * top_k
    flat = ids.flatten().tolist()
    ends = al.expert_end.tolist()
    assert al.sorted_ids.dtype == al.expert_of_block.dtype == al.expert_end.dtype == torch.int32
    assert al.rows == max_rows(P, E, tile) and al.rows % tile == 0 and al.num_pairs == P
    assert int(al.num_padded) == ends[-1] <= al.rows
    sorted_ids = al.sorted_ids.tolist()
    start = 0
    for e, end in enumerate(ends):
        mine = [p for p in range(P) if flat[p] == e]  # expert e's pairs, in pair order
        run = sorted_ids[start:end]
        assert (end - start) % tile == 0 and len(mine) <= end - start < len(mine) + tile
        assert run == mine + [P] * (end - start - len(mine))  # stable, then the sentinel
        blocks = al.expert_of_block[start // tile : end // tile].tolist()
        assert blocks == [e] * ((end - start) // tile)
        start = end
    assert sorted_ids[start:] == [P] * (al.rows - start)
    assert al.expert_of_block[start // tile :].tolist() == [-1] * (al.rows // tile - start // tile)


@pytest.mark.parametrize("T, top_k, E, tile", CASES[1:])
def test_row_maps(T, top_k, E, tile):
    ids = routing(T, top_k, E, seed=3)
    al = align(ids, E, tile)
    w = torch.rand(T, top_k, generator=torch.Generator().manual_seed(1))
    rows = al.row_of_pair()
    assert rows.dtype == torch.int64 and rows.shape == (T * top_k,)
    assert torch.equal(al.sorted_ids[rows].long(), torch.arange(T * top_k))  # the inverse of sorted_ids
    holds = al.holds_pair()
    assert int(holds.sum()) == T * top_k and bool(holds[rows].all())
    tokens, weights = al.token_of_row(top_k), al.weight_of_row(w)
    assert torch.equal(tokens[rows], torch.arange(T).repeat_interleave(top_k))
    assert bool((tokens[~holds] == T).all())  # padding reads one past the last token
    assert torch.equal(weights[rows], w.flatten()) and bool((weights[~holds] == 0).all())


def test_max_rows_is_reached_by_the_worst_routing():
    # every expert gets one pair more than a multiple of the tile: each run wastes tile − 1 rows
    E, tile = 6, 16
    ids = torch.tensor([e for e in range(E) for _ in range(tile + 1)], dtype=torch.int32)[:, None]
    al = align(ids, E, tile)
    assert int(al.num_padded) == al.rows == max_rows(ids.numel(), E, tile) == ids.numel() + E * (tile - 1)


def test_int64_ids_and_one_expert():
    ids = torch.full((70, 1), 5, dtype=torch.int64)
    al = align(ids, 16, 16)
    assert int(al.num_padded) == 80 and al.sorted_ids[:70].tolist() == list(range(70))
    assert al.expert_of_block[:5].tolist() == [5] * 5 and al.expert_end.tolist() == [0] * 5 + [80] * 11

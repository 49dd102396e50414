"""triton_moe.align against a torch reference: stable sort by expert, padding, block labels."""

import pytest
import torch

from triton_moe.align import MAX_EXPERTS, align_block_size, max_padded_size

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")


def reference(topk_ids, E, block_m):
    """vLLM's moe_align_block_size contract in plain torch (stable within an expert)."""
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    sorted_ids, expert_ids = [], []
    for e in range(E):
        pairs = (flat == e).nonzero().squeeze(1).tolist()
        if not pairs:
            continue
        padded = -(-len(pairs) // block_m) * block_m
        sorted_ids += pairs + [P] * (padded - len(pairs))
        expert_ids += [e] * (padded // block_m)
    return sorted_ids, expert_ids


@pytest.mark.parametrize("T, top_k, E, block_m", [
    (1, 1, 4, 16),      # a single pair
    (1, 8, 512, 16),    # E = 512, almost all experts empty
    (37, 2, 8, 16),     # T not a multiple of anything
    (300, 8, 64, 64),   # several chunks of 256 pairs: offsets carried across chunks
    (3000, 8, 256, 32), # 24 000 pairs, 94 chunks (more than one scan step)
])
def test_alignment_matches_reference(T, top_k, E, block_m):
    gen = torch.Generator().manual_seed(T * E + top_k)
    topk_ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).to(torch.int32)
    sorted_ids, expert_ids, num_padded = align_block_size(topk_ids, E, block_m)
    ref_sorted, ref_experts = reference(topk_ids, E, block_m)
    n = int(num_padded)
    assert n == len(ref_sorted)
    assert sorted_ids.numel() == max_padded_size(T * top_k, E, block_m) >= n
    assert sorted_ids[:n].tolist() == ref_sorted
    assert (sorted_ids[n:] == T * top_k).all()  # sentinel beyond the padded total
    nb = n // block_m
    assert expert_ids[:nb].tolist() == ref_experts
    assert (expert_ids[nb:] == -1).all()


def test_skewed_routing_int64_ids():
    # every token on expert 5 (int64 ids): one long run, all other experts empty
    topk_ids = torch.full((70, 1), 5, dtype=torch.int64)
    sorted_ids, expert_ids, num_padded = align_block_size(topk_ids, 16, 16)
    assert int(num_padded) == 80
    assert sorted_ids[:70].tolist() == list(range(70)) and (sorted_ids[70:] == 70).all()
    assert expert_ids[:5].tolist() == [5] * 5


def test_max_experts():
    # E = MAX_EXPERTS, the scan's widest program: pairs on the first and the last experts
    topk_ids = torch.tensor([[1023, 0], [1022, 1023]], dtype=torch.int32)
    sorted_ids, expert_ids, num_padded = align_block_size(topk_ids, MAX_EXPERTS, 16)
    assert int(num_padded) == 3 * 16
    assert sorted_ids[:48].tolist() == [1] + [4] * 15 + [2] + [4] * 15 + [0, 3] + [4] * 14
    assert expert_ids[:3].tolist() == [0, 1022, 1023] and (expert_ids[3:] == -1).all()


def test_more_experts_than_supported_is_named_before_any_launch():
    from moe_spec.problem import MoEShape, make_inputs
    from triton_moe import fused_moe
    from triton_moe.jit import count_compilations

    inp = make_inputs(MoEShape("wide", MAX_EXPERTS + 1, 2, 16, 16, "test: one expert too many"), 3)
    with count_compilations(dry_run=True) as counter, pytest.raises(ValueError, match="^w1: at most 1024 experts"):
        fused_moe(**inp.kwargs())
    assert counter.total() == 0

"""triton_moe.align (Triton kernels, the interpreter on the CPU) is the reference alignment
(moe_spec.align) bit for bit, over varied routings."""

import pytest
import torch

from moe_spec.align import align
from triton_moe.align import CHUNK, MAX_EXPERTS, align_block_size

from test_align import routing

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

FIELDS = ("tile", "num_pairs", "sorted_ids", "expert_of_block", "expert_end")


def assert_same(got, want):
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert a == b, name
    assert torch.equal(got.num_padded, want.num_padded)


@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("T, top_k, E, block_m", [
    (0, 2, 4, 16),      # no pairs at all
    (1, 1, 4, 16),      # a single pair
    (1, 8, 512, 16),    # E = 512, almost all experts empty
    (37, 2, 8, 16),     # T not a multiple of anything
    (5, 3, 7, 64),      # a block much larger than any run
    (300, 8, 64, 64),   # several chunks of 256 pairs: offsets carried across chunks
    (3000, 8, 256, 32), # 24 000 pairs, 94 chunks (more than one scan step)
])
def test_alignment_is_the_reference(T, top_k, E, block_m, skew):
    topk_ids = routing(T, top_k, E, seed=T * E + top_k, skew=skew and T > 0)
    assert_same(align_block_size(topk_ids, E, block_m), align(topk_ids, E, block_m))


def test_int64_ids_and_one_long_run():
    topk_ids = torch.full((CHUNK + 70, 1), 5, dtype=torch.int64)  # one run across two chunks
    assert_same(align_block_size(topk_ids, 16, 16), align(topk_ids, 16, 16))


def test_max_experts():
    # E = MAX_EXPERTS, the scan's widest program: pairs on the first and the last experts
    topk_ids = torch.tensor([[1023, 0], [1022, 1023]], dtype=torch.int32)
    got = align_block_size(topk_ids, MAX_EXPERTS, 16)
    assert_same(got, align(topk_ids, MAX_EXPERTS, 16))
    assert got.expert_of_block[:3].tolist() == [0, 1022, 1023] and int(got.num_padded) == 3 * 16


def test_more_experts_than_supported_is_named_before_any_launch():
    from moe_spec.problem import MoEShape, make_inputs
    from triton_moe import fused_moe
    from triton_moe.jit import count_compilations

    for T in (3, 0):  # refused whatever T, before any launch
        inp = make_inputs(MoEShape("wide", MAX_EXPERTS + 1, 2, 16, 16, "test: one expert too many"), T)
        with count_compilations(dry_run=True) as counter, pytest.raises(ValueError, match="^w1: at most 1024 experts"):
            fused_moe(**inp.kwargs())
        assert counter.total() == 0

"""compare.baselines: the grouped layout, and both torch baselines against the oracle."""

import pytest
import torch

from compare import metrics
from compare.baselines import GROUP_ALIGN, group_by_expert, grouped_fused_moe, loop_fused_moe
from moe_spec.oracle import oracle
from moe_spec.problem import MoEShape, make_inputs

SMALL = MoEShape("small", num_experts=8, top_k=2, hidden=256, intermediate=128, source="test")


@pytest.mark.parametrize("T, k, E", [(1, 1, 4), (5, 2, 8), (37, 4, 16), (64, 8, 8)])
def test_groups_are_the_reference_alignment_at_the_cutlass_multiple(T, k, E):
    """torch._grouped_mm reads group ends that are multiples of GROUP_ALIGN (16 rows, CUTLASS);
    the groups are the project's one alignment (moe_spec.align), and padding rows read the zero row T."""
    from moe_spec.align import align

    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(T)])
    layout = group_by_expert(ids, E)
    want = align(ids, E, GROUP_ALIGN)
    assert layout.tile == GROUP_ALIGN and torch.equal(layout.sorted_ids, want.sorted_ids)
    assert bool((layout.expert_end % GROUP_ALIGN == 0).all()) and layout.expert_end.dtype == torch.int32
    assert bool((layout.token_of_row(k)[~layout.holds_pair()] == T).all())


@pytest.mark.parametrize("fused", [loop_fused_moe, grouped_fused_moe])
@pytest.mark.parametrize("T", [1, 9, 40])
def test_bf16_baselines_match_the_oracle(fused, T):
    inputs = make_inputs(SMALL, T, None, seed=T)
    out = fused(**inputs.kwargs())
    assert out.dtype == torch.bfloat16 and out.shape == (T, SMALL.hidden)
    assert metrics.check(metrics.errors(out, oracle(**inputs.kwargs())), None) == (True, "ok")
    assert metrics.bitwise_equal(out, fused(**inputs.kwargs()))


@pytest.mark.parametrize("fused", [loop_fused_moe, grouped_fused_moe])
def test_zero_tokens(fused):
    inputs = make_inputs(SMALL, 0, None, seed=0)
    assert fused(**inputs.kwargs()).shape == (0, SMALL.hidden)


def test_grouped_refuses_block_scales_by_name():
    inputs = make_inputs(SMALL, 4, "fp8_block", seed=0)
    with pytest.raises(NotImplementedError, match="row-wise"):
        grouped_fused_moe(**inputs.kwargs())


def test_baselines_validate_arguments():
    inputs = make_inputs(SMALL, 4, None, seed=0)
    with pytest.raises(TypeError, match="x"):
        loop_fused_moe(**{**inputs.kwargs(), "x": inputs.x.float()})

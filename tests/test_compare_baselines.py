"""compare.baselines: the grouped layout, and both torch baselines against the oracle."""

import pytest
import torch

from compare import metrics
from compare.baselines import GROUP_ALIGN, grouped_fused_moe, group_by_expert, loop_fused_moe
from moe_spec.oracle import oracle
from moe_spec.problem import MoEShape, make_inputs

SMALL = MoEShape("small", num_experts=8, top_k=2, hidden=256, intermediate=128, source="test")


@pytest.mark.parametrize("T, k, E", [(1, 1, 4), (5, 2, 8), (37, 4, 16), (64, 8, 8)])
def test_group_by_expert_layout(T, k, E):
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(T)])
    layout = group_by_expert(ids, E)
    flat = ids.reshape(-1)
    ends = layout.offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    assert layout.rows == T * k + E * (GROUP_ALIGN - 1)
    assert bool((ends - starts >= 0).all()) and bool(((ends - starts) % GROUP_ALIGN == 0).all())
    for p in range(T * k):
        row, e = int(layout.row_of_pair[p]), int(flat[p])
        assert starts[e] <= row < ends[e]  # the pair sits in its expert's group
        assert int(layout.token_of_row[row]) == p // k
    assert int(layout.valid.sum()) == T * k
    assert bool((layout.token_of_row[~layout.valid] == T).all())  # padding reads the zero row
    # within an expert, pairs keep their original order (a stable sort)
    for e in range(E):
        rows = layout.row_of_pair[flat == e]
        assert bool((rows[1:] > rows[:-1]).all())


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

"""The routing statistics notes/problem.md states for Mixtral decode (8 tokens, top-2 of 8 experts)."""

import math

import torch

from moe_spec.problem import get_shape, make_inputs, route

MIXTRAL = get_shape("mixtral-8x7b")
T = 8


def _exact():
    E, k = MIXTRAL.num_experts, MIXTRAL.top_k
    pairs = math.comb(E, k)
    idle = lambda n: (math.comb(E - n, k) / pairs) ** T  # noqa: E731  P(n given experts all idle)
    p_all = sum((-1) ** j * math.comb(E, j) * idle(j) for j in range(E + 1))
    return E * (1 - idle(1)), p_all


def test_expected_hits_and_all_hit_probability():
    mean, p_all = _exact()
    assert round(mean, 2) == 7.20 and round(p_all, 3) == 0.375
    # the same from route() on i.i.d. N(0, 1) logits, as make_inputs draws them (20,000 batches at once)
    g = torch.Generator().manual_seed(0)
    ids = route(torch.randn(20_000 * T, MIXTRAL.num_experts, generator=g), MIXTRAL.top_k)[1].long()
    hit = torch.zeros(20_000, MIXTRAL.num_experts).scatter_(1, ids.view(20_000, T * MIXTRAL.top_k), 1).sum(1)
    assert abs(hit.mean().item() - mean) < 0.02
    assert abs((hit == MIXTRAL.num_experts).float().mean().item() - p_all) < 0.015


def test_the_timed_routings_hit_every_expert():
    # compare and cute_moe.lab.bench pass their own weights, so make_inputs draws x then the logits
    none = (torch.empty(0), torch.empty(0))
    for seed in (0, 1):
        ids = make_inputs(MIXTRAL, T, seed=seed, weights_bf16=none).topk_ids
        assert ids.unique().numel() == MIXTRAL.num_experts

"""GPU lane: cluster multicast of the weight tile (``GemmConfig.cluster = 2``, :mod:`cute_moe.gemm_parts`).

A cluster of two CTAs loads a shared weight tile once (half each, multicast into both) when its two
token blocks are one expert's, and each its own box otherwise; the odd last block is computed twice
and stored once.  None of that may change a byte: the cluster kernel must give the single-CTA
kernel's output bit for bit, on routings that exercise every case.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from test_cute_gpu import TOL, _dims, _inputs, shapes  # noqa: E402,F401  (shapes: the module fixture)

from moe_spec.oracle import oracle, rel_l2  # noqa: E402

pytestmark = pytest.mark.gpu


def _configs():
    from cute_moe.plan import choose_config

    gemm1 = choose_config(1024, 768, 2048, gated=True).replace(gather_rows=True)  # the prefill GEMM1
    gemm2 = choose_config(1024, 2048, 768, row_scale=True)  # the prefill GEMM2: 128 × 256
    plain = choose_config(1024, 640, 2048)  # TMA token tiles, no gate
    return {"gemm1-gated-gather": gemm1, "gemm2-row-scale": gemm2, "plain": plain}


COUNTS = {
    # 1, 0, 1, 3, 1, 2, 1, 2 blocks of 128: 11 in all (an odd last block), pairs straddling experts
    "mixed": [37, 0, 5, 300, 1, 129, 64, 130],
    "one-expert": [1000, 0],  # 8 blocks of one expert: every pair shares its weight tile
    "one-block": [0, 3],  # a single block: rank 1 of the only cluster computes it again and stores nothing
}


@pytest.mark.parametrize("ctas", [None, 5], ids=["grid-sms", "grid-5"])
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("name", list(_configs()))
def test_cluster_is_the_single_cta_kernel_bit_for_bit(name, counts, ctas, monkeypatch):
    """Same bytes as cluster = 1 on every row both write; reruns identical; fp32 torch agrees.  With 5
    CTAs the launch takes 4 (two clusters), each walking many tiles and wrapping its ring."""
    import cute_moe.moe as moe
    from cute_moe.moe import grouped_gemm, sort_rows

    one = _configs()[name]
    two = one.replace(cluster=2)
    if ctas is not None:
        monkeypatch.setattr(moe, "sm_count", lambda device=None: ctas)
    counts = COUNTS[counts]
    gated, gather = one.gated, one.gather_rows
    n_out, k = (200 if gated else 328), 640
    g = torch.Generator(device="cuda").manual_seed(5)
    E = len(counts)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).cuda()
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(5)).cuda()]
    T = ids.numel()
    weights = torch.rand(T, 1, device="cuda", generator=g)
    rows = sort_rows(ids.view(T, 1), weights, E, one.tokens_tile)
    used = int(rows.alignment.num_padded)
    x = torch.randn(T, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, (2 if gated else 1) * n_out, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    xs = x if gather else x.index_select(0, rows.token_of_row)
    scale = rows.weight_of_row if one.row_scale else None
    a = grouped_gemm(xs, w, rows, one, row_scale=scale)
    b = grouped_gemm(xs, w, rows, two, row_scale=scale)
    again = grouped_gemm(xs, w, rows, two, row_scale=scale)
    assert torch.equal(a[:used].view(torch.int16), b[:used].view(torch.int16))
    assert torch.equal(b[:used].view(torch.int16), again[:used].view(torch.int16))
    h = torch.einsum("tk,tnk->tn", x.float(), w.float()[ids.long()])
    ref = torch.nn.functional.silu(h[:, :n_out]) * h[:, n_out:] if gated else h
    if one.row_scale:
        ref = ref * weights
    assert rel_l2(b.index_select(0, rows.row_of_pair), ref) < TOL


@pytest.mark.parametrize("spec", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"])
def test_cluster_layer_is_the_plans_layer_bit_for_bit(shapes, spec):  # noqa: F811
    """The bf16 prefill layer (T = 4096) with its cooperative GEMMs on clusters of two gives the plan's
    bytes and meets the oracle (DeepSeek-V3 TP8's GEMM2 is ping-pong in the plan: kept)."""
    import cute_moe

    inp = _inputs(shapes, spec, 4096, seed=41)
    p = cute_moe.plan(_dims(inp))
    clustered = tuple(g if g.pingpong else g.replace(cluster=2) for g in (p.gemm1, p.gemm2))
    out = cute_moe.fused_moe(**inp.kwargs())
    mc = cute_moe.fused_moe(**inp.kwargs(), configs=clustered)
    assert torch.equal(out.view(torch.int16), mc.view(torch.int16))
    assert rel_l2(mc, oracle(**inp.kwargs())) < TOL

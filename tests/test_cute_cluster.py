"""Cluster multicast of the weight tile (``GemmConfig.cluster``, bf16 and FP8) in the PTX the CPU compiles: the
weight boxes — and only they — go out with ``.multicast::cluster``; the consumers release a slot in
both CTAs of the cluster (a remote mbarrier arrive through ``mapa``); the cluster barrier orders the
barrier initialization; a config without a cluster has none of it.  The GPU lane checks the bytes
(``tests/test_cute_cluster_gpu.py``)."""

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cute_moe = pytest.importorskip("cute_moe")

from cute_moe.config import GemmConfig  # noqa: E402
from cute_moe.plan import choose_config  # noqa: E402

LOAD = re.compile(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::(?:cta|cluster)\.global\S*")  # TMA loads


def _configs():
    """The bf16 prefill GEMMs, a plain one, and the FP8 plan's prefill GEMMs (Qwen3-30B-A3B fp8_block T = 4096:
    the gated GEMM1 with the intermediate's amax in its epilogue, GEMM2 with the routing weights)."""
    from moe_spec.validate import MoEDims

    gemm1 = choose_config(1024, 768, 2048, gated=True).replace(gather_rows=True)
    fp8 = cute_moe.plan(MoEDims(T=4096, E=128, K=2048, I=768, top_k=8), "fp8_block")
    return {
        "gemm1-gated-gather": gemm1,
        "gemm2-row-scale": choose_config(1024, 2048, 768, row_scale=True),
        "plain": choose_config(1024, 640, 2048),
        "fp8-gemm1-gated-epi": fp8.gemm1,
        "fp8-gemm2-row-scale": fp8.gemm2,
    }


@pytest.fixture(scope="module", params=list(_configs()))
def pair(request):
    cfg = _configs()[request.param]
    return cfg, cute_moe.compile_ptx(cfg), cute_moe.compile_ptx(cfg.replace(cluster=2))


def test_only_the_weight_boxes_are_multicast(pair):
    cfg, single, clustered = pair
    weight_rank = 4 if cfg.gated else 3  # W (N, K, E), gated W1 (I, K, 2, E); x is 2-D
    assert LOAD.search(single) and "multicast::cluster" not in single
    mc = [m.group(0) for m in LOAD.finditer(clustered) if "multicast::cluster" in m.group(0)]
    assert mc and all(f".{weight_rank}d." in op for op in mc)
    # the same weight boxes also load without multicast (a pair of blocks of two experts)
    plain_w = [
        m.group(0) for m in LOAD.finditer(clustered) if m.group(1) == str(weight_rank) and "multicast" not in m.group(0)
    ]
    assert plain_w


def test_consumers_release_the_slot_in_both_ctas(pair):
    _, single, clustered = pair
    assert re.search(r"mapa\.shared::cluster", clustered)
    assert re.search(r"mbarrier\.arrive\.shared::cluster\.b64", clustered)
    assert not re.search(r"mapa\.shared::cluster", single)


def test_the_cluster_barrier_orders_the_barrier_init(pair):
    _, single, clustered = pair
    assert "barrier.cluster.arrive" in clustered and "barrier.cluster.wait" in clustered
    assert "barrier.cluster" not in single


def test_the_tile_walk_reads_the_cluster_rank(pair):
    _, single, clustered = pair
    assert "%cluster_ctarank" in clustered and "%cluster_ctarank" not in single


def test_a_cluster_keeps_the_stage_bytes():
    """Each CTA's full barrier expects the whole stage (its token tile + both weight halves)."""
    from test_cute_cpu import _EXPECT_TX

    for cfg in _configs().values():  # the same transaction count as on one CTA (gathering: weights only)
        tx = [
            {int(n) for _, n in re.findall(_EXPECT_TX, cute_moe.compile_ptx(c))} for c in (cfg, cfg.replace(cluster=2))
        ]
        assert len(tx[0]) == 1 and tx[0] == tx[1], cfg


def test_the_field_is_in_the_cache_key():
    assert GemmConfig().key() != GemmConfig(cluster=2).key()


def test_the_cluster_walk_stores_every_tile_exactly_once():
    """The two ranks of a cluster over the pairs of token blocks (cluster.pair_blocks after
    raster.tile_coordinates, as the kernel walks them): every (token block, weight block) is stored
    by exactly one CTA; the only tile computed without a store is rank 1's copy of an odd last block,
    which has its partner's expert (so a multicast half it sends is still wanted)."""
    from cute_moe.gemm_parts import pair_blocks, tile_coordinates

    for n_tokens in range(1, 12):
        for n_weights in range(1, 5):
            for group in (1, 2, 3, 4):
                pairs = (n_tokens + 1) // 2
                stored, idle = [], []
                for t in range(pairs * n_weights):
                    pair, w = tile_coordinates(t, pairs, n_weights, group)
                    for rank in (0, 1):
                        first, last, block, stores = pair_blocks(pair, rank, n_tokens)
                        assert first <= block <= last < n_tokens and last - first <= 1
                        (stored if stores else idle).append((block, w))
                assert sorted(stored) == [(b, w) for b in range(n_tokens) for w in range(n_weights)]
                assert len(idle) == (n_weights if n_tokens % 2 else 0)
                assert all(b == n_tokens - 1 for b, _ in idle)


def test_the_plan_clusters_what_was_measured_faster():
    """cluster.clustered: the cooperative 128-token tile of the normal path — bf16's GEMM1 always, GEMM2
    (bf16 or FP8) from CLUSTER_GEMM2_MIN_K_STEPS steps of K; FP8's GEMM1, swap-AB, ping-pong and smaller
    tiles never."""
    from cute_moe.gemm_rules import CLUSTER_GEMM2_MIN_K_STEPS, clustered, short_k_gemm2

    gemm1, gemm2 = _configs()["gemm1-gated-gather"], _configs()["gemm2-row-scale"]
    deep = CLUSTER_GEMM2_MIN_K_STEPS * gemm2.tile_k
    assert clustered(gemm1, 2048, gemm2=False).cluster == 2
    assert clustered(gemm2, deep, gemm2=True).cluster == 2
    assert clustered(gemm2, deep - gemm2.tile_k, gemm2=True) == gemm2
    assert clustered(short_k_gemm2(gemm2, 256), 256, gemm2=True).cluster == 1  # ping-pong keeps one CTA
    for other in (
        choose_config(16, 768, 2048, gated=True),
        choose_config(1024, 2048, 768, quant="fp8_tensor"),
        gemm1.replace(tokens_tile=64, weights_tile=128, consumer_warpgroups=1),
    ):
        assert clustered(other, 1 << 14, gemm2=False) == other
    fp8 = choose_config(4096, 4096, 14336, quant="fp8_block")  # FP8's GEMM2 (K = I) by the same rule
    assert not fp8.swap_ab and fp8.tokens_tile == 128
    assert clustered(fp8, CLUSTER_GEMM2_MIN_K_STEPS * fp8.tile_k, gemm2=True).cluster == 2
    assert clustered(fp8, (CLUSTER_GEMM2_MIN_K_STEPS - 1) * fp8.tile_k, gemm2=True) == fp8


@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_channel", "fp8_block"])
def test_the_plan_names_the_cluster(quant):
    from moe_spec.validate import MoEDims

    p = cute_moe.plan(MoEDims(T=4096, E=8, K=4096, I=14336, top_k=2), quant)  # Mixtral-8x7B prefill
    g1, g2 = p.describe().split(" | ")[:2]
    assert " cluster2 " in f"{g2} " and (" cluster2 " in f"{g1} ") == (quant is None)  # bf16: both GEMMs
    assert "cluster" not in cute_moe.plan(MoEDims(T=8, E=8, K=4096, I=14336, top_k=2), quant).describe()
    qwen3 = cute_moe.plan(MoEDims(T=4096, E=128, K=2048, I=768, top_k=8), quant)  # 6 K steps of GEMM2
    assert "cluster" not in qwen3.describe().split(" | ")[1]


def test_the_pingpong_twin_of_a_clustered_gemm_runs_on_single_ctas():
    """schedule.pingpong_config of the plan's clustered prefill GEMM1 is a buildable single-CTA twin
    (ping-pong is refused on clusters): the GPU lane compares the layers built from both."""
    from cute_moe.gemm_rules import pingpong_config

    twin = pingpong_config(_configs()["gemm1-gated-gather"].replace(cluster=2))
    assert twin.pingpong and twin.cluster == 1

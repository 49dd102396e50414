"""GPU lane for cute_moe.alignops (H200): the two alignment launches against the reference, bit for bit.

Run on the device: ``source .ci/on-device && python3 -m pytest -m gpu tests/test_cute_align_gpu.py``.
The same grid as the CPU model's (``tests/test_cute_align.py``) plus decode and prefill sizes of the
catalog. Every output — the alignment (``moe_spec.align.align``), the row maps, each GEMM tile's
block map and count, the zeroed scratch — and the error word's bits are compared with
``alignops.reference_rows`` (``moe_spec.validate.guard_routing``'s meaning: bad ids clamped and
weighted NaN); every buffer starts poisoned, so an element the kernels never write cannot pass;
CUDA-graph capture and replay with new routing; no host sync; two launches (one for a single chunk);
the layer's tiles at Qwen3-30B-A3B and DeepSeek-V3 TP8 sizes; place grids beyond the host's choice.
"""

from __future__ import annotations

import importlib
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from test_align import routing  # noqa: E402
from test_cute_align import CASES, POISON  # noqa: E402

from moe_spec.align import align  # noqa: E402
from moe_spec.validate import BAD_ID, BAD_WEIGHT, REPEATED_ID  # noqa: E402

pytestmark = pytest.mark.gpu

FIELDS = ("sorted_ids", "expert_of_block", "expert_end")
GPU_CASES = CASES + [
    (0, 2, 4, 16),  # no pairs
    (4096, 8, 128, 128),  # Qwen3 prefill: 16 chunks
    (4096, 8, 256, 64),  # DeepSeek-V3 prefill
    (4096, 2, 8, 128),  # Mixtral prefill: 8 experts, 1024 pairs each
    (8191, 8, 128, 128),  # 65 528 pairs: 32 chunks
]


def _assert_same(got, want):
    assert got.tile == want.tile and got.num_pairs == want.num_pairs and got.rows == want.rows
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a.cpu(), b.cpu()), name
    assert torch.equal(got.num_padded.cpu(), want.num_padded.cpu())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("T, top_k, E, tile", GPU_CASES)
def test_kernels_are_the_reference(T, top_k, E, tile, skew, dtype):
    from cute_moe.rowmaps import align_on_device

    ids = routing(T, top_k, E, seed=T * E + tile, skew=skew and T > 0).to(dtype)
    got = align_on_device(ids.cuda(), E, tile)
    _assert_same(got, align(ids, E, tile))  # the reference on the CPU
    _assert_same(got, align(ids.cuda(), E, tile))  # ... and on the GPU


def _poisoned_launch(ids, weights, E, tile, tiles=None, zeroed=5, ctas=None):
    """Launch into buffers filled with poison; every output (and the error word's bits) on the CPU.
    ``ctas``: the place launch's grid (default: the host's, ``alignops.place_ctas``)."""
    from cute_moe.rowmaps import RowBuffers, launch_rows

    T, top_k = ids.shape
    bufs = RowBuffers(T, top_k, E, tile, tiles or (tile,), "cuda", zeroed=zeroed)
    bufs.ctas = bufs.ctas if ctas is None else ctas
    for t in list(bufs.out.values()) + [bufs.counts, bufs.block_counts, bufs.scratch]:
        t.fill_(POISON)
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    launch_rows(ids.cuda(), weights.cuda(), bufs, word)
    got = {name: t.cpu() for name, t in bufs.out.items()}
    got.update(block_counts=bufs.block_counts.cpu(), scratch=bufs.scratch.cpu(), bits=int(word))
    return got


def _assert_outputs_are_the_reference(got, ids, weights, E, tile, tiles=None):
    from cute_moe.rowmaps import reference_rows

    tiles = tiles or (tile,)
    word = torch.zeros(1, dtype=torch.int32)
    want = reference_rows(ids, weights, E, tile, tiles, word=word)
    for name in ("sorted_ids", "expert_of_block", "expert_end"):
        assert torch.equal(got[name], getattr(want.alignment, name)), name
    for name in ("token_of_row", "row_of_pair", "row_mask"):
        w = getattr(want, name)
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
    for name in ("weight_of_row", "weight_of_pair"):  # NaN exactly where the reference has NaN
        torch.testing.assert_close(got[name], getattr(want, name), rtol=0, atol=0, equal_nan=True, msg=name)
    full = tiles + (tiles[-1],) * (2 - len(tiles))
    for i, t in enumerate(full):
        experts, used = want.blocks[t]
        assert torch.equal(got[f"blocks{i}"], experts), t
        assert int(got["block_counts"][i]) == int(used), t
    assert bool((got["scratch"] == 0).all())
    assert got["bits"] == int(word), (got["bits"], int(word))


def _weights(T, top_k, seed):
    return torch.rand(T, top_k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "T, top_k, E, tile",
    [(1, 8, 128, 16), (37, 2, 8, 16), (300, 8, 64, 64), (3000, 8, 256, 32), (700, 6, 1024, 16), (4096, 8, 128, 128)],
)
def test_every_output_is_written_into_poisoned_buffers(T, top_k, E, tile):
    ids = routing(T, top_k, E, seed=T + E, skew=True)
    w = _weights(T, top_k, T)
    for tiles in ((tile,), (max(tile // 2, 1), tile), (tile, max(tile // 4, 1))):
        _assert_outputs_are_the_reference(_poisoned_launch(ids, w, E, tile, tiles), ids, w, E, tile, tiles)


@pytest.mark.parametrize("pairs", [1, 8, 1024, 2047, 2048, 2049, 5000])
@pytest.mark.parametrize("extra", [0, 1, 3, 40, 200])
def test_any_grid_writes_the_reference_into_poisoned_buffers(pairs, extra):
    """The place launch with a CTA per chunk and more (every CTA stages and counts a single chunk
    itself; the fill slices go round the grid): the same outputs as the reference, every element
    written (the CPU model proves each is written once)."""
    from cute_moe.alignops import CHUNK

    top_k, E, tile = 8, 256, 8
    T = -(-pairs // top_k)
    ids = routing(T, top_k, E, seed=pairs, skew=extra % 2 == 1)
    w = _weights(T, top_k, pairs)
    ctas = -(-T * top_k // CHUNK) + extra
    got = _poisoned_launch(ids, w, E, tile, (tile, tile), zeroed=3000, ctas=ctas)
    _assert_outputs_are_the_reference(got, ids, w, E, tile, (tile, tile))


@pytest.mark.parametrize("T", [1, 8, 32, 128, 1024, 4096])
@pytest.mark.parametrize("spec", ["qwen3-30b-a3b", "deepseek-v3:tp8"])
def test_the_layer_s_alignment_is_the_reference(spec, T):
    """What the bf16 layer launches: its plan's alignment tile and GEMM tiles at that T."""
    from cute_moe.plan import plan
    from moe_spec.problem import get_shape
    from moe_spec.validate import MoEDims

    shape = get_shape(spec)
    E, k = shape.num_experts, shape.top_k
    with pytest.MonkeyPatch.context() as mp:  # the grouped pipeline's alignment (the one launch sorts nothing)
        mp.setattr(importlib.import_module("cute_moe.plan"), "ONE_LAUNCH", False)
        p = plan(MoEDims(T=T, E=E, K=shape.hidden, I=shape.intermediate, top_k=k))
    tiles = (p.gemm1.tokens_tile, p.gemm2.tokens_tile)
    ids, w = routing(T, k, E, seed=T), _weights(T, k, T)
    got = _poisoned_launch(ids, w, E, p.align_tile, tiles, zeroed=0)
    _assert_outputs_are_the_reference(got, ids, w, E, p.align_tile, tiles)


@pytest.mark.parametrize("tile", [8, 64, 256])
def test_one_expert_takes_every_pair(tile):
    from cute_moe.alignops import CHUNK

    ids = torch.full((3 * CHUNK + 70, 1), 5, dtype=torch.int32)
    w = _weights(ids.shape[0], 1, tile)
    _assert_outputs_are_the_reference(_poisoned_launch(ids, w, 16, tile), ids, w, 16, tile)


FAULTS = {  # name: mutation of (ids, weights) in place, and the bits guard_routing sets
    "id = E": (lambda i, w: i.__setitem__((3, 1), 32), BAD_ID),
    "id < 0": (lambda i, w: i.__setitem__((600, 0), -1), BAD_ID),
    "id huge": (lambda i, w: i.__setitem__((5, 2), 2**31 - 1), BAD_ID),
    "repeated": (lambda i, w: i.__setitem__((9, 2), int(i[9, 0])), REPEATED_ID),
    "repeated across chunks": (lambda i, w: i.__setitem__((682, 2), int(i[682, 0])), REPEATED_ID),
    "weight NaN": (lambda i, w: w.__setitem__((4, 1), float("nan")), BAD_WEIGHT),
    "weight -inf": (lambda i, w: w.__setitem__((600, 2), -float("inf")), BAD_WEIGHT),
    "all of them": (
        lambda i, w: (
            i.__setitem__((1, 0), 99),
            i.__setitem__((2, 1), int(i[2, 0])),
            w.__setitem__((8, 2), float("inf")),
        ),
        BAD_ID | REPEATED_ID | BAD_WEIGHT,
    ),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_bad_routing_sets_guard_routing_s_bits_and_is_made_harmless(fault, dtype):
    """Each fault alone: its bit and no other; a bad id clamped (its pair NaN-weighted), nothing else
    moved; 700 rows of top_k 3 = 2100 pairs, so row 682 (pairs 2046–2048) straddles the two chunks."""
    mutate, bit = FAULTS[fault]
    ids, w = routing(700, 3, 32, seed=2).to(dtype), _weights(700, 3, 2)
    mutate(ids, w)
    got = _poisoned_launch(ids, w, 32, 16, (8, 16))
    assert got["bits"] == bit
    _assert_outputs_are_the_reference(got, ids, w, 32, 16, (8, 16))


def test_int64_ids_beyond_int32_are_clamped():
    ids, w = routing(40, 2, 8, seed=3).long(), _weights(40, 2, 3)
    ids[7, 1], ids[8, 0] = 2**40, -(2**40)
    got = _poisoned_launch(ids, w, 8, 16)
    assert got["bits"] == BAD_ID
    _assert_outputs_are_the_reference(got, ids, w, 8, 16)


def test_sort_rows_sets_the_device_error_word_and_check_names_the_argument():
    from cute_moe.moe import sort_rows
    from moe_spec.validate import check

    check()
    ids, w = routing(64, 4, 16, seed=4).cuda(), _weights(64, 4, 4).cuda()
    sort_rows(ids, w, 16, 16)
    check()  # good routing: nothing to raise
    ids[3, 1] = 16
    rows = sort_rows(ids, w, 16, 16)
    assert bool(rows.weight_of_pair.view(64, 4)[3, 1].isnan()) and int(rows.row_of_pair[13]) >= 0
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E\)"):
        check()
    w[5, 0] = float("nan")
    ids[3, 1] = int(ids[3, 0])
    sort_rows(ids, w, 16, 16)
    with pytest.raises(ValueError, match=r"^topk_ids: expected distinct ids .*also failed: topk_weights"):
        check()
    check()


def _rows_outputs(rows, bufs, word):
    got = {name: t.cpu() for name, t in bufs.out.items()}
    got.update(block_counts=bufs.block_counts.cpu(), scratch=bufs.scratch.cpu(), bits=int(word))
    return got


def test_graph_replay_with_new_routing():
    from cute_moe.rowmaps import RowBuffers, sort_rows_on_device

    T, top_k, E, tile = 1000, 8, 128, 64
    ids, w = routing(T, top_k, E, seed=0).cuda(), _weights(T, top_k, 0).cuda()
    bufs, word = (
        RowBuffers(T, top_k, E, tile, (32, 64), "cuda", zeroed=3),
        torch.zeros(1, dtype=torch.int32, device="cuda"),
    )
    sort_rows_on_device(ids, w, E, tile, (32, 64), word=word, buffers=bufs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sort_rows_on_device(ids, w, E, tile, (32, 64), word=word, buffers=bufs)
    for seed in (1, 2, 3):
        new_ids, new_w = routing(T, top_k, E, seed=seed, skew=seed == 2), _weights(T, top_k, seed)
        if seed == 3:
            new_ids[10, 1] = E  # a bad id after capture: flagged by the replay
        ids.copy_(new_ids)
        w.copy_(new_w)
        bufs.scratch.fill_(1.0)
        word.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _assert_outputs_are_the_reference(_rows_outputs(bufs.rows, bufs, word), new_ids, new_w, E, tile, (32, 64))


def test_no_host_sync():
    from cute_moe.rowmaps import RowBuffers, sort_rows_on_device

    ids, w = routing(777, 8, 128, seed=4).cuda(), _weights(777, 8, 4).cuda()
    bufs, word = RowBuffers(777, 8, 128, 32, (16, 32), "cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    sort_rows_on_device(ids, w, 128, 32, (16, 32), word=word, buffers=bufs)  # compile, first-touch allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sort_rows_on_device(ids, w, 128, 32, (16, 32), word=word, buffers=bufs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _assert_outputs_are_the_reference(_rows_outputs(bufs.rows, bufs, word), ids.cpu(), w.cpu(), 128, 32, (16, 32))


def _kernels_launched(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_two_launches_one_for_a_single_chunk_and_no_recompile():
    import cute_moe
    from cute_moe.alignops import CHUNK
    from cute_moe.rowmaps import RowBuffers, sort_rows_on_device

    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    many, one = routing(4096, 8, 128, seed=5).cuda(), routing(CHUNK // 8, 8, 128, seed=6).cuda()
    calls = []
    for ids in (many, one, many.long()):
        w = _weights(*ids.shape, 0).cuda()
        bufs = RowBuffers(*ids.shape, 128, 128, (64, 128), "cuda")
        calls.append(
            lambda ids=ids, w=w, bufs=bufs: sort_rows_on_device(ids, w, 128, 128, (64, 128), word=word, buffers=bufs)
        )
        calls[-1]()
    torch.cuda.synchronize()
    compiled = cute_moe.compile_count()
    kernels = _kernels_launched(calls[0])
    assert len(kernels) == 2 and "CountExperts" in kernels[0] and "PlacePairs" in kernels[1], kernels
    kernels = _kernels_launched(calls[1])  # 2048 pairs: one chunk
    assert len(kernels) == 1 and "PlacePairs" in kernels[0], kernels
    for T, E, tile, dtype in ((1, 8, 16, torch.int32), (3000, 1024, 8, torch.int64), (17, 3, 256, torch.int32)):
        sort_rows_on_device(
            routing(T, 2, E, seed=T).to(dtype).cuda(), _weights(T, 2, T).cuda(), E, tile, (tile,), word=word
        )
    torch.cuda.synchronize()
    assert cute_moe.compile_count() == compiled and int(word) == 0

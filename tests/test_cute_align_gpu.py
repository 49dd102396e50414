"""GPU lane for cute_moe.alignops (H200): the two alignment kernels against moe_spec.align, bit for bit.

Run on the device: ``source .device/on-device.sh && python3 -m pytest -m gpu tests/test_cute_align_gpu.py``.
The same grid as the CPU model's (``tests/test_cute_align.py``) plus decode and prefill sizes of the
catalog; every output buffer starts poisoned, so an element the kernels never write cannot pass;
CUDA-graph capture and replay with new ids; no host sync; two launches (one for a single chunk).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from moe_spec.align import align, max_rows  # noqa: E402

from test_align import routing  # noqa: E402
from test_cute_align import CASES, POISON, model_align  # noqa: E402

pytestmark = pytest.mark.gpu

FIELDS = ("sorted_ids", "expert_of_block", "expert_end")
GPU_CASES = CASES + [
    (0, 2, 4, 16),          # no pairs
    (4096, 8, 128, 128),    # Qwen3 prefill: 16 chunks
    (4096, 8, 256, 64),     # DeepSeek-V3 prefill
    (4096, 2, 8, 128),      # Mixtral prefill: 8 experts, 1024 pairs each
    (8191, 8, 128, 128),    # 65 528 pairs: 32 chunks
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
    from cute_moe.alignops import align_on_device

    ids = routing(T, top_k, E, seed=T * E + tile, skew=skew and T > 0).to(dtype)
    got = align_on_device(ids.cuda(), E, tile)
    _assert_same(got, align(ids, E, tile))         # the reference on the CPU
    _assert_same(got, align(ids.cuda(), E, tile))  # ... and on the GPU


def _poisoned_launch(ids, E, tile):
    from cute_moe.alignops import CHUNK, launch_align

    flat = ids.reshape(-1).cuda()
    rows = max_rows(flat.numel(), E, tile)
    bufs = [torch.full((n,), POISON, dtype=torch.int32, device="cuda") for n in (rows, rows // tile, E)]
    launch_align(flat, E, tile, *bufs, torch.full((-(-flat.numel() // CHUNK) * E,), POISON, dtype=torch.int32,
                                                  device="cuda"))
    return [b.cpu() for b in bufs]


@pytest.mark.parametrize("T, top_k, E, tile", [(1, 8, 128, 16), (37, 2, 8, 16), (300, 8, 64, 64),
                                               (3000, 8, 256, 32), (700, 6, 1024, 16)])
def test_every_element_is_written_into_poisoned_buffers(T, top_k, E, tile):
    ids = routing(T, top_k, E, seed=T + E, skew=True)
    want = align(ids, E, tile)
    for name, got in zip(FIELDS, _poisoned_launch(ids, E, tile)):
        assert torch.equal(got, getattr(want, name)), name


@pytest.mark.parametrize("tile", [8, 64, 256])
def test_one_expert_takes_every_pair(tile):
    from cute_moe.alignops import CHUNK

    ids = torch.full((3 * CHUNK + 70, 1), 5, dtype=torch.int32)
    for name, got in zip(FIELDS, _poisoned_launch(ids, 16, tile)):
        assert torch.equal(got, getattr(align(ids, 16, tile), name)), name


def test_out_of_range_ids_are_dropped_as_the_model_says():
    """Ids the host cannot check inside a capture (E, −1, huge): no write out of bounds, the other
    pairs exactly where the CPU model of the kernels puts them."""
    ids = routing(500, 4, 32, seed=9)
    ids[::7, 1] = 32
    ids[3::11, 0] = -1
    ids[5, 2] = 2**30
    for got, want in zip(_poisoned_launch(ids, 32, 16), model_align(ids, 32, 16)):
        assert torch.equal(got, want)
    torch.cuda.synchronize()


def test_graph_replay_with_new_ids():
    from cute_moe.alignops import align_on_device

    T, top_k, E, tile = 1000, 8, 128, 64
    static = routing(T, top_k, E, seed=0).cuda()
    align_on_device(static, E, tile)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = align_on_device(static, E, tile)
    for seed in (1, 2, 3):
        new = routing(T, top_k, E, seed=seed, skew=seed == 2)
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(captured, align(new, E, tile))


def test_no_host_sync():
    from cute_moe.alignops import align_on_device

    ids = routing(777, 8, 128, seed=4).cuda()
    align_on_device(ids, 128, 32)  # compile, first-touch allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = align_on_device(ids, 128, 32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _assert_same(got, align(ids.cpu(), 128, 32))


def _kernels_launched(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_two_launches_one_for_a_single_chunk_and_no_recompile():
    import cute_moe
    from cute_moe.alignops import CHUNK, align_on_device

    many, one = routing(4096, 8, 128, seed=5).cuda(), routing(CHUNK // 8, 8, 128, seed=6).cuda()
    for ids in (many, one, many.long()):
        align_on_device(ids, 128, 128)
    torch.cuda.synchronize()
    compiled = cute_moe.compile_count()
    kernels = _kernels_launched(lambda: align_on_device(many, 128, 128))
    assert len(kernels) == 2 and "CountExperts" in kernels[0] and "PlacePairs" in kernels[1], kernels
    kernels = _kernels_launched(lambda: align_on_device(one, 128, 128))  # 2048 pairs: one chunk
    assert len(kernels) == 1 and "PlacePairs" in kernels[0], kernels
    for T, E, tile, dtype in ((1, 8, 16, torch.int32), (3000, 1024, 8, torch.int64), (17, 3, 256, torch.int32)):
        align_on_device(routing(T, 2, E, seed=T).to(dtype).cuda(), E, tile)
    torch.cuda.synchronize()
    assert cute_moe.compile_count() == compiled

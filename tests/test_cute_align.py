"""cute_moe.alignops on the CPU: the alignment kernels compile, their PTX holds what the scheme
relies on, and a torch model of the two launches equals moe_spec.align bit for bit.

The model runs the kernels' steps one CTA, one warp, one 32-lane round at a time, with the same
chunk, warp slice, ``match.any`` rank, shared tables, block scan (per-thread sums, shuffle scan
in each warp, warp sums) and fill assignment — so the algorithm is proven here, where no CuTe
kernel can launch. Every output element starts at a poison value and must be written exactly
once: that is what makes the kernel's unordered writes (CTAs and warps run in any order) safe.
The kernels themselves are checked against the same reference on the H200 in
``tests/test_cute_align_gpu.py``.
"""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cute_moe.alignops import (CHUNK, MAX_EXPERTS, THREADS, WARP, WARPS, align_on_device,  # noqa: E402
                               compile_align_kernels)
from moe_spec.align import align, max_rows  # noqa: E402

from test_align import routing  # noqa: E402

POISON = -7  # no output element may keep it, none may be written twice
FIELDS = ("tile", "num_pairs", "sorted_ids", "expert_of_block", "expert_end")


# ---- the model ----------------------------------------------------------------------------------
class _Memory:
    """An output buffer that records every write (element written twice or never: an error)."""

    def __init__(self, n):
        self.data = torch.full((n,), POISON, dtype=torch.int64)
        self.writes = torch.zeros(n, dtype=torch.int64)

    def store(self, index, value):
        index = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
        value = torch.as_tensor(value, dtype=torch.int64).expand(index.shape)
        self.writes.index_add_(0, index, torch.ones_like(index))
        self.data[index] = value


def _span(start, stop, step=1):
    """The indices a strided loop ``for i = start; i < stop; i += step`` visits (none if start ≥ stop)."""
    return torch.tensor(list(range(start, stop, step)), dtype=torch.int64)


def _padded(count, tile):
    return (count + tile - 1) // tile * tile


def _stage(flat, lo, n, num_experts):
    i = torch.arange(CHUNK)
    v = flat[lo + i.clamp(max=n - 1)]
    return torch.where((i >= n) | (v < 0) | (v >= num_experts), -1, v)


def _warp_slice(n, warp):
    span = -(-n // (WARPS * WARP)) * WARP
    first = warp * span
    return first, min(first + span, n)


def _rounds(s_ids, n, warp):
    """The warp's 32-lane rounds: (chunk positions, experts (−1: idle lane), rank among the lanes of
    the same expert below, lanes of the same expert) — what ``match.any`` and ``lanemask_lt`` give."""
    lane = torch.arange(WARP)
    first, last = _warp_slice(n, warp)
    for base in range(first, last, WARP):
        pos = base + lane
        x = torch.where(pos < last, s_ids[pos.clamp(max=CHUNK - 1)], -1)
        same = x[:, None] == x[None, :]
        yield pos, x, (same & (lane[None, :] < lane[:, None])).sum(1), same.sum(1)


def _count_warp_slices(s_ids, n, num_experts):
    table = torch.zeros(WARPS, num_experts, dtype=torch.int64)
    for w in range(WARPS):
        for _, x, rank, size in _rounds(s_ids, n, w):
            lead = (x >= 0) & (rank == 0)  # one lane per expert: distinct indices
            table[w, x[lead]] += size[lead]
    return table


def _scan_runs(total, tile):
    """The block scan of ``_scan_runs``: thread t owns ``per`` consecutive experts."""
    num_experts = total.numel()
    per = -(-num_experts // THREADS)
    padded = _padded(total, tile)
    owned = [[e for e in range(t * per, t * per + per) if e < num_experts] for t in range(THREADS)]
    mine = torch.tensor([int(padded[es].sum()) for es in owned]).view(WARPS, WARP)
    inclusive = mine.clone()
    for j in range(5):  # shuffle-up by 2^j; lanes below keep their value
        d = 1 << j
        up = inclusive.clone()
        inclusive[:, d:] += up[:, :-d]
    warp_sums = inclusive[:, -1]
    row = (inclusive - mine + (torch.cumsum(warp_sums, 0) - warp_sums)[:, None]).flatten()
    end = torch.empty(num_experts, dtype=torch.int64)
    for t, es in enumerate(owned):
        for e in es:
            row[t] += padded[e]
            end[e] = row[t]
    return end


def model_align(topk_ids, num_experts, tile):
    """The two launches of ``cute_moe.alignops`` for P ≥ 1 pairs, executed with torch."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    rows = max_rows(num_pairs, num_experts, tile)
    chunks = -(-num_pairs // CHUNK)
    sorted_ids, expert_of_block, expert_end = _Memory(rows), _Memory(rows // tile), _Memory(num_experts)
    counts = torch.full((chunks, num_experts), POISON, dtype=torch.int64)
    for c in range(chunks if chunks > 1 else 0):  # launch 1 (skipped for a single chunk)
        lo, n = c * CHUNK, min(CHUNK, num_pairs - c * CHUNK)
        counts[c] = _count_warp_slices(_stage(flat, lo, n, num_experts), n, num_experts).sum(0)
    for c in range(chunks):  # launch 2
        lo, n = c * CHUNK, min(CHUNK, num_pairs - c * CHUNK)
        s_ids = _stage(flat, lo, n, num_experts)
        table = _count_warp_slices(s_ids, n, num_experts)
        if chunks > 1:
            before, total = counts[:c].sum(0), counts.sum(0)
        else:  # the CTA's own table holds the totals
            before, total = torch.zeros(num_experts, dtype=torch.int64), table.sum(0)
        end = _scan_runs(total, tile)
        if c == 0:
            expert_end.store(torch.arange(num_experts), end)
        row = end - _padded(total, tile) + before
        for w in range(WARPS):
            row, table[w] = row + table[w], row
        for w in range(WARPS):  # placement
            for pos, x, rank, size in _rounds(s_ids, n, w):
                live = x >= 0
                sorted_ids.store(table[w, x[live]] + rank[live], lo + pos[live])
                lead = live & (rank == 0)
                table[w, x[lead]] += size[lead]
        for w in range(WARPS):  # runs' padding and blocks, warp (c, w) takes every (chunks·WARPS)-th expert
            for e in range(c * WARPS + w, num_experts, chunks * WARPS):
                start = int(end[e] - _padded(total[e], tile))
                sorted_ids.store(_span(start + int(total[e]), int(end[e])), num_pairs)
                expert_of_block.store(_span(start // tile, int(end[e]) // tile), e)
        used = int(end[-1])
        for tid in range(THREADS):  # past the used rows: a grid-stride loop over all threads
            gid = c * THREADS + tid
            sorted_ids.store(_span(used + gid, rows, chunks * THREADS), num_pairs)
            expert_of_block.store(_span(used // tile + gid, rows // tile, chunks * THREADS), -1)
    for name, mem in (("sorted_ids", sorted_ids), ("expert_of_block", expert_of_block), ("expert_end", expert_end)):
        assert bool((mem.writes == 1).all()), f"{name}: elements written {sorted(set(mem.writes.tolist()))} times"
    return sorted_ids.data.int(), expert_of_block.data.int(), expert_end.data.int()


def assert_model_is_the_reference(topk_ids, num_experts, tile):
    want = align(topk_ids, num_experts, tile)
    got = model_align(topk_ids, num_experts, tile)
    for name, g in zip(("sorted_ids", "expert_of_block", "expert_end"), got):
        w = getattr(want, name)
        assert w.dtype == torch.int32 and torch.equal(g, w), name


# ---- the model against the reference ------------------------------------------------------------
CASES = [
    (1, 1, 4, 16),         # a single pair
    (1, 8, 128, 16),       # decode: 8 pairs over 128 experts
    (1, 8, 512, 256),      # almost every expert idle, the largest tile
    (5, 2, 8, 1),          # tile 1: no padding at all
    (37, 2, 8, 16),        # a partial round, a partial warp slice
    (37, 4, 16, 8),
    (64, 8, 8, 64),
    (128, 8, 128, 32),     # 1024 pairs: one chunk, four warps with pairs
    (130, 2, 6, 48),       # a tile that is no power of two
    (300, 8, 64, 64),      # 2400 pairs: two chunks, runs carried across them
    (600, 8, 128, 128),
    (3000, 8, 256, 32),    # 24 000 pairs: 12 chunks
    (1, 8, MAX_EXPERTS, 8),      # the widest scan, four experts per thread
    (700, 6, MAX_EXPERTS, 16),   # ... with pairs in two chunks
]


@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("T, top_k, E, tile", CASES)
def test_model_is_the_reference(T, top_k, E, tile, skew):
    assert_model_is_the_reference(routing(T, top_k, E, seed=T * E + tile, skew=skew), E, tile)


@pytest.mark.parametrize("tile", [8, 16, 64, 256])
def test_model_one_expert_takes_every_pair(tile):
    """One run across three chunks and every warp, one ``match`` group of 32 lanes per round."""
    topk_ids = torch.full((2 * CHUNK + 70, 1), 5, dtype=torch.int64)
    assert_model_is_the_reference(topk_ids, 16, tile)


def test_model_experts_in_descending_order():
    """Pairs arrive in the reverse of the sorted order: every round writes backwards across runs."""
    E = 64
    topk_ids = torch.arange(CHUNK + 300).remainder(E).flip(0).view(-1, 1).int()
    assert_model_is_the_reference(topk_ids, E, 16)


@settings(derandomize=True, deadline=None, database=None, max_examples=40)
@given(st.data())
def test_model_is_the_reference_fuzzed(data):
    E = data.draw(st.sampled_from([1, 2, 3, 8, 33, 128, 257, MAX_EXPERTS]), label="E")
    top_k = data.draw(st.integers(1, min(E, 8)), label="top_k")
    T = data.draw(st.integers(1, 3 * CHUNK // top_k), label="T")
    tile = data.draw(st.sampled_from([1, 8, 16, 24, 64, 128, 256]), label="tile")
    hot = data.draw(st.integers(1, E), label="experts in use")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    g = torch.Generator().manual_seed(seed)
    topk_ids = torch.randint(0, hot, (T, top_k), generator=g, dtype=torch.int32)  # repeats allowed
    assert_model_is_the_reference(topk_ids, E, tile)


def test_model_drops_out_of_range_ids():
    """An id outside [0, E) is counted and placed nowhere; every other pair keeps its row."""
    topk_ids = torch.tensor([[3, 9], [-1, 3], [0, 2]], dtype=torch.int32)  # E = 4: 9 and −1 are out
    sorted_ids, expert_of_block, expert_end = model_align(topk_ids, 4, 8)
    assert expert_end.tolist() == [8, 8, 16, 24]
    assert sorted_ids[:24].tolist() == [4] + [6] * 7 + [5] + [6] * 7 + [0, 3] + [6] * 6
    assert expert_of_block[:3].tolist() == [0, 2, 3]


# ---- the host function on the CPU ---------------------------------------------------------------
@pytest.mark.parametrize("T", [0, 37])
def test_align_on_device_on_the_cpu_is_the_reference(T):
    topk_ids = routing(T, 2, 8, seed=3)
    got, want = align_on_device(topk_ids, 8, 16), align(topk_ids, 8, 16)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name


@pytest.mark.parametrize("args, error, needle", [
    ((torch.zeros(2, 2, dtype=torch.int32), MAX_EXPERTS + 1, 16), ValueError, "^num_experts: "),
    ((torch.zeros(2, 2, dtype=torch.int32), 0, 16), ValueError, "^num_experts: "),
    ((torch.zeros(2, 2, dtype=torch.int32), 8, 0), ValueError, "^tile: "),
    ((torch.zeros(2, 2, dtype=torch.int32), 8, 16.0), TypeError, "^tile: "),
    ((torch.zeros(2, 2, dtype=torch.int16), 8, 16), TypeError, "^topk_ids: "),
    (([[0, 1]], 8, 16), TypeError, "^topk_ids: "),
])
def test_bad_arguments_are_named(args, error, needle):
    with pytest.raises(error, match=needle):
        align_on_device(*args)


# ---- the kernels compile, and their PTX ---------------------------------------------------------
@pytest.fixture(scope="module")
def ptx():
    return {(dt, name): k.__ptx__ for dt in (torch.int32, torch.int64)
            for name, k in compile_align_kernels(dt, keep_ptx=True).items()}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernels_compile_to_ptx_with_the_scheme_s_instructions(ptx, dtype):
    count, place = ptx[(dtype, "count")], ptx[(dtype, "place")]
    for text in (count, place):
        assert ".target sm_90a" in text and f".reqntid {THREADS}, 1, 1" in text
        assert "match.any.sync.b32" in text and "%lanemask_lt" in text and "popc.b32" in text
        assert not re.search(r"\b(atom|red)\.", text), "the scheme uses no atomics"
        # the ids are read in their own width: no conversion launch on the host
        assert re.search(rf"ld\.global(\.\w+)*\.b{dtype.itemsize * 8}\b", text)
    assert "shfl.sync.up.b32" in place  # the block scan over the experts
    assert "shfl.sync.up" not in count


def test_kernels_compile_once_per_id_dtype():
    import cute_moe

    kernels = compile_align_kernels(torch.int64)
    n = cute_moe.compile_count()
    assert compile_align_kernels(torch.int64) is kernels and set(kernels) == {"count", "place"}
    assert cute_moe.compile_count() == n
    with pytest.raises(TypeError, match="^ids_dtype: "):
        compile_align_kernels(torch.float32)


def test_launch_align_checks_every_buffer_before_any_launch():
    from cute_moe.alignops import launch_align

    flat, E, tile = torch.zeros(5, dtype=torch.int32), 8, 16
    rows = max_rows(5, E, tile)
    i32 = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731
    good = [i32(rows), i32(rows // tile), i32(E), i32(E)]
    for k, name in enumerate(("sorted_ids", "expert_of_block", "expert_end", "counts")):
        bad = list(good)
        bad[k] = i32(bad[k].numel() + 1)
        with pytest.raises(ValueError, match=f"^{name}: "):
            launch_align(flat, E, tile, *bad)
    with pytest.raises(ValueError, match="^flat_ids: .*contiguous"):
        launch_align(torch.zeros(10, dtype=torch.int32)[::2], E, tile, *good)
    with pytest.raises(ValueError, match="^flat_ids: .*CUDA"):
        launch_align(flat, E, tile, *good)

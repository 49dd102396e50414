"""cute_moe.alignops on the CPU: the alignment kernels compile, their PTX holds what the scheme
relies on, and a torch model of the two launches equals the reference bit for bit — the
alignment of moe_spec.align, the row maps and block maps, and the routing data checks with
moe_spec.validate.guard_routing's meaning (``alignops.reference_rows`` puts them together).

The model runs the kernels' steps one CTA, one warp, one 32-lane round at a time, with the same
chunk, warp slice, ``match.any`` rank, shared tables, block scan (per-thread sums, shuffle scan
in each warp, warp sums), binary search of the run ends and fill slices — for the place launch's
grid as the host sizes it (``alignops.place_ctas``) or any other of at least a CTA per chunk —
so the algorithm is proven here, where no CuTe kernel can launch. Every output element starts at a
poison value and must be written exactly once: that is what makes the kernel's unordered writes
(CTAs and warps run in any order) safe.
The kernels themselves are checked against the same reference on the H200 in
``tests/test_cute_align_gpu.py``.
"""

from __future__ import annotations

import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_align import routing  # noqa: E402

from cute_moe.alignops import (  # noqa: E402
    BIG,
    CHUNK,
    FILL_CTAS,
    FILL_ROWS,
    MAX_EXPERTS,
    THREADS,
    WARP,
    WARPS,
    compile_align_kernels,
    place_ctas,
    place_slice,
)
from cute_moe.rowmaps import align_on_device, reference_rows, sort_rows_on_device  # noqa: E402
from moe_spec.align import align, max_rows  # noqa: E402
from moe_spec.validate import BAD_ID, BAD_WEIGHT, REPEATED_ID  # noqa: E402

POISON = -7  # no output element may keep it, none may be written twice
FIELDS = ("tile", "num_pairs", "sorted_ids", "expert_of_block", "expert_end")


# ---- the model ----------------------------------------------------------------------------------
class _Memory:
    """An output buffer that records every write (element written twice or never: an error)."""

    def __init__(self, n, dtype=torch.int64):
        self.data = torch.full((n,), POISON, dtype=dtype)
        self.writes = torch.zeros(n, dtype=torch.int64)

    def store(self, index, value):
        index = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
        value = torch.as_tensor(value, dtype=self.data.dtype).expand(index.shape)
        self.writes.index_add_(0, index, torch.ones_like(index))
        self.data[index] = value


def _span(start, stop, step=1):
    """The indices a strided loop ``for i = start; i < stop; i += step`` visits (none if start ≥ stop)."""
    return torch.tensor(list(range(start, stop, step)), dtype=torch.int64)


def _padded(count, tile):
    return (count + tile - 1) // tile * tile


def _stage(flat, lo, n, num_experts):
    """Ids clamped into [0, E) (guard_routing's rule), −1 past the chunk."""
    i = torch.arange(CHUNK)
    v = flat[lo + i.clamp(max=n - 1)].clamp(0, num_experts - 1)
    return torch.where(i >= n, -1, v)


def _stage_bad(flat, lo, n, num_experts):
    """The place kernel's BAD bit of each staged pair: its raw id was outside [0, E)."""
    v = flat[lo + torch.arange(CHUNK).clamp(max=n - 1)]
    return (torch.arange(CHUNK) < n) & ((v < 0) | (v >= num_experts))


def _check(flat, weights, s_ids, lo, a, b, num_experts, top_k):
    """The error bits a CTA's threads OR in for the staged positions [a, b): range, finite weight, the
    earlier slots of the row — the staged (clamped) experts compared first, the raw ids only on a
    clamped match or before the chunk."""
    bits = 0
    for p in range(lo + a, lo + b):
        v = int(flat[p])
        if not 0 <= v < num_experts:
            bits |= BAD_ID
        if not bool(torch.isfinite(weights[p])):
            bits |= BAD_WEIGHT
        for d in range(p % top_k):
            q = p - 1 - d
            if q >= lo and int(s_ids[q - lo]) != int(s_ids[p - lo]):
                continue
            if int(flat[q]) == v:
                bits |= REPEATED_ID
    return bits


def _warp_slice(start, end, warp):
    span = -(-(end - start) // (WARPS * WARP)) * WARP
    first = start + warp * span
    return first, min(first + span, end)


def _rounds(s_ids, start, end, warp):
    """The warp's 32-lane rounds over its slice of [start, end): (chunk positions, experts (−1: idle
    lane), rank among the lanes of the same expert below, lanes of the same expert) — what
    ``match.any`` and ``lanemask_lt`` give."""
    lane = torch.arange(WARP)
    first, last = _warp_slice(start, end, warp)
    for base in range(first, last, WARP):
        pos = base + lane
        x = torch.where(pos < last, s_ids[pos.clamp(max=CHUNK - 1)], -1)
        same = x[:, None] == x[None, :]
        yield pos, x, (same & (lane[None, :] < lane[:, None])).sum(1), same.sum(1)


def _count_warp_slices(s_ids, start, end, num_experts):
    table = torch.zeros(WARPS, num_experts, dtype=torch.int64)
    for w in range(WARPS):
        for _, x, rank, size in _rounds(s_ids, start, end, w):
            lead = (x >= 0) & (rank == 0)  # one lane per expert: distinct indices
            table[w, x[lead]] += size[lead]
    return table


def _count_totals(s_ids, n, a, num_experts):
    """``_count_totals``: every round's per-expert counts over the chunk's n pairs summed (the kernel's
    shared atomics: the order does not matter), and those of the rounds before position a."""
    total = torch.zeros(num_experts, dtype=torch.int64)
    before = torch.zeros(num_experts, dtype=torch.int64)
    for w in range(WARPS):
        for pos, x, rank, size in _rounds(s_ids, 0, n, w):
            lead = (x >= 0) & (rank == 0)
            total[x[lead]] += size[lead]
            if int(pos[0]) < a:
                before[x[lead]] += size[lead]
    return total, before


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


def _owner(s_end, r, top):
    """The kernel's binary search, lane-wise over the rows ``r``: the first e with s_end[e] > r, over
    ``top`` (a power of two ≥ E) entries, BIG past E."""
    pos = torch.zeros_like(r)
    half = top // 2
    while half > 0:
        pos = torch.where(s_end[pos + half - 1] <= r, pos + half, pos)
        half //= 2
    return pos


def _staged(flat, lo, n, num_experts, cache):
    """A CTA's staged chunk.  Every CTA that stages the same chunk holds the same values (same data,
    same code), so the model stages it once per chunk."""
    if (lo, n) not in cache:
        cache[lo, n] = _stage(flat, lo, n, num_experts)
    return cache[lo, n]


def model_align(topk_ids, num_experts, tile, topk_weights=None, gemm_tiles=None, ctas=None):
    """The two launches of ``cute_moe.alignops`` for P ≥ 1 pairs, executed with torch: a dict of
    every output (as the kernels write them; ``bits``: what they OR into the error word).  ``ctas``:
    the place launch's grid (default :func:`place_ctas`, as the host launches it; at least a CTA
    per chunk)."""
    T, top_k = topk_ids.shape if topk_ids.dim() == 2 else (topk_ids.numel(), 1)
    flat = topk_ids.reshape(-1).long()
    weights = torch.zeros(flat.numel()) if topk_weights is None else topk_weights.reshape(-1).float()
    tiles = gemm_tiles or (tile, tile)
    num_pairs = flat.numel()
    rows = max_rows(num_pairs, num_experts, tile)
    chunks = -(-num_pairs // CHUNK)
    grid = place_ctas(num_pairs, rows) if ctas is None else ctas
    assert grid >= chunks
    out = dict(
        sorted_ids=_Memory(rows),
        expert_of_block=_Memory(rows // tile),
        expert_end=_Memory(num_experts),
        token_of_row=_Memory(rows),
        weight_of_row=_Memory(rows, torch.float32),
        row_of_pair=_Memory(num_pairs),
        weight_of_pair=_Memory(num_pairs, torch.float32),
        row_mask=_Memory(rows),
        blocks0=_Memory(rows // tiles[0]),
        blocks1=_Memory(rows // tiles[1]),
        block_counts=_Memory(2),
    )
    counts = torch.full((chunks, num_experts), POISON, dtype=torch.int64)
    bits, cache, scans = 0, {}, {}
    for c in range(chunks if chunks > 1 else 0):  # launch 1 (skipped for a single chunk)
        lo, n = c * CHUNK, min(CHUNK, num_pairs - c * CHUNK)
        counts[c] = _count_warp_slices(_stage(flat, lo, n, num_experts), 0, n, num_experts).sum(0)
    top = 1 << (num_experts - 1).bit_length()

    def pad(r):
        out["sorted_ids"].store(r, num_pairs)
        out["token_of_row"].store(r, T - 1)
        out["weight_of_row"].store(r, 0.0)
        out["row_mask"].store(r, 0)

    for c in range(grid):  # launch 2
        lo = 0 if chunks == 1 else c * CHUNK  # one chunk: staged by every CTA
        n = min(CHUNK, num_pairs - lo)
        start, stop = place_slice(c, grid, n) if chunks == 1 else (0, n if c < chunks else 0)  # this CTA's pairs
        s_ids = None
        if chunks == 1 or c < chunks:
            s_ids = _staged(flat, lo, n, num_experts, cache)
        if chunks > 1:
            before, total = counts[: min(c, chunks)].sum(0), counts.sum(0)
        else:  # the CTA counts the whole chunk itself
            total, before = _count_totals(s_ids, n, start, num_experts)
        table = _count_warp_slices(s_ids, start, stop, num_experts) if stop > start else None
        key = tuple(total.tolist())
        if key not in scans:  # the same totals give the same scan in every CTA
            scans[key] = _scan_runs(total, tile)
        end = scans[key]
        s_end = torch.cat([end, torch.full((top - num_experts,), BIG, dtype=torch.int64)])
        used = int(end[-1])
        if c == 0:
            out["expert_end"].store(torch.arange(num_experts), end)
            out["block_counts"].store(torch.arange(2), torch.tensor([used // tiles[0], used // tiles[1]]))
        if stop > start:
            row = end - _padded(total, tile) + before
            for w in range(WARPS):
                row, table[w] = row + table[w], row
            bad = _stage_bad(flat, lo, n, num_experts)
            bits |= _check(flat, weights, s_ids, lo, start, stop, num_experts, top_k)
            for w in range(WARPS):  # placement: the pair's row in every map
                for pos, x, rank, size in _rounds(s_ids, start, stop, w):
                    live = x >= 0
                    r, p = table[w, x[live]] + rank[live], lo + pos[live]
                    out["sorted_ids"].store(r, p)
                    out["token_of_row"].store(r, p // top_k)
                    out["row_of_pair"].store(p, r)
                    b = bad[pos[live]]
                    out["row_mask"].store(r, (~b).long())
                    wp = torch.where(b, float("nan"), weights[p])
                    out["weight_of_row"].store(r, wp)
                    out["weight_of_pair"].store(p, wp)
                    lead = live & (rank == 0)
                    table[w, x[lead]] += size[lead]
        for s in range(c, -(-rows // FILL_ROWS), grid):  # this CTA's fill slices
            first, last = s * FILL_ROWS, min(s * FILL_ROWS + FILL_ROWS, rows)
            r = _span(first, last)
            e = _owner(s_end, r.clamp(max=max(used - 1, 0)), top)
            start = torch.where(e > 0, s_end[(e - 1).clamp(min=0)], 0)
            pad(r[(r >= used) | (r >= start + total[e])])
            for name, t in (("expert_of_block", tile), ("blocks0", tiles[0]), ("blocks1", tiles[1])):
                b = _span(-(-first // t), min(-(-last // t), rows // t))
                out[name].store(b, torch.where(b * t < used, _owner(s_end, b * t, top), -1))
    for name, mem in out.items():
        assert bool((mem.writes == 1).all()), f"{name}: elements written {sorted(set(mem.writes.tolist()))} times"
    got = {name: mem.data for name, mem in out.items()}
    for name in ("sorted_ids", "expert_of_block", "expert_end", "row_mask", "blocks0", "blocks1", "block_counts"):
        got[name] = got[name].int()
    got["bits"] = bits
    return got


def assert_model_is_the_reference(topk_ids, num_experts, tile, topk_weights=None, gemm_tiles=None, ctas=None):
    """Every output of the model equals ``alignops.reference_rows`` (guard_routing, align, the maps)."""
    T, top_k = topk_ids.shape
    weights = torch.rand(T, top_k, generator=torch.Generator().manual_seed(T)) if topk_weights is None else topk_weights
    tiles = gemm_tiles or (tile, tile)
    got = model_align(topk_ids, num_experts, tile, weights, tiles, ctas)
    word = torch.zeros(1, dtype=torch.int32)
    want = reference_rows(topk_ids, weights, num_experts, tile, tiles, word=word)
    for name in ("sorted_ids", "expert_of_block", "expert_end"):
        w = getattr(want.alignment, name)
        assert w.dtype == torch.int32 and torch.equal(got[name], w), name
    for name in ("token_of_row", "row_of_pair", "row_mask"):
        w = getattr(want, name)
        assert torch.equal(got[name].to(w.dtype), w), name
    for name in ("weight_of_row", "weight_of_pair"):  # NaN where the reference has NaN, else equal
        torch.testing.assert_close(got[name], getattr(want, name), rtol=0, atol=0, equal_nan=True, msg=name)
    for i, t in enumerate(tiles):
        experts, used = want.blocks[t]
        assert torch.equal(got[f"blocks{i}"], experts) and int(got["block_counts"][i]) == int(used), t
    assert got["bits"] == int(word), (got["bits"], int(word))


# ---- the model against the reference ------------------------------------------------------------
CASES = [
    (1, 1, 4, 16),  # a single pair
    (1, 8, 128, 16),  # decode: 8 pairs over 128 experts
    (1, 8, 512, 256),  # almost every expert idle, the largest tile
    (5, 2, 8, 1),  # tile 1: no padding at all
    (37, 2, 8, 16),  # a partial round, a partial warp slice
    (37, 4, 16, 8),
    (64, 8, 8, 64),
    (128, 8, 128, 32),  # 1024 pairs: one chunk, four warps with pairs
    (130, 2, 6, 48),  # a tile that is no power of two
    (300, 8, 64, 64),  # 2400 pairs: two chunks, runs carried across them
    (600, 8, 128, 128),
    (3000, 8, 256, 32),  # 24 000 pairs: 12 chunks
    (1, 8, MAX_EXPERTS, 8),  # the widest scan, four experts per thread
    (700, 6, MAX_EXPERTS, 16),  # ... with pairs in two chunks
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


def test_model_clamps_out_of_range_ids_and_weights_their_pairs_nan():
    """An id outside [0, E) is aligned as the nearest expert (guard_routing's clamp), its pair's weight
    is NaN, and BAD_ID is set; every other pair keeps its row."""
    topk_ids = torch.tensor([[3, 9], [-1, 3], [0, 2]], dtype=torch.int32)  # E = 4: 9 → 3, −1 → 0
    weights = torch.tensor([[0.5, 0.25], [0.125, 1.0], [2.0, 4.0]])
    got = model_align(topk_ids, 4, 8, weights)
    assert got["expert_end"].tolist() == [8, 8, 16, 24] and got["bits"] == BAD_ID
    assert got["sorted_ids"][:24].tolist() == [2, 4] + [6] * 6 + [5] + [6] * 7 + [0, 1, 3] + [6] * 5
    assert got["expert_of_block"][:3].tolist() == [0, 2, 3]
    assert got["row_of_pair"].tolist() == [16, 17, 0, 18, 1, 8]
    assert got["weight_of_pair"].isnan().tolist() == [False, True, True, False, False, False]
    assert got["token_of_row"][:8].tolist() == [1, 2] + [2] * 6  # padding: the last token
    assert got["row_mask"][[0, 1, 8, 16, 17, 18]].tolist() == [0, 1, 1, 1, 0, 1]  # clamped pairs: no amax
    assert_model_is_the_reference(topk_ids, 4, 8, weights)


def _bad_routing(T, top_k, E, seed):
    """Distinct ids per row, then faults sprinkled in: ids E, −1 and 2**31 − 1, a repeated id, NaN
    and ±inf weights (rows straddle the chunks when CHUNK is no multiple of top_k)."""
    ids = routing(T, top_k, E, seed=seed)
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(T, top_k, generator=g)
    ids[::97, 0] = E
    ids[5::89, top_k - 1] = -1
    ids[7, 0] = 2**31 - 1
    if top_k > 1:
        ids[11::101, 1] = ids[11::101, 0]
    w[3::83, 0] = float("nan")
    w[13, top_k - 1] = float("inf")
    w[17, 0] = -float("inf")
    return ids, w


@pytest.mark.parametrize("T, top_k, E, tile", [(40, 2, 8, 16), (700, 3, 64, 16), (1400, 6, 128, 32), (683, 3, 16, 8)])
def test_model_flags_bad_routing_as_guard_routing(T, top_k, E, tile):
    ids, w = _bad_routing(T, top_k, E, seed=T)
    got = model_align(ids, E, tile, w)
    assert got["bits"] == BAD_ID | BAD_WEIGHT | (REPEATED_ID if top_k > 1 else 0)
    assert_model_is_the_reference(ids, E, tile, w)
    assert_model_is_the_reference(ids.long(), E, tile, w, (tile // 2 or 1, tile))


def test_model_repeated_ids_across_a_chunk_boundary():
    """Row 682 of top_k = 3 holds pairs 2046, 2047 (chunk 0) and 2048 (chunk 1): the repeat in its
    last slot is found by chunk 1's thread, reading the earlier slots from global memory."""
    ids = routing(700, 3, 16, seed=1)
    ids[682, 2] = ids[682, 0]
    got = model_align(ids, 16, 8, torch.ones(700, 3))
    assert got["bits"] == REPEATED_ID
    assert_model_is_the_reference(ids, 16, 8, torch.ones(700, 3))


@pytest.mark.parametrize(
    "T, top_k, E, tile, tiles",
    [(37, 2, 8, 64, (8, 64)), (300, 8, 64, 128, (128, 32)), (3000, 8, 256, 32, (16, 16)), (5, 2, 8, 1, (1, 1))],
)
def test_model_writes_each_gemm_tile_s_block_map(T, top_k, E, tile, tiles):
    assert_model_is_the_reference(routing(T, top_k, E, seed=T, skew=True), E, tile, gemm_tiles=tiles)


# ---- the place launch's grid: any grid of at least a CTA per chunk gives the same outputs ------------
def test_place_ctas_is_a_cta_per_chunk_or_per_fill_slice():
    assert place_ctas(1, 64) == 1 and place_ctas(8, FILL_ROWS + 1) == 2
    assert place_ctas(CHUNK, 10**7) == FILL_CTAS  # the fill alone takes at most FILL_CTAS
    assert place_ctas(40 * CHUNK, 10) == 40  # ... and every chunk its own CTA
    for P in (1, CHUNK - 1, CHUNK, CHUNK + 1, 17 * CHUNK):
        for E, tile in ((8, 1), (128, 8), (256, 128), (MAX_EXPERTS, 256)):
            rows = max_rows(P, E, tile)
            g = place_ctas(P, rows)
            assert g >= -(-P // CHUNK) and g * FILL_ROWS >= min(rows, FILL_CTAS * FILL_ROWS)


@pytest.mark.parametrize("pairs", [1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5])
@pytest.mark.parametrize("extra", [0, 1, 2, 5, 23])
def test_model_is_the_reference_for_any_grid(pairs, extra):
    """From the fewest CTAs (one per chunk: each walks many fill slices) to more CTAs than slices
    (some fill nothing, stage and scan for nothing): the same outputs, every element written once;
    across the single-chunk (every CTA counts the pairs itself) / multi-chunk boundary."""
    top_k, E, tile = (1, 16, 64) if pairs < 8 else (8, 64, 64)
    T = -(-pairs // top_k)
    ids = routing(T, top_k, E, seed=pairs + extra, skew=extra % 2 == 1)
    ctas = -(-T * top_k // CHUNK) + extra
    assert_model_is_the_reference(ids, E, tile, gemm_tiles=(tile // 2, tile), ctas=ctas)


@pytest.mark.parametrize(
    "T, top_k, E, tile",
    [
        (1, 8, 128, 8),
        (1, 8, 256, 8),
        (8, 8, 128, 8),
        (32, 8, 256, 8),
        (128, 8, 128, 8),
        (128, 8, 256, 8),
        (1024, 8, 128, 64),
        (1024, 8, 256, 32),
    ],
)
def test_model_is_the_reference_at_the_layer_s_sizes(T, top_k, E, tile):
    """The bf16 plan's tiles of Qwen3-30B-A3B (E = 128) and DeepSeek-V3 TP8 (E = 256), with the grid the
    host launches (one CTA per 512 rows at decode)."""
    assert_model_is_the_reference(routing(T, top_k, E, seed=T + E), E, tile, gemm_tiles=(tile, tile))


@settings(derandomize=True, deadline=None, database=None, max_examples=30)
@given(st.data())
def test_model_is_the_reference_for_any_grid_fuzzed(data):
    E = data.draw(st.sampled_from([1, 3, 8, 64, 128, 256, MAX_EXPERTS]), label="E")
    top_k = data.draw(st.integers(1, min(E, 8)), label="top_k")
    T = data.draw(st.integers(1, 3 * CHUNK // top_k), label="T")
    tile = data.draw(st.sampled_from([1, 8, 16, 24, 64, 128]), label="tile")
    g0 = data.draw(st.sampled_from([1, tile // 8 or 1, tile]), label="GEMM tile")
    extra = data.draw(st.integers(0, 40), label="CTAs past the chunks")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    g = torch.Generator().manual_seed(seed)
    topk_ids = torch.randint(-1, E + 1, (T, top_k), generator=g, dtype=torch.int32)  # bad ids and repeats too
    w = torch.rand(T, top_k, generator=g)
    w[torch.rand(T, top_k, generator=g) < 0.01] = float("nan")
    assert_model_is_the_reference(
        topk_ids, E, tile, w, gemm_tiles=(g0 if tile % g0 == 0 else tile, tile), ctas=-(-T * top_k // CHUNK) + extra
    )


# ---- the host function on the CPU ---------------------------------------------------------------
@pytest.mark.parametrize("T", [0, 37])
def test_align_on_device_on_the_cpu_is_the_reference(T):
    topk_ids = routing(T, 2, 8, seed=3)
    got, want = align_on_device(topk_ids, 8, 16), align(topk_ids, 8, 16)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name


@pytest.mark.parametrize(
    "args, error, needle",
    [
        ((torch.zeros(2, 2, dtype=torch.int32), MAX_EXPERTS + 1, 16), ValueError, "^num_experts: "),
        ((torch.zeros(2, 2, dtype=torch.int32), 0, 16), ValueError, "^num_experts: "),
        ((torch.zeros(2, 2, dtype=torch.int32), 8, 0), ValueError, "^tile: "),
        ((torch.zeros(2, 2, dtype=torch.int32), 8, 16.0), TypeError, "^tile: "),
        ((torch.zeros(2, 2, dtype=torch.int16), 8, 16), TypeError, "^topk_ids: "),
        (([[0, 1]], 8, 16), TypeError, "^topk_ids: "),
    ],
)
def test_bad_arguments_are_named(args, error, needle):
    with pytest.raises(error, match=needle):
        align_on_device(*args)


# ---- the kernels compile, and their PTX ---------------------------------------------------------
@pytest.fixture(scope="module")
def ptx():
    return {
        (dt, name): k.__ptx__
        for dt in (torch.int32, torch.int64)
        for name, k in compile_align_kernels(dt, keep_ptx=True).items()
    }


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernels_compile_to_ptx_with_the_scheme_s_instructions(ptx, dtype):
    count, place = ptx[(dtype, "count")], ptx[(dtype, "place")]
    for text in (count, place):
        assert ".target sm_90a" in text and f".reqntid {THREADS}, 1, 1" in text
        assert "match.any.sync.b32" in text and "%lanemask_lt" in text and "popc.b32" in text
        # the ids are read in their own width: no conversion launch on the host
        assert re.search(rf"ld\.global(\.\w+)*\.b{dtype.itemsize * 8}\b", text)
    # the stable order uses no atomics: the count launch none, the place launch the error word's OR
    # and the shared-memory sums of a single chunk's totals (the same in any order)
    assert not re.search(r"\b(atom|red)\.", count)
    atomics = re.findall(r"\b(?:atom|red)\.[\w.]+", place)
    assert atomics.count("atom.global.or.b32") == 1 and set(atomics) == {"atom.global.or.b32", "atom.shared.add.u32"}
    assert "shfl.sync.up.b32" in place  # the block scan over the experts
    assert "%nctaid.x" in place and "%nctaid.x" not in count  # the fill slices and scratch go round the grid
    assert "shfl.sync.up" not in count
    # the weight check: w − w compared unordered with 0 (true for NaN and ±inf), one per staged pair
    assert place.count("setp.neu.f32") >= CHUNK // THREADS
    assert re.search(r"st\.global(\.\w+)*\.b64", place)  # the int64 row maps


def test_kernels_compile_once_per_id_dtype():
    import cute_moe

    kernels = compile_align_kernels(torch.int64)
    n = cute_moe.compile_count()
    assert compile_align_kernels(torch.int64) is kernels and set(kernels) == {"count", "place"}
    assert cute_moe.compile_count() == n
    with pytest.raises(TypeError, match="^ids_dtype: "):
        compile_align_kernels(torch.float32)


def test_launch_rows_checks_its_arguments_before_any_launch():
    from cute_moe.rowmaps import RowBuffers, launch_rows

    T, k, E, tile = 5, 2, 8, 16
    bufs = RowBuffers(T, k, E, tile, (8, 16), "cpu")
    ids, w, word = torch.zeros(T, k, dtype=torch.int32), torch.ones(T, k), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^topk_ids: expected a contiguous"):
        launch_rows(torch.zeros(T + 1, k, dtype=torch.int32), w, bufs, word)
    with pytest.raises(ValueError, match="^topk_ids: expected a contiguous"):
        launch_rows(torch.zeros(k, T, dtype=torch.int32).t(), w, bufs, word)
    with pytest.raises(ValueError, match="^topk_weights: expected a contiguous"):
        launch_rows(ids, w.double(), bufs, word)
    with pytest.raises(ValueError, match="^topk_ids: .*CUDA"):
        launch_rows(ids, w, bufs, word)
    with pytest.raises(ValueError, match="^buffers: made for"):
        sort_rows_on_device(ids, w, E, tile, (16,), buffers=bufs)
    with pytest.raises(ValueError, match="^gemm_tiles: tokens_tile=32 does not divide the alignment tile 16"):
        sort_rows_on_device(ids, w, E, tile, (32,))


def test_row_buffers_size_every_map():
    from cute_moe.rowmaps import RowBuffers

    T, k, E, tile = 300, 8, 64, 64
    bufs = RowBuffers(T, k, E, tile, (16, 64), "cpu", zeroed=10)
    rows = max_rows(T * k, E, tile)
    sizes = {name: t.numel() for name, t in bufs.out.items()}
    assert sizes == dict(
        sorted_ids=rows,
        expert_of_block=rows // tile,
        expert_end=E,
        token_of_row=rows,
        weight_of_row=rows,
        row_of_pair=T * k,
        weight_of_pair=T * k,
        row_mask=rows,
        blocks0=rows // 16,
        blocks1=rows // 64,
    )
    assert bufs.counts.numel() == -(-T * k // CHUNK) * E and bufs.scratch.numel() == 10
    assert set(bufs.rows.blocks) == {16, 64} and bufs.rows.blocks[16][0] is bufs.out["blocks0"]


# ---- the benchmark times what the layer launches ----------------------------------------------------
def test_bench_align_takes_the_bf16_layer_s_tiles_at_each_T(monkeypatch):
    from cute_moe.lab import bench_align
    from cute_moe.plan import plan
    from moe_spec.problem import get_shape
    from moe_spec.validate import MoEDims

    assert bench_align.TOKENS == (1, 8, 32, 128, 1024, 4096)
    assert {"qwen3-30b-a3b", "deepseek-v3:tp8"} <= set(bench_align.SPECS)
    for spec in bench_align.SPECS:
        s = get_shape(spec)
        for T in bench_align.TOKENS:
            p = plan(MoEDims(T=T, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k))
            if p.path == "decode":  # the one launch aligns nothing: the bench times the grouped pipeline's
                with monkeypatch.context() as m:
                    m.setattr(importlib.import_module("cute_moe.plan"), "ONE_LAUNCH", False)
                    p = plan(MoEDims(T=T, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k))
            assert p.path == "grouped"
            assert bench_align.layer_tiles(spec, T) == (p.align_tile, (p.gemm1.tokens_tile, p.gemm2.tokens_tile))


def test_bench_align_table_and_its_refusals_before_any_gpu_work(tmp_path, capsys):
    from cute_moe.lab import bench_align

    row = {
        "shape": "qwen3-30b-a3b",
        "E": 128,
        "T": 1,
        "tile": 8,
        "gemm_tiles": [8, 8],
        "place_ctas": 1,
        "device_us": 3.0,
        "PlacePairs_cold_us": 4.0,
        "CountExperts_cold_us": 0.0,
        "PlacePairs_warm_us": 2.5,
        "CountExperts_warm_us": 0.0,
        "torch_us": 50.0,
        "equal": False,
    }
    md = bench_align.markdown({"date": "d", "device": "H200", "commit": "c", "command": "cmd", "cells": [row]})
    assert "| qwen3-30b-a3b | 128 | 1 | 8 (8, 8) | 1 | 3.0 | 4.0 | 0.0 | 2.5 | 0.0 | 50.0 | **no** |" in md
    for argv in (["--shapes", "no-such-shape"], ["--tokens", "0"]):
        with pytest.raises(SystemExit) as stop:
            bench_align.main(argv)
        assert stop.value.code == 2
    (tmp_path / "old.md").write_text("x")
    with pytest.raises(SystemExit) as stop:
        bench_align.main(["--out", str(tmp_path)])
    assert stop.value.code == 2 and "python -m cute_moe.lab.bench_align: error: --out: " in capsys.readouterr().err

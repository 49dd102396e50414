"""triton_moe.align (Triton kernels, the interpreter on the CPU) is the reference alignment
(moe_spec.align) bit for bit, over varied routings."""

import pytest
import torch
from test_align import routing

from moe_spec.align import align
from triton_moe.align import CHUNK, MAX_EXPERTS, align_block_size

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
@pytest.mark.parametrize(
    "T, top_k, E, block_m",
    [
        (0, 2, 4, 16),  # no pairs at all
        (1, 1, 4, 16),  # a single pair
        (1, 8, 512, 16),  # E = 512, almost all experts empty
        (37, 2, 8, 16),  # T not a multiple of anything
        (5, 3, 7, 64),  # a block much larger than any run
        (300, 8, 64, 64),  # several chunks of 256 pairs: offsets carried across chunks
        (3000, 8, 256, 32),  # 24 000 pairs, 94 chunks (more than one scan step)
    ],
)
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


# --- chunks of whole rows, launches, and the checks of topk_ids ---------------------------------------

from moe_spec.validate import BAD_ID, REPEATED_ID, check  # noqa: E402
from triton_moe.jit import count_compilations  # noqa: E402


@pytest.mark.parametrize(
    "T, top_k, E",
    [
        (85, 3, 16),  # 255 pairs: one chunk of 85 rows
        (86, 3, 16),  # 258 pairs: a second chunk (a chunk holds 85 rows of 3)
        (300, 3, 16),  # 900 pairs, 4 chunks, none straddles a row
    ],
)
def test_chunks_hold_whole_rows_in_two_launches(T, top_k, E, word):
    topk_ids = routing(T, top_k, E, seed=T)
    with count_compilations() as counter:
        got = align_block_size(topk_ids, E, 16)
    assert counter.launches == ["_count_kernel", "_place_kernel"]
    assert_same(got, align(topk_ids, E, 16))
    assert int(word) == 0


@pytest.mark.parametrize("T, top_k", [(20, 4), (200, 4)], ids=["one chunk", "four chunks"])
def test_bad_ids_are_clamped_and_flagged(T, top_k, word):
    """Ids outside [0, E) (a large int64 too: no truncation into range) are aligned as if clamped
    into range — the reference alignment of the clamped ids — and set BAD_ID; a token whose row
    repeats an expert sets REPEATED_ID. check() raises naming topk_ids and clears the word."""
    E = 8
    ids = routing(T, top_k, E, seed=3).long()
    ids[1, 2] = E
    ids[T - 1, 0] = -5
    ids[T // 2, 3] = 2**33  # truncated to 32 bits it would read 0
    got = align_block_size(ids, E, 16)
    assert_same(got, align(ids.clamp(0, E - 1), E, 16))
    assert int(word) == BAD_ID
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E\)"):
        check("cpu")
    assert int(word) == 0

    ids = routing(T, top_k, E, seed=4)
    ids[T - 1, 3] = ids[T - 1, 1]  # a repeat in the last row (the last chunk under "four chunks")
    assert_same(align_block_size(ids, E, 16), align(ids, E, 16))
    assert int(word) == REPEATED_ID
    with pytest.raises(ValueError, match="^topk_ids: expected distinct ids in each token's row"):
        check("cpu")


def test_the_same_expert_in_two_rows_is_not_a_repeat(word):
    ids = torch.tensor([[0, 1], [1, 0], [1, 2]], dtype=torch.int32)  # ids repeat across rows, never within
    assert_same(align_block_size(ids, 4, 16), align(ids, 4, 16))
    assert int(word) == 0


SM90_SCRIPT = r"""
import json
from triton_moe.align import PLACE_WARPS, RANK_ROWS, _count_kernel, _launch_sizes, _place_kernel
from triton_moe.sm90 import compile_sm90
from triton_moe.kernels_rows import amax_kernel, combine_kernel, quantize_kernel

out = {}
for E, bm, top_k in ((8, 16, 2), (256, 128, 8), (1024, 16, 8)):
    cex = _launch_sizes(1, top_k, E, 1)[2]
    r = compile_sm90(_count_kernel, {"topk_ids_ptr": "*i64", "counts_ptr": "*i32", "num_pairs": "i32"}, cex,
                     num_warps=4, num_stages=1)
    out[f"count E={E}"] = r["spill_bytes"]
    ptrs = ("topk_ids", "counts", "sorted_ids", "expert_of_block", "expert_end", "error")
    sig = {f"{n}_ptr": "*i32" for n in ptrs} | {"num_pairs": "i32", "num_chunks": "i32", "num_blocks": "i32"}
    r = compile_sm90(_place_kernel, sig, cex | dict(BLOCK_M=bm, SCAN_ROWS=16, BLOCKS_PER_PROGRAM=64,
                                                    RANK_ROWS=RANK_ROWS),
                     num_warps=PLACE_WARPS, num_stages=1)
    out[f"place E={E}"] = r["spill_bytes"]
r = compile_sm90(amax_kernel, {"x_ptr": "*bf16", "amax_ptr": "*fp32", "num_rows": "i32", "K": "i32"},
                 dict(BLOCK=1024), num_warps=4, num_stages=1)
out["amax"] = r["spill_bytes"]
for q in (1, 2, 3):
    sig = {"a_ptr": "*bf16", "amax_ptr": "*fp32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "zero_ptr": "*fp32",
           "num_rows": "i32", "K": "i32", "num_amax": "i32", "zero_count": "i32"}
    r = compile_sm90(quantize_kernel, sig, dict(QUANT=q, AMAX_GIVEN=q == 1, GROUPS=8, INTERPRETER=False),
                     num_warps=4, num_stages=1)
    out[f"quantize {q}"] = r["spill_bytes"]
r = compile_sm90(combine_kernel, {"y_ptr": "*bf16", "out_ptr": "*bf16", "num_tokens": "i32", "K": "i32"},
                 dict(TOP_K=8, BLOCK=1024, INTERPRETER=False), num_warps=4, num_stages=1)
out["combine"] = r["spill_bytes"]
print(json.dumps(out))
"""


def test_the_small_kernels_compile_for_sm90():
    """The alignment, amax, quantize and combine kernels compile for Hopper on the CPU (the
    interpreter accepts things the compiler refuses, e.g. a plain-int global in a kernel) and fit
    their registers: the place kernel too, since it ranks RANK_ROWS pairs of a chunk per step (its
    whole-chunk 256 × 256 comparison spilled 104–328 bytes at E = 8…256)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SM90_SCRIPT], capture_output=True, text=True, env=env)
    if run.returncode and "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert run.returncode == 0, run.stderr[-2000:]
    spills = json.loads(run.stdout.strip().splitlines()[-1])
    assert {k: v for k, v in spills.items() if v} == {}, spills


# --- two chunk widths in one binary -------------------------------------------------------------------

from triton_moe.align import (  # noqa: E402
    SMALL_CHUNK,
    _widths,  # noqa: E402
    buffer_sizes,
    chunk_pairs,
)


@pytest.mark.parametrize("top_k, E", [(8, 128), (2, 8), (6, 256), (1, 16)])
def test_small_and_large_chunks_on_both_sides_of_the_limit(top_k, E, word):
    """Small alignments take SMALL_CHUNK-pair chunks, larger ones CHUNK-pair chunks: the reference
    on both sides of the limit, with the chunks the buffers were sized for, bit for bit."""
    small, large, limit = _widths(top_k)
    assert small == SMALL_CHUNK and large == CHUNK and limit == 16 * (SMALL_CHUNK // top_k * top_k)
    for T in (1, limit // top_k, limit // top_k + 1):
        P = T * top_k
        width, per_chunk = chunk_pairs(top_k, P)
        assert width == (small if P <= limit else large) and per_chunk % top_k == 0
        assert buffer_sizes(T, top_k, E, 16)["chunks"] == -(-P // per_chunk)
        for skew in (False, True):
            topk_ids = routing(T, top_k, E, seed=T + top_k, skew=skew)
            assert_same(align_block_size(topk_ids, E, 16), align(topk_ids, E, 16))
    assert int(word) == 0


def test_small_and_large_chunks_share_their_binaries():
    """The chunk width is a run-time branch: T on both sides of the limit gives one key per kernel."""
    with count_compilations(dry_run=True) as counter:
        for T in (1, 2, 127, 128, 129, 500, 4096):
            align_block_size(routing(T, 8, 128, seed=T), 128, 16)
    assert {k: len(v) for k, v in counter.keys.items()} == {"_count_kernel": 1, "_place_kernel": 1}


def test_a_repeat_found_in_a_later_rank_step(word):
    """A large chunk ranks RANK_ROWS pairs per step: a repeat and a bad id in the chunk's last step
    are flagged, and the pairs before them are placed as the reference places them."""
    T, top_k, E = 200, 8, 64  # 1600 pairs: large chunks of 256 (32 rows), the last step holds rows 24–31
    ids = routing(T, top_k, E, seed=9)
    ids[31, 7] = ids[31, 2]
    assert_same(align_block_size(ids, E, 16), align(ids, E, 16))
    assert int(word) == REPEATED_ID
    word.zero_()
    ids = routing(T, top_k, E, seed=9).long()
    ids[30, 5] = E + 3
    assert_same(align_block_size(ids, E, 16), align(ids.clamp(0, E - 1), E, 16))
    assert int(word) == BAD_ID


# --- the GPU micro-benchmark's command line (runs on the CPU up to the point it needs CUDA) ---------


def test_bench_align_refuses_a_non_empty_out(tmp_path):
    from triton_moe.lab import bench_align

    (tmp_path / "old.md").write_text("an earlier run")
    with pytest.raises(SystemExit, match="is not empty"):
        bench_align.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="every T must be at least 1"):
        bench_align.main(["--out", str(tmp_path / "new"), "--tokens", "0"])


def test_bench_align_variants_restore_the_constants():
    from triton_moe import align as align_mod
    from triton_moe.lab import bench_align

    before = align_mod.PLACE_WARPS, align_mod.SMALL_CHUNK
    with bench_align._variant("256-pair chunks"):
        assert chunk_pairs(8, 8) == (CHUNK, CHUNK)
        topk_ids = routing(40, 8, 64, seed=1)
        assert_same(align_block_size(topk_ids, 64, 16), align(topk_ids, 64, 16))
    with bench_align._variant("4 warps"):
        assert align_mod.PLACE_WARPS == 4
    assert (align_mod.PLACE_WARPS, align_mod.SMALL_CHUNK) == before and chunk_pairs(8, 8) == (SMALL_CHUNK, 64)


@pytest.mark.gpu
def test_bench_align_on_the_gpu(tmp_path):
    import json

    from triton_moe.lab import bench_align

    bench_align.main(["--out", str(tmp_path), "--shapes", "qwen3-30b-a3b", "--tokens", "1", "200"])
    rows = json.loads((tmp_path / "bench_align.json").read_text())["rows"]
    assert [r["T"] for r in rows] == [1, 200]
    assert all(r[v]["reference"] and r[v]["us"] > 0 for r in rows for v in bench_align.VARIANTS)
    assert "| qwen3-30b-a3b | 1 |" in (tmp_path / "bench_align.md").read_text()


def test_bench_align_table_names_every_variant_and_flags_a_mismatch():
    from triton_moe.lab import bench_align

    cell = lambda us, ok=True: {"us": us, "p10_us": us - 0.5, "p90_us": us + 0.5, "chunk": 64, "reference": ok}  # noqa: E731
    row = {"shape": "qwen3-30b-a3b", "T": 1, "pairs": 8, "block_m": 16}
    result = {
        "device": "H200",
        "date": "d",
        "commit": "c",
        "command": "python -m triton_moe.lab.bench_align",
        "rows": [
            row | {v: cell(5.0 + i) for i, v in enumerate(bench_align.VARIANTS)},
            row | {"T": 8, "pairs": 64} | {v: cell(5.0, v != "4 warps") for v in bench_align.VARIANTS},
        ],
    }
    md = bench_align.to_markdown(result)
    assert all(f"{v} µs" in md for v in bench_align.VARIANTS)
    assert "| qwen3-30b-a3b | 1 | 8 | 16 | 5.0 (4.5–5.5) | 6.0 (5.5–6.5) | 7.0 (6.5–7.5) | 64 | yes |" in md
    assert md.rstrip().endswith("| 64 | **no** |")

"""Device time of the Triton alignment (``align_block_size``: count + place) on the GPU.

    python -m triton_moe.lab.bench_align --out DIR [--shapes ...] [--tokens 1 8 32 128 4096]

For each catalog shape and T: µs per ``align_block_size`` call, CUDA-graph replayed over rotated
routings (:func:`moe_spec.timing.time_cuda_graph`: both launches and the gap between them, no host
time), with the BLOCK_M the bf16 plan of that T aligns to. Three variants per row:

* ``shipped``: this module's constants (64-pair chunks up to the small limit, :data:`PLACE_WARPS` warps);
* ``4 warps``: the same with 4 warps per place program;
* ``256-pair chunks``: ``SMALL_CHUNK = CHUNK`` (a binary compiled for this run only): every T with
  256-pair chunks, and up to 16 chunks each ranked whole (256 × 256 at once) as the alignment
  did before its small chunks — the comparison that tells what the 64-pair chunks bring.

Writes ``bench_align.md`` and ``bench_align.json`` (date, device, commit, command) into ``--out``,
which must be new or empty.
"""

from __future__ import annotations

import contextlib
import json
import sys

from moe_spec import studyout
from moe_spec.cli import ArgumentParser

FILES = ("bench_align.md", "bench_align.json")
DEFAULT_SHAPES = ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8"]
DEFAULT_TOKENS = [1, 8, 32, 128, 4096]
VARIANTS = ["shipped", "4 warps", "256-pair chunks"]


@contextlib.contextmanager
def _variant(name: str):
    """The alignment's module constants for one variant (restored afterwards)."""
    from triton_moe import align

    saved = align.PLACE_WARPS, align.SMALL_CHUNK
    if name == "4 warps":
        align.PLACE_WARPS = 4
    elif name == "256-pair chunks":
        align.SMALL_CHUNK = align.CHUNK
    align._launch_sizes.cache_clear()
    align._bound.cache_clear()
    try:
        yield
    finally:
        align.PLACE_WARPS, align.SMALL_CHUNK = saved
        align._launch_sizes.cache_clear()
        align._bound.cache_clear()


def measure(shapes, tokens, n_sets: int = 4) -> list[dict]:
    import torch

    from moe_spec.align import align
    from moe_spec.problem import get_shape, route
    from moe_spec.timing import time_cuda_graph
    from moe_spec.validate import MoEDims, check
    from triton_moe.align import align_block_size, chunk_pairs
    from triton_moe.plan import plan

    rows = []
    for label in shapes:
        shape = get_shape(label)
        E, top_k = shape.num_experts, shape.top_k
        for T in tokens:
            block_m = plan(MoEDims(T=T, E=E, K=shape.hidden, I=shape.intermediate, top_k=top_k)).align_tile
            g = torch.Generator(device="cuda").manual_seed(T)
            ids = [route(torch.randn(T, E, device="cuda", generator=g), top_k)[1] for _ in range(n_sets)]
            want = align(ids[0].cpu(), E, block_m)
            row = {"shape": label, "E": E, "top_k": top_k, "T": T, "pairs": T * top_k, "block_m": block_m}
            for name in VARIANTS:
                with _variant(name):
                    got = align_block_size(ids[0], E, block_m)
                    same = all(
                        torch.equal(getattr(got, f).cpu(), getattr(want, f))
                        for f in ("sorted_ids", "expert_of_block", "expert_end")
                    )
                    t = time_cuda_graph(
                        lambda i: lambda: align_block_size(ids[i], E, block_m), n_sets, replays=20, min_calls=20
                    )
                    row[name] = {
                        "us": t.median_us,
                        "p10_us": t.p10_us,
                        "p90_us": t.p90_us,
                        "chunk": chunk_pairs(top_k, T * top_k)[0],
                        "reference": same,
                    }
            check("cuda")
            rows.append(row)
            print(
                " | ".join(f"{row[k]}" for k in ("shape", "T", "block_m"))
                + " | "
                + " | ".join(f"{row[v]['us']:.1f}" for v in VARIANTS),
                flush=True,
            )
    return rows


def to_markdown(result: dict) -> str:
    lines = [
        f"# Triton alignment device time on {result['device']}",
        "",
        *studyout.header_lines(result),
        "",
        "µs per `align_block_size` call (count + place), CUDA-graph replay over rotated routings, "
        "median (p10–p90). BLOCK_M: the bf16 plan's alignment tile at that T. `ref`: the result equals "
        "moe_spec.align's.",
        "",
        "| shape | T | pairs | BLOCK_M | " + " | ".join(f"{v} µs" for v in VARIANTS) + " | chunk (shipped) | ref |",
        "|---|---|---|---|" + "---|" * len(VARIANTS) + "---|---|",
    ]
    for r in result["rows"]:
        cells = [f"{r[v]['us']:.1f} ({r[v]['p10_us']:.1f}–{r[v]['p90_us']:.1f})" for v in VARIANTS]
        ok = all(r[v]["reference"] for v in VARIANTS)
        lines.append(
            f"| {r['shape']} | {r['T']} | {r['pairs']} | {r['block_m']} | "
            + " | ".join(cells)
            + f" | {r['shipped']['chunk']} | {'yes' if ok else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    from moe_spec.runinfo import command_line, require_cuda, run_info

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a new or empty directory for bench_align.md and .json")
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    p.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD)")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    try:
        out = studyout.check_out(a.out, FILES)
    except studyout.OutError as exc:
        raise SystemExit(f"bench_align: error: {exc}") from None
    if any(t < 1 for t in a.tokens):
        raise SystemExit("bench_align: error: --tokens: every T must be at least 1")
    require_cuda("bench_align")
    result = run_info(command_line("python -m triton_moe.lab.bench_align", argv), cuda=True, commit=a.commit)
    result["rows"] = measure(a.shapes, a.tokens)
    studyout.write_files(out, dict(zip(FILES, (to_markdown(result), json.dumps(result, indent=1) + "\n"))))
    print(to_markdown(result))


if __name__ == "__main__":
    main()

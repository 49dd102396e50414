"""The one-launch decode kernel (:func:`cute_moe.decode.decode_fused_moe`) against the grouped pipeline.

    python -m cute_moe.lab.bench_decode --out DIR [--deadline-s 300] [--shapes ...] [--tokens 1,2,8]
        [--quant bf16,fp8_tensor,fp8_tensor_static,fp8_channel,fp8_block]
        [--stages N] [--ctas-per-sm M] [--fp8-overlap on|off]

Every cell (format, catalog shape, T with T·top_k within the kernel's pairs) times one whole layer call of
each path, CUDA-graph replayed over rotated weight sets (cold L2), median µs, and checks the one-launch
output against the fp64 oracle (rel L2; FP8: the W8A8 model on the quantized weights) and the grouped
pipeline's (rel L2 and whether the bits are equal: both round h, y and the sum once, in the same order —
FP8: quantize x and h the same way), and a rerun of it (bits).  ``fp8_tensor_static`` is fp8_tensor with
static activation scales (``a1_scale``, ``a2_scale``: 1/64 each).  ``--stages``, ``--ctas-per-sm`` and
``--fp8-overlap`` run the one launch as a variant of the kernel's constants (:func:`apply_variant`: its ring
depth, CTAs per SM, FP8 overlap), named in the results.  The eager
column is plain back-to-back calls (one synchronization per repeat): what a caller without graphs pays.

Writes ``decode.md`` and ``decode.json`` into ``--out`` (new or empty), rewritten after every cell.
"""

from __future__ import annotations

import json
import sys

from moe_spec import studyout

FILES = ("decode.md", "decode.json")
SHAPES = ("qwen3-30b-a3b", "deepseek-v3:tp8", "mixtral-8x7b")
TOKENS = (1, 2, 8)
QUANTS = ("bf16",)
FORMATS = ("bf16", "fp8_tensor", "fp8_tensor_static", "fp8_channel", "fp8_block")
STATIC_SCALE = 1 / 64  # a1_scale and a2_scale of fp8_tensor_static: x ~ N(0, 1) and h stay inside ±448·s
CELL_S = 25.0  # a cell starts only when this much time is left before the deadline


# one CTA's shared memory beyond its ring: barriers, queue, tables (decode_parts.smem_bytes), and the 1 KiB the
# driver reserves per CTA
_CTA_EXTRA_BYTES = 2048 + 1024
_SM_SMEM_BYTES = 228 * 1024


def add_variant_options(parser) -> None:
    """The one launch's variant options (``bench_decode`` and ``trace_decode``)."""
    parser.add_argument("--stages", type=int, default=None, help="ring stages of the one launch [the kernel's]")
    parser.add_argument("--ctas-per-sm", type=int, default=None, help="CTAs per SM of the one launch [the kernel's]")
    parser.add_argument("--fp8-overlap", choices=("on", "off"), default=None, help="FP8_OVERLAP [the kernel's]")


def apply_variant(a) -> dict:
    """Set the one launch's constants from the variant options (each checked, named if bad) and return the
    variant as run: {"stages", "ctas_per_sm", "fp8_overlap"}."""
    from .. import decode_parts as dp

    stages = dp.STAGES if a.stages is None else a.stages
    ctas = dp.CTAS_PER_SM if a.ctas_per_sm is None else a.ctas_per_sm
    if stages < 2:
        raise studyout.UsageError(f"--stages: at least 2 (a ring), got {stages}")
    if ctas < 1:
        raise studyout.UsageError(f"--ctas-per-sm: at least 1, got {ctas}")
    per_cta = stages * (dp.stage_tx_bytes() + dp.TOKENS * dp.TILE_K * 2) + _CTA_EXTRA_BYTES
    if per_cta * ctas > _SM_SMEM_BYTES:
        raise studyout.UsageError(
            f"--ctas-per-sm: {ctas} CTAs of {stages} stages need {per_cta * ctas} B of shared memory, "
            f"an SM has {_SM_SMEM_BYTES}"
        )
    dp.STAGES, dp.CTAS_PER_SM = stages, ctas
    if a.fp8_overlap is not None:
        dp.FP8_OVERLAP = a.fp8_overlap == "on"
    return {"stages": dp.STAGES, "ctas_per_sm": dp.CTAS_PER_SM, "fp8_overlap": dp.FP8_OVERLAP}


def _cell(shape, T: int, n_sets: int, fmt: str = "bf16") -> dict:
    """One cell, the grouped pipeline timed with the one launch off (``cute_moe.plan.ONE_LAUNCH``)."""
    from ..moe import plan_switches

    with plan_switches(ONE_LAUNCH=False):
        return _timed_cell(shape, T, n_sets, fmt)


def _timed_cell(shape, T: int, n_sets: int, fmt: str = "bf16") -> dict:
    import torch

    from moe_spec.oracle import oracle, rel_l2
    from moe_spec.problem import make_inputs
    from moe_spec.timing import time_cuda_graph, wall_us

    from ..decode import decode_fused_moe
    from ..moe import fused_moe

    quant = None if fmt == "bf16" else fmt.removesuffix("_static")
    sets = []
    for i in range(n_sets):
        kw = make_inputs(shape, T, quant, seed=i, device="cuda").to("cuda").kwargs()
        if quant is None:
            kw = {n: kw[n] for n in ("x", "w1", "w2", "topk_weights", "topk_ids")}
        if fmt.endswith("_static"):
            kw |= {n: torch.full((1,), STATIC_SCALE, device="cuda") for n in ("a1_scale", "a2_scale")}
        sets.append(kw)
    one = decode_fused_moe(**sets[0])
    again = decode_fused_moe(**sets[0])
    grouped = fused_moe(**sets[0])
    ref = oracle(**sets[0])
    t_one = time_cuda_graph(lambda i: lambda: decode_fused_moe(**sets[i]), n_sets)
    t_grouped = time_cuda_graph(lambda i: lambda: fused_moe(**sets[i]), n_sets)
    eager_one = wall_us(
        [lambda s=s: decode_fused_moe(**s) for s in sets], calls=50, repeats=5, sync=torch.cuda.synchronize
    )
    eager_grouped = wall_us(
        [lambda s=s: fused_moe(**s) for s in sets], calls=50, repeats=5, sync=torch.cuda.synchronize
    )
    return {
        "one_us": round(t_one.median_us, 1),
        "grouped_us": round(t_grouped.median_us, 1),
        "ratio": round(t_one.median_us / t_grouped.median_us, 3),
        "one_eager_us": round(eager_one, 1),
        "grouped_eager_us": round(eager_grouped, 1),
        "rel_l2_oracle": rel_l2(one, ref),
        "rel_l2_grouped": rel_l2(one, grouped.double()),
        "equal_grouped": bool(torch.equal(one, grouped)),
        "rerun_equal": bool(torch.equal(one, again)),
    }


def _write(out, results: dict) -> None:
    lines = [
        f"# cute_moe's one-launch decode kernel on {results['device']}",
        "",
        *studyout.header_lines(results),
        f"- one launch: {results.get('variant')}",
        "",
        "Whole layer. one-launch: `cute_moe.decode.decode_fused_moe`; grouped: `cute_moe.fused_moe` "
        "(alignment, GEMM1, GEMM2, combine). µs: CUDA-graph replay, cold L2, median; eager: back-to-back "
        "calls, µs per call. rel L2 against the fp64 oracle and against the grouped output; equal: the "
        "bits of the two outputs; rerun: the one-launch output again, bit for bit.",
        "",
        "| format | shape | T | one-launch µs | grouped µs | one / grouped | eager one / grouped µs | rel L2 oracle "
        "| rel L2 grouped | equal | rerun |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r.get('quant', 'bf16')} | {r['shape']} | {r['T']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r.get('quant', 'bf16')} | {r['shape']} | {r['T']} | {r['one_us']:.1f} | {r['grouped_us']:.1f} "
            f"| {r['ratio']:.3f} "
            f"| {r['one_eager_us']:.1f} / {r['grouped_eager_us']:.1f} | {r['rel_l2_oracle']:.1e} "
            f"| {r['rel_l2_grouped']:.1e} | {r['equal_grouped']} | {r['rerun_equal']} |"
        )
    if results["cut"]:
        lines += ["", f"Not run (deadline or over the kernel's pairs): {', '.join(results['cut'])}"]
    text = json.dumps(results, indent=1, default=str) + "\n"
    studyout.write_files(out, dict(zip(FILES, ("\n".join(lines) + "\n", text))))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m cute_moe.lab.bench_decode"
    parser = studyout.gpu_study_parser(prog, __doc__, FILES, 300.0)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="catalog shapes, comma separated")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, comma separated")
    parser.add_argument("--quant", default=",".join(QUANTS), help=f"formats, comma separated, of {FORMATS}")
    parser.add_argument("--sets", type=int, default=4, help="weight sets rotated per timing (cold L2) [4]")
    add_variant_options(parser)
    a, out, run = studyout.start_gpu_study(prog, parser, argv, FILES)
    try:
        shapes = studyout.split_list("--shapes", a.shapes)
        tokens = studyout.positive_ints("--tokens", a.tokens)
        quants = studyout.split_list("--quant", a.quant)
        bad = [q for q in quants if q not in FORMATS]
        if bad:
            raise studyout.UsageError(f"--quant: {', '.join(bad)} not among {', '.join(FORMATS)}")
        variant = apply_variant(a)
    except studyout.UsageError as exc:
        parser.error(str(exc))
    if a.sets < 1:
        parser.error(f"--sets: must be at least 1, got {a.sets}")
    import torch

    from moe_spec.problem import get_shape

    from ..decode_parts import PAIR_LANES

    results = {**run, "variant": variant, "rows": [], "cut": []}
    _write(out, results)
    took = studyout.run_cells(
        results,
        [{"quant": q, "shape": spec, "T": T} for q in quants for spec in shapes for T in tokens],
        lambda cell: _cell(get_shape(cell["shape"]), cell["T"], a.sets, cell["quant"]),
        lambda r: _write(out, r),
        deadline_s=a.deadline_s,
        cell_s=CELL_S,
        skip=lambda cell: cell["T"] * get_shape(cell["shape"]).top_k > PAIR_LANES,
        after=lambda i: torch.cuda.empty_cache(),
    )
    print(f"\n{(out / 'decode.md').read_text()}")
    print(f"bench_decode done in {took:.0f} s")


if __name__ == "__main__":
    main()

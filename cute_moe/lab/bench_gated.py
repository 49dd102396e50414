"""The gated FP8 GEMM1 (SiLU·up in its epilogue), with and without the intermediate's quantization in
that epilogue, against the plain GEMM1 and its SiLU·up pass, whole layer.

    python -m cute_moe.lab.bench_gated --out DIR [--deadline-s 300] [--shapes ...] [--tokens 1,8,...]
        [--quants fp8_block,fp8_tensor,fp8_channel] [--static]

:data:`cute_moe.plan.GATED_FP8_GEMM1` names the paths (``"swap_ab"``, ``"normal"``) on which the fused
FP8 layer's GEMM1 is gated, and :data:`cute_moe.plan.EPILOGUE_QUANT` whether a gated GEMM1 on the normal
path also quantizes the intermediate in its epilogue (:mod:`cute_moe.epilogue_quant`: ``static`` with
static scales, else the amax there and the quantize launch after). Every cell times one whole
``fused_moe`` call three times on the same inputs: **plain** (no gated path), **gated** (both paths,
``EPILOGUE_QUANT`` off: GEMM1 writes its fp32 intermediate, the amax and quantize launches follow) and
**epilogue** (both paths, ``EPILOGUE_QUANT`` on, the plan's default) — CUDA-graph replayed over rotated
weight sets (cold L2, :func:`moe_spec.timing.time_cuda_graph`), median µs. The outputs are compared with
plain's (rel L2: the gated layer computes the same fp32 values in the same order, so 0 is expected, and
anything else is a finding) and each is rerun (bit-identical). ``--static`` gives fp8_tensor cells calibrated
static scales (:func:`moe_spec.oracle.calibrate_static_scales`, ``a1_scale`` / ``a2_scale``), the ``static`` epilogue.
The plan's switches are the ones ``fused_moe`` reads, set for the run and restored after it.

Writes ``gated.md`` and ``gated.json`` into ``--out`` (new or empty), rewritten after every cell; no
cell starts after ``--deadline-s``.
"""

from __future__ import annotations

import json
import sys

from moe_spec import studyout

FILES = ("gated.md", "gated.json")
#: The catalog shapes compare times by default (compare.cases.DEFAULT_SHAPES; the lab does not import compare).
SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
TOKENS = (1, 8, 32, 128, 1024, 4096)
QUANTS = ("fp8_block",)
KNOWN_QUANTS = ("fp8_tensor", "fp8_channel", "fp8_block")
#: The variants a cell times: (name, GATED_FP8_GEMM1, EPILOGUE_QUANT).
VARIANTS = (("plain", (), True), ("gated", ("swap_ab", "normal"), False), ("epilogue", ("swap_ab", "normal"), True))
#: A cell starts only when this much time is left before the deadline.
CELL_S = 20.0


def _inputs(shape, T: int, quant: str, n_sets: int, static: bool):
    """``n_sets`` problems of ``T`` tokens in ``quant`` on the GPU, each with its own weights (cold L2);
    with ``static`` (fp8_tensor), the calibrated static scales of the first set given to every set."""
    from moe_spec.oracle import calibrate_static_scales
    from moe_spec.problem import make_inputs

    sets = [make_inputs(shape, T, quant, seed=i, device="cuda").to("cuda").kwargs() for i in range(n_sets)]
    if static and quant == "fp8_tensor":
        keys = ("x", "w1", "w2", "topk_weights", "topk_ids")
        a1, a2 = calibrate_static_scales(
            *(sets[0][k] for k in keys), quant=quant, w1_scale=sets[0]["w1_scale"], w2_scale=sets[0]["w2_scale"]
        )
        for kw in sets:
            kw.update(a1_scale=a1.to("cuda"), a2_scale=a2.to("cuda"))
    return sets


def _measure(sets: list, gated: tuple, epilogue_quant: bool = True) -> dict:
    """Time and check ``fused_moe`` on ``sets`` with :data:`~cute_moe.plan.GATED_FP8_GEMM1` = ``gated`` (and
    :data:`~cute_moe.plan.EPILOGUE_QUANT` = ``epilogue_quant``)."""
    import torch

    from moe_spec.timing import time_cuda_graph

    from ..moe import fused_moe, plan_switches

    with plan_switches(GATED_FP8_GEMM1=gated, EPILOGUE_QUANT=epilogue_quant):
        out, again = fused_moe(**sets[0]), fused_moe(**sets[0])
        t = time_cuda_graph(lambda i: lambda: fused_moe(**sets[i]), len(sets))
        torch.cuda.synchronize()
        return {"us": round(t.median_us, 1), "out": out, "bit_identical": bool(torch.equal(out, again))}


def _write(out, results: dict) -> None:
    lines = [
        f"# cute_moe's gated FP8 GEMM1 on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Whole fused_moe calls, CUDA-graph replay, cold L2, median µs. plain: GATED_FP8_GEMM1 = () (GEMM1 "
        "writes H [M_pad, 2I], a SiLU·up + amax pass); gated: both paths, EPILOGUE_QUANT off (SiLU·up in "
        "GEMM1's epilogue, fp32 intermediate, amax and quantize launches); epilogue: both paths, EPILOGUE_QUANT "
        "on (normal path: the intermediate's amax, or with static scales its codes, in GEMM1's epilogue); with "
        "static scales (fp8_tensor rows marked static) no amax is taken anywhere. rel L2: against plain; bits: a "
        "rerun of each bit-identical.",
        "",
        "| shape | format | T | plain µs | gated µs | epilogue µs | gated / plain | epilogue / plain "
        "| rel L2 gated, epilogue | bits (plain, gated, epilogue) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['quant']} | {r['T']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['quant']}{' static' if r.get('static') else ''} | {r['T']} "
            f"| {r['plain_us']:.1f} | {r['gated_us']:.1f} "
            f"| {r['epilogue_us']:.1f} | {r['gated_us'] / r['plain_us']:.3f} | {r['epilogue_us'] / r['plain_us']:.3f} "
            f"| {r['gated_rel_l2']:.1e}, {r['epilogue_rel_l2']:.1e} "
            f"| {r['plain_bits']}, {r['gated_bits']}, {r['epilogue_bits']} |"
        )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    text = json.dumps(results, indent=1, default=str) + "\n"
    studyout.write_files(out, dict(zip(FILES, ("\n".join(lines) + "\n", text))))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m cute_moe.lab.bench_gated"
    parser = studyout.gpu_study_parser(prog, __doc__, FILES, 300.0)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="catalog shapes, comma separated")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, comma separated")
    parser.add_argument("--sets", type=int, default=2, help="weight sets rotated per timing (cold L2) [2]")
    parser.add_argument("--quants", default=",".join(QUANTS), help=f"FP8 formats of {KNOWN_QUANTS} [%(default)s]")
    parser.add_argument("--static", action="store_true", help="fp8_tensor cells with calibrated static scales")
    a, out, run = studyout.start_gpu_study(prog, parser, argv, FILES)
    try:
        shapes = studyout.split_list("--shapes", a.shapes)
        tokens = studyout.positive_ints("--tokens", a.tokens)
        quants = studyout.known_list("--quants", a.quants, KNOWN_QUANTS)
        if a.static and "fp8_tensor" not in quants:
            raise studyout.UsageError("--static: static scales are per tensor; --quants must include fp8_tensor")
    except studyout.UsageError as exc:
        parser.error(str(exc))
    if a.sets < 1:
        parser.error(f"--sets: must be at least 1, got {a.sets}")
    import torch

    from moe_spec.oracle import rel_l2
    from moe_spec.problem import get_shape

    def cell(c) -> dict:
        sets = _inputs(get_shape(c["shape"]), c["T"], c["quant"], a.sets, a.static)
        got = {name: _measure(sets, gated, epi) for name, gated, epi in VARIANTS}
        row = {"static": a.static and c["quant"] == "fp8_tensor"}
        row.update({f"{name}_us": m["us"] for name, m in got.items()})
        row.update({f"{name}_bits": m["bit_identical"] for name, m in got.items()})
        reference = got["plain"]["out"].double()
        row.update({f"{name}_rel_l2": rel_l2(got[name]["out"], reference) for name in ("gated", "epilogue")})
        return row

    results = {**run, "quants": quants, "static": a.static, "rows": [], "cut": []}
    _write(out, results)
    took = studyout.run_cells(
        results,
        [{"shape": spec, "quant": q, "T": T} for spec in shapes for q in quants for T in tokens],
        cell,
        lambda r: _write(out, r),
        deadline_s=a.deadline_s,
        cell_s=CELL_S,
        after=lambda i: torch.cuda.empty_cache(),
    )
    print(f"\n{(out / 'gated.md').read_text()}")
    print(f"bench_gated done in {took:.0f} s")


if __name__ == "__main__":
    main()

"""The gated FP8 GEMM1 (SiLU·up in its epilogue) against the plain GEMM1 and its SiLU·up pass, whole layer.

    python -m cute_moe.lab.bench_gated --out DIR [--deadline-s 300] [--shapes ...] [--tokens 1,8,...]

:data:`cute_moe.plan.GATED_FP8_GEMM1` names the paths (``"swap_ab"``, ``"normal"``) on which the fused
fp8_block layer's GEMM1 is gated.  Every cell times one whole ``fused_moe`` call twice on the same
inputs — the plan with no gated path, then with both — CUDA-graph replayed over rotated weight sets
(cold L2, :func:`moe_spec.timing.time_cuda_graph`), median µs; the two outputs are compared (rel L2:
the gated layer rounds the intermediate once less, so the bits differ) and each is rerun (bit-identical).
The plan's rule is the one ``fused_moe`` reads, switched for the run and restored after it.
``--epilogue-quant off`` also sets :data:`cute_moe.plan.EPILOGUE_QUANT` False, so the gated GEMM1 on the
normal path writes its fp32 intermediate and the amax launch follows (today's path); ``on`` (the
default, the plan's) takes that amax in GEMM1's epilogue (:mod:`cute_moe.epilogue_quant`).

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
QUANT = "fp8_block"  # the one format the gated GEMM1 takes (cute_moe.limits.gated_quant_layer)
#: A cell starts only when this much time is left before the deadline.
CELL_S = 20.0


def _inputs(shape, T: int, n_sets: int):
    """``n_sets`` fp8_block problems of ``T`` tokens on the GPU, each with its own weights (cold L2)."""
    from moe_spec.problem import make_inputs

    return [make_inputs(shape, T, QUANT, seed=i, device="cuda").to("cuda").kwargs() for i in range(n_sets)]


def _measure(sets: list, gated: tuple, epilogue_quant: bool = True) -> dict:
    """Time and check ``fused_moe`` on ``sets`` with :data:`~cute_moe.plan.GATED_FP8_GEMM1` = ``gated`` (and
    :data:`~cute_moe.plan.EPILOGUE_QUANT` = ``epilogue_quant``)."""
    import torch

    from moe_spec.timing import time_cuda_graph

    from ..moe import forget_calls, fused_moe

    plan_module = sys.modules["cute_moe.plan"]  # the module: the package's attribute `plan` is the function

    saved = plan_module.GATED_FP8_GEMM1, plan_module.EPILOGUE_QUANT
    plan_module.GATED_FP8_GEMM1, plan_module.EPILOGUE_QUANT = gated, epilogue_quant
    forget_calls()
    try:
        out, again = fused_moe(**sets[0]), fused_moe(**sets[0])
        t = time_cuda_graph(lambda i: lambda: fused_moe(**sets[i]), len(sets))
        torch.cuda.synchronize()
        return {"us": round(t.median_us, 1), "out": out, "bit_identical": bool(torch.equal(out, again))}
    finally:
        plan_module.GATED_FP8_GEMM1, plan_module.EPILOGUE_QUANT = saved
        forget_calls()


def _write(out, results: dict) -> None:
    lines = [
        f"# cute_moe's gated FP8 GEMM1 on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Whole fp8_block fused_moe calls, CUDA-graph replay, cold L2, median µs. plain: GATED_FP8_GEMM1 = () "
        "(GEMM1 writes H [M_pad, 2I], a SiLU·up + amax pass); gated: both paths (SiLU·up in GEMM1's epilogue). "
        f"rel L2: gated against plain; bit-identical: a rerun of each. EPILOGUE_QUANT: {results['epilogue_quant']}.",
        "",
        "| shape | T | plain µs | gated µs | gated / plain | rel L2 | bit-identical (plain, gated) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['T']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['T']} | {r['plain_us']:.1f} | {r['gated_us']:.1f} | {r['ratio']:.3f} "
            f"| {r['rel_l2']:.1e} | {r['plain_bits']}, {r['gated_bits']} |"
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
    parser.add_argument(
        "--epilogue-quant", choices=("on", "off"), default="on", help="the amax in GEMM1's epilogue [on]"
    )
    a, out, run = studyout.start_gpu_study(prog, parser, argv, FILES)
    try:
        shapes = studyout.split_list("--shapes", a.shapes)
        tokens = studyout.positive_ints("--tokens", a.tokens)
    except studyout.UsageError as exc:
        parser.error(str(exc))
    if a.sets < 1:
        parser.error(f"--sets: must be at least 1, got {a.sets}")
    import torch

    from moe_spec.oracle import rel_l2
    from moe_spec.problem import get_shape

    def cell(c) -> dict:
        sets = _inputs(get_shape(c["shape"]), c["T"], a.sets)
        plain, gated = _measure(sets, ()), _measure(sets, ("swap_ab", "normal"), a.epilogue_quant == "on")
        return {
            "plain_us": plain["us"],
            "gated_us": gated["us"],
            "ratio": round(gated["us"] / plain["us"], 3),
            "rel_l2": rel_l2(gated["out"], plain["out"].double()),
            "plain_bits": plain["bit_identical"],
            "gated_bits": gated["bit_identical"],
        }

    results = {**run, "quant": QUANT, "epilogue_quant": a.epilogue_quant, "rows": [], "cut": []}
    _write(out, results)
    took = studyout.run_cells(
        results,
        [{"shape": spec, "T": T} for spec in shapes for T in tokens],
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

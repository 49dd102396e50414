"""The whole layer with the plan's GEMMs against other schedules of the same tiles, in any format.

    python -m cute_moe.lab.bench_schedule --out DIR [--deadline-s 300] [--shapes ...] [--tokens 8,4096]
        [--quants bf16,fp8_tensor,fp8_channel,fp8_block] [--variants pingpong,cluster,pingpong1,...]

The variants, each given to ``fused_moe`` as ``configs=`` but gather_quant and swap_amax, switches of the
plan (:data:`SWITCHES`, :func:`variant_plan`):

* **pingpong** — both GEMMs' ping-pong twins (:func:`cute_moe.gemm_rules.pingpong_config`, single CTAs): each
  consumer warpgroup a whole tile of one warpgroup's 64 rows, the same WGMMA sequence per output element
  (FP8: its block and promoted accumulators, the gated GEMM1's epilogue step kept);
* **cluster** — the plan's normal-path GEMMs on clusters of two CTAs multicasting the weight tile
  (``GemmConfig.cluster = 2``; swap-AB GEMMs stay as they are);
* **pingpong1**, **pingpong2**, **cluster1**, **cluster2** — the same for one GEMM only (the digit: GEMM1 or
  GEMM2), the other the plan's: which GEMM a gain comes from;
* **gather_quant** — FP8 with x's quantization the other way from the plan's (``cute_moe.plan.GATHER_QUANT``:
  one launch for x's quantize, the gather of its codes and of its scales, or those three), the GEMMs the
  plan's; the describe column says which;
* **swap_amax** — FP8 on the swap-AB path with the intermediate's amax the other way from the plan's: in the
  gated GEMM1's epilogue (``cute_moe.plan.SWAP_AB_EPILOGUE_AMAX``) or its own launch.

Every cell times one whole ``fused_moe`` call per variant on the same inputs, the plan's own first —
CUDA-graph replayed over rotated weight sets (cold L2, :func:`moe_spec.timing.time_cuda_graph`), median µs
— and checks that each variant's output equals the plan's bit for bit and that a rerun of each is.
``lab/bench_pingpong.py`` times the bf16 GEMMs alone; this is the layer, so a schedule's gain or loss is
seen with the launches around it.

Writes ``schedule.md`` and ``schedule.json`` into ``--out`` (new or empty), rewritten after every cell; no
cell starts after ``--deadline-s``.
"""

from __future__ import annotations

import json
import sys

from moe_spec import studyout

FILES = ("schedule.md", "schedule.json")
#: The catalog shapes compare times by default (the lab does not import compare).
SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
TOKENS = (8, 4096)
QUANTS = ("fp8_tensor", "fp8_block")
KNOWN_QUANTS = ("bf16", "fp8_tensor", "fp8_channel", "fp8_block")
VARIANTS = ("pingpong", "cluster", "pingpong1", "pingpong2", "cluster1", "cluster2", "gather_quant", "swap_amax")
#: The variants that are a switch of cute_moe.plan, turned on (fused_moe plans with it).
SWITCHES = ("gather_quant", "swap_amax")


def switch_settings(name: str, p) -> dict:
    """The cute_moe.plan switches that give plan ``p``'s call the other side of switch variant ``name``: x
    quantized where its rows are gathered (on both paths, any top_k) or on its own; the swap-AB GEMM1's
    epilogue amax or its launch."""
    if name == "gather_quant":
        return {"GATHER_QUANT": False} if p.gather_quant else {"GATHER_QUANT": True, "GATHER_QUANT_NORMAL_TOP_K": None}
    return {"SWAP_AB_EPILOGUE_AMAX": p.gemm1.epilogue_quant != "amax"}


DEFAULT_VARIANTS = ("pingpong", "cluster")
#: A cell starts only when this much time is left before the deadline.
CELL_S = 20.0


#: Which GEMMs (0: GEMM1, 1: GEMM2) each variant changes, and to what schedule.
VARIANT_GEMMS = {
    "pingpong": (0, 1),
    "cluster": (0, 1),
    "pingpong1": (0,),
    "pingpong2": (1,),
    "cluster1": (0,),
    "cluster2": (1,),
}


def variant_plan(dims, quant, name: str):
    """(the plan, the plan of variant ``name`` of :data:`VARIANTS`), the second None where the variant changes
    nothing (the one launch; cluster: no normal-path GEMM, or those already clustered; a switch: the plan
    made with it the other way (:func:`switch_settings`) is the plan, e.g. bf16, or the normal path for
    swap_amax)."""
    from ..gemm_rules import pingpong_config
    from ..moe import plan_switches
    from ..plan import plan

    p = plan(dims, quant)
    if p.path != "grouped":
        return p, None
    if name in SWITCHES:
        with plan_switches(**switch_settings(name, p)):
            vp = plan(dims, quant)
        return p, (None if vp == p else vp)
    pair = [p.gemm1, p.gemm2]
    for i in VARIANT_GEMMS[name]:
        g = pair[i]
        if name.startswith("pingpong"):
            pair[i] = pingpong_config(g.replace(cluster=1))
        elif not g.swap_ab:
            pair[i] = g.replace(cluster=2)
    if tuple(pair) == (p.gemm1, p.gemm2):
        return p, None
    return p, plan(dims, quant, configs=tuple(pair))


def _measure(sets: list, configs) -> dict:
    import torch

    from moe_spec.timing import time_cuda_graph

    from ..moe import fused_moe

    extra = {} if configs is None else {"configs": configs}
    out, again = fused_moe(**sets[0], **extra), fused_moe(**sets[0], **extra)
    t = time_cuda_graph(lambda i: lambda: fused_moe(**sets[i], **extra), len(sets))
    torch.cuda.synchronize()
    return {"us": round(t.median_us, 1), "out": out, "bits": bool(torch.equal(out, again))}


def _write(out, results: dict) -> None:
    names = results["variants"]
    lines = [
        f"# cute_moe's layer: the plan's GEMMs against {', '.join(names)}, on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Whole fused_moe calls, CUDA-graph replay, cold L2, median µs. plan: the plan's configs; pingpong: both "
        "GEMMs' ping-pong twins (single CTAs); cluster: the normal-path GEMMs on clusters of two; a digit: "
        "that GEMM alone (pingpong1: GEMM1's twin, the plan's GEMM2); gather_quant: x quantized in the gather or on "
        "its own, swap_amax: the intermediate's amax in the swap-AB GEMM1's epilogue or its own launch — each the "
        "other way from the plan (the JSON's describe says which). "
        "Each variant's "
        "µs / the plan's, and whether its output equals the plan's bit for bit (each rerun's bits: the JSON).",
        "",
        "| shape | format | T | plan | plan µs | "
        + " | ".join(f"{n} µs | {n} / plan | {n} equal" for n in names)
        + " |",
        "|---|---|---|---|---|" + "---|---|---|" * len(names),
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['quant']} | {r['T']} | error: {r['error']} |")
            continue
        cells = []
        for n in names:
            v = r["variants"].get(n)
            cells.append("— | — | —" if v is None else f"{v['us']:.1f} | {v['us'] / r['plan_us']:.3f} | {v['equal']}")
        lines.append(
            f"| {r['shape']} | {r['quant']} | {r['T']} | `{r['plan']}` | {r['plan_us']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    if results["cut"]:
        lines += ["", f"Not run (deadline): {', '.join(results['cut'])}"]
    text = json.dumps(results, indent=1, default=str) + "\n"
    studyout.write_files(out, dict(zip(FILES, ("\n".join(lines) + "\n", text))))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m cute_moe.lab.bench_schedule"
    parser = studyout.gpu_study_parser(prog, __doc__, FILES, 300.0)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="catalog shapes, comma separated")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, comma separated")
    parser.add_argument("--sets", type=int, default=2, help="weight sets rotated per timing (cold L2) [2]")
    parser.add_argument("--quants", default=",".join(QUANTS), help=f"formats of {KNOWN_QUANTS} [%(default)s]")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {VARIANTS} [%(default)s]")
    a, out, run = studyout.start_gpu_study(prog, parser, argv, FILES)
    try:
        shapes = studyout.split_list("--shapes", a.shapes)
        tokens = studyout.positive_ints("--tokens", a.tokens)
        quants = studyout.known_list("--quants", a.quants, KNOWN_QUANTS)
        names = studyout.known_list("--variants", a.variants, VARIANTS)
    except studyout.UsageError as exc:
        parser.error(str(exc))
    if a.sets < 1:
        parser.error(f"--sets: must be at least 1, got {a.sets}")
    import torch

    from moe_spec.problem import get_shape, make_inputs
    from moe_spec.validate import MoEDims

    from ..moe import plan_switches
    from ..plan import plan

    def cell(c) -> dict:
        s = get_shape(c["shape"])
        quant = None if c["quant"] == "bf16" else c["quant"]
        dims = MoEDims(T=c["T"], E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k)
        sets = [make_inputs(s, c["T"], quant, seed=i, device="cuda").to("cuda").kwargs() for i in range(a.sets)]
        p = plan(dims, quant)
        own = _measure(sets, None)
        row = {"plan": p.describe(), "plan_us": own["us"], "plan_bits": own["bits"], "variants": {}}
        for name in names:
            vp = variant_plan(dims, quant, name)[1]
            if vp is None:
                row["variants"][name] = None
                continue
            if name in SWITCHES:  # a switch of the plan, not a config: fused_moe plans with it the other way
                with plan_switches(**switch_settings(name, p)):
                    got = _measure(sets, None)
            else:
                got = _measure(sets, (vp.gemm1, vp.gemm2))
            equal = bool(torch.equal(got["out"], own["out"]))
            row["variants"][name] = {"plan": vp.describe(), "us": got["us"], "equal": equal, "bits": got["bits"]}
        return row

    results = {**run, "quants": quants, "variants": names, "rows": [], "cut": []}
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
    print(f"\n{(out / 'schedule.md').read_text()}")
    print(f"bench_schedule done in {took:.0f} s")


if __name__ == "__main__":
    main()

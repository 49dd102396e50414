"""The whole layer with the plan's cooperative GEMMs against their ping-pong twins, in any format.

    python -m cute_moe.lab.bench_schedule --out DIR [--deadline-s 300] [--shapes ...] [--tokens 8,4096]
        [--quants bf16,fp8_tensor,fp8_channel,fp8_block]

:func:`cute_moe.gemm_rules.pingpong_config` gives the twin of a cooperative GEMM: each consumer warpgroup a
whole tile of one warpgroup's 64 rows, the same WGMMA sequence per output element (FP8: its block and
promoted accumulators, the gated GEMM1's epilogue step kept). Every cell times one whole ``fused_moe`` call
twice on the same inputs: **cooperative** (the plan's configs) and **pingpong** (both GEMMs' twins, given
as ``configs=``) — CUDA-graph replayed over rotated weight sets (cold L2,
:func:`moe_spec.timing.time_cuda_graph`), median µs — and checks that the two outputs are equal bit for
bit and that a rerun of each is.  ``lab/bench_pingpong.py`` times the bf16 GEMMs alone; this is the layer,
so the ping-pong GEMMs' gain or loss is seen with the launches around them.

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
#: A cell starts only when this much time is left before the deadline.
CELL_S = 20.0


def twins(dims, quant):
    """(the plan, the plan with both GEMMs' ping-pong twins), or (the plan, None) where it runs one launch."""
    from ..gemm_rules import pingpong_config
    from ..plan import plan

    p = plan(dims, quant)
    if p.path != "grouped":
        return p, None
    pair = (pingpong_config(p.gemm1.replace(cluster=1)), pingpong_config(p.gemm2.replace(cluster=1)))
    return p, plan(dims, quant, configs=pair)


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
    lines = [
        f"# cute_moe's layer, cooperative against ping-pong GEMMs, on {results['device']}",
        "",
        *studyout.header_lines(results),
        "",
        "Whole fused_moe calls, CUDA-graph replay, cold L2, median µs. cooperative: the plan's configs; "
        "pingpong: both GEMMs' twins (gemm_rules.pingpong_config, single CTAs). equal: the two outputs "
        "bit for bit; bits: a rerun of each bit-identical.",
        "",
        "| shape | format | T | cooperative | pingpong | cooperative µs | pingpong µs | pingpong / cooperative "
        "| equal | bits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['shape']} | {r['quant']} | {r['T']} | {r.get('error') or r['skipped']} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['quant']} | {r['T']} | `{r['cooperative']}` | `{r['pingpong']}` "
            f"| {r['cooperative_us']:.1f} | {r['pingpong_us']:.1f} | {r['pingpong_us'] / r['cooperative_us']:.3f} "
            f"| {r['equal']} | {r['cooperative_bits']}, {r['pingpong_bits']} |"
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
    a, out, run = studyout.start_gpu_study(prog, parser, argv, FILES)
    try:
        shapes = studyout.split_list("--shapes", a.shapes)
        tokens = studyout.positive_ints("--tokens", a.tokens)
        quants = studyout.split_list("--quants", a.quants)
        bad = [q for q in quants if q not in KNOWN_QUANTS]
        if bad:
            raise studyout.UsageError(f"--quants: unknown {', '.join(bad)}; known: {', '.join(KNOWN_QUANTS)}")
    except studyout.UsageError as exc:
        parser.error(str(exc))
    if a.sets < 1:
        parser.error(f"--sets: must be at least 1, got {a.sets}")
    import torch

    from moe_spec.problem import get_shape, make_inputs
    from moe_spec.validate import MoEDims

    def cell(c) -> dict:
        s = get_shape(c["shape"])
        quant = None if c["quant"] == "bf16" else c["quant"]
        dims = MoEDims(T=c["T"], E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k)
        p, pp = twins(dims, quant)
        if pp is None:
            return {"skipped": f"the plan runs the {p.path} path: no GEMMs to twin"}
        sets = [make_inputs(s, c["T"], quant, seed=i, device="cuda").to("cuda").kwargs() for i in range(a.sets)]
        coop, ping = _measure(sets, None), _measure(sets, (pp.gemm1, pp.gemm2))
        return {
            "cooperative": p.describe(),
            "pingpong": pp.describe(),
            "cooperative_us": coop["us"],
            "pingpong_us": ping["us"],
            "equal": bool(torch.equal(coop["out"], ping["out"])),
            "cooperative_bits": coop["bits"],
            "pingpong_bits": ping["bits"],
        }

    results = {**run, "quants": quants, "rows": [], "cut": []}
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

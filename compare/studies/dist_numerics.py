"""``python -m compare.studies.dist_numerics``: which splits of the layer still compute the single-process function.

For tensor and expert parallelism, every format and a few ranks counts, the fp64 oracle of the
split layer (:func:`compare.distributed.simulate_tp` / :func:`~compare.distributed.simulate_ep` with
:func:`moe_spec.oracle.oracle` as each rank's expert computation) is compared with the oracle of
the whole layer. No kernel and no rank runs: a gap is the *function's*, made by the dynamic FP8
activation scales a rank takes over its own part (its slice of I under TP, the rows it receives
under EP). For scale, each row also gives the FP8 quantization error itself: the quantized layer's
oracle against the bf16 layer's. Runs on the CPU in seconds; writes ``dist_numerics.json`` / ``.md``.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from compare.distributed import SIMULATORS
from moe_spec.cli import ArgumentParser
from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.quant import QUANT_FORMATS
from moe_spec.runinfo import git_commit as _git_commit

SHAPES = (
    MoEShape("tiny", 4, 2, 64, 256, "tests/test_distributed.py's layer"),
    MoEShape("small", 8, 2, 512, 512, "a layer whose I/4 is still a multiple of 128"),
)
TOKENS = 64
WORLDS = (2, 4)


def measure(shapes=SHAPES, T: int = TOKENS, worlds=WORLDS, seed: int = 0) -> list[dict]:
    rows = []
    for shape in shapes:
        bf16 = oracle(**make_inputs(shape, T, None, seed=seed).kwargs())
        for quant in QUANT_FORMATS:
            inp = make_inputs(shape, T, quant, seed=seed)
            whole = oracle(**inp.kwargs())
            row = {
                "shape": shape.name,
                "E": shape.num_experts,
                "K": shape.hidden,
                "I": shape.intermediate,
                "T": T,
                "quant": quant or "bf16",
                "quant_error": rel_l2(whole, bf16) if quant else 0.0,
            }
            for parallel in ("tp", "ep"):
                for world in worlds:
                    try:
                        row[f"{parallel}{world}"] = rel_l2(SIMULATORS[parallel](inp, world, oracle), whole)
                    except ValueError as exc:
                        row[f"{parallel}{world}"] = f"refused: {exc}"
            rows.append(row)
    return rows


def markdown(meta: dict, rows: list, worlds=WORLDS) -> str:
    cols = [f"{p}{w}" for p in ("tp", "ep") for w in worlds]
    lines = [
        "# Split layers against the whole layer (fp64 oracles)",
        "",
        f"date {meta['date']}, device {meta['device']}, commit `{meta['commit']}`, command `{meta['command']}`",
        "",
        "Relative L2 distance of the split layer's function from the whole layer's, both evaluated in fp64 "
        "(no kernel). 0 to rounding: the split computes the same function. The last column is the FP8 "
        "quantization error (the quantized layer against the bf16 layer), for scale.",
        "",
        "| shape | quant | " + " | ".join(c.upper().replace("P", "P=") for c in cols) + " | quantization error |",
        "|---|---|" + "---|" * (len(cols) + 1),
    ]
    show = lambda v: "refused" if isinstance(v, str) else f"{v:.1e}"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['shape']} (E {r['E']}, K {r['K']}, I {r['I']}, T {r['T']}) | {r['quant']} | "
            + " | ".join(show(r[c]) for c in cols)
            + f" | {show(r['quant_error'])} |"
        )
    refusals = sorted({r[c] for r in rows for c in cols if isinstance(r[c], str)})
    return "\n".join(lines + [""] + [f"- {msg}" for msg in refusals]) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = ArgumentParser(prog="python -m compare.studies.dist_numerics", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="notes/results", help="directory for dist_numerics.json / .md [%(default)s]")
    a = p.parse_args(argv)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"CPU ({platform.processor() or platform.machine()})",
        "commit": _git_commit(),
        "command": "python -m compare.studies.dist_numerics " + " ".join(argv),
        "torch": torch.__version__,
    }
    rows = measure()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dist_numerics.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = markdown(meta, rows)
    (out / "dist_numerics.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

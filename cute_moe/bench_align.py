"""Time the token alignment on the GPU: the two CuTe launches against the torch reference.

    python -m cute_moe.bench_align [--out PREFIX] [--commit SHA]

For the three layer shapes ``cute_moe.bench`` times (their ``E`` and ``top_k`` are all the
alignment sees) and T ∈ {1, 8, 128, 1024, 4096}: the tile is the layer plan's ``align_tile`` at
that T (what ``fused_moe`` pads to), the routings are softmax top-k of random logits
(``moe_spec.problem.route``), one per input set.  Both routines are first checked to agree bit
for bit on every set, then timed by CUDA-graph replay (``moe_spec.timing.time_cuda_graph``, the
median µs per call): ``device`` is :func:`cute_moe.rowmaps.align_on_device`, ``torch`` is
:func:`moe_spec.align.align`.  Writes ``PREFIX.json`` (raw) and ``PREFIX.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

from moe_spec import runinfo  # noqa: E402
from moe_spec.align import align  # noqa: E402
from moe_spec.problem import get_shape, route  # noqa: E402
from moe_spec.timing import time_cuda_graph  # noqa: E402
from moe_spec.validate import MoEDims  # noqa: E402

from .rowmaps import align_on_device  # noqa: E402
from .plan import plan  # noqa: E402

SPECS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
TOKENS = (1, 8, 128, 1024, 4096)
FIELDS = ("sorted_ids", "expert_of_block", "expert_end")


def bench_cell(spec: str, T: int, n_sets: int = 4) -> dict:
    shape = get_shape(spec)
    E, k = shape.num_experts, shape.top_k
    tile = plan(MoEDims(T=T, E=E, K=shape.hidden, I=shape.intermediate, top_k=k)).align_tile
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = [route(torch.randn(T, E, device="cuda", generator=g), k)[1] for _ in range(n_sets)]
    equal = all(torch.equal(getattr(align_on_device(i, E, tile), f), getattr(align(i, E, tile), f))
                for i in ids for f in FIELDS)
    row = {"shape": spec, "E": E, "top_k": k, "T": T, "tile": tile, "pairs": T * k, "equal": equal}
    for name, fn in (("device", align_on_device), ("torch", align)):
        t = time_cuda_graph(lambda i: (lambda: fn(ids[i], E, tile)), n_sets)
        row[f"{name}_us"], row[f"{name}_p10_us"], row[f"{name}_p90_us"] = (
            round(t.median_us, 2), round(t.p10_us, 2), round(t.p90_us, 2))
    row["speedup"] = round(row["torch_us"] / row["device_us"], 1)
    print(row, flush=True)
    return row


def markdown(result: dict) -> str:
    lines = [f"# Token alignment on the device vs the torch reference ({result['device']}, {result['date']})", "",
             f"Commit `{result['commit']}`, command `{result['command']}`. CUDA-graph replay, median µs per call "
             "(p10–p90 in the JSON); `equal`: both gave the same Alignment, bit for bit, on every routing.", "",
             "| shape | E | top_k | T | tile | device µs | torch µs | speedup | equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["cells"]:
        lines.append(f"| {r['shape']} | {r['E']} | {r['top_k']} | {r['T']} | {r['tile']} | {r['device_us']} | "
                     f"{r['torch_us']} | {r['speedup']}× | {r['equal']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    ap.add_argument("--commit", default=None, help="git commit to record (when the checkout has no .git)")
    args = ap.parse_args(argv)
    runinfo.require_cuda("python -m cute_moe.bench_align")
    command = runinfo.command_line("python -m cute_moe.bench_align", sys.argv[1:] if argv is None else argv)
    result = {**runinfo.run_info(command, cuda=True, commit=args.commit),
              "cells": [bench_cell(spec, T) for spec in SPECS for T in TOKENS]}
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(result))
    return result


if __name__ == "__main__":
    main()

"""Time the token alignment on the GPU — the two CuTe launches (routing checks, alignment, row and
block maps) against the torch ops that do the same — and, on a CPU, fused_moe's host cost.

    python -m cute_moe.bench_align [--out PREFIX] [--commit SHA]

For the three layer shapes ``cute_moe.bench`` times (their ``E`` and ``top_k`` are all the
alignment sees) and T ∈ {1, 8, 128, 1024, 4096}: the tile is the layer plan's ``align_tile`` at
that T (what ``fused_moe`` pads to), the routings are softmax top-k of random logits
(``moe_spec.problem.route``), one per input set, with the plan's two GEMM token tiles.  Both
routines are first checked to agree on every set (the alignment and every map bit for bit, the
weights' NaN where the other's), then timed by CUDA-graph replay
(``moe_spec.timing.time_cuda_graph``, the median µs per call): ``device`` is
:func:`cute_moe.rowmaps.sort_rows_on_device` into preallocated buffers, ``torch`` is
:func:`cute_moe.rowmaps.reference_rows` (``guard_routing``, ``moe_spec.align.align`` and the
maps in torch ops: what ``fused_moe`` ran before the kernels wrote the maps).  Writes
``PREFIX.json`` (raw) and ``PREFIX.md`` (the table).

Host cost (no GPU needed)::

    python -m cute_moe.bench_align --host [--tokens 1 64] [--quant bf16 fp8_tensor ...]

runs ``fused_moe``'s GPU path on CPU tensors with every CuTe launch and compilation stubbed
(:func:`gpu_stand_in`): the time per call is the Python of the call — checks, plan, workspaces,
the CuTe argument wrapping — plus the torch ops it still runs (on the CPU here), and the count is
the launches a GPU call makes (stubbed CuTe launches + torch ops that launch a kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import sys
import textwrap
import types

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

from moe_spec import runinfo  # noqa: E402
from moe_spec.problem import get_shape, route  # noqa: E402
from moe_spec.timing import time_cuda_graph  # noqa: E402
from moe_spec.validate import MoEDims  # noqa: E402

from .rowmaps import RowBuffers, reference_rows, sort_rows_on_device  # noqa: E402
from .plan import plan  # noqa: E402

SPECS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
TOKENS = (1, 8, 128, 1024, 4096)
FIELDS = ("sorted_ids", "expert_of_block", "expert_end")


def _same_rows(a, b) -> bool:
    fields = [getattr(a.alignment, f) for f in FIELDS], [getattr(b.alignment, f) for f in FIELDS]
    maps = [(a.token_of_row, b.token_of_row), (a.row_of_pair, b.row_of_pair), (a.row_mask, b.row_mask)]
    floats = [(a.weight_of_row, b.weight_of_row), (a.weight_of_pair, b.weight_of_pair)]
    blocks = [(a.blocks[t][i], b.blocks[t][i]) for t in b.blocks for i in (0, 1)]
    return (all(torch.equal(x, y) for x, y in zip(*fields)) and all(torch.equal(x, y) for x, y in maps + blocks)
            and all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in floats))


def bench_cell(spec: str, T: int, n_sets: int = 4) -> dict:
    shape = get_shape(spec)
    E, k = shape.num_experts, shape.top_k
    p = plan(MoEDims(T=T, E=E, K=shape.hidden, I=shape.intermediate, top_k=k))
    tile, tiles = p.align_tile, (p.gemm1.tokens_tile, p.gemm2.tokens_tile)
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = [route(torch.randn(T, E, device="cuda", generator=g), k)[1] for _ in range(n_sets)]
    weights = [torch.rand(T, k, device="cuda", generator=g) for _ in range(n_sets)]
    bufs = [RowBuffers(T, k, E, tile, tiles, "cuda") for _ in range(n_sets)]
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    device = lambda i: sort_rows_on_device(ids[i], weights[i], E, tile, tiles, word=word, buffers=bufs[i])  # noqa
    torch_ops = lambda i: reference_rows(ids[i], weights[i], E, tile, tiles, word=word)  # noqa: E731
    equal = all(_same_rows(device(i), torch_ops(i)) for i in range(n_sets))
    row = {"shape": spec, "E": E, "top_k": k, "T": T, "tile": tile, "pairs": T * k, "equal": equal}
    for name, fn in (("device", device), ("torch", torch_ops)):
        t = time_cuda_graph(lambda i, fn=fn: (lambda: fn(i)), n_sets)
        row[f"{name}_us"], row[f"{name}_p10_us"], row[f"{name}_p90_us"] = (
            round(t.median_us, 2), round(t.p10_us, 2), round(t.p90_us, 2))
    row["speedup"] = round(row["torch_us"] / row["device_us"], 1)
    print(row, flush=True)
    return row


def markdown(result: dict) -> str:
    lines = [f"# Alignment, checks and row maps on the device vs torch ops ({result['device']}, {result['date']})",
             "", f"Commit `{result['commit']}`, command `{result['command']}`. CUDA-graph replay, median µs per call "
             "(p10–p90 in the JSON); `equal`: both gave the same alignment and maps, bit for bit, on every routing.",
             "",
             "| shape | E | top_k | T | tile | device µs | torch µs | speedup | equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["cells"]:
        lines.append(f"| {r['shape']} | {r['E']} | {r['top_k']} | {r['T']} | {r['tile']} | {r['device_us']} | "
                     f"{r['torch_us']} | {r['speedup']}× | {r['equal']} |")
    return "\n".join(lines) + "\n"


#: aten ops that launch nothing: allocation and views (``tests/test_launches.py`` counts the same way).
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "view", "_unsafe_view", "reshape", "slice", "select",
             "alias", "as_strided", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "detach",
             "lift_fresh", "_reshape_alias"}


class _Stubs(dict):
    """A compiled-kernel table whose every entry records its launches instead of running."""

    def __init__(self, launches: list):
        super().__init__()
        self.launches = launches

    def __missing__(self, name):
        return lambda *args: self.launches.append(name)


def _without_device_guard(fn):
    """``fn`` (``fused_moe``) recompiled from its source without its refusal of non-CUDA tensors."""
    src = textwrap.dedent(inspect.getsource(fn))
    cut, n = re.subn(r'\n    if x\.device\.type != "cuda":\n(?:        .*\n)+', "\n", src, count=1)
    if n != 1:
        raise RuntimeError("gpu_stand_in: fused_moe's device check was not found in its source")
    scope: dict = {}
    exec(compile(cut, inspect.getsourcefile(fn), "exec"), fn.__globals__, scope)  # noqa: S102
    return scope[fn.__name__]


@contextlib.contextmanager
def gpu_stand_in():
    """``fused_moe``'s GPU path on CPU tensors: every compile returns stubs that record their launches
    (the DSL still wraps every argument), the stream is a stand-in and the host wrappers take CPU
    tensors for device ones.  Yields ``(fused_moe, launches)``; the patches are undone on exit."""
    from . import moe, moe_fp8, unfused

    launches: list = []
    stubs = lambda *a, **k: _Stubs(launches)  # noqa: E731
    patches = [(torch.cuda, "is_current_stream_capturing", lambda: False),
               (torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0)),
               (torch.cuda, "device", lambda device: contextlib.nullcontext()),
               (moe, "compile_gemm", lambda *a, **k: (lambda *args: launches.append("GroupedGemm"))),
               (moe, "_row_kernels", stubs), (moe, "_stream", lambda t: None),
               (moe_fp8, "compile_quant_kernels", stubs), (moe_fp8, "current_stream", lambda t: None),
               (unfused, "compile_unfused_kernels", stubs), (unfused, "current_stream", lambda t: None)]
    try:
        from . import rowmaps
        class RowBuffers(rowmaps.RowBuffers):  # maps a later torch op may index: valid values (0)
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                for t in self.out.values():
                    t.zero_()

        patches += [(rowmaps, "compile_align_kernels", stubs), (rowmaps, "current_stream", lambda t: None),
                    (rowmaps, "on_gpu", lambda t: True), (moe, "RowBuffers", RowBuffers)]
    except ImportError:  # an older tree: its alignment launches behind align_on_device
        patches.append((moe, "align_on_device", _older_align_stand_in(launches)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches if hasattr(obj, name)]
    for obj, name, value in patches:
        if hasattr(obj, name):
            setattr(obj, name, value)
    try:
        yield _without_device_guard(moe.fused_moe), launches
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _older_align_stand_in(launches: list):
    """The GPU branch of an older ``alignops.align_on_device`` (four buffers, five wrapped vectors, one
    launch), for a tree without ``rowmaps``: what its call did on the host.  It returns the
    reference alignment of the ids (computed once per routing), so later torch ops index validly."""
    from moe_spec.align import align, max_rows

    from .runtime import cute_vector

    done: dict = {}

    def align_on_device(topk_ids, num_experts, tile):
        flat = topk_ids.reshape(-1)
        rows = max_rows(flat.numel(), num_experts, tile)
        new = lambda n: torch.empty(n, dtype=torch.int32, device=flat.device)  # noqa: E731
        for t in [flat, new(rows), new(rows // tile), new(num_experts), new(num_experts)]:
            cute_vector(t)
        launches.append("PlacePairs")
        key = (flat.data_ptr(), flat.numel(), num_experts, tile)
        if key not in done:
            with torch.utils._python_dispatch._disable_current_modes():
                done[key] = align(topk_ids, num_experts, tile)
        return done[key]

    return align_on_device


class _Ops:
    """Records every aten op name run inside the block (a ``TorchDispatchMode``)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Ops(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                self.ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        return Ops()


def launches_per_call(fused_moe, launches: list, kwargs: dict) -> tuple[list, list, list]:
    """(CuTe launches, torch ops that launch a kernel, every aten op) of one warm call under
    :func:`gpu_stand_in` (its ``fused_moe`` and ``launches``)."""
    fused_moe(**kwargs)  # warm: plan, workspace, wrappers
    launches.clear()
    with _Ops() as ops:
        fused_moe(**kwargs)
    return list(launches), [op for op in ops.ops if op not in NO_LAUNCH], list(ops.ops)


def host_cost(T: int, quant=None, calls: int = 200, repeats: int = 5) -> dict:
    """Median over ``repeats`` of the host µs per ``fused_moe`` call (Qwen3-30B-A3B's E = 128, top_k = 8
    with K = 256, I = 128), under :func:`gpu_stand_in`, and the launches of one warm call."""
    from moe_spec.problem import MoEShape, make_inputs
    from moe_spec.timing import host_us

    kw = make_inputs(MoEShape("host", 128, 8, 256, 128, "host cost"), T, quant, seed=0).kwargs()
    with gpu_stand_in() as (fused_moe, launches):
        cute, torch_ops, _ = launches_per_call(fused_moe, launches, kw)
        us = host_us(fused_moe, kw, calls=calls, repeats=repeats)
    return {"T": T, "quant": quant or "bf16", "host_us": round(us, 1),
            "cute_launches": len(cute), "torch_launches": len(torch_ops), "launches": len(cute) + len(torch_ops),
            "cute": cute, "torch": torch_ops}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    ap.add_argument("--commit", default=None, help="git commit to record (when the checkout has no .git)")
    ap.add_argument("--host", action="store_true", help="host cost per fused_moe call, no GPU (gpu_stand_in)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64], help="with --host: batch sizes")
    ap.add_argument("--quant", nargs="+", default=["bf16", "fp8_tensor", "fp8_channel", "fp8_block"],
                    help="with --host: formats")
    args = ap.parse_args(argv)
    if args.host:
        rows = [host_cost(T, None if q == "bf16" else q) for q in args.quant for T in args.tokens]
        for r in rows:
            print({k: v for k, v in r.items() if k not in ("cute", "torch")}, "\n   cute:", r["cute"],
                  "\n   torch:", r["torch"], flush=True)
        return {"host": rows}
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

"""Time the token alignment on the GPU exactly as the bf16 layer launches it — the CuTe launches
(routing checks, alignment, row and block maps) against the torch ops that do the same — and, on a
CPU, fused_moe's host cost.

    python -m cute_moe.lab.bench_align [--out DIR] [--shapes ...] [--tokens ...] [--commit SHA]

For each shape (default: Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 TP8 — their ``E`` and ``top_k``
and, through the plan, their tiles are all the alignment sees) and T (default 1, 8, 32, 128, 1024,
4096): the layer's bf16 plan at that T gives the alignment tile and the two GEMM token tiles, and
the buffers are the layer's (:class:`cute_moe.rowmaps.RowBuffers`, the place launch's grid
included); the routings are softmax top-k of random logits (``moe_spec.problem.route``), one per
input set.  Per cell:

* ``equal``: on every set the launches give what :func:`cute_moe.rowmaps.reference_rows` gives
  (``moe_spec.align.align`` of the clamped ids, every map, bit for bit; NaN weights where it has them);
* ``device µs`` / ``torch µs``: CUDA-graph replay (``moe_spec.timing.time_cuda_graph``, median µs
  per call, launch gaps included) of :func:`~cute_moe.rowmaps.sort_rows_on_device` into the
  preallocated buffers and of ``reference_rows`` (what ``fused_moe`` ran before the kernels);
* ``count`` / ``place µs (cold)``: the kernels' own durations from ``torch.profiler`` over eager
  calls, each after a fill of a buffer twice the L2 (as in the layer, where the GEMMs before it have
  moved the alignment's data and code out of the cache); ``warm``: the same, back to back.  The
  profiler runs after every graph was timed (no graph is captured once CUPTI is active).

Prints each cell as it goes and the table at the end; ``--out`` (a new or empty directory) receives
``bench_align.md`` and ``bench_align.json`` (date, device, commit, command).

Host cost (no GPU needed)::

    python -m cute_moe.lab.bench_align --host [--tokens 1 64] [--quant bf16 fp8_tensor ...]

runs ``fused_moe``'s GPU path on CPU tensors with every CuTe launch and compilation stubbed
(:func:`gpu_stand_in`): the time per call is the Python of the call — checks, plan, workspaces,
the CuTe argument wrapping — plus the torch ops it still runs (on the CPU here), and the count is
the launches a GPU call makes (stubbed CuTe launches + torch ops that launch a kernel).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import sys
import textwrap
import types

import torch

from moe_spec import runinfo, studyout
from moe_spec.cli import ArgumentParser
from moe_spec.problem import get_shape, route
from moe_spec.timing import L2_BYTES, time_cuda_graph

from ..plan import LayerPlan, layer_configs
from ..rowmaps import RowBuffers, reference_rows, sort_rows_on_device

SPECS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
TOKENS = (1, 8, 32, 128, 1024, 4096)
FILES = ("bench_align.md", "bench_align.json")
PROFILED_CALLS = 20  # per cell and mode (cold, warm)
KERNELS = ("CountExperts", "PlacePairs")
FIELDS = ("sorted_ids", "expert_of_block", "expert_end")


def _same_rows(a, b) -> bool:
    fields = [getattr(a.alignment, f) for f in FIELDS], [getattr(b.alignment, f) for f in FIELDS]
    maps = [(a.token_of_row, b.token_of_row), (a.row_of_pair, b.row_of_pair), (a.row_mask, b.row_mask)]
    floats = [(a.weight_of_row, b.weight_of_row), (a.weight_of_pair, b.weight_of_pair)]
    blocks = [(a.blocks[t][i], b.blocks[t][i]) for t in b.blocks for i in (0, 1)]
    return (
        all(torch.equal(x, y) for x, y in zip(*fields))
        and all(torch.equal(x, y) for x, y in maps + blocks)
        and all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in floats)
    )


def layer_tiles(spec: str, T: int) -> tuple[int, tuple[int, int]]:
    """The bf16 grouped layer's alignment tile and (GEMM1, GEMM2) token tiles at T (what ``fused_moe``
    passes to its alignment; where the plan takes the one launch, :func:`~cute_moe.plan.one_launch`, the
    grouped pipeline's, which runs with that rule off: the one launch aligns nothing)."""
    shape = get_shape(spec)
    g1, g2 = layer_configs(T, shape.num_experts, shape.hidden, shape.intermediate, shape.top_k)
    return LayerPlan(g1, g2).align_tile, (g1.tokens_tile, g2.tokens_tile)


class Cell:
    """One (shape, T): its routings, the layer's tiles and buffers, and the two routines on set ``i``."""

    def __init__(self, spec: str, T: int, n_sets: int = 4):
        shape = get_shape(spec)
        self.E, self.k = E, k = shape.num_experts, shape.top_k
        self.tile, self.tiles = tile, tiles = layer_tiles(spec, T)
        g = torch.Generator(device="cuda").manual_seed(T)
        self.ids = [route(torch.randn(T, E, device="cuda", generator=g), k)[1] for _ in range(n_sets)]
        self.weights = [torch.rand(T, k, device="cuda", generator=g) for _ in range(n_sets)]
        self.bufs = [RowBuffers(T, k, E, tile, tiles, "cuda") for _ in range(n_sets)]
        self.word = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.row = {
            "shape": spec,
            "E": E,
            "top_k": k,
            "T": T,
            "tile": tile,
            "gemm_tiles": list(tiles),
            "pairs": T * k,
            "rows": self.bufs[0].rows.rows,
            "place_ctas": self.bufs[0].ctas,
        }

    def device(self, i):
        return sort_rows_on_device(
            self.ids[i], self.weights[i], self.E, self.tile, self.tiles, word=self.word, buffers=self.bufs[i]
        )

    def torch_ops(self, i):
        return reference_rows(self.ids[i], self.weights[i], self.E, self.tile, self.tiles, word=self.word)


def time_cell(cell: Cell) -> dict:
    """Phase 1: ``equal`` and the CUDA-graph µs of both routines."""
    row, n = cell.row, len(cell.ids)
    row["equal"] = all(_same_rows(cell.device(i), cell.torch_ops(i)) for i in range(n))
    for name, fn in (("device", cell.device), ("torch", cell.torch_ops)):
        t = time_cuda_graph(lambda i, fn=fn: lambda: fn(i), n)
        row[f"{name}_us"], row[f"{name}_p10_us"], row[f"{name}_p90_us"] = (
            round(t.median_us, 2),
            round(t.p10_us, 2),
            round(t.p90_us, 2),
        )
    row["speedup"] = round(row["torch_us"] / row["device_us"], 1)
    return row


def profile_cell(cell: Cell, flush: torch.Tensor, calls: int = PROFILED_CALLS) -> dict:
    """Phase 2: each alignment kernel's mean duration per call (torch.profiler), after an L2 flush
    (``cold``) and back to back (``warm``)."""
    from torch.profiler import ProfilerActivity, profile

    n, row = len(cell.ids), cell.row
    for mode in ("cold", "warm"):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in range(calls):
                if mode == "cold":
                    flush.zero_()
                cell.device(c % n)
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        for kernel in KERNELS:
            us = [
                e.device_time_total or e.time_range.elapsed_us()
                for e in prof.events()
                if e.device_type == cuda and kernel in e.name
            ]
            key = f"{kernel}_{mode}_us"
            row[key] = round(sum(us) / calls, 2) if us else 0.0
    return row


def markdown(result: dict) -> str:
    lines = [
        f"# Token alignment as the bf16 layer launches it ({result['device']})",
        "",
        *studyout.header_lines(result),
        "",
        "Tiles: the bf16 plan's alignment tile (GEMM1, GEMM2 token tiles) at that T; `ctas`: the place "
        "launch's grid. `device`/`torch`: CUDA-graph replay, median µs per call (p10–p90 in the JSON), "
        "launch gaps included. `count`/`place`: the kernels' own µs per call from torch.profiler, `cold` "
        "after a fill of twice the L2 (as inside the layer), `warm` back to back. `equal`: the launches "
        "gave moe_spec.align's alignment and the reference maps, bit for bit, on every routing.",
        "",
        "| shape | E | T | tile (G1, G2) | ctas | device µs | place cold | count cold | place warm | "
        "count warm | torch µs | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cells"]:
        lines.append(
            f"| {r['shape']} | {r['E']} | {r['T']} | {r['tile']} {tuple(r['gemm_tiles'])} | "
            f"{r['place_ctas']} | {r['device_us']} | {r.get('PlacePairs_cold_us', '–')} | "
            f"{r.get('CountExperts_cold_us', '–')} | {r.get('PlacePairs_warm_us', '–')} | "
            f"{r.get('CountExperts_warm_us', '–')} | {r['torch_us']} | "
            f"{'yes' if r['equal'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


#: aten ops that launch nothing: allocation and views (``tests/test_launches.py`` counts the same way).
NO_LAUNCH = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "view",
    "_unsafe_view",
    "reshape",
    "slice",
    "select",
    "alias",
    "as_strided",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "detach",
    "lift_fresh",
    "_reshape_alias",
}


class _Stubs(dict):
    """A compiled-kernel table whose every entry records its launches instead of running."""

    def __init__(self, launches: list):
        super().__init__()
        self.launches = launches

    def __missing__(self, name):
        return lambda *args: self.launches.append(name)


def _without_device_guard(fn):
    """``fn`` (``fused_moe``) recompiled from its source without its refusal of non-CUDA tensors; ``fn``
    itself where that refusal is ``moe_spec.validate.check_runs_on`` (patched out by the caller)."""
    src = textwrap.dedent(inspect.getsource(fn))
    cut, n = re.subn(r'\n    if x\.device\.type != "cuda":\n(?:        .*\n)+', "\n", src, count=1)
    if n != 1:
        if "check_runs_on" in fn.__globals__:
            return fn
        raise RuntimeError("gpu_stand_in: fused_moe's device check was not found in its source")
    scope: dict = {}
    exec(compile(cut, inspect.getsourcefile(fn), "exec"), fn.__globals__, scope)  # noqa: S102
    return scope[fn.__name__]


@contextlib.contextmanager
def gpu_stand_in():
    """``fused_moe``'s GPU path on CPU tensors: every compile returns stubs that record their launches
    (the DSL still wraps every argument), the stream is a stand-in and the host wrappers take CPU
    tensors for device ones.  Yields ``(fused_moe, launches)``; the patches are undone on exit."""
    from .. import decode, moe, moe_fp8, unfused

    launches: list = []
    stubs = lambda *a, **k: _Stubs(launches)  # noqa: E731
    patches = [
        (torch.cuda, "is_current_stream_capturing", lambda: False),
        (torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0)),
        (torch.cuda, "device", lambda device: contextlib.nullcontext()),
        (moe, "compile_gemm", lambda *a, **k: lambda *args: launches.append("GroupedGemm")),
        (decode, "compile_decode", lambda *a, **k: lambda *args: launches.append("DecodeKernel")),
        (moe, "_row_kernels", stubs),
        (moe, "_stream", lambda t: None),
        (moe, "check_runs_on", lambda *a: None),
        (moe, "surface_errors", lambda *a: None),
        (moe_fp8, "compile_quant_kernels", stubs),
        (moe_fp8, "compile_gather_quantize", lambda *a, **k: lambda *args: launches.append("x_gather_quantize")),
        (moe_fp8, "current_stream", lambda t: None),
        (unfused, "compile_unfused_kernels", stubs),
        (unfused, "current_stream", lambda t: None),
    ]
    try:
        from .. import rowmaps

        class RowBuffers(rowmaps.RowBuffers):  # maps a later torch op may index: valid values (0)
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                for t in self.out.values():
                    t.zero_()

        patches += [
            (rowmaps, "compile_align_kernels", stubs),
            (rowmaps, "current_stream", lambda t: None),
            (rowmaps, "on_gpu", lambda t: True),
            (moe, "RowBuffers", RowBuffers),
        ]
    except ImportError:  # an older tree: its alignment launches behind align_on_device
        patches.append((moe, "align_on_device", _older_align_stand_in(launches)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches if hasattr(obj, name)]
    forget = getattr(moe, "forget_calls", lambda: None)  # launches bound per call signature: bound anew here
    for obj, name, value in patches:
        if hasattr(obj, name):
            setattr(obj, name, value)
    forget()
    try:
        yield _without_device_guard(moe.fused_moe), launches
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        forget()


def _older_align_stand_in(launches: list):
    """The GPU branch of an older ``alignops.align_on_device`` (four buffers, five wrapped vectors, one
    launch), for a tree without ``rowmaps``: what its call did on the host.  It returns the
    reference alignment of the ids (computed once per routing), so later torch ops index validly."""
    from moe_spec.align import align, max_rows

    from ..runtime import cute_vector

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
    return {
        "T": T,
        "quant": quant or "bf16",
        "host_us": round(us, 1),
        "cute_launches": len(cute),
        "torch_launches": len(torch_ops),
        "launches": len(cute) + len(torch_ops),
        "cute": cute,
        "torch": torch_ops,
    }


def main(argv=None) -> dict:
    prog = "python -m cute_moe.lab.bench_align"
    ap = ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="a new or empty directory for bench_align.md and .json")
    ap.add_argument("--shapes", nargs="+", default=list(SPECS), help="catalog shapes (default: %(default)s)")
    ap.add_argument("--commit", default=None, help="git commit to record (when the checkout has no .git)")
    ap.add_argument("--host", action="store_true", help="host cost per fused_moe call, no GPU (gpu_stand_in)")
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=None,
        help=f"batch sizes (default: {' '.join(map(str, TOKENS))}; with --host: 1 64)",
    )
    ap.add_argument(
        "--quant", nargs="+", default=["bf16", "fp8_tensor", "fp8_channel", "fp8_block"], help="with --host: formats"
    )
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.host:
        rows = [host_cost(T, None if q == "bf16" else q) for q in args.quant for T in args.tokens or (1, 64)]
        for r in rows:
            print(
                {k: v for k, v in r.items() if k not in ("cute", "torch")},
                "\n   cute:",
                r["cute"],
                "\n   torch:",
                r["torch"],
                flush=True,
            )
        return {"host": rows}
    out = None if args.out is None else studyout.out_or_exit(prog, args.out, FILES)  # before any GPU work
    tokens = args.tokens or list(TOKENS)
    if any(t < 1 for t in tokens):
        ap.error("--tokens: every T must be at least 1")
    for spec in args.shapes:
        try:
            get_shape(spec)
        except ValueError as exc:
            ap.error(f"--shapes: {exc}")
    runinfo.require_cuda(prog)
    result = {**runinfo.run_info(runinfo.command_line(prog, argv), cuda=True, commit=args.commit), "cells": []}
    cells = [Cell(spec, T) for spec in args.shapes for T in tokens]
    for cell in cells:  # every graph first: none is captured once the profiler has run
        print(time_cell(cell), flush=True)
    flush = torch.empty(2 * L2_BYTES // 4, dtype=torch.int32, device="cuda")
    for cell in cells:
        result["cells"].append(profile_cell(cell, flush))
        print(
            {k: v for k, v in cell.row.items() if k in ("shape", "T") or k.endswith(("cold_us", "warm_us"))}, flush=True
        )
    text = markdown(result)
    print(text)
    if out is not None:
        studyout.write_files(out, {"bench_align.md": text, "bench_align.json": json.dumps(result, indent=1) + "\n"})
    return result


if __name__ == "__main__":
    main()

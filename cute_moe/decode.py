"""The MoE layer at decode in ONE persistent CuTe DSL launch (bf16): :func:`decode_fused_moe`.

For T·top_k ≤ 64 (token, slot) pairs the layer only streams the weights of the experts it hits; the
grouped pipeline (:func:`cute_moe.fused_moe`) spends four launches on it (the alignment's place kernel,
GEMM1 gathering its rows, GEMM2, the combine), each with its ramp and tail.  Here the whole layer is
one launch of :class:`~cute_moe.decode_kernel.DecodeKernel`: the routing read in the kernel (no sort),
tasks claimed from a ticket counter — GEMM1 per (expert, 64 columns of I), GEMM2 per (128 columns of K,
expert), the combine per (128 columns of K, 8 tokens) — ordered by device counters with release / acquire
semantics (notes/decode.md, "The CuTe DSL kernel").

The arithmetic is the grouped pipeline's: h = SiLU(gate)·up in fp32 rounded once to bf16 (its gated
GEMM1's epilogue, :func:`cute_moe.rowops.silu_mul`), y = (h·W2ᵀ)·w in fp32 rounded once (its GEMM2's row
scale), out[t] = Σ_j y[t·top_k + j] in fp32 in slot order, rounded once (its combine).

Host side: the arguments are checked by :func:`moe_spec.validate.validate_moe_args` with cute_moe's
limits, then the kernel's own (:func:`check_decode_sizes`: at most 64 pairs, K a multiple of 128, I of
64), each error naming the argument, before anything is allocated or launched.  One compile per
``topk_ids`` dtype serves every T, E, K, I (:func:`compile_decode`); h, y and
the self-resetting counters are a workspace per (pair bucket, K, I, device, stream, thread)
(:func:`decode_workspace`).  GPU tests: ``tests/test_cute_decode_gpu.py``; timings: notes/decode.md.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

from moe_spec.hopper import sm_count
from moe_spec.validate import MoEDims, check_runs_on, error_word, surface_errors, validate_moe_args
from moe_spec.workspace import Workspaces

from .cache import compile_once
from .decode_kernel import BF16, DecodeKernel
from .decode_parts import (
    H_TILE,
    STAGES,
    TOKENS,
    VEC,
    Y_TILE,
    counter_words,
    exchange_words,
    grid_size,
    half_tasks,
    pair_bucket,
    size_error,
)
from .limits import LIMITS
from .runtime import fake_rows, fake_stream, fake_vector, ffi_function

#: Workspaces kept (least recently used dropped first): one per (bucket, sizes, device, stream, thread).
WORKSPACES = 8
_workspaces = Workspaces(WORKSPACES)


def check_decode_sizes(dims: MoEDims) -> None:
    """The decode kernel's limits on a validated call's sizes (:func:`~cute_moe.decode_parts.size_error`),
    each error naming the argument."""
    error = size_error(dims.T, dims.top_k, dims.K, dims.I)
    if error is not None:
        raise ValueError(error)


def workspace_shapes(T: int, top_k: int, K: int, I: int, sms: int) -> dict:  # noqa: E741
    """Shapes of a workspace: h bf16 [bucket, I], y bf16 [bucket, K] (bucket: :func:`pair_bucket` of
    T·top_k), the int32 counters [:func:`counter_words`] and the halves' exchange, fp32 part and int32
    arrive (:func:`~cute_moe.decode_parts.exchange_words` for a grid of at most ``sms`` CTAs)."""
    rows = pair_bucket(T * top_k)
    part, arrive = exchange_words(sms)
    return {"h": (rows, I), "y": (rows, K), "counters": (counter_words(K),), "part": (part,), "arrive": (arrive,)}


def new_workspace(T: int, top_k: int, K: int, I: int, device) -> dict:  # noqa: E741
    """Fresh buffers of :func:`workspace_shapes`; the counters zeroed once (every launch leaves them zero)."""
    shapes = workspace_shapes(T, top_k, K, I, sm_count(device))
    return {
        "h": torch.empty(shapes["h"], dtype=torch.bfloat16, device=device),
        "y": torch.empty(shapes["y"], dtype=torch.bfloat16, device=device),
        "counters": torch.zeros(shapes["counters"], dtype=torch.int32, device=device),
        "part": torch.empty(shapes["part"], dtype=torch.float32, device=device),
        "arrive": torch.zeros(shapes["arrive"], dtype=torch.int32, device=device),
    }


def decode_workspace(T: int, top_k: int, K: int, I: int, device) -> dict:  # noqa: E741
    """The workspace of a call, as :class:`moe_spec.workspace.Workspaces` keeps it (launches on one stream
    never overlap, so one counter block serves all the eager calls of a stream)."""
    sizes = (pair_bucket(T * top_k), K, I, half_tasks())  # the exchange's size follows the switch
    return _workspaces.get(sizes, device, lambda: new_workspace(T, top_k, K, I, device))


def check_workspace(ws, dims: MoEDims, device) -> None:
    """A caller's workspace: a dict with h, y, counters of the call's sizes on x's device, named if not."""
    if not isinstance(ws, dict) or not {"h", "y", "counters", "part", "arrive"} <= set(ws):
        raise TypeError(
            "workspace: expected a dict with 'h', 'y', 'counters', 'part' and 'arrive' (cute_moe.decode.new_workspace)"
        )
    pairs = dims.T * dims.top_k
    for name, dtype, cols in (("h", torch.bfloat16, dims.I), ("y", torch.bfloat16, dims.K)):
        t = ws[name]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 2 or t.shape[1] != cols:
            raise ValueError(f"workspace: {name} must be a bf16 [≥ {pairs}, {cols}] tensor")
        if t.shape[0] < pairs or not t.is_contiguous() or t.device != device:
            raise ValueError(f"workspace: {name} must be a contiguous bf16 [≥ {pairs}, {cols}] tensor on {device}")
    c = ws["counters"]
    words = counter_words(dims.K)
    if not isinstance(c, torch.Tensor) or c.dtype != torch.int32 or tuple(c.shape) != (words,) or c.device != device:
        raise ValueError(f"workspace: counters must be an int32 [{words}] tensor on {device}, zeroed once when made")
    part_words, arrive_words = exchange_words(sm_count(device))
    for name, dtype, n in (("part", torch.float32, part_words), ("arrive", torch.int32, arrive_words)):
        t = ws[name]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (n,) or t.device != device:
            raise ValueError(
                f"workspace: {name} must be a {str(dtype).removeprefix('torch.')} [{n}] tensor on {device}"
            )


IDS_DTYPES = {"int32": cutlass.Int32, "int64": cutlass.Int64}
"""The ``topk_ids`` dtypes the kernel is compiled for (one binary each)."""


def fake_arguments(ids_dtype: str = "int32"):
    """Symbolic stand-ins for every argument (16-B aligned rows; K a multiple of 128, I of 64)."""
    sym, sym64 = cute.sym_int, cute.sym_int64
    x = make_fake_tensor(
        BF16, (sym(), sym(divisibility=Y_TILE)), stride=(sym64(divisibility=Y_TILE), 1), assumed_align=16
    )
    w1 = make_fake_tensor(
        BF16,
        (sym(divisibility=H_TILE), sym(divisibility=Y_TILE), sym(), sym()),
        stride=(sym64(divisibility=VEC), 1, sym64(divisibility=VEC), sym64(divisibility=VEC)),
        assumed_align=16,
    )
    w2 = make_fake_tensor(
        BF16,
        (sym(divisibility=Y_TILE), sym(divisibility=H_TILE), sym()),
        stride=(sym64(divisibility=VEC), 1, sym64(divisibility=VEC)),
        assumed_align=16,
    )
    ids_type = IDS_DTYPES[ids_dtype]
    routing = lambda dt: make_fake_compact_tensor(dt, (sym(), sym()), stride_order=(1, 0), assumed_align=dt.width // 8)  # noqa: E731
    return (
        x,
        w1,
        w2,
        routing(cutlass.Float32),
        routing(ids_type),
        fake_rows(BF16, H_TILE),
        fake_rows(BF16, Y_TILE),
        fake_rows(BF16, Y_TILE),
        fake_vector(cutlass.Int32),
        fake_vector(cutlass.Int32),
        fake_vector(cutlass.Float32),
        fake_vector(cutlass.Int32),
        cutlass.Int32(1),
        fake_stream(),
    )


def compile_decode(ids_dtype: str = "int32", *, keep_ptx: bool = False):
    """The compiled decode kernel for ``topk_ids`` of ``ids_dtype`` ("int32" or "int64"): one compile
    serves every T, E, K, I and grid (all runtime values), cached by :func:`cute_moe.cache.compile_once`."""
    if ids_dtype not in IDS_DTYPES:
        raise ValueError(f"topk_ids: the decode kernel takes int32 or int64 ids, got {ids_dtype}")

    def build(options):
        return cute.compile(DecodeKernel(), *fake_arguments(ids_dtype), options=options)

    key = ("decode", ids_dtype, STAGES, TOKENS, half_tasks())  # the switch read when compiling
    return compile_once(key, build, keep_ptx=keep_ptx)


@functools.lru_cache(maxsize=4)
def _kernel(ids_dtype: torch.dtype):
    return ffi_function(compile_decode(str(ids_dtype).removeprefix("torch.")))


def decode_fused_moe(x, w1, w2, topk_weights, topk_ids, *, workspace: dict | None = None) -> torch.Tensor:
    """The MoE layer in one launch → out bf16 [T, K] (the contract of :mod:`moe_spec.contract`, bf16).

    ``x`` bf16 [T, K]; ``w1`` bf16 [E, 2I, K] (gate rows, then up rows); ``w2`` bf16 [E, K, I];
    ``topk_weights`` fp32 [T, top_k]; ``topk_ids`` int32 or int64 [T, top_k]; T·top_k ≤ 64, K a
    multiple of 128, I of 64.  ``workspace``: a dict of :func:`new_workspace` (default: this stream's,
    :func:`decode_workspace`).  Bad routing data is the contract's: an id outside [0, E) is computed
    clamped with its routing weight replaced by NaN (its token's row is NaN), flagged in the error word
    as are a repeated id and a non-finite weight; the next call raises it."""
    dims = validate_moe_args(x, w1, w2, topk_weights, topk_ids, limits=LIMITS)
    check_decode_sizes(dims)
    if workspace is not None:
        check_workspace(workspace, dims, x.device)
    check_runs_on(x.device, LIMITS)
    surface_errors(x.device)  # an earlier call's failed data check raises here
    if dims.T == 0:
        return x.new_empty((0, dims.K))
    return launch(_kernel(topk_ids.dtype), x, w1, w2, topk_weights, topk_ids, dims, workspace)


def launch_grid(dims: MoEDims, device) -> int:
    """CTAs of a launch with sizes ``dims`` on ``device`` (:func:`~cute_moe.decode_parts.grid_size`): a
    caller that launches one signature many times (``cute_moe.moe._Call``) keeps it."""
    return grid_size(dims.T, dims.top_k, dims.E, dims.K, dims.I, sm_count(device))


def launch(
    kernel, x, w1, w2, topk_weights, topk_ids, dims: MoEDims, workspace: dict | None = None, grid: int | None = None
) -> torch.Tensor:
    """One launch of ``kernel`` (the TVM-FFI function of :func:`compile_decode` for ``topk_ids``' dtype) on a
    call whose arguments and sizes are checked, T ≥ 1 → out bf16 [T, K]: :func:`decode_fused_moe`'s and,
    where the plan's path is "decode", ``cute_moe.fused_moe``'s (:mod:`cute_moe.moe`) last step.  ``grid``:
    :func:`launch_grid` of the call, when the caller keeps it."""
    T, K, I, top_k = dims.T, dims.K, dims.I, dims.top_k  # noqa: E741
    ws = workspace if workspace is not None else decode_workspace(T, top_k, K, I, x.device)
    out = torch.empty((T, K), dtype=torch.bfloat16, device=x.device)
    grid = launch_grid(dims, x.device) if grid is None else grid
    w1_view = w1.unflatten(1, (2, I)).permute(2, 3, 1, 0)  # (I, K, half, E): gate 0, up 1
    w2_view = w2.permute(1, 2, 0)  # (K, I, E)
    word = error_word(x.device)
    kernel(
        x,
        w1_view,
        w2_view,
        topk_weights,
        topk_ids,
        ws["h"],
        ws["y"],
        out,
        ws["counters"],
        word,
        ws["part"],
        ws["arrive"],
        grid,
    )
    return out

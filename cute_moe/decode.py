"""The MoE layer at decode in ONE persistent CuTe DSL launch (bf16 and the FP8 formats): :func:`decode_fused_moe`.

For T·top_k ≤ 64 (token, slot) pairs the layer only streams the weights of the experts it hits; the
grouped pipeline (:func:`cute_moe.fused_moe`) spends four launches on it (the alignment's place kernel,
GEMM1 gathering its rows, GEMM2, the combine), each with its ramp and tail.  Here the whole layer is
one launch of :class:`~cute_moe.decode_kernel.DecodeKernel`: the routing read in the kernel (no sort),
tasks claimed from a ticket counter — GEMM1 per (expert, 64 columns of I), GEMM2 per (128 columns of K,
expert), the combine per (128 columns of K, 8 tokens) — ordered by device counters with release / acquire
semantics (notes/decode.md, "The CuTe DSL kernel").

The arithmetic is the grouped pipeline's: h = SiLU(gate)·up in fp32 rounded once to bf16 (its gated
GEMM1's epilogue, :func:`cute_moe.activation.silu_mul`), y = (h·W2ᵀ)·w in fp32 rounded once (its GEMM2's row
scale), out[t] = Σ_j y[t·top_k + j] in fp32 in slot order, rounded once (its combine).  Under an FP8 format
(``quant``, weights E4M3 with their scales) x and h are quantized inside the launch as the grouped FP8
pipeline quantizes them, h stays fp32 until then (:mod:`cute_moe.decode_quant`).

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
from moe_spec.quant import FP8_BLOCK, FP8_DTYPE
from moe_spec.validate import MoEDims, check_runs_on, error_word, surface_errors, validate_moe_args
from moe_spec.workspace import Workspaces

from .cache import compile_once
from .decode_kernel import BF16, FP8, DecodeKernel
from .decode_parts import (
    FP8_TILE_K,
    H_TILE,
    TOKENS,
    Y_TILE,
    counter_words,
    exchange_words,
    fp8_overlap,
    grid_size,
    half_tasks,
    pair_bucket,
    size_error,
    stages,
)
from .decode_trace import TRACE_WORDS
from .limits import LIMITS
from .runtime import fake_rows, fake_stream, fake_vector, ffi_function

#: Workspaces kept (least recently used dropped first): one per (bucket, sizes, device, stream, thread).
WORKSPACES = 8
_workspaces = Workspaces(WORKSPACES)


def check_decode_sizes(dims: MoEDims, quant: str | None = None) -> None:
    """The decode kernel's limits on a validated call's sizes (:func:`~cute_moe.decode_parts.size_error`),
    each error naming the argument."""
    error = size_error(dims.T, dims.top_k, dims.K, dims.I, quant is not None)
    if error is not None:
        raise ValueError(error)


def workspace_shapes(T: int, top_k: int, K: int, I: int, sms: int, quant: str | None = None) -> dict:  # noqa: E741
    """Shapes of a workspace: h [bucket, I] (bf16; fp32 under FP8), y bf16 [bucket, K] (bucket:
    :func:`pair_bucket` of T·top_k), the int32 counters [:func:`counter_words`] and the halves' exchange, fp32
    part and int32 arrive (:func:`~cute_moe.decode_parts.exchange_words` for a grid of at most ``sms`` CTAs).
    FP8 adds x's and h's E4M3 rows xq [bucket, K] and hq [bucket, I], their flat fp32 scales xs and hs (room
    for a scale per 128 columns of every row, the finest format's) and the amax word [1]."""
    rows = pair_bucket(T * top_k)
    part, arrive = exchange_words(sms)
    shapes = {"h": (rows, I), "y": (rows, K), "counters": (counter_words(K),), "part": (part,), "arrive": (arrive,)}
    if quant is not None:
        shapes |= {"xq": (rows, K), "xs": (rows * (K // FP8_BLOCK),), "hq": (rows, I)}
        shapes |= {"hs": (rows * (I // FP8_BLOCK),), "amax": (1,)}
    return shapes


#: The dtype of each workspace buffer (h: bf16, fp32 under FP8).
_DTYPES = {"y": torch.bfloat16, "counters": torch.int32, "part": torch.float32, "arrive": torch.int32}
_DTYPES |= {"xq": FP8_DTYPE, "xs": torch.float32, "hq": FP8_DTYPE, "hs": torch.float32, "amax": torch.float32}
_ZEROED = ("counters", "arrive", "amax")
"""The buffers every launch leaves zero: zeroed once, when made."""


def _dtype(name: str, quant: str | None) -> torch.dtype:
    if name == "h":
        return torch.bfloat16 if quant is None else torch.float32
    return _DTYPES[name]


def new_workspace(T: int, top_k: int, K: int, I: int, device, quant: str | None = None) -> dict:  # noqa: E741
    """Fresh buffers of :func:`workspace_shapes`; the counters (and FP8's amax) zeroed once (every launch
    leaves them zero)."""
    shapes = workspace_shapes(T, top_k, K, I, sm_count(device), quant)
    return {
        name: (torch.zeros if name in _ZEROED else torch.empty)(shape, dtype=_dtype(name, quant), device=device)
        for name, shape in shapes.items()
    }


def decode_workspace(T: int, top_k: int, K: int, I: int, device, quant: str | None = None) -> dict:  # noqa: E741
    """The workspace of a call, as :class:`moe_spec.workspace.Workspaces` keeps it (launches on one stream
    never overlap, so one counter block serves all the eager calls of a stream)."""
    sizes = (pair_bucket(T * top_k), K, I, half_tasks(), quant)  # the exchange's size follows the switch
    return _workspaces.get(sizes, device, lambda: new_workspace(T, top_k, K, I, device, quant))


def check_workspace(ws, dims: MoEDims, device, quant: str | None = None) -> None:
    """A caller's workspace: a dict of :func:`workspace_shapes`' buffers for the call's sizes and format on x's
    device — row buffers with at least the call's rows, the rest exactly their shapes — named if not."""
    shapes = workspace_shapes(dims.T, dims.top_k, dims.K, dims.I, sm_count(device), quant)
    if not isinstance(ws, dict) or not set(shapes) <= set(ws):
        names = ", ".join(repr(n) for n in shapes)
        raise TypeError(f"workspace: expected a dict with {names} (cute_moe.decode.new_workspace)")
    pairs = dims.T * dims.top_k
    at_least = {"h": pairs, "y": pairs, "hq": pairs, "xq": dims.T}  # rows
    at_least |= {"xs": dims.T * (dims.K // FP8_BLOCK), "hs": pairs * (dims.I // FP8_BLOCK)}  # flat scales
    for name, shape in shapes.items():
        t, dtype = ws[name], _dtype(name, quant)
        dt = str(dtype).removeprefix("torch.")
        kind = f"{dt} [{', '.join(map(str, shape))}]"
        if name in at_least:
            kind = f"contiguous {dt} [≥ {', '.join(map(str, (at_least[name], *shape[1:])))}]"
        ok = isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == len(shape) and t.device == device
        if ok and name in at_least:
            ok = tuple(t.shape[1:]) == shape[1:] and t.shape[0] >= at_least[name] and t.is_contiguous()
        elif ok:
            ok = tuple(t.shape) == shape
        if not ok:
            made = ", zeroed once when made" if name in _ZEROED else ""
            raise ValueError(f"workspace: {name} must be a {kind} tensor on {device}{made}")


IDS_DTYPES = {"int32": cutlass.Int32, "int64": cutlass.Int64}
"""The ``topk_ids`` dtypes the kernel is compiled for (one binary each)."""


FP8_FORMATS = ("fp8_tensor", "fp8_channel", "fp8_block")
"""The FP8 formats the kernel computes (:mod:`cute_moe.decode_quant`); static scales: fp8_tensor only."""


def _check_format(quant, static: bool) -> None:
    if quant is not None and quant not in FP8_FORMATS:
        raise ValueError(f"quant: the decode kernel takes None (bf16) or one of {FP8_FORMATS}, got {quant!r}")
    if static and quant != "fp8_tensor":
        raise ValueError(f"a1_scale: static activation scales are fp8_tensor's, got quant {quant!r}")


def fake_arguments(ids_dtype: str = "int32", quant: str | None = None, static: bool = False):
    """Symbolic stand-ins for every argument (16-B aligned rows; K a multiple of 128, I of 64): bf16's
    fourteen, and under FP8 its nine more (:class:`~cute_moe.decode_quant.Fp8Args`) in ``quant``'s shapes."""
    sym, sym64 = cute.sym_int, cute.sym_int64
    ab = BF16 if quant is None else FP8
    vec = 128 // ab.width  # elements per 16 bytes
    x = make_fake_tensor(
        BF16, (sym(), sym(divisibility=Y_TILE)), stride=(sym64(divisibility=Y_TILE), 1), assumed_align=16
    )
    w1 = make_fake_tensor(
        ab,
        (sym(divisibility=H_TILE), sym(divisibility=Y_TILE), sym(), sym()),
        stride=(sym64(divisibility=vec), 1, sym64(divisibility=vec), sym64(divisibility=vec)),
        assumed_align=16,
    )
    w2 = make_fake_tensor(
        ab,
        (sym(divisibility=Y_TILE), sym(divisibility=H_TILE), sym()),
        stride=(sym64(divisibility=vec), 1, sym64(divisibility=vec)),
        assumed_align=16,
    )
    ids_type = IDS_DTYPES[ids_dtype]
    compact = lambda dt, rank: make_fake_compact_tensor(  # noqa: E731
        dt, tuple(sym() for _ in range(rank)), stride_order=tuple(reversed(range(rank))), assumed_align=dt.width // 8
    )
    h = fake_rows(BF16, H_TILE) if quant is None else fake_rows(cutlass.Float32, H_TILE)
    bf16 = (
        x,
        w1,
        w2,
        compact(cutlass.Float32, 2),
        compact(ids_type, 2),
        h,
        fake_rows(BF16, Y_TILE),
        fake_rows(BF16, Y_TILE),
        fake_vector(cutlass.Int32),
        fake_vector(cutlass.Int32),
        fake_vector(cutlass.Float32),
        fake_vector(cutlass.Int32),
        cutlass.Int32(1),
        fake_stream(),
    )
    if quant is None:
        return bf16
    rank = {"fp8_tensor": 1, "fp8_channel": 2, "fp8_block": 3}[quant]  # the weight scales' [E, ...]
    f32 = lambda: fake_vector(cutlass.Float32)  # noqa: E731
    w_scales = (compact(cutlass.Float32, rank), compact(cutlass.Float32, rank))
    rows = (fake_rows(FP8, Y_TILE), f32(), fake_rows(FP8, FP8_TILE_K), f32(), f32())  # xq, xs, hq, hs, amax
    return bf16 + w_scales + (f32(), f32()) + rows


def compile_decode(
    ids_dtype: str = "int32",
    quant: str | None = None,
    static: bool = False,
    *,
    trace: bool = False,
    keep_ptx: bool = False,
):
    """The compiled decode kernel for ``topk_ids`` of ``ids_dtype`` ("int32" or "int64") in format ``quant``
    (None: bf16; ``static``: fp8_tensor with static activation scales): one compile serves every T, E, K, I
    and grid (all runtime values), cached by :func:`cute_moe.cache.compile_once`.  ``trace``: the lab's
    instrumented twin, which records every task's SM and times into a last argument
    (:data:`~cute_moe.decode_parts.TRACE_WORDS`; :mod:`cute_moe.lab.trace_decode`)."""
    if ids_dtype not in IDS_DTYPES:
        raise ValueError(f"topk_ids: the decode kernel takes int32 or int64 ids, got {ids_dtype}")
    _check_format(quant, static)

    def build(options):
        kernel = DecodeKernel(quant, static, trace)
        args = fake_arguments(ids_dtype, quant, static)
        if trace:  # after the FP8 arguments (None in bf16)
            args += (None,) * (9 if quant is None else 0) + (
                make_fake_compact_tensor(
                    cutlass.Int64, (cute.sym_int(), TRACE_WORDS), stride_order=(1, 0), assumed_align=8
                ),
            )
        return cute.compile(kernel, *args, options=options)

    key = ("decode", ids_dtype, stages(), TOKENS, half_tasks())  # the switch read when compiling
    if quant is not None:
        key += (quant, static, fp8_overlap())
    if trace:
        key += ("trace",)
    return compile_once(key, build, keep_ptx=keep_ptx)


@functools.lru_cache(maxsize=16)
def _kernel(ids_dtype: torch.dtype, quant: str | None = None, static: bool = False):
    return ffi_function(compile_decode(str(ids_dtype).removeprefix("torch."), quant, static))


def decode_fused_moe(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    *,
    quant: str | None = None,
    w1_scale=None,
    w2_scale=None,
    a1_scale=None,
    a2_scale=None,
    workspace: dict | None = None,
) -> torch.Tensor:
    """The MoE layer in one launch → out bf16 [T, K] (the contract of :mod:`moe_spec.contract`).

    ``x`` bf16 [T, K]; ``w1`` [E, 2I, K] (gate rows, then up rows); ``w2`` [E, K, I] — bf16, or under
    ``quant`` (an FP8 format) E4M3 with ``w1_scale`` and ``w2_scale``, and for fp8_tensor optionally the
    static activation scales ``a1_scale`` and ``a2_scale`` (both or neither); ``topk_weights`` fp32
    [T, top_k]; ``topk_ids`` int32 or int64 [T, top_k]; T·top_k ≤ 64, K a multiple of 128, I of 64 (FP8:
    of 128).  ``workspace``: a dict of :func:`new_workspace` for the format (default: this stream's,
    :func:`decode_workspace`).  Bad routing data is the contract's: an id outside [0, E) is computed
    clamped with its routing weight replaced by NaN (its token's row is NaN), flagged in the error word
    as are a repeated id and a non-finite weight (and a static scale that is not finite and positive);
    the next call raises it."""
    scales = dict(w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale)
    dims = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, limits=LIMITS, **scales)
    static = a1_scale is not None  # a pair, fp8_tensor only: validated
    _check_format(quant, static)
    check_decode_sizes(dims, quant)
    if workspace is not None:
        check_workspace(workspace, dims, x.device, quant)
    check_runs_on(x.device, LIMITS)
    surface_errors(x.device)  # an earlier call's failed data check raises here
    if dims.T == 0:
        return x.new_empty((0, dims.K))
    kernel = _kernel(topk_ids.dtype, quant, static)
    return launch(kernel, x, w1, w2, topk_weights, topk_ids, dims, workspace, quant=quant, scales=scales)


def launch_grid(dims: MoEDims, device, quant: str | None = None) -> int:
    """CTAs of a launch with sizes ``dims`` on ``device`` (:func:`~cute_moe.decode_parts.grid_size`): a
    caller that launches one signature many times (``cute_moe.moe._Call``) keeps it."""
    return grid_size(dims.T, dims.top_k, dims.E, dims.K, dims.I, sm_count(device), quant is not None)


@functools.lru_cache(maxsize=8)
def _stand_in(device) -> torch.Tensor:
    """A one-element fp32 tensor passed where a dynamic-scale launch takes no static scale (never read)."""
    return torch.ones(1, dtype=torch.float32, device=device)


def launch(
    kernel,
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    dims: MoEDims,
    workspace: dict | None = None,
    grid: int | None = None,
    *,
    quant: str | None = None,
    scales: dict | None = None,
    trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch of ``kernel`` (the TVM-FFI function of :func:`compile_decode` for ``topk_ids``' dtype and the
    format) on a call whose arguments and sizes are checked, T ≥ 1 → out bf16 [T, K]:
    :func:`decode_fused_moe`'s and, where the plan's path is "decode", ``cute_moe.fused_moe``'s
    (:mod:`cute_moe.moe`) last step.  ``grid``: :func:`launch_grid` of the call, when the caller keeps it;
    ``scales``: under FP8, the call's w1_scale, w2_scale, a1_scale, a2_scale; ``trace``: int64 [≥ tasks,
    TRACE_WORDS], zeroed, for the kernel of ``compile_decode(..., trace=True)`` (None for every other)."""
    T, K, I, top_k = dims.T, dims.K, dims.I, dims.top_k  # noqa: E741
    ws = workspace if workspace is not None else decode_workspace(T, top_k, K, I, x.device, quant)
    out = torch.empty((T, K), dtype=torch.bfloat16, device=x.device)
    grid = launch_grid(dims, x.device, quant) if grid is None else grid
    w1_view = w1.unflatten(1, (2, I)).permute(2, 3, 1, 0)  # (I, K, half, E): gate 0, up 1
    w2_view = w2.permute(1, 2, 0)  # (K, I, E)
    word = error_word(x.device)
    args = [x, w1_view, w2_view, topk_weights, topk_ids, ws["h"], ws["y"], out, ws["counters"], word]
    args += [ws["part"], ws["arrive"], grid]
    if quant is None:
        args += [None] * 9  # the FP8 arguments of the kernel's signature (DecodeKernel.__call__), unused
    else:
        a1, a2 = scales["a1_scale"], scales["a2_scale"]
        if a1 is None:
            a1 = a2 = _stand_in(x.device)
        args += [scales["w1_scale"], scales["w2_scale"], a1.reshape(1), a2.reshape(1)]
        args += [ws["xq"], ws["xs"], ws["hq"], ws["hs"], ws["amax"]]
    kernel(*args, trace)
    return out

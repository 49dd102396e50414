"""The MoE layer on the grouped GEMM: ``fused_moe`` and the host wrappers of its steps.

For ``T`` tokens routed to ``top_k`` of ``E`` experts (``topk_ids``, ``topk_weights``)::

    out[t] = Σ_j  w[t, j] · ( SiLU(x[t]·W1g[e]ᵀ) ⊙ (x[t]·W1u[e]ᵀ) ) · W2[e]ᵀ ,   e = topk_ids[t, j]

with ``W1 [E, 2I, K]`` (gate rows, then up rows) and ``W2 [E, K, I]``.  A call runs its plan
(``plan.py``): the alignment sorts the (token, slot) pairs by expert into runs padded to the plan's
tile and writes the row maps (``rowmaps.py``); GEMM1 writes SiLU·up from its epilogue, reading its
token rows by index where the plan gathers in the producer (else a gather row kernel runs first);
GEMM2 applies each row's routing weight in its epilogue; a row kernel sums every token's top_k rows
(``rowops.py``).  Nothing reads routing data back to the host, so the layer can be captured in a
CUDA graph and a new routing recompiles nothing; buffers are sized by the host-known worst case
(:func:`moe_spec.align.max_rows`).  An FP8 ``quant`` adds the W8A8 steps of ``moe_fp8.py``;
``fusion="separate"`` runs the unfused pipeline of ``unfused.py``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from moe_spec.align import Alignment, max_rows
from moe_spec.hopper import sm_count
from moe_spec.ops import through_op
from moe_spec.quant import FP8_DTYPE, activation_scale_shape
from moe_spec.validate import Limits, MoEDims, check_runs_on, error_word, surface_errors, validate_moe_args

from .alignops import MAX_EXPERTS
from .config import GemmConfig
from .gemm_plan import compile_gemm
from .limits import ALIGN_ELEMS
from .moe_fp8 import amax_sizes, quantize_intermediate, quantize_tokens, sorted_token_scales
from .plan import LayerPlan, plan
from .rowmaps import RowBuffers, SortedRows, sort_rows_on_device, split_blocks
from .rowops import compile_row_kernels
from .runtime import current_stream as _stream
from .runtime import cute_scale, keep, release
from .runtime import cute_tensor as _cute_tensor
from .runtime import cute_vector as _cute_vector
from .runtime import cute_weight as _cute_weight
from .unfused import scale_rows, weighted_combine

#: What this backend adds to the contract (moe_spec.validate.Limits): every surface checks it.
LIMITS = Limits("cute_moe", MAX_EXPERTS, cpu="on a CPU, cute_moe.compile_ptx() shows the kernels")


def sort_rows(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    tile: int,
    gemm_tiles=(),
    *,
    word: torch.Tensor | None = None,
    buffers: RowBuffers | None = None,
) -> SortedRows:
    """Check the routing data, align the pairs (runs padded to ``tile``) and write every row map and the
    block maps of each GEMM token tile in ``gemm_tiles`` (default: ``tile``): the two launches of
    :func:`~cute_moe.rowmaps.sort_rows_on_device` on a GPU, :func:`~cute_moe.rowmaps.reference_rows`
    on the CPU.  Failed checks go into ``word`` (default: the device's error word)."""
    return sort_rows_on_device(topk_ids, topk_weights, num_experts, tile, gemm_tiles, word=word, buffers=buffers)


def gemm_blocks(rows: SortedRows | Alignment, tokens_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of every ``tokens_tile``-row block int32, number of used blocks int32 [1]) for a GEMM.

    From :class:`SortedRows`: the maps its launches wrote for that tile (no launch); for another
    tile, or from an :class:`~moe_spec.align.Alignment`, derived in torch ops
    (:func:`~cute_moe.rowmaps.split_blocks`).  ``tokens_tile`` must divide the alignment tile, so
    each block lies inside one expert's run.  Blocks past the used rows get −1 (never read: the
    scheduler stops at the block count).
    """
    if isinstance(rows, SortedRows):
        hit = rows.blocks.get(tokens_tile)
        if hit is not None:
            return hit
        rows = rows.alignment
    return split_blocks(rows, tokens_tile)


def check_gemm_shape(n_out: int, k: int, cfg: GemmConfig | None = None) -> None:
    """The grouped GEMM's host check of its problem sizes: ``N_out`` and ``K`` positive multiples of
    the config's row alignment — TMA's 16-byte rows: ``cfg.out_align`` and ``cfg.operand_align``
    (8 bf16, 16 E4M3, 4 fp32; a bf16 config's ``ALIGN_ELEMS`` without one).  With K = 0 no stage
    would ever be loaded."""
    cfg = GemmConfig() if cfg is None else cfg
    for name, v, multiple, what in (
        ("K", k, cfg.operand_align, cfg.dtype),
        ("N_out", n_out, cfg.out_align, cfg.out_dtype),
    ):
        if v <= 0 or v % multiple:
            raise ValueError(
                f"grouped_gemm: {name}={v} must be a positive multiple of {multiple} "
                f"(TMA needs 16-byte aligned {what} rows)"
            )


def grouped_gemm(
    x_sorted: torch.Tensor,
    w: torch.Tensor,
    rows: SortedRows,
    cfg: GemmConfig,
    *,
    row_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[r] = x_sorted[r] · w[expert(r)]ᵀ (· row_scale[r])`` for every used sorted row r.

    x_sorted: [M_pad, K]; w: [E, N_out, K] (contiguous), both bf16 or — FP8 config — E4M3 with
    ``x_scale`` (per sorted row: [1] / [M_pad] / [M_pad, ⌈K/128⌉]) and ``w_scale`` (moe_spec's
    weight scale shape), dequantized in registers.  Returns ``cfg.out_dtype`` [M_pad, N_out]
    (rows past the used blocks are left unwritten).  A gated config (``cfg.gated``) takes W1
    ``[E, 2I, K]`` (gate rows, then up rows) and returns ``SiLU(x·W1gᵀ) ⊙ (x·W1uᵀ)`` bf16 [M_pad, I].
    A ``gather_rows`` config takes the unsorted tokens ``x [T, K]`` in place of ``x_sorted`` and reads
    row r from ``x[rows.token_of_row[r]]`` (the gathering producer, ``gemm.py``; K a multiple of ``cfg.tile_k``).
    """
    m_pad, k = (rows.rows, x_sorted.shape[1]) if cfg.gather_rows else x_sorted.shape
    n_experts, n_out, k_w = w.shape
    if cfg.gated:
        if n_out % 2:
            raise ValueError(
                f"grouped_gemm: a gated config takes w = W1 [E, 2I, K] (gate rows, then up rows); w has {n_out} rows"
            )
        n_out //= 2  # the output is [M_pad, I]
    if k_w != k:
        raise ValueError(f"grouped_gemm: K of x_sorted ({k}) and w ({k_w}) differ")
    dtype = getattr(torch, cfg.dtype)
    for name, t in (("x_sorted", x_sorted), ("w", w)):
        if t.dtype != dtype:
            raise TypeError(f"grouped_gemm: {name} is {t.dtype}, the config's operands are {cfg.dtype}")
    check_gemm_shape(n_out, k, cfg)
    if cfg.gather_rows and k % cfg.tile_k:
        raise ValueError(
            f"grouped_gemm: K={k} must be a multiple of tile_k={cfg.tile_k} for a gather_rows config "
            f"(its cp.async copies move whole stages of a token row)"
        )
    if cfg.row_scale != (row_scale is not None):
        raise ValueError("grouped_gemm: pass row_scale exactly when cfg.row_scale is set")
    if (cfg.quant is not None) != (x_scale is not None) or (x_scale is None) != (w_scale is None):
        raise ValueError("grouped_gemm: pass x_scale and w_scale exactly when cfg.quant is set")
    if out is None:
        out = torch.empty(m_pad, n_out, dtype=getattr(torch, cfg.out_dtype), device=x_sorted.device)
    expert_of_block, num_blocks = gemm_blocks(rows, cfg.tokens_tile)
    if row_scale is None:
        row_scale = rows.weight_of_row  # a valid fp32 buffer the kernel never reads
    index_dtype = str(rows.token_of_row.dtype).removeprefix("torch.")  # read by a gather_rows kernel only
    compiled = compile_gemm(cfg, sm_count(x_sorted.device), index_dtype=index_dtype)
    compiled(
        _cute_tensor(x_sorted, 1),
        # (N_out, K, E): the expert is TMA's 3rd coordinate; gated (I, K, half, E): gate 0 / up 1, then the expert
        _cute_weight(w.unflatten(1, (2, n_out)).permute(2, 3, 1, 0) if cfg.gated else w.permute(1, 2, 0), 1),
        _cute_tensor(out.t(), 0) if cfg.swap_ab else _cute_tensor(out, 1),
        _cute_vector(expert_of_block),
        _cute_vector(num_blocks),
        _cute_vector(row_scale),
        _stream(x_sorted),
        *(() if cfg.quant is None else (cute_scale(x_scale), cute_scale(w_scale))),
        *((None, None, _cute_vector(rows.token_of_row)) if cfg.gather_rows else ()),
    )
    return out


def fused_moe(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    *,
    quant=None,
    w1_scale=None,
    w2_scale=None,
    swap_ab: bool | None = None,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    fusion: str = "fused",
    a1_scale=None,
    a2_scale=None,
) -> torch.Tensor:
    """The backend contract: bf16 ``[T, K]`` output of the MoE layer.

    Backend options: ``swap_ab`` forces the path (None: the rule in
    :func:`~cute_moe.plan.path_rule`); ``configs`` gives the (GEMM1, GEMM2) configs outright
    (then ``swap_ab`` must be None); ``fusion="separate"`` runs the unfused pipeline of
    :mod:`cute_moe.unfused` (scales and routing weight in passes of their own) instead of the fused
    one.  ``quant`` (an FP8 format) runs the W8A8 layer of :mod:`cute_moe.moe_fp8`.  The
    arguments, then the options and every limit of this backend (:func:`~cute_moe.plan.plan`), are
    checked on the host before the first launch — T = 0 included — so bad input never leaves a
    half-run pipeline behind. Static activation scales (``a1_scale``, ``a2_scale``) are not
    implemented here (the activations are quantized with dynamic scales): refused by name.
    """
    if a1_scale is not None or a2_scale is not None:
        raise ValueError(
            f"{'a1_scale' if a1_scale is not None else 'a2_scale'}: static activation scales are not "
            "implemented by cute_moe (dynamic scales only); triton_moe takes them with fp8_tensor"
        )
    dims = validate_moe_args(
        x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, limits=LIMITS
    )
    p = plan(dims, quant, swap_ab=swap_ab, configs=configs, fusion=fusion)
    check_runs_on(x.device, LIMITS)  # T = 0 included: what T = 1 refuses, T = 0 refuses
    surface_errors(x.device)  # an earlier call's failed data check raises here (moe_spec.contract)
    if dims.T == 0:
        return x.new_empty((0, dims.K))
    # The routing data is checked on the device, without a sync, by the alignment's place kernel
    # (guard_routing's meaning): an id outside [0, E) is clamped and its pair weighted NaN, and the
    # error word says why.  Its buffers and the layer's are the workspace of this shape and stream.
    ws = _workspace(dims, p, x.device)
    rows = sort_rows(
        topk_ids,
        topk_weights,
        dims.E,
        p.align_tile,
        (p.gemm1.tokens_tile, p.gemm2.tokens_tile),
        word=ws["word"],
        buffers=ws["rows"],
    )
    if quant is not None:
        return _fp8_layer(x, w1, w2, w1_scale, w2_scale, topk_weights, p, rows, ws)
    # gather_rows: GEMM1 reads x by token index; gated: SiLU·up in GEMM1's epilogue, [M_pad, I] straight out
    x_sorted = x if p.gemm1.gather_rows else gather_rows(x, rows, out=ws["x_sorted"])
    h = grouped_gemm(x_sorted, w1, rows, p.gemm1, out=ws["h"])
    a = h if p.gemm1.gated else silu_mul(h, rows)
    if p.fusion == "separate":
        y = grouped_gemm(a, w2, rows, p.gemm2, out=ws["y"])
        return weighted_combine(y, rows.row_of_pair, rows.weight_of_pair.view(dims.T, dims.top_k), quant)
    y = grouped_gemm(a, w2, rows, p.gemm2, row_scale=rows.weight_of_row, out=ws["y"])
    return combine(y, rows, dims.T, dims.top_k)


fused_moe.limits = LIMITS


def _fp8_layer(x, w1, w2, w1_scale, w2_scale, topk_weights, p: LayerPlan, rows: SortedRows, ws: dict) -> torch.Tensor:
    """The W8A8 layer (``moe_fp8``'s docstring): x quantized once, its E4M3 rows gathered (as bf16
    pairs: the gather moves bytes), GEMM1 to fp32, SiLU·up quantized, GEMM2 with the routing
    weight, combine — or, ``separate``, with the scale and routing-weight passes of ``unfused``.
    ``ws``: the workspace (its amax buffers zeroed by the alignment)."""
    T, top_k = topk_weights.shape
    quant, separate, al = p.quant, p.fusion == "separate", rows.alignment
    xq, x_scale = quantize_tokens(x, quant, amax=ws["x_amax"], out=(ws["xq"], ws["x_scale"]))
    x_sorted = gather_rows(xq.view(torch.bfloat16), rows, out=ws["x_sorted"]).view(FP8_DTYPE)
    x_scale = sorted_token_scales(x_scale, rows.token_of_row, quant)
    h = grouped_gemm(x_sorted, w1, rows, p.gemm1, x_scale=x_scale, w_scale=w1_scale, out=ws["h"])
    if separate:
        scale_rows(h, al, x_scale, w1_scale, quant)
    aq, a_scale = quantize_intermediate(h, rows, quant, amax=ws["a_amax"], out=ws["a"], q_out=(ws["aq"], ws["a_scale"]))
    if not separate:
        y = grouped_gemm(
            aq, w2, rows, p.gemm2, row_scale=rows.weight_of_row, x_scale=a_scale, w_scale=w2_scale, out=ws["y"]
        )
        return combine(y, rows, T, top_k)
    y = grouped_gemm(aq, w2, rows, p.gemm2, x_scale=a_scale, w_scale=w2_scale, out=ws["y"])
    return weighted_combine(
        scale_rows(y, al, a_scale, w2_scale, quant), rows.row_of_pair, rows.weight_of_pair.view(T, top_k), quant
    )


#: Workspaces kept (least recently used dropped first): one per (sizes, plan tiles, device, stream, thread).
WORKSPACES = 8
_workspaces: OrderedDict = OrderedDict()


def _workspace(dims: MoEDims, p: LayerPlan, device) -> dict:
    """The buffers of one call — the alignment's outputs (:class:`~cute_moe.rowmaps.RowBuffers`),
    X_sorted, H and Y (FP8: also A in fp32 and the two amax buffers, which the alignment zeroes) —
    reused by the eager calls of one stream and thread: the stream orders each call after the
    last, and the returned output is always a new tensor.  Their CuTe
    wrappers are made once (``runtime.keep``).  Fresh, and not kept, while a CUDA graph is being
    captured: a graph owns the buffers it was captured with; so does a call through the op
    (:func:`moe_spec.ops.through_op`)."""
    capturing = torch.cuda.is_current_stream_capturing() or through_op()
    stream = torch.cuda.current_stream(device).cuda_stream
    tiles = (p.gemm1.tokens_tile, p.gemm2.tokens_tile)
    key = (
        dims,
        p.quant,
        p.align_tile,
        tiles,
        p.gemm1.gated,
        p.gemm1.gather_rows,
        device,
        stream,
        threading.get_ident(),
    )
    ws = None if capturing else _workspaces.get(key)
    if ws is not None:
        _workspaces.move_to_end(key)
        return ws
    rows = max_rows(dims.T * dims.top_k, dims.E, p.align_tile)
    n_x, n_a = amax_sizes(p.quant, dims.T, rows, dims.K, dims.I) if p.quant else (0, 0)
    bufs = RowBuffers(dims.T, dims.top_k, dims.E, p.align_tile, tiles, device, zeroed=n_x + n_a)
    new = lambda cols, dtype=torch.bfloat16: torch.empty(rows, cols, dtype=dtype, device=device)  # noqa: E731
    ws = dict(
        rows=bufs,
        word=error_word(device),
        y=new(dims.K),
        h=new(dims.I if p.gemm1.gated else 2 * dims.I, getattr(torch, p.gemm1.out_dtype)),
    )
    if not p.gemm1.gather_rows:  # else GEMM1 reads x itself: no sorted copy
        ws["x_sorted"] = new(dims.K if p.quant is None else dims.K // 2)
    if p.quant is not None:  # the E4M3 rows are gathered as bf16 pairs
        ws.update(
            a=new(dims.I, torch.float32),
            x_amax=bufs.scratch[:n_x],
            a_amax=bufs.scratch[n_x : n_x + n_a],
            xq=torch.empty(dims.T, dims.K, dtype=FP8_DTYPE, device=device),
            aq=new(dims.I, FP8_DTYPE),
            x_scale=torch.empty(n_x, dtype=torch.float32, device=device),
            a_scale=torch.empty(n_a, dtype=torch.float32, device=device),
        )
    if not capturing:
        keep(ws["word"])  # it lives as long as the process
        ws["kept"] = [t for name, t in ws.items() if name not in ("rows", "word")] + list(bufs.tensors())
        ws["kept"] += [ws["h"].t(), ws["y"].t()]  # the swap-AB GEMM's view of its output
        if p.quant is not None:  # the views the FP8 steps pass on: E4M3 rows as bf16 pairs, scales in shape
            shape = activation_scale_shape(p.quant, dims.T, dims.K)
            ws["kept"] += [
                ws["xq"].view(torch.bfloat16),
                ws["x_scale"].view(shape),
                ws["a_scale"].view(rows, -1) if p.quant == "fp8_block" else ws["a_scale"],
            ]
        keep(*ws["kept"])
        _workspaces[key] = ws
        if len(_workspaces) > WORKSPACES:
            _, old = _workspaces.popitem(last=False)
            release(*old["kept"])
    return ws


def _row_kernels(device) -> dict:
    return compile_row_kernels(sm_count(device))


def _check_row_width(fn: str, name: str, cols: int, multiple: int = ALIGN_ELEMS) -> None:
    """The row kernels walk a row in 16-byte vectors (``cols // VEC`` of them): a tail would be dropped."""
    if cols % multiple:
        raise ValueError(
            f"{fn}: {name} = {cols} must be a multiple of {multiple} "
            f"(the row kernels move {ALIGN_ELEMS}-element vectors; a tail would be silently dropped)"
        )


def gather_rows(x: torch.Tensor, rows: SortedRows, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``X_sorted[r] = x[token_of_row[r]]`` on the used rows (bf16 [M_pad, K]; other rows unwritten),
    into ``out`` (a workspace's, of that shape and dtype) or a new tensor."""
    _check_row_width("gather_rows", "x.shape[1]", x.shape[1])
    if out is None:
        out = torch.empty(rows.rows, x.shape[1], dtype=x.dtype, device=x.device)
    elif out.shape != (rows.rows, x.shape[1]) or out.dtype != x.dtype:
        raise ValueError(
            f"gather_rows: out is {out.dtype} {list(out.shape)}, expected {x.dtype} {[rows.rows, x.shape[1]]}"
        )
    _row_kernels(x.device)["gather"](
        _cute_tensor(x, 1),
        _cute_tensor(out, 1),
        _cute_vector(rows.token_of_row),
        _cute_vector(rows.alignment.num_padded),
        _stream(x),
    )
    return out


def silu_mul(h: torch.Tensor, rows: SortedRows) -> torch.Tensor:
    """``SiLU(h[:, :I]) ⊙ h[:, I:]`` on the used rows (bf16 [M_pad, I]; other rows unwritten)."""
    m_pad, two_i = h.shape
    _check_row_width("silu_mul", "h.shape[1] (2I)", two_i, 2 * ALIGN_ELEMS)  # each half whole vectors
    a = torch.empty(m_pad, two_i // 2, dtype=h.dtype, device=h.device)
    _row_kernels(h.device)["silu_mul"](
        _cute_tensor(h, 1), _cute_tensor(a, 1), _cute_vector(rows.alignment.num_padded), _stream(h)
    )
    return a


def combine(y: torch.Tensor, rows: SortedRows, T: int, top_k: int) -> torch.Tensor:
    """``out[t] = Σ_j y[row_of_pair[t·top_k + j]]`` (rows already carry their routing weight): fp32
    sum → bf16 [T, K]."""
    _check_row_width("combine", "y.shape[1]", y.shape[1])
    if rows.row_of_pair.numel() != T * top_k:
        raise ValueError(
            f"combine: rows has {rows.row_of_pair.numel()} (token, slot) pairs, T·top_k = {T}·{top_k} = {T * top_k}"
        )
    out = torch.empty(T, y.shape[1], dtype=y.dtype, device=y.device)
    _row_kernels(y.device)["combine"](
        _cute_tensor(y, 1), _cute_tensor(out, 1), _cute_vector(rows.row_of_pair), _stream(y)
    )
    return out

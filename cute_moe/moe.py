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
``fusion="separate"`` runs the unfused pipeline of ``unfused.py``; a plan whose path is "decode"
(:func:`~cute_moe.plan.one_launch`) runs the whole layer in one launch of ``decode.py`` instead.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch

import cute_moe.decode as decode
import cute_moe.moe_fp8 as moe_fp8  # modules: a stand-in may replace their compile functions
import cute_moe.rowmaps as rowmaps
from moe_spec.align import Alignment, max_rows
from moe_spec.hopper import sm_count
from moe_spec.quant import FP8_DTYPE
from moe_spec.validate import MoEDims, check_runs_on, error_word, surface_errors, validate_moe_args
from moe_spec.workspace import Workspaces

from .config import GemmConfig
from .gemm_args import launch_args
from .gemm_plan import INDEX_DTYPE, check_gemm_shape, compile_gemm
from .limits import ALIGN_ELEMS, LIMITS
from .moe_fp8 import layer_amax_sizes, quantize_intermediate, quantize_tokens, sorted_token_scales
from .plan import LayerPlan, plan
from .rowmaps import RowBuffers, SortedRows, place_rows, sort_rows_on_device, split_blocks
from .rowops import compile_row_kernels
from .runtime import ffi_function
from .unfused import scale_rows, weighted_combine


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
    epilogue: tuple | None = None,
) -> torch.Tensor:
    """``out[r] = x_sorted[r] · w[expert(r)]ᵀ (· row_scale[r])`` for every used sorted row r.

    x_sorted: [M_pad, K]; w: [E, N_out, K] (contiguous), both bf16 or — FP8 config — E4M3 with
    ``x_scale`` (per sorted row: [1] / [M_pad] / [M_pad, ⌈K/128⌉]) and ``w_scale`` (moe_spec's
    weight scale shape), dequantized in registers.  Returns ``cfg.out_dtype`` [M_pad, N_out]
    (rows past the used blocks are left unwritten).  A gated config (``cfg.gated``) takes W1
    ``[E, 2I, K]`` (gate rows, then up rows) and returns ``SiLU(x·W1gᵀ) ⊙ (x·W1uᵀ)`` [M_pad, I] (out_dtype).
    A ``gather_rows`` config takes the unsorted tokens ``x [T, K]`` in place of ``x_sorted`` and reads
    row r from ``x[rows.token_of_row[r]]`` (the gathering producer, ``gemm.py``; K a multiple of ``cfg.tile_k``).
    A config with ``epilogue_quant`` takes ``epilogue`` = (q_scale, q_aux) (``gemm_plan.GemmLaunch``: the
    static scale and the error word; the flat scales or amax slots and ``rows.row_mask``) and returns
    ``cfg.c_dtype`` (E4M3 codes for "static" / "block").
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
    if (cfg.epilogue_quant is not None) != (epilogue is not None):
        raise ValueError("grouped_gemm: pass epilogue exactly when cfg.epilogue_quant is set")
    if out is None:
        out = torch.empty(m_pad, n_out, dtype=getattr(torch, cfg.c_dtype), device=x_sorted.device)
    expert_of_block, num_blocks = gemm_blocks(rows, cfg.tokens_tile)
    if row_scale is None:
        row_scale = rows.weight_of_row  # a valid fp32 buffer the kernel never reads
    index_dtype = str(rows.token_of_row.dtype).removeprefix("torch.")  # read by a gather_rows kernel only
    gemm = ffi_function(compile_gemm(cfg, sm_count(x_sorted.device), index_dtype=index_dtype))
    blocks = (expert_of_block, num_blocks)
    gemm(*launch_args(cfg, x_sorted, w, out, blocks, row_scale, x_scale, w_scale, rows, epilogue))
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
    one.  ``quant`` (an FP8 format) runs the W8A8 layer of :mod:`cute_moe.moe_fp8`.  A bf16 call the path
    rule :func:`~cute_moe.plan.one_launch` takes (no option, few pairs, small I) runs in one launch of
    :func:`cute_moe.decode.decode_fused_moe`'s kernel, bit for bit its output and error word.  The
    arguments, then the options and every limit of this backend (:func:`~cute_moe.plan.plan`), are
    checked on the host before the first launch — T = 0 included — so bad input never leaves a
    half-run pipeline behind. Static activation scales (``a1_scale``, ``a2_scale``: fp8_tensor, both
    or neither) replace the two amax launches by the given scales (:mod:`cute_moe.moe_fp8`); the
    unfused pipeline takes dynamic scales only.

    Host cost: the checks' verdict is cached per argument signature
    (:func:`moe_spec.validate.validate_moe_args`), the plan and the compiled launches per call
    signature (:func:`_call_of`), the buffers per (sizes, device, stream, thread)
    (:func:`_workspace`); each launch is one call of a TVM-FFI function with the torch tensors
    (:mod:`cute_moe.runtime`).
    """
    scales = dict(w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale)
    dims = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, limits=LIMITS, **scales)
    static = a1_scale is not None  # a pair, fp8_tensor only: validated
    if (
        (swap_ab is None or type(swap_ab) is bool)
        and (configs is None or type(configs) is tuple)
        and type(fusion) is str
        and (quant is None or type(quant) is str)
    ):
        c = _call_of(dims, quant, swap_ab, configs, fusion, x.device, topk_ids.dtype, static)
    else:  # raises, naming the option (or an option of an unusual type: planned at every call)
        p = plan(dims, quant, swap_ab=swap_ab, configs=configs, fusion=fusion, static=static)
        c = _Call(p, dims, x.device, topk_ids.dtype, static)
    if static and c.plan.fusion == "separate":
        raise ValueError(
            "fusion: 'separate' quantizes with dynamic scales only; static a1_scale / a2_scale need 'fused'"
        )
    check_runs_on(x.device, LIMITS)  # T = 0 included: what T = 1 refuses, T = 0 refuses
    surface_errors(x.device)  # an earlier call's failed data check raises here (moe_spec.contract)
    if dims.T == 0:
        return x.new_empty((0, dims.K))
    if c.plan.path == "decode":  # one launch: the kernel reads and checks the routing itself
        kernel = (c.launches or c.bind())["decode"]
        return decode.launch(kernel, x, w1, w2, topk_weights, topk_ids, dims, grid=c.grid, quant=quant, scales=scales)
    # The routing data is checked on the device, without a sync, by the alignment's place kernel
    # (guard_routing's meaning): an id outside [0, E), is clamped and its pair weighted NaN, and the
    # error word says why.  Its buffers and the layer's are the workspace of this shape and stream.
    f = c.launches or c.bind()
    ws = _workspace(c)
    bufs = ws["rows"]
    place_rows(f["count"], f["place"], topk_ids.data_ptr(), topk_weights.data_ptr(), bufs, ws["word"])
    rows = bufs.rows
    p = c.plan
    if p.fusion == "separate":
        return _separate_layer(x, w1, w2, w1_scale, w2_scale, p, rows, ws)
    if quant is not None:
        return moe_fp8.fp8_layer(f, x, w1, w2, w1_scale, w2_scale, p, rows, ws, a1_scale, a2_scale)
    # gather_rows: GEMM1 reads x by token index; gated: SiLU·up in GEMM1's epilogue, [M_pad, I] straight out
    num_padded = rows.alignment.num_padded
    if p.gemm1.gather_rows:
        x_sorted = x
    else:
        x_sorted = ws["x_sorted"]
        f["gather"](x, x_sorted, rows.token_of_row, num_padded)
    h = ws["h"]
    f["gemm1"](*launch_args(p.gemm1, x_sorted, w1, h, rows.blocks[p.gemm1.tokens_tile], rows.weight_of_row, rows=rows))
    if p.gemm1.gated:
        a = h
    else:
        a = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
        f["silu_mul"](h, a, num_padded)
    y = ws["y"]
    f["gemm2"](*launch_args(p.gemm2, a, w2, y, rows.blocks[p.gemm2.tokens_tile], rows.weight_of_row))
    out = torch.empty(dims.T, dims.K, dtype=y.dtype, device=y.device)
    f["combine"](y, out, rows.row_of_pair)
    return out


fused_moe.limits = LIMITS


def _separate_layer(x, w1, w2, w1_scale, w2_scale, p: LayerPlan, rows: SortedRows, ws: dict) -> torch.Tensor:
    """The unfused pipeline (``fusion="separate"``, :mod:`cute_moe.unfused`: the reference the fused
    one is measured against) through the step functions: scales and routing weight in passes of
    their own.  ``ws``: the workspace (its amax buffers zeroed by the alignment)."""
    T = x.shape[0]
    quant, al = p.quant, rows.alignment
    weights = rows.weight_of_pair.view(T, -1)
    if quant is None:
        x_sorted = gather_rows(x, rows, out=ws["x_sorted"])
        h = grouped_gemm(x_sorted, w1, rows, p.gemm1, out=ws["h"])
        y = grouped_gemm(silu_mul(h, rows), w2, rows, p.gemm2, out=ws["y"])
        return weighted_combine(y, rows.row_of_pair, weights, quant)
    xq, x_scale = quantize_tokens(x, quant, amax=ws["x_amax"], out=(ws["xq"], ws["x_scale"]))
    x_sorted = gather_rows(xq.view(torch.bfloat16), rows, out=ws["x_sorted"]).view(FP8_DTYPE)
    x_scale = sorted_token_scales(x_scale, rows.token_of_row, quant)
    h = grouped_gemm(x_sorted, w1, rows, p.gemm1, x_scale=x_scale, w_scale=w1_scale, out=ws["h"])
    scale_rows(h, al, x_scale, w1_scale, quant)
    aq, a_scale = quantize_intermediate(h, rows, quant, amax=ws["a_amax"], out=ws["a"], q_out=(ws["aq"], ws["a_scale"]))
    y = grouped_gemm(aq, w2, rows, p.gemm2, x_scale=a_scale, w_scale=w2_scale, out=ws["y"])
    return weighted_combine(scale_rows(y, al, a_scale, w2_scale, quant), rows.row_of_pair, weights, quant)


class _Call:
    """What a ``fused_moe`` call takes from its plan, found once per call signature (:func:`_call_of`):
    the plan, the sizes its workspace depends on and — bound at the first launch (:meth:`bind`) —
    the compiled launches of its pipeline as bare TVM-FFI functions (:func:`cute_moe.runtime.ffi_function`)."""

    __slots__ = ("plan", "dims", "device", "ids_dtype", "static", "sizes", "launches", "grid")

    def __init__(self, p: LayerPlan, dims: MoEDims, device, ids_dtype, static: bool = False):
        self.plan, self.dims, self.device, self.ids_dtype, self.static = p, dims, device, ids_dtype, static
        self.launches: dict | None = None
        self.grid = None  # the decode path's CTAs (decode.launch_grid), found at bind
        self.sizes = None  # of the grouped pipeline's workspace; the decode path keeps its own (decode.py)
        if p.path == "grouped":
            g1, tiles = p.gemm1, (p.gemm1.tokens_tile, p.gemm2.tokens_tile)
            self.sizes = (dims, p.quant, p.align_tile, tiles, g1.gated, g1.gather_rows, g1.epilogue_quant, static)
            self.sizes += (p.gather_quant, device)  # (gather_quant: no token-order E4M3 copy of x)

    def bind(self) -> dict:
        """Compile (or find in the compile cache) every kernel the plan launches and keep their TVM-FFI
        functions: ``count`` and ``place`` (the alignment, for the ids' dtype), ``gemm1``, ``gemm2``,
        the row kernels and, under FP8, the quantization's kernels (:func:`~cute_moe.moe_fp8.fp8_kernels`);
        on the decode path its one kernel, ``decode``, for the ids' dtype."""
        p, n = self.plan, sm_count(self.device)
        if p.path == "decode":
            kernel = decode.compile_decode(str(self.ids_dtype).removeprefix("torch."), p.quant, self.static)
            self.launches = {"decode": ffi_function(kernel)}
            self.grid = decode.launch_grid(self.dims, self.device, p.quant)
            return self.launches
        align = rowmaps.compile_align_kernels(self.ids_dtype)
        f = {"count": align["count"], "place": align["place"]}
        f["gemm1"] = compile_gemm(p.gemm1, n, index_dtype=INDEX_DTYPE)  # SortedRows.token_of_row: int64
        f["gemm2"] = compile_gemm(p.gemm2, n, index_dtype=INDEX_DTYPE)
        row = _row_kernels(self.device)
        f.update(gather=row["gather"], silu_mul=row["silu_mul"], combine=row["combine"])
        if p.quant is not None:
            f.update(moe_fp8.fp8_kernels(p, n, self.static))
        self.launches = {name: ffi_function(fn) for name, fn in f.items()}
        return self.launches


@functools.lru_cache(maxsize=1024)
def _call_of(dims: MoEDims, quant, swap_ab, configs, fusion, device, ids_dtype, static) -> _Call:
    """The :class:`_Call` of one call signature, ``static``: static activation scales given (its plan
    raises, naming a bad option, and is not cached).  Every argument is positional and required: the
    cache keys ``f(..., False)`` and ``f(...)`` apart, so a caller that left one to its default would
    find a second, unbound ``_Call`` instead of ``fused_moe``'s."""
    p = plan(dims, quant, swap_ab=swap_ab, configs=configs, fusion=fusion, static=static)
    return _Call(p, dims, device, ids_dtype, static)


def forget_calls() -> None:
    """Drop the cached plans and bound launches (after a module constant they read changed, or a
    compile function was stood in for: ``cute_moe.lab.bench_align.gpu_stand_in``)."""
    _call_of.cache_clear()


@contextlib.contextmanager
def plan_switches(**values):
    """:mod:`cute_moe.plan`'s module switches (``GATED_FP8_GEMM1``, ``EPILOGUE_QUANT``, ``GATHER_QUANT``,
    ``ONE_LAUNCH``, …) set to ``values`` inside and restored after, the cached plans and bound launches
    forgotten on the way in and out — how benches and tests run a plan the default does not.  A name the
    module does not have is refused before anything is set."""
    rules = importlib.import_module("cute_moe.plan")  # the module: the package's attribute `plan` is the function
    unknown = [name for name in values if not hasattr(rules, name)]
    if unknown:
        raise AttributeError(f"plan_switches: cute_moe.plan has no switch {', '.join(unknown)}")
    saved = {name: getattr(rules, name) for name in values}
    for name, value in values.items():
        setattr(rules, name, value)
    forget_calls()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(rules, name, value)
        forget_calls()


#: Workspaces kept (least recently used dropped first): one per (sizes, plan tiles, device, stream, thread).
WORKSPACES = 8
_workspaces = Workspaces(WORKSPACES)


def _workspace(c: _Call) -> dict:
    """The buffers of a call of ``c`` — the alignment's outputs (:class:`~cute_moe.rowmaps.RowBuffers`),
    X_sorted, H and Y (FP8: also A in fp32, the two amax buffers, which the alignment zeroes, the
    quantized activations and their scales, and the views the launches take of them) — reused as
    :class:`moe_spec.workspace.Workspaces` says."""
    return _workspaces.get(c.sizes, c.device, lambda: _buffers(c))


def _buffers(c: _Call) -> dict:
    """New buffers of :func:`_workspace` for ``c``."""
    dims, p, device = c.dims, c.plan, c.device
    rows = max_rows(dims.T * dims.top_k, dims.E, p.align_tile)
    n_x, n_a = layer_amax_sizes(p, dims.T, rows, dims.K, dims.I) if p.quant and not c.static else (0, 0)
    tiles = (p.gemm1.tokens_tile, p.gemm2.tokens_tile)
    bufs = RowBuffers(dims.T, dims.top_k, dims.E, p.align_tile, tiles, device, zeroed=n_x + n_a)
    new = lambda cols, dtype=torch.bfloat16: torch.empty(rows, cols, dtype=dtype, device=device)  # noqa: E731
    ws = dict(
        rows=bufs,
        word=error_word(device),
        y=new(dims.K),
    )
    if p.gemm1.c_dtype != "float8_e4m3fn":  # else GEMM1's epilogue writes the E4M3 intermediate itself
        ws["h"] = new(dims.I if p.gemm1.gated else 2 * dims.I, getattr(torch, p.gemm1.out_dtype))
    if not p.gemm1.gather_rows:  # else GEMM1 reads x itself: no sorted copy
        ws["x_sorted"] = new(dims.K if p.quant is None else dims.K // 2)
    if p.quant is not None:  # the E4M3 activations, their scales and amaxes (dynamic), the launches' views
        moe_fp8.fp8_buffers(ws, dims, p, rows, bufs.scratch, c.static)
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
    _row_kernels(x.device)["gather"](x, out, rows.token_of_row, rows.alignment.num_padded)
    return out


def silu_mul(h: torch.Tensor, rows: SortedRows) -> torch.Tensor:
    """``SiLU(h[:, :I]) ⊙ h[:, I:]`` on the used rows (bf16 [M_pad, I]; other rows unwritten)."""
    m_pad, two_i = h.shape
    _check_row_width("silu_mul", "h.shape[1] (2I)", two_i, 2 * ALIGN_ELEMS)  # each half whole vectors
    a = torch.empty(m_pad, two_i // 2, dtype=h.dtype, device=h.device)
    _row_kernels(h.device)["silu_mul"](h, a, rows.alignment.num_padded)
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
    _row_kernels(y.device)["combine"](y, out, rows.row_of_pair)
    return out

"""``fused_moe``: the whole expert computation of one MoE layer in five to eight Triton launches.

::

    plan               the config, checked for the quant format (host only, cached)
    _count_kernel      topk_ids → per-chunk expert histograms
    _place_kernel      → Alignment: sorted_ids, expert_of_block, …  + checks of topk_ids
    amax_kernel        partial amaxes of x                (fp8_tensor with dynamic scales only)
    quantize_kernel    x → xq E4M3 [T, K] + scales; zeroes GEMM1's amax buffer   (FP8 only)
    moe_gemm_kernel    GEMM1 + SiLU(gate)·up (+ amax of the intermediate) → act [P, I]
    quantize_kernel    act fp32 → E4M3 [P, I] + scales                              (FP8 only)
    moe_gemm_kernel    GEMM2 × routing weight (GEMM2's own tile, if any)  → y [P, K]
    combine_kernel     out[t] = Σ_j y[t·top_k + j]                        (skipped for top_k = 1)

Static activation scales (``a1_scale``, ``a2_scale``: fp8_tensor, :mod:`moe_spec.contract`): the
amax kernel and GEMM1's amax are skipped, and both quantize launches divide by the given scales
(and check them into the error word) — seven launches instead of eight.

No launch fills or zeroes a buffer: every buffer is written whole by the kernel that produces it
(the alignment writes its padding; x's quantization zeroes the amax GEMM1 accumulates into). The
one exception is split-K's per-tile counts (configs with ``split_k`` > 1): zeroed when the
workspace is made — once per eager workspace, one memset per replay of a captured CUDA graph —
and left zero by every GEMM1 launch.

Nothing here reads device data on the host, so a call is as cheap eager as in a CUDA graph and can
be captured and replayed for new routing; the buffer sizes depend only on T, top_k, E and the
config. The data checks of the contract run inside the kernels (``moe_spec.validate``: the
alignment flags bad and repeated ids, the GEMMs bad routing weights and scales, into the device's
error word; :func:`moe_spec.validate.check` raises).

Host cost per call: the argument checks' verdict is cached per signature
(:func:`moe_spec.validate.validate_moe_args`), the plan per (sizes, options, device), and the
intermediate buffers per (sizes, device, stream, thread) — a workspace reused by the thread's
next eager call on the same stream, which the stream orders after this one (never during a CUDA
graph capture, whose buffers belong to the graph; the returned output is always a new tensor).
See :mod:`triton_moe.kernels` for the arithmetic and :mod:`triton_moe.config` for the tile rule.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Optional

import torch

from moe_spec.align import Alignment
from moe_spec.quant import FP8_DTYPE, WHOLE, get_format
from moe_spec.validate import (BAD_A1_SCALE, BAD_A2_SCALE, Limits, check_runs_on, error_word, surface_errors,
                               validate_moe_args)
from triton_moe.align import MAX_EXPERTS, align_into, buffer_sizes
from triton_moe.config import EARLY_ROUTING_MAX_K_STEPS, TritonConfig
from triton_moe.jit import INTERPRET, launch
from triton_moe.kernels import QUANT_MODE, fp8_imprecise_acc, moe_gemm_kernel
from triton_moe.kernels_rows import AMAX_PARTS, amax_kernel, combine_kernel, quantize_kernel
from triton_moe.kernels_tma import check_tma_operand, gemm_tma
from triton_moe.plan import plan

#: What this backend adds to the contract (moe_spec.validate.Limits): every surface checks it. Off
#: a GPU it runs only under Triton's interpreter, which TRITON_INTERPRET=1 selects at import.
LIMITS = Limits("triton_moe", MAX_EXPERTS, cpu=None if INTERPRET else
                "on a CPU, set TRITON_INTERPRET=1 before Python imports triton (Triton's interpreter: slow, exact)")

COMBINE_BLOCK = 1024
PARTS = AMAX_PARTS.value  # fp8_tensor's partial amaxes of x, at most
AMAX_BLOCK = 1024
QUANT_GROUPS = 8  # quantize_kernel's step: 8 groups of 128 columns
#: Workspaces kept (least recently used dropped first): one per (sizes, device, stream).
WORKSPACES = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize(a, quant: str, amax=None, *, q=None, scale=None, parts=None, zero=None, static_bit=0):
    """(q E4M3, scale fp32) of activations a [rows, cols] — moe_spec.quant.quantize_activation's
    result. ``amax``: the amax in the format's shape when already known (else found here); ``q``,
    ``scale``, ``parts`` (fp32 [PARTS], fp8_tensor's partial amaxes): buffers to use;
    ``zero``: a buffer the same launch zeroes (GEMM1's amax). ``static_bit`` ≠ 0: ``scale`` is a
    static fp8_tensor scale (read, not written: ``quantize_activation_static``), and a bad one sets
    this bit of the error word."""
    rows, cols = a.shape
    fmt = get_format(quant)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=a.device) if q is None else q
    if static_bit:
        launch(quantize_kernel, (rows,), a, error_word(a.device), q, scale, scale, rows, cols, 1, 0,
               QUANT=fmt.mode, AMAX_GIVEN=False, GROUPS=QUANT_GROUPS, INTERPRETER=INTERPRET, STATIC_BIT=static_bit)
        return q, scale
    if scale is None:
        scale = torch.empty(fmt.activation_scale_shape(rows, cols), dtype=torch.float32, device=a.device)
    num_amax = 1
    if fmt.activation_group == (WHOLE, WHOLE) and amax is None:  # one scale for the whole tensor
        num_amax = min(rows, PARTS)
        amax = torch.empty(PARTS, dtype=torch.float32, device=a.device) if parts is None else parts
        launch(amax_kernel, (num_amax,), a, amax, rows, cols, BLOCK=AMAX_BLOCK)
    launch(quantize_kernel, (rows,), a, amax if amax is not None else scale, q, scale,
           zero if zero is not None else scale, rows, cols, num_amax, 0 if zero is None else zero.numel(),
           QUANT=fmt.mode, AMAX_GIVEN=amax is not None, GROUPS=QUANT_GROUPS, INTERPRETER=INTERPRET)
    return q, scale


@functools.lru_cache(maxsize=256)
def _gemm_constants(cfg: TritonConfig, quant, fuse_silu: bool, a_row_div: int, k: int) -> dict:
    """The constexpr arguments of one GEMM launch with ``cfg``, the config of that GEMM
    (:meth:`~triton_moe.config.TritonConfig.gemm1_config` / ``gemm2_config``; a function of the
    plan; not to be mutated), whose reduction length is ``k`` (a layer size: no new compile per T).
    Only GEMM1 splits K (``cfg.split_k``); only a short GEMM2 reads its routing early."""
    early = not fuse_silu and _cdiv(k, cfg.BLOCK_K) <= EARLY_ROUTING_MAX_K_STEPS
    return dict(A_ROW_DIV=a_row_div, FUSE_SILU=fuse_silu, MUL_ROUTED_WEIGHT=not fuse_silu, QUANT=QUANT_MODE[quant],
                EARLY_ROUTING=early, FP8_IMPRECISE_ACC=fp8_imprecise_acc(cfg.BLOCK_K, quant),
                SWAP_AB=bool(cfg.swap_ab), INTERPRETER=INTERPRET,
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                SPLIT_K=cfg.split_k if fuse_silu else 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.lru_cache(maxsize=1024)
def _geometry(T: int, top_k: int, K: int, I: int, quant, cfg: TritonConfig, num_blocks: int) -> tuple:  # noqa: E741
    """What the launches of :func:`expert_computation` take from the sizes alone: (quantized,
    GEMM1 grid, GEMM2 grid, combine grid, GEMM1 constexprs, GEMM2 constexprs, GEMM1's config,
    GEMM2's config) — once per shape. GEMM2's grid and constexprs are its own tile's
    (``cfg.gemm2``, else GEMM1's)."""
    cfg1, cfg2 = cfg.gemm1_config(), cfg.gemm2_config()
    return (get_format(quant).quantized, (num_blocks * _cdiv(I, cfg1.BLOCK_N), cfg1.split_k),
            (num_blocks * _cdiv(K, cfg2.BLOCK_N),), (T, _cdiv(K, COMBINE_BLOCK)),
            _gemm_constants(cfg1, quant, True, top_k, K), _gemm_constants(cfg2, quant, False, 1, I), cfg1, cfg2)


def _gemm(grid, constants, a, a_scale, w, w_scale, out, out_amax, topk_weights, topk_ids, error, routing: Alignment,
          num_padded, N, K, cfg: TritonConfig, static=False, split=None):
    """One grouped GEMM; ``cfg`` is that GEMM's config (its kernel: grouped or persistent TMA)."""
    if cfg.persistent_tma:  # the persistent TMA kernel (triton_moe.kernels_tma): only when the config asks
        return gemm_tma(a, a_scale, w, w_scale, out, out_amax, topk_weights, topk_ids, error, routing, num_padded,
                        N, K, constants, flatten=cfg.tma_flatten, static=static)
    dummy = out  # stands in for pointers a mode does not read
    launch(moe_gemm_kernel, grid,
           a, a_scale if a_scale is not None else dummy, w, w_scale if w_scale is not None else dummy,
           out, None if static else out_amax if out_amax is not None else dummy, topk_weights, topk_ids,
           routing.sorted_ids, routing.expert_of_block, num_padded, error,
           *(split if split is not None else (dummy, dummy)), routing.num_pairs, N, K, w.shape[0], **constants)


def _buffers(T: int, top_k: int, E: int, K: int, I: int, quant, tile: int, device,  # noqa: E741
             split: tuple = (1, 0)) -> dict:
    """Every intermediate buffer of one call, by name (``torch.empty``: no launch). ``split``:
    (split_k, BLOCK_N); with split_k > 1 also GEMM1's fp32 partial tiles and its per-tile counts,
    zeroed once here (one fill at creation; the kernel leaves them zero after every launch)."""
    P = T * top_k
    fmt = get_format(quant)
    n = buffer_sizes(T, top_k, E, tile)
    new = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    end = new((E,), torch.int32)
    b = dict(sorted_ids=new((n["rows"],), torch.int32), expert_of_block=new((n["blocks"],), torch.int32),
             expert_end=end, num_padded=end[-1:], counts=new((n["chunks"], E), torch.int32),
             act=new((P, I), torch.float32 if fmt.quantized else torch.bfloat16),
             y=new((P, K), torch.bfloat16) if top_k > 1 else None)
    split_k, block_n = split
    if split_k > 1:
        tiles = n["blocks"] * _cdiv(I, block_n)
        b.update(partials=new((tiles * split_k * 2 * tile * block_n,), torch.float32),
                 counts_split=torch.zeros((tiles,), dtype=torch.int32, device=device))
    if fmt.quantized:
        b.update(xq=new((T, K), FP8_DTYPE), x_scale=new(fmt.activation_scale_shape(T, K), torch.float32),
                 parts=new((PARTS,), torch.float32),
                 act_amax=new(fmt.activation_scale_shape(P, I), torch.float32),
                 aq=new((P, I), FP8_DTYPE), act_scale=new(fmt.activation_scale_shape(P, I), torch.float32))
    return b


_workspaces: OrderedDict = OrderedDict()


def _split(cfg: TritonConfig) -> tuple:
    """What GEMM1's split-K buffers depend on: (split_k, BLOCK_N), or (1, 0) without a split."""
    return (cfg.split_k, cfg.BLOCK_N) if cfg.split_k > 1 else (1, 0)


def _workspace(T, top_k, E, K, I, quant, tile, device, split=(1, 0)) -> dict:  # noqa: E741
    """The buffers of :func:`_buffers`, reused by the eager calls of one stream (see the module
    docstring); fresh while a CUDA graph is being captured."""
    stream = None
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return _buffers(T, top_k, E, K, I, quant, tile, device, split)
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (T, top_k, E, K, I, quant, tile, device, split, stream, threading.get_ident())
    b = _workspaces.get(key)
    if b is None:
        b = _workspaces[key] = _buffers(T, top_k, E, K, I, quant, tile, device, split)
        if len(_workspaces) > WORKSPACES:
            _workspaces.popitem(last=False)
    else:
        _workspaces.move_to_end(key)
    return b


@functools.lru_cache(maxsize=1024)
def _cached_plan(dims, quant, config, swap_ab, device):
    return plan(dims, quant, config=config, swap_ab=swap_ab)


def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None, a1_scale=None,
              a2_scale=None, config: Optional[TritonConfig] = None, swap_ab: Optional[bool] = None) -> torch.Tensor:
    """The MoE expert computation (see :mod:`moe_spec.contract`) with Triton kernels → [T, K] bf16.

    ``a1_scale`` / ``a2_scale``: static activation scales of x and of the intermediate (fp8_tensor,
    both or neither; one fp32 element each): one launch fewer, and batch-invariant rows.

    Backend options:
      ``config``   a :class:`~triton_moe.config.TritonConfig`; default: the tuned table for this
                   shape and device, else the heuristic (:func:`~triton_moe.heuristic.get_config`).
      ``swap_ab``  force swap-AB on (True) or off (False); default: the config's rule.

    The arguments, then the options and this backend's limits (:func:`~triton_moe.plan.plan`), are
    checked before any launch — T = 0 included: an empty batch returns the empty [0, K] tensor only
    when the call would run at T = 1. The data (ids, routing weights, scales) is checked by the
    kernels, without a sync (:mod:`moe_spec.contract`).
    """
    d = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale,
                          w2_scale=w2_scale, limits=LIMITS, a1_scale=a1_scale, a2_scale=a2_scale)
    if (config is None or type(config) is TritonConfig) and (swap_ab is None or type(swap_ab) is bool):
        p = _cached_plan(d, quant, config, swap_ab, x.device)
    else:
        p = plan(d, quant, config=config, swap_ab=swap_ab)  # raises, naming the option
    check_runs_on(x.device, LIMITS)  # T = 0 included: what T = 1 refuses, T = 0 refuses
    surface_errors(x.device)  # an earlier call's failed data check raises here (moe_spec.contract)
    if d.T == 0:
        return x.new_empty((0, d.K))
    if p.gemm1.persistent_tma:  # TMA reads the weights: 16-byte rows and base, checked before any launch
        check_tma_operand("w1", w1)
    if p.gemm2.persistent_tma:
        check_tma_operand("w2", w2)
    ws = _workspace(d.T, d.top_k, d.E, d.K, d.I, quant, p.align_tile, x.device, _split(p.config))
    error = error_word(x.device)
    routing = align_into(topk_ids, d.E, p.align_tile, ws["sorted_ids"], ws["expert_of_block"], ws["expert_end"],
                         ws["counts"], error)
    return expert_computation(x, w1, w2, topk_weights, topk_ids, routing, quant=quant, w1_scale=w1_scale,
                              w2_scale=w2_scale, config=p.config, workspace=ws, a1_scale=a1_scale, a2_scale=a2_scale)


fused_moe.limits = LIMITS


def expert_computation(x, w1, w2, topk_weights, topk_ids, routing, *, quant, w1_scale, w2_scale,
                       config: TritonConfig, workspace: Optional[dict] = None, a1_scale=None,
                       a2_scale=None) -> torch.Tensor:
    """Everything after the alignment: quantize x, GEMM1 + SiLU·up, quantize the intermediate,
    GEMM2 × routing weight, combine.

    ``routing`` is the :class:`~moe_spec.align.Alignment` of ``topk_ids`` for ``config.BLOCK_M``
    (:func:`~triton_moe.align.align_block_size`); ``config`` must be resolved and checked (a
    plan's); GEMM2 runs its ``gemm2`` tile when it has one; ``workspace``: the buffers of
    :func:`_buffers` (default: new ones). :func:`fused_moe`
    is the validated entry point; the benchmark times this part alone (the alignment is timed
    separately).
    """
    T, K = x.shape
    E, I = w2.shape[0], w2.shape[2]  # noqa: E741
    top_k = topk_ids.shape[1]
    ws = workspace or _buffers(T, top_k, E, K, I, quant, config.BLOCK_M, x.device, _split(config))
    num_padded = ws["num_padded"] if routing.expert_end is ws["expert_end"] else routing.num_padded
    error = error_word(x.device)
    quantized, grid1, grid2, combine_grid, const1, const2, cfg1, cfg2 = _geometry(
        T, top_k, K, I, quant, config, routing.expert_of_block.numel())
    static = a1_scale is not None  # static activation scales (validated: fp8_tensor, both given)
    a1, s1, act_amax = x, None, None
    if static:
        a1, s1 = _quantize(x, quant, q=ws["xq"], scale=a1_scale, static_bit=BAD_A1_SCALE)
    elif quantized:
        act_amax = ws["act_amax"]
        a1, s1 = _quantize(x, quant, q=ws["xq"], scale=ws["x_scale"], parts=ws["parts"], zero=act_amax)

    # GEMM1 + SiLU(gate)·up: bf16 intermediate, or fp32 (with its amax unless the scale is static),
    # quantized once for GEMM2
    act = ws["act"]
    _gemm(grid1, const1, a1, s1, w1, w1_scale, act, act_amax, topk_weights, topk_ids, error, routing,
          num_padded, I, K, cfg1, static=static,
          split=(ws["partials"], ws["counts_split"]) if cfg1.split_k > 1 else None)
    if static:
        a2, s2 = _quantize(act, quant, q=ws["aq"], scale=a2_scale, static_bit=BAD_A2_SCALE)
    else:
        a2, s2 = (act, None) if act_amax is None else _quantize(act, quant, act_amax, q=ws["aq"],
                                                                scale=ws["act_scale"])

    # GEMM2 × routing weight; with top_k = 1 its rows are already the output
    out = torch.empty((T, K), dtype=torch.bfloat16, device=x.device)
    y = out if top_k == 1 else ws["y"]
    _gemm(grid2, const2, a2, s2, w2, w2_scale, y, None, topk_weights, topk_ids, error, routing, num_padded, K, I,
          cfg2)
    if top_k > 1:
        launch(combine_kernel, combine_grid, y, out, T, K, TOP_K=top_k, BLOCK=COMBINE_BLOCK, INTERPRETER=INTERPRET)
    return out


def gemm2(a2, s2, w2, w2_scale, y, topk_weights, topk_ids, routing, config: TritonConfig, *, quant) -> None:
    """GEMM2 alone, launched as :func:`expert_computation` launches it: y [P, K] (bf16, by pair) =
    routing weight × (a2 [P, I] · W2[e]ᵀ), with GEMM2's tile (``config.gemm2``, else the config's
    own) and GEMM2's kernel (grouped or persistent TMA).

    ``a2``: the intermediate — bf16, or under FP8 its E4M3 copy with the scales ``s2``;
    ``routing``: the alignment of ``topk_ids`` for ``config.BLOCK_M``; ``config`` resolved and
    checked (a plan's). ``python -m triton_moe.lab.bench_gemm2`` times this launch alone."""
    top_k = topk_ids.shape[1]
    P, I = a2.shape  # noqa: E741
    K = w2.shape[1]
    geometry = _geometry(P // top_k, top_k, K, I, quant, config, routing.expert_of_block.numel())
    grid2, const2, cfg2 = geometry[2], geometry[5], geometry[7]
    _gemm(grid2, const2, a2, s2, w2, w2_scale, y, None, topk_weights, topk_ids, error_word(a2.device), routing,
          routing.num_padded, K, I, cfg2)

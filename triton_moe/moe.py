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
(:func:`moe_spec.validate.validate_moe_args`); the plan, with every launch's grid and constexprs
bound to it (:class:`_Launches` of :class:`triton_moe.jit.Bound` launches, which key the direct
launch path by the positional arguments alone), per (sizes, options, device); and the
intermediate buffers per (sizes, device, stream, thread) — a workspace reused by the thread's
next eager call on the same stream, which the stream orders after this one (never during a CUDA
graph capture, whose buffers belong to the graph; the returned output is always a new tensor).
See :mod:`triton_moe.kernels` for the arithmetic and :mod:`triton_moe.config` for the tile rule.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import torch

from moe_spec.align import Alignment
from moe_spec.quant import FP8_DTYPE, WHOLE, get_format
from moe_spec.validate import (
    BAD_A1_SCALE,
    BAD_A2_SCALE,
    Limits,
    MoEDims,
    check_runs_on,
    error_word,
    surface_errors,
    validate_moe_args,
)
from triton_moe.align import MAX_EXPERTS, align_into, buffer_sizes
from triton_moe.config import EARLY_ROUTING_MAX_K_STEPS, TritonConfig
from triton_moe.jit import INTERPRET, Bound
from triton_moe.kernels import QUANT_MODE, fp8_imprecise_acc, moe_gemm_kernel
from triton_moe.kernels_rows import AMAX_PARTS, amax_kernel, combine_kernel, quantize_kernel
from triton_moe.kernels_tma import check_tma_operand, gemm_tma
from triton_moe.plan import plan

#: What this backend adds to the contract (moe_spec.validate.Limits): every surface checks it. Off
#: a GPU it runs only under Triton's interpreter, which TRITON_INTERPRET=1 selects at import.
LIMITS = Limits(
    "triton_moe",
    MAX_EXPERTS,
    cpu=None
    if INTERPRET
    else "on a CPU, set TRITON_INTERPRET=1 before Python imports triton (Triton's interpreter: slow, exact)",
)

COMBINE_BLOCK = 1024
PARTS = AMAX_PARTS.value  # fp8_tensor's partial amaxes of x, at most
AMAX_BLOCK = 1024
QUANT_GROUPS = 8  # quantize_kernel's step: 8 groups of 128 columns
#: Workspaces kept (least recently used dropped first): one per (sizes, device, stream).
WORKSPACES = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1024)
def _quantize_launches(rows: int, cols: int, quant: str, amax_given: bool, zero_numel: int, static_bit: int) -> tuple:
    """(amax launch or None, its program count, quantize launch) of :func:`_quantize` for activations
    [rows, cols]: grids and constexprs bound once per shape (:class:`~triton_moe.jit.Bound`)."""
    fmt = get_format(quant)
    common = dict(QUANT=fmt.mode, GROUPS=QUANT_GROUPS, INTERPRETER=INTERPRET)
    if static_bit:
        return None, 1, Bound(quantize_kernel, (rows,), AMAX_GIVEN=False, STATIC_BIT=static_bit, **common)
    if fmt.activation_group == (WHOLE, WHOLE) and not amax_given:  # one scale for the whole tensor
        num_amax = min(rows, PARTS)
        return (
            Bound(amax_kernel, (num_amax,), BLOCK=AMAX_BLOCK),
            num_amax,
            Bound(quantize_kernel, (rows,), AMAX_GIVEN=True, **common),
        )
    return None, 1, Bound(quantize_kernel, (rows,), AMAX_GIVEN=amax_given, **common)


def _quantize(a, quant: str, amax=None, *, q=None, scale=None, parts=None, zero=None, static_bit=0, launches=None):
    """(q E4M3, scale fp32) of activations a [rows, cols] — moe_spec.quant.quantize_activation's
    result. ``amax``: the amax in the format's shape when already known (else found here); ``q``,
    ``scale``, ``parts`` (fp32 [PARTS], fp8_tensor's partial amaxes): buffers to use;
    ``zero``: a buffer the same launch zeroes (GEMM1's amax). ``static_bit`` ≠ 0: ``scale`` is a
    static fp8_tensor scale (read, not written: ``quantize_activation_static``), and a bad one sets
    this bit of the error word. ``launches``: :func:`_quantize_launches` of these arguments, when
    the caller holds them."""
    rows, cols = a.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=a.device) if q is None else q
    zero_numel = 0 if zero is None else zero.numel()
    amax_launch, num_amax, quantize = launches or _quantize_launches(
        rows, cols, quant, amax is not None, zero_numel, static_bit
    )
    if static_bit:
        quantize(a, error_word(a.device), q, scale, scale, rows, cols, 1, 0)
        return q, scale
    if scale is None:
        scale = torch.empty(get_format(quant).activation_scale_shape(rows, cols), dtype=torch.float32, device=a.device)
    if amax_launch is not None:
        amax = torch.empty(PARTS, dtype=torch.float32, device=a.device) if parts is None else parts
        amax_launch(a, amax, rows, cols)
    quantize(
        a,
        amax if amax is not None else scale,
        q,
        scale,
        zero if zero is not None else scale,
        rows,
        cols,
        num_amax,
        zero_numel,
    )
    return q, scale


@functools.lru_cache(maxsize=256)
def _gemm_constants(cfg: TritonConfig, quant, fuse_silu: bool, a_row_div: int, k: int) -> dict:
    """The constexpr arguments of one GEMM launch with ``cfg``, the config of that GEMM
    (:meth:`~triton_moe.config.TritonConfig.gemm1_config` / ``gemm2_config``; a function of the
    plan; not to be mutated), whose reduction length is ``k`` (a layer size: no new compile per T).
    Only GEMM1 splits K (``cfg.split_k``); only a short GEMM2 reads its routing early."""
    early = not fuse_silu and _cdiv(k, cfg.BLOCK_K) <= EARLY_ROUTING_MAX_K_STEPS
    return dict(
        A_ROW_DIV=a_row_div,
        FUSE_SILU=fuse_silu,
        MUL_ROUTED_WEIGHT=not fuse_silu,
        QUANT=QUANT_MODE[quant],
        EARLY_ROUTING=early,
        FP8_IMPRECISE_ACC=fp8_imprecise_acc(cfg.BLOCK_K, quant),
        SWAP_AB=bool(cfg.swap_ab),
        INTERPRETER=INTERPRET,
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M,
        SPLIT_K=cfg.split_k if fuse_silu else 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


class _Launches:
    """Every launch of :func:`expert_computation` for one shape, quant format, config and
    activation-scale mode, bound once (:func:`_launches`): grids and constexprs
    (:class:`~triton_moe.jit.Bound`), and what the persistent TMA kernel takes instead."""

    __slots__ = (
        "quantized",
        "cfg1",
        "cfg2",
        "const1",
        "const2",
        "gemm1",
        "gemm2",
        "combine",
        "x_quant",
        "act_quant",
        "split",
    )

    def __init__(
        self,
        T: int,
        top_k: int,
        K: int,
        I: int,
        quant,
        cfg: TritonConfig,
        num_blocks: int,  # noqa: E741
        static: bool,
    ):
        fmt = get_format(quant)
        P = T * top_k
        cfg1, cfg2 = cfg.gemm1_config(), cfg.gemm2_config()
        self.quantized, self.cfg1, self.cfg2 = fmt.quantized, cfg1, cfg2
        self.const1 = _gemm_constants(cfg1, quant, True, top_k, K)
        self.const2 = _gemm_constants(cfg2, quant, False, 1, I)
        self.gemm1 = (
            None
            if cfg1.persistent_tma
            else Bound(moe_gemm_kernel, (num_blocks * _cdiv(I, cfg1.BLOCK_N), cfg1.split_k), **self.const1)
        )
        self.gemm2 = (
            None
            if cfg2.persistent_tma
            else Bound(moe_gemm_kernel, (num_blocks * _cdiv(K, cfg2.BLOCK_N),), **self.const2)
        )
        self.combine = (
            None
            if top_k == 1
            else Bound(
                combine_kernel, (T, _cdiv(K, COMBINE_BLOCK)), TOP_K=top_k, BLOCK=COMBINE_BLOCK, INTERPRETER=INTERPRET
            )
        )
        self.split = cfg1.split_k > 1
        self.x_quant = self.act_quant = None
        if static:
            self.x_quant = _quantize_launches(T, K, quant, False, 0, BAD_A1_SCALE)
            self.act_quant = _quantize_launches(P, I, quant, False, 0, BAD_A2_SCALE)
        elif fmt.quantized:
            amax_numel = _numel(fmt.activation_scale_shape(P, I))
            self.x_quant = _quantize_launches(T, K, quant, False, amax_numel, 0)
            self.act_quant = _quantize_launches(P, I, quant, True, 0, 0)


def _numel(shape) -> int:
    n = 1
    for v in shape:
        n *= v
    return n


@functools.lru_cache(maxsize=1024)
def _launches(
    T: int,
    top_k: int,
    K: int,
    I: int,
    quant,
    cfg: TritonConfig,
    num_blocks: int,  # noqa: E741
    static: bool = False,
) -> _Launches:
    """The :class:`_Launches` of one shape, once per shape (``cfg``: a plan's config; GEMM2's grid
    and constexprs are its own tile's, ``cfg.gemm2``, else GEMM1's)."""
    return _Launches(T, top_k, K, I, quant, cfg, num_blocks, static)


def _gemm(
    bound,
    constants,
    a,
    a_scale,
    w,
    w_scale,
    out,
    out_amax,
    topk_weights,
    topk_ids,
    error,
    routing: Alignment,
    num_padded,
    N,
    K,
    cfg: TritonConfig,
    static=False,
    split=None,
):
    """One grouped GEMM; ``cfg`` is that GEMM's config (its kernel: grouped, through the bound launch
    ``bound``, or persistent TMA, with ``constants``)."""
    if cfg.persistent_tma:  # the persistent TMA kernel (triton_moe.kernels_tma): only when the config asks
        return gemm_tma(
            a,
            a_scale,
            w,
            w_scale,
            out,
            out_amax,
            topk_weights,
            topk_ids,
            error,
            routing,
            num_padded,
            N,
            K,
            constants,
            flatten=cfg.tma_flatten,
            static=static,
        )
    dummy = out  # stands in for pointers a mode does not read
    bound(
        a,
        a_scale if a_scale is not None else dummy,
        w,
        w_scale if w_scale is not None else dummy,
        out,
        None if static else out_amax if out_amax is not None else dummy,
        topk_weights,
        topk_ids,
        routing.sorted_ids,
        routing.expert_of_block,
        num_padded,
        error,
        *(split if split is not None else (dummy, dummy)),
        routing.num_pairs,
        N,
        K,
        w.shape[0],
    )


def _buffers(
    T: int,
    top_k: int,
    E: int,
    K: int,
    I: int,
    quant,
    tile: int,
    device,  # noqa: E741
    split: tuple = (1, 0),
) -> dict:
    """Every intermediate buffer of one call, by name (``torch.empty``: no launch). ``split``:
    (split_k, BLOCK_N); with split_k > 1 also GEMM1's fp32 partial tiles and its per-tile counts,
    zeroed once here (one fill at creation; the kernel leaves them zero after every launch)."""
    P = T * top_k
    fmt = get_format(quant)
    n = buffer_sizes(T, top_k, E, tile)
    new = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    end = new((E,), torch.int32)
    b = dict(
        sorted_ids=new((n["rows"],), torch.int32),
        expert_of_block=new((n["blocks"],), torch.int32),
        expert_end=end,
        num_padded=end[-1:],
        counts=new((n["chunks"], E), torch.int32),
        act=new((P, I), torch.float32 if fmt.quantized else torch.bfloat16),
        y=new((P, K), torch.bfloat16) if top_k > 1 else None,
    )
    split_k, block_n = split
    if split_k > 1:
        tiles = n["blocks"] * _cdiv(I, block_n)
        b.update(
            partials=new((tiles * split_k * 2 * tile * block_n,), torch.float32),
            counts_split=torch.zeros((tiles,), dtype=torch.int32, device=device),
        )
    if fmt.quantized:
        b.update(
            xq=new((T, K), FP8_DTYPE),
            x_scale=new(fmt.activation_scale_shape(T, K), torch.float32),
            parts=new((PARTS,), torch.float32),
            act_amax=new(fmt.activation_scale_shape(P, I), torch.float32),
            aq=new((P, I), FP8_DTYPE),
            act_scale=new(fmt.activation_scale_shape(P, I), torch.float32),
        )
    return b


_workspaces: OrderedDict = OrderedDict()


def _split(cfg: TritonConfig) -> tuple:
    """What GEMM1's split-K buffers depend on: (split_k, BLOCK_N), or (1, 0) without a split."""
    return (cfg.split_k, cfg.BLOCK_N) if cfg.split_k > 1 else (1, 0)


def _workspace(T, top_k, E, K, I, quant, tile, device, split=(1, 0)) -> dict:  # noqa: E741
    """The buffers of :func:`_buffers`, reused by the eager calls of one stream (see the module
    docstring); fresh while a CUDA graph is being captured."""
    return _workspace_of((T, top_k, E, K, I, quant, tile, device, split))


def _workspace_of(sizes: tuple) -> dict:
    """:func:`_workspace` of ``sizes`` = its arguments as a tuple (a :class:`_Call` holds them)."""
    device = sizes[7]
    stream = None
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return _buffers(*sizes)
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (sizes, stream, threading.get_ident())
    b = _workspaces.get(key)
    if b is None:
        b = _workspaces[key] = _buffers(*sizes)
        if len(_workspaces) > WORKSPACES:
            _workspaces.popitem(last=False)
    else:
        _workspaces.move_to_end(key)
    return b


class _Call:
    """What a ``fused_moe`` call takes from its plan, found once per call signature
    (:func:`_call_of`): the plan, the workspace's sizes, whether a GEMM reads its weight by TMA,
    and the launches bound for this shape (:class:`_Launches`; None for T = 0)."""

    __slots__ = ("plan", "sizes", "tma1", "tma2", "launches")

    def __init__(self, p, d: MoEDims, quant, device, static: bool):
        self.plan, self.tma1, self.tma2 = p, p.gemm1.persistent_tma, p.gemm2.persistent_tma
        tile = p.align_tile
        self.sizes = (d.T, d.top_k, d.E, d.K, d.I, quant, tile, device, _split(p.config))
        self.launches = (
            None
            if not d.T
            else _launches(
                d.T, d.top_k, d.K, d.I, quant, p.config, buffer_sizes(d.T, d.top_k, d.E, tile)["blocks"], static
            )
        )


@functools.lru_cache(maxsize=1024)
def _call_of(dims, quant, config, swap_ab, device, static: bool) -> _Call:
    return _Call(plan(dims, quant, config=config, swap_ab=swap_ab), dims, quant, device, static)


def forget_plans() -> None:
    """Drop the cached plans and bound launches (after a change of a module constant they read)."""
    for cached in (_call_of, _launches, _quantize_launches, _gemm_constants):
        cached.cache_clear()


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
    a1_scale=None,
    a2_scale=None,
    config: TritonConfig | None = None,
    swap_ab: bool | None = None,
) -> torch.Tensor:
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
    d = validate_moe_args(
        x,
        w1,
        w2,
        topk_weights,
        topk_ids,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        limits=LIMITS,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
    )
    static = a1_scale is not None  # static activation scales (validated: fp8_tensor, both given)
    if (config is None or type(config) is TritonConfig) and (swap_ab is None or type(swap_ab) is bool):
        c = _call_of(d, quant, config, swap_ab, x.device, static)
    else:  # raises, naming the option (or a TritonConfig subclass: planned every call)
        c = _Call(plan(d, quant, config=config, swap_ab=swap_ab), d, quant, x.device, static)
    check_runs_on(x.device, LIMITS)  # T = 0 included: what T = 1 refuses, T = 0 refuses
    surface_errors(x.device)  # an earlier call's failed data check raises here (moe_spec.contract)
    if d.T == 0:
        return x.new_empty((0, d.K))
    if c.tma1:  # TMA reads the weights: 16-byte rows and base, checked before any launch
        check_tma_operand("w1", w1)
    if c.tma2:
        check_tma_operand("w2", w2)
    ws = _workspace_of(c.sizes)
    error = error_word(x.device)
    routing = align_into(
        topk_ids, d.E, c.sizes[6], ws["sorted_ids"], ws["expert_of_block"], ws["expert_end"], ws["counts"], error
    )
    return expert_computation(
        x,
        w1,
        w2,
        topk_weights,
        topk_ids,
        routing,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        config=c.plan.config,
        workspace=ws,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        launches=c.launches,
    )


fused_moe.limits = LIMITS


def expert_computation(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    routing,
    *,
    quant,
    w1_scale,
    w2_scale,
    config: TritonConfig,
    workspace: dict | None = None,
    a1_scale=None,
    a2_scale=None,
    launches: _Launches | None = None,
) -> torch.Tensor:
    """Everything after the alignment: quantize x, GEMM1 + SiLU·up, quantize the intermediate,
    GEMM2 × routing weight, combine.

    ``routing`` is the :class:`~moe_spec.align.Alignment` of ``topk_ids`` for ``config.BLOCK_M``
    (:func:`~triton_moe.align.align_block_size`); ``config`` must be resolved and checked (a
    plan's); GEMM2 runs its ``gemm2`` tile when it has one; ``workspace``: the buffers of
    :func:`_buffers` (default: new ones); ``launches``: :func:`_launches` of this call (default:
    looked up). :func:`fused_moe` is the validated entry point; the benchmark times this part alone
    (the alignment is timed separately).
    """
    T, K = x.shape
    E, I = w2.shape[0], w2.shape[2]  # noqa: E741
    top_k = topk_ids.shape[1]
    ws = workspace or _buffers(T, top_k, E, K, I, quant, config.BLOCK_M, x.device, _split(config))
    num_padded = ws["num_padded"] if routing.expert_end is ws["expert_end"] else routing.num_padded
    error = error_word(x.device)
    static = a1_scale is not None  # static activation scales (validated: fp8_tensor, both given)
    b = launches or _launches(T, top_k, K, I, quant, config, routing.expert_of_block.numel(), static)
    cfg1, cfg2 = b.cfg1, b.cfg2
    a1, s1, act_amax = x, None, None
    if static:
        a1, s1 = _quantize(x, quant, q=ws["xq"], scale=a1_scale, static_bit=BAD_A1_SCALE, launches=b.x_quant)
    elif b.quantized:
        act_amax = ws["act_amax"]
        a1, s1 = _quantize(
            x, quant, q=ws["xq"], scale=ws["x_scale"], parts=ws["parts"], zero=act_amax, launches=b.x_quant
        )

    # GEMM1 + SiLU(gate)·up: bf16 intermediate, or fp32 (with its amax unless the scale is static),
    # quantized once for GEMM2
    act = ws["act"]
    _gemm(
        b.gemm1,
        b.const1,
        a1,
        s1,
        w1,
        w1_scale,
        act,
        act_amax,
        topk_weights,
        topk_ids,
        error,
        routing,
        num_padded,
        I,
        K,
        cfg1,
        static=static,
        split=(ws["partials"], ws["counts_split"]) if b.split else None,
    )
    if static:
        a2, s2 = _quantize(act, quant, q=ws["aq"], scale=a2_scale, static_bit=BAD_A2_SCALE, launches=b.act_quant)
    else:
        a2, s2 = (
            (act, None)
            if act_amax is None
            else _quantize(act, quant, act_amax, q=ws["aq"], scale=ws["act_scale"], launches=b.act_quant)
        )

    # GEMM2 × routing weight; with top_k = 1 its rows are already the output
    out = torch.empty((T, K), dtype=torch.bfloat16, device=x.device)
    y = out if top_k == 1 else ws["y"]
    _gemm(
        b.gemm2, b.const2, a2, s2, w2, w2_scale, y, None, topk_weights, topk_ids, error, routing, num_padded, K, I, cfg2
    )
    if top_k > 1:
        b.combine(y, out, T, K)
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
    b = _launches(P // top_k, top_k, K, I, quant, config, routing.expert_of_block.numel())
    _gemm(
        b.gemm2,
        b.const2,
        a2,
        s2,
        w2,
        w2_scale,
        y,
        None,
        topk_weights,
        topk_ids,
        error_word(a2.device),
        routing,
        routing.num_padded,
        K,
        I,
        b.cfg2,
    )

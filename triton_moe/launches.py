"""The launches of one ``fused_moe`` call and the buffers they write, bound once per shape.

:func:`_launches` binds every launch of :func:`triton_moe.moe.expert_computation` — grids and
constexprs (:class:`~triton_moe.jit.Bound`) — once per (sizes, quant format, config, scale mode), so
an eager call re-derives nothing; :func:`_workspace` keeps the intermediate buffers as
:class:`moe_spec.workspace.Workspaces` does for every backend (per sizes, stream and thread; fresh
in a graph capture or a call through the op). :func:`_quantize` is the activations' quantization
(amax, then E4M3 and scales) as x, where GEMM1 does not quantize it in its A load
(:func:`triton_moe.plan.x_quant_in_gemm1`), and the intermediate, where GEMM1's epilogue does not
(:func:`triton_moe.plan.epilogue_quant`), need it.
"""

from __future__ import annotations

import functools

import torch

from moe_spec.quant import FP8_DTYPE, WHOLE, get_format
from moe_spec.validate import (
    BAD_A1_SCALE,
    BAD_A2_SCALE,
    error_word,
)
from moe_spec.workspace import Workspaces
from triton_moe.align import buffer_sizes
from triton_moe.config import EARLY_ROUTING_MAX_K_STEPS, TritonConfig
from triton_moe.jit import INTERPRET, Bound
from triton_moe.kernels import QUANT_MODE, fp8_imprecise_acc, moe_gemm_kernel
from triton_moe.kernels_rows import AMAX_PARTS, amax_kernel, combine_kernel, quantize_kernel
from triton_moe.plan import epilogue_quant, x_quant_in_gemm1

COMBINE_BLOCK = 1024
PARTS = AMAX_PARTS.value  # fp8_tensor's partial amaxes of x, at most
AMAX_BLOCK = 1024
QUANT_GROUPS = 8  # quantize_kernel's step: 8 groups of 128 columns
#: quantize_kernel's programs a few long rows are spread over, at most (about two per SM of an H100 / H200):
#: a row's steps go to up to ⌈QUANT_PROGRAMS / rows⌉ programs (:func:`quantize_splits`).
QUANT_PROGRAMS = 256
#: Workspaces kept (least recently used dropped first): one per (sizes, device, stream).
WORKSPACES = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_splits(rows: int, cols: int, zero_after: bool = False) -> int:
    """S, the programs per row of quantize_kernel's grid [rows, S]: a row's ⌈cols / (QUANT_GROUPS·128)⌉
    steps spread over at most that many programs while rows · S ≤ QUANT_PROGRAMS (a decode step's one row
    of 7168 columns: 7 programs instead of one walking 7 steps); 1 under ``zero_after`` (its zeroing is per
    row, after the row's reads). The codes and scales do not depend on S."""
    steps = _cdiv(cols, QUANT_GROUPS * 128)
    return 1 if zero_after else max(1, min(steps, QUANT_PROGRAMS // max(rows, 1)))


@functools.lru_cache(maxsize=1024)
def _quantize_launches(
    rows: int, cols: int, quant: str, amax_given: bool, zero_numel: int, static_bit: int, zero_after: bool = False
) -> tuple:
    """(amax launch or None, its program count, quantize launch) of :func:`_quantize` for activations
    [rows, cols]: grids and constexprs bound once per shape (:class:`~triton_moe.jit.Bound`).
    ``zero_after``: the launch zeroes the amax it reads, after reading it (``ZERO_AFTER``)."""
    fmt = get_format(quant)
    common = dict(QUANT=fmt.mode, GROUPS=QUANT_GROUPS, INTERPRETER=INTERPRET)
    if zero_after:
        common.update(ZERO_AFTER=True)
    grid = (rows, quantize_splits(rows, cols, zero_after))
    if static_bit:
        return None, 1, Bound(quantize_kernel, grid, AMAX_GIVEN=False, STATIC_BIT=static_bit, **common)
    if fmt.activation_group == (WHOLE, WHOLE) and not amax_given:  # one scale for the whole tensor
        num_amax = min(rows * _cdiv(cols, AMAX_BLOCK), PARTS)  # amax_kernel's pieces, at most PARTS programs
        return (
            Bound(amax_kernel, (num_amax,), BLOCK=AMAX_BLOCK),
            num_amax,
            Bound(quantize_kernel, grid, AMAX_GIVEN=True, **common),
        )
    return None, 1, Bound(quantize_kernel, grid, AMAX_GIVEN=amax_given, **common)


def _quantize(a, quant: str, amax=None, *, q=None, scale=None, parts=None, zero=None, static_bit=0, launches=None):
    """(q E4M3, scale fp32) of activations a [rows, cols] — moe_spec.quant.quantize_activation's
    result. ``amax``: the amax in the format's shape when already known (else found here); ``q``,
    ``scale``, ``parts`` (fp32 [PARTS], fp8_tensor's partial amaxes): buffers to use;
    ``zero``: a buffer the same launch zeroes (GEMM1's amax; the ``amax`` itself, after reading it, when
    ``launches`` were bound with ``zero_after``). ``static_bit`` ≠ 0: ``scale`` is a
    static fp8_tensor scale (read, not written: ``quantize_activation_static``), and a bad one sets
    this bit of the error word. ``launches``: :func:`_quantize_launches` of these arguments, when
    the caller holds them."""
    rows, cols = a.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=a.device) if q is None else q
    zero_numel = 0 if zero is None else zero.numel()
    amax_launch, num_amax, quantize = launches or _quantize_launches(
        rows, cols, quant, amax is not None, zero_numel, static_bit, zero is not None and zero is amax
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
def _gemm_constants(
    cfg: TritonConfig, quant, fuse_silu: bool, a_row_div: int, k: int, quant_out: bool = False, quant_a: bool = False
) -> dict:
    """The constexpr arguments of one GEMM launch with ``cfg``, the config of that GEMM
    (:meth:`~triton_moe.config.TritonConfig.gemm1_config` / ``gemm2_config``; a function of the
    plan; not to be mutated), whose reduction length is ``k`` (a layer size: no new compile per T).
    Only GEMM1 splits K (``cfg.split_k``); only a short GEMM2 reads its routing early; ``quant_out``:
    GEMM1 stores the intermediate as E4M3 (:func:`triton_moe.plan.epilogue_quant`'s answer); ``quant_a``:
    GEMM1 quantizes bf16 x in its A load (:func:`triton_moe.plan.x_quant_in_gemm1`'s)."""
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
        QUANT_OUT=bool(quant_out and fuse_silu),
        **({"QUANT_A": True} if quant_a and fuse_silu else {}),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


class _Launches:
    """Every launch of :func:`expert_computation` for one shape, quant format, config and
    activation-scale mode, bound once (:func:`_launches`): grids and constexprs
    (:class:`~triton_moe.jit.Bound`), and what the persistent TMA kernel takes instead.
    ``epilogue_quant``: GEMM1 writes the E4M3 intermediate itself (:func:`triton_moe.plan.epilogue_quant`),
    so there is no ``act_quant`` launch and x's quantization zeroes no amax buffer.
    ``x_quant_in_gemm1``: GEMM1 quantizes x in its A load (:func:`triton_moe.plan.x_quant_in_gemm1`),
    so there is no ``x_quant`` launch, and ``act_quant`` (if any) zeroes the amax after reading it."""

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
        "epilogue_quant",
        "x_quant_in_gemm1",
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
        self.epilogue_quant = fused = epilogue_quant(cfg1, quant, static)
        self.x_quant_in_gemm1 = in_gemm1 = x_quant_in_gemm1(cfg1, quant, static)
        self.const1 = _gemm_constants(cfg1, quant, True, top_k, K, fused, in_gemm1)
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
            self.x_quant = None if in_gemm1 else _quantize_launches(T, K, quant, False, 0, BAD_A1_SCALE)
            self.act_quant = None if fused else _quantize_launches(P, I, quant, False, 0, BAD_A2_SCALE)
        elif fmt.quantized:
            amax_numel = 0 if fused else _numel(fmt.activation_scale_shape(P, I))
            self.x_quant = None if in_gemm1 else _quantize_launches(T, K, quant, False, amax_numel, 0)
            zero = amax_numel if in_gemm1 else 0  # the amax no x launch zeroes: its reader does, after
            self.act_quant = None if fused else _quantize_launches(P, I, quant, True, zero, 0, bool(zero))


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
    epilogue_quant: bool = False,
    x_in_gemm1: bool | None = None,
) -> dict:
    """Every intermediate buffer of one call, by name (``torch.empty``: no launch). ``split``:
    (split_k, BLOCK_N); with split_k > 1 also GEMM1's fp32 partial tiles and its per-tile counts,
    zeroed once here (one fill at creation; the kernel leaves them zero after every launch).
    ``epilogue_quant`` (:func:`triton_moe.plan.epilogue_quant` of the call): GEMM1 writes ``aq``
    (and ``act_scale``) itself, so no fp32 ``act`` (None) and no ``act_amax``. ``x_in_gemm1``
    (:func:`triton_moe.plan.x_quant_in_gemm1` of the call): GEMM1 quantizes x, so no ``xq``,
    ``x_scale``, ``parts``; and ``act_amax`` is made zero (one fill at creation; the intermediate's
    quantization leaves it zero after every launch), as also when unknown (None)."""
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
        act=None if epilogue_quant else new((P, I), torch.float32 if fmt.quantized else torch.bfloat16),
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
        b.update(aq=new((P, I), FP8_DTYPE), act_scale=new(fmt.activation_scale_shape(P, I), torch.float32))
        if not x_in_gemm1:
            b.update(
                xq=new((T, K), FP8_DTYPE),
                x_scale=new(fmt.activation_scale_shape(T, K), torch.float32),
                parts=new((PARTS,), torch.float32),
            )
        if not epilogue_quant:
            amax_shape = fmt.activation_scale_shape(P, I)
            b.update(
                act_amax=new(amax_shape, torch.float32)
                if x_in_gemm1 is False
                else torch.zeros(amax_shape, device=device)
            )
    return b


_workspaces = Workspaces(WORKSPACES)


def _split(cfg: TritonConfig) -> tuple:
    """What GEMM1's split-K buffers depend on: (split_k, BLOCK_N), or (1, 0) without a split."""
    return (cfg.split_k, cfg.BLOCK_N) if cfg.split_k > 1 else (1, 0)


def _workspace(T, top_k, E, K, I, quant, tile, device, split=(1, 0), epilogue_quant=False, x_in_gemm1=None) -> dict:  # noqa: E741
    """The buffers of :func:`_buffers`, kept in :data:`_workspaces` (see the module docstring)."""
    return _workspace_of((T, top_k, E, K, I, quant, tile, device, split, epilogue_quant, x_in_gemm1))


def _workspace_of(sizes: tuple) -> dict:
    """:func:`_workspace` of ``sizes`` = its arguments as a tuple (a :class:`_Call` holds them)."""
    return _workspaces.get(sizes, sizes[7], lambda: _buffers(*sizes))

"""The pieces the grouped GEMM kernels are made of (:mod:`triton_moe.kernels`' ``moe_gemm_kernel`` and
:mod:`triton_moe.kernels_tma`'s persistent TMA kernel) and the registry's constants as the kernels
read them: one K step with FP8 promotion, the scaled MMA, the routing reads and the epilogue
(split-K's sum is in :mod:`triton_moe.kernels`, x's quantization in the A load in
:mod:`triton_moe.kernel_quant`). :mod:`triton_moe.kernels` explains the arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

import moe_spec.quant
import moe_spec.validate
from moe_spec.quant import FORMATS

#: The registry's numbers and FP8 constants as the kernels read them (a Triton kernel may read a
#: module global only when it is a ``tl.constexpr``).
PER_TENSOR = tl.constexpr(FORMATS["fp8_tensor"].mode)


PER_CHANNEL = tl.constexpr(FORMATS["fp8_channel"].mode)


PER_BLOCK = tl.constexpr(FORMATS["fp8_block"].mode)


FP8_MAX = tl.constexpr(moe_spec.quant.FP8_MAX)  # largest E4M3FN value, 448


AMAX_FLOOR = tl.constexpr(moe_spec.quant.AMAX_FLOOR)  # smallest amax a scale is taken of, 1e-12


FP8_BLOCK = tl.constexpr(moe_spec.quant.FP8_BLOCK)  # weight block / activation group edge, 128


#: The error-word bits the GEMMs set (moe_spec.validate.DATA_CHECKS).
BAD_WEIGHT, BAD_W1_SCALE, BAD_W2_SCALE = (
    tl.constexpr(b)
    for b in (moe_spec.validate.BAD_WEIGHT, moe_spec.validate.BAD_W1_SCALE, moe_spec.validate.BAD_W2_SCALE)
)

#: The bits of the routing and static-scale checks, for a kernel that makes them itself (the
#: one-launch decode kernel, triton_moe.decode; the grouped pipeline's alignment and quantization
#: kernels set the same bits).
BAD_ID, REPEATED_ID, BAD_A1_SCALE, BAD_A2_SCALE = (
    tl.constexpr(b)
    for b in (
        moe_spec.validate.BAD_ID,
        moe_spec.validate.REPEATED_ID,
        moe_spec.validate.BAD_A1_SCALE,
        moe_spec.validate.BAD_A2_SCALE,
    )
)


@triton.jit
def _abs_bits(v):
    """|v| as int32 bits: the sign bit cleared, which is |v| for every v, NaN included.

    For values ≥ 0 the order of the bit patterns is the order of the values, and every NaN
    (exponent all ones, mantissa ≠ 0) sorts above +inf. An integer max of these bits is therefore
    an amax that keeps NaN, where ``tl.max`` / ``tl.maximum`` (IEEE maxNum on the GPU, NaN-skipping
    in the interpreter's reductions) return the largest number and drop it; integer maxima,
    reductions and atomics need no NaN rule of their own.
    """
    return v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _bits_ptr(ptr):
    """An fp32 amax buffer seen as the int32 bits that :func:`_abs_bits` maxima are taken over."""
    return ptr.to(tl.pointer_type(tl.int32))


@triton.jit
def _cast_out(x, dtype: tl.constexpr, INTERPRETER: tl.constexpr):
    """fp32 → output dtype, rounding to nearest even. The interpreter's fp32→bf16 cast truncates,
    so there the rounding is done on the bits first (the cast then only drops zero bits)."""
    if INTERPRETER and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # a NaN's mantissa may carry out
    return x.to(dtype)


@triton.jit
def _widen(t):
    """Interpreter only: a bf16 or E4M3 tile as fp32 (exact) for ``tl.dot``. The interpreter's bf16
    dot returns garbage, and its E4M3 conversion reads the NaN byte (S.1111.111) as ±480."""
    wide = t.to(tl.float32)
    if t.dtype == tl.float8e4nv:
        wide = tl.where((t.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), wide)
    return wide


@triton.jit
def _mma(acc, a, w, SWAP_AB: tl.constexpr, INTERPRETER: tl.constexpr, FP8_IMPRECISE_ACC: tl.constexpr):
    """acc += a·wᵀ ([BM, BN]) or, swapped, acc += w·aᵀ ([BN, BM]).

    bf16 accumulates in the MMA itself. FP8 is promoted to fp32 as ``FP8_IMPRECISE_ACC`` says (see
    the module docstring): 0 adds each K step's product into ``acc``; n > 0 lets the WGMMA
    accumulate into ``acc`` and Triton promote every n elements of K (the kernels pass 128, for
    steps deeper than that).
    """
    FP8: tl.constexpr = a.dtype == tl.float8e4nv
    if INTERPRETER:
        a = _widen(a)
        w = _widen(w)
    if FP8 and FP8_IMPRECISE_ACC == 0:
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(a))
        else:
            acc += tl.dot(a, tl.trans(w))
    elif FP8:
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc, max_num_imprecise_acc=FP8_IMPRECISE_ACC)
        else:
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=FP8_IMPRECISE_ACC)
    elif SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _mma_scaled(acc, a, w, a_s, w_s, SWAP_AB: tl.constexpr, INTERPRETER: tl.constexpr):
    """Block-scaled FP8 step: acc += (a·wᵀ) · a_s[row] · w_s[col] (transposed when swapped)."""
    if INTERPRETER:
        a = _widen(a)
        w = _widen(w)
    if SWAP_AB:
        acc += tl.dot(w, tl.trans(a)) * (w_s[:, None] * a_s[None, :])
    else:
        acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * w_s[None, :])
    return acc


@triton.jit
def _k_step(
    acc,
    acc_up,
    scale_bad,
    a,
    w,
    w_up,
    k0,
    a_row,
    row_ok,
    expert,
    offs_n,
    col_ok,
    a_scale_ptr,
    w_scale_ptr,
    N,
    K_GROUPS,
    N_GROUPS,
    FUSE_SILU: tl.constexpr,
    QUANT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    INTERPRETER: tl.constexpr,
    FP8_IMPRECISE_ACC: tl.constexpr,
    a_s,
    QUANT_A: tl.constexpr = False,
):
    """One K step of a grouped GEMM on its loaded tiles — A, the weight (GEMM1: gate) tile ``w`` and,
    under ``FUSE_SILU``, the up tile ``w_up`` — into (acc, acc_up, scale_bad). fp8_block loads the
    step's scales, checks the weight's and scales the product; every other format adds the raw
    product. Both kernels' K loops call it, so on one tile they add the same products in one order.
    ``QUANT_A``: A's scales ``a_s`` were made in the A load (:mod:`triton_moe.kernel_quant`), not loaded."""
    if QUANT == PER_BLOCK:
        kg = k0 // FP8_BLOCK
        if QUANT_A:
            s_a = a_s
        else:
            s_a = tl.load(a_scale_ptr + a_row * K_GROUPS + kg, mask=row_ok, other=1.0)
        s_w = tl.load(w_scale_ptr + (expert * N_GROUPS + offs_n // FP8_BLOCK) * K_GROUPS + kg, mask=col_ok, other=1.0)
        scale_bad |= _scale_bad(s_w)
        acc = _mma_scaled(acc, a, w, s_a, s_w, SWAP_AB, INTERPRETER)
        if FUSE_SILU:
            s_w_up = tl.load(
                w_scale_ptr + (expert * N_GROUPS + (N + offs_n) // FP8_BLOCK) * K_GROUPS + kg, mask=col_ok, other=1.0
            )
            scale_bad |= _scale_bad(s_w_up)
            acc_up = _mma_scaled(acc_up, a, w_up, s_a, s_w_up, SWAP_AB, INTERPRETER)
    else:  # bf16, or FP8 with scales applied after the loop
        acc = _mma(acc, a, w, SWAP_AB, INTERPRETER, FP8_IMPRECISE_ACC)
        if FUSE_SILU:
            acc_up = _mma(acc_up, a, w_up, SWAP_AB, INTERPRETER, FP8_IMPRECISE_ACC)
    return acc, acc_up, scale_bad


@triton.jit
def _acc_tile(SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if SWAP_AB:
        return tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _unswap(acc, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _scale_bad(s):  # 1 where a weight scale is not finite and positive (NaN fails both compares)
    return tl.where((s > 0.0) & (s < float("inf")), 0, 1)


@triton.jit
def _dequant_after_loop(
    acc,
    a_scale_ptr,
    a_row,
    row_ok,
    w_scale_ptr,
    expert,
    w_cols,
    col_ok,
    N_TOTAL,
    QUANT: tl.constexpr,
    a_s,
    QUANT_A: tl.constexpr,
):
    """Per-tensor / per-channel FP8: both scales once, after the K loop → (acc, a weight scale bad).
    ``QUANT_A``: per-channel A scales are ``a_s``, made by GEMM1 itself (:mod:`triton_moe.kernel_quant`)."""
    bad = 0
    if QUANT == PER_TENSOR:
        s_a = tl.load(a_scale_ptr)
        s_w = tl.load(w_scale_ptr + expert)
        acc = acc * (s_a * s_w)
        bad = _scale_bad(s_w)
    elif QUANT == PER_CHANNEL:
        if QUANT_A:
            s_a = a_s
        else:
            s_a = tl.load(a_scale_ptr + a_row, mask=row_ok, other=1.0)
        s_w = tl.load(w_scale_ptr + expert * N_TOTAL + w_cols, mask=col_ok, other=0.0)
        acc = acc * s_a[:, None] * s_w[None, :]
        bad = tl.max(tl.where(col_ok, _scale_bad(s_w), 0), axis=0)
    return acc, bad


@triton.jit
def _row_routing(
    pair,
    row_ok,
    topk_ids_ptr,
    topk_weights_ptr,
    E,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    LOAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The routing data of a tile's rows, for the epilogue: whether each pair's id is in [0, E), and
    its routing weight (GEMM2; zeros otherwise) — or, unless ``LOAD``, placeholders.  Loaded in the
    epilogue, or — ``EARLY_ROUTING``, a GEMM2 of at most
    :data:`triton_moe.config.EARLY_ROUTING_MAX_K_STEPS` K steps — before the K loop, so that the two
    gathers' latency hides under a main loop too short to cover an epilogue's wait; a long loop gains
    nothing and holds the registers across it.  notes/triton_moe.md has the measurement."""
    if LOAD:
        ids = tl.load(topk_ids_ptr + pair, mask=row_ok, other=0)
        id_ok = (ids >= 0) & (ids < E)
        if MUL_ROUTED_WEIGHT:
            rw = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
        else:
            rw = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        id_ok, rw = row_ok, tl.zeros([BLOCK_M], dtype=tl.float32)
    return id_ok, rw


@triton.jit
def _epilogue(
    acc,
    acc_up,
    scale_bad,
    pair,
    row_ok,
    a_row,
    expert,
    offs_n,
    col_ok,
    pid_n,
    a_scale_ptr,
    w_scale_ptr,
    out_ptr,
    out_amax_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    id_ok,
    rw,
    error_ptr,
    N,
    E,
    N_TOTAL,
    FUSE_SILU: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    QUANT: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EARLY_ROUTING: tl.constexpr,
    QUANT_OUT: tl.constexpr = False,
    a_s=None,
    QUANT_A: tl.constexpr = False,
):
    """The epilogue of both grouped GEMMs on an (unswapped) [BLOCK_M, BLOCK_N] tile: dequantize,
    SiLU(gate)·up and the intermediate's amax (GEMM1), routing weight (GEMM2), error bits, store.
    ``id_ok`` and ``rw`` were loaded before the K loop (``EARLY_ROUTING``) or are loaded here (:func:`_row_routing`).
    ``QUANT_OUT`` (GEMM1, :func:`triton_moe.plan.epilogue_quant`): the intermediate is stored as E4M3
    (:func:`_quantize_tile`), and ``out_amax_ptr`` is its scale — static fp8_tensor's, read, or
    fp8_block's [P, ⌈N/128⌉], written — instead of an amax. ``a_s``, ``QUANT_A``: x's scales made in
    GEMM1's A load (:mod:`triton_moe.kernel_quant`)."""
    acc, bad = _dequant_after_loop(
        acc, a_scale_ptr, a_row, row_ok, w_scale_ptr, expert, offs_n, col_ok, N_TOTAL, QUANT, a_s, QUANT_A
    )
    if QUANT == PER_BLOCK:
        bad = tl.max(scale_bad, axis=0)
    # a pair whose id is outside [0, E) was aligned with it clamped (triton_moe.align): GEMM1 zeroes
    # its intermediate, GEMM2 multiplies it by NaN instead of its routing weight (moe_spec.contract)
    if not EARLY_ROUTING:
        id_ok, rw = _row_routing(pair, row_ok, topk_ids_ptr, topk_weights_ptr, E, MUL_ROUTED_WEIGHT, True, BLOCK_M)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if FUSE_SILU:
        up, bad_up = _dequant_after_loop(
            acc_up, a_scale_ptr, a_row, row_ok, w_scale_ptr, expert, N + offs_n, col_ok, N_TOTAL, QUANT, a_s, QUANT_A
        )
        bad = bad | bad_up
        acc = acc / (1.0 + tl.exp(-acc)) * up  # SiLU(gate)·up in fp32
        acc = tl.where(out_mask & id_ok[:, None], acc, 0.0)
        # the intermediate's amax, as int32 bits (NaN kept, see _abs_bits), per tensor / row / group
        if QUANT_OUT:  # its scale is known in this tile: E4M3 codes (and block scales) instead
            acc, a2_bits = _quantize_tile(
                acc, pair, row_ok, pid_n, out_amax_ptr, N, QUANT, INTERPRETER, BLOCK_M, BLOCK_N
            )
        elif QUANT == PER_TENSOR and out_amax_ptr is not None:  # None: a static scale follows
            tl.atomic_max(_bits_ptr(out_amax_ptr), tl.max(tl.max(_abs_bits(acc), axis=1), axis=0))
        elif QUANT == PER_CHANNEL:
            tl.atomic_max(_bits_ptr(out_amax_ptr) + pair, tl.max(_abs_bits(acc), axis=1), mask=row_ok)
        elif QUANT == PER_BLOCK:
            # 1×128 groups of the intermediate: BLOCK_N/G groups of G columns in this tile
            G: tl.constexpr = BLOCK_N if BLOCK_N < FP8_BLOCK else FP8_BLOCK
            group_max = tl.max(tl.reshape(_abs_bits(acc), [BLOCK_M, BLOCK_N // G, G]), axis=2)
            gcol = (pid_n * BLOCK_N) // FP8_BLOCK + tl.arange(0, BLOCK_N // G)
            tl.atomic_max(
                _bits_ptr(out_amax_ptr) + pair[:, None].to(tl.int64) * tl.cdiv(N, FP8_BLOCK) + gcol[None, :],
                group_max,
                mask=row_ok[:, None] & (gcol < tl.cdiv(N, FP8_BLOCK))[None, :],
            )
    bits = tl.where(bad > 0, BAD_W1_SCALE if FUSE_SILU else BAD_W2_SCALE, 0)  # the weight scale it read
    if QUANT_OUT:
        bits |= a2_bits  # a bad static a2_scale
    if MUL_ROUTED_WEIGHT:
        bits |= tl.where(tl.max((row_ok & ~(tl.abs(rw) < float("inf"))).to(tl.int32), axis=0) > 0, BAD_WEIGHT, 0)
        acc = acc * tl.where(id_ok | ~row_ok, rw, float("nan"))[:, None]
    tl.atomic_or(error_ptr, bits, mask=bits != 0)
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, _cast_out(acc, out_ptr.dtype.element_ty, INTERPRETER), mask=out_mask)


@triton.jit
def _quantize_tile(
    acc,
    pair,
    row_ok,
    pid_n,
    scale_ptr,
    N,
    QUANT: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """GEMM1's fp32 intermediate tile (masked rows and columns zero) → (its E4M3 codes, the error bit
    of a bad static scale), exactly as ``quantize_kernel`` quantizes the same values after a
    round trip through memory (:func:`_scale_of`, :func:`_quantize`). Per-tensor: the static scale
    at ``scale_ptr``, checked (``BAD_A2_SCALE``). Block: the tile holds whole 1×128 groups (BLOCK_N
    a multiple of 128, starting at pid_n·BLOCK_N); each group's amax is an integer max of its bits
    (NaN kept, :func:`_abs_bits`; masked columns are zeros, as the separate pass's masked loads),
    its scale is stored at scale_ptr[pair, group] for the pair rows only (padding never)."""
    if QUANT == PER_TENSOR:
        s = tl.load(scale_ptr)
        return _quantize(acc, s, INTERPRETER), tl.where(_scale_bad(s) != 0, BAD_A2_SCALE, 0)
    else:
        GROUPS: tl.constexpr = BLOCK_N // FP8_BLOCK
        v = tl.reshape(acc, [BLOCK_M, GROUPS, FP8_BLOCK])
        s = _scale_of(tl.max(_abs_bits(v), axis=2).to(tl.float32, bitcast=True))  # [BLOCK_M, GROUPS]
        q = tl.reshape(_quantize(v, s[:, :, None], INTERPRETER), [BLOCK_M, BLOCK_N])
        gcol = pid_n * GROUPS + tl.arange(0, GROUPS)
        n_groups = tl.cdiv(N, FP8_BLOCK)
        tl.store(
            scale_ptr + pair[:, None].to(tl.int64) * n_groups + gcol[None, :],
            s,
            mask=row_ok[:, None] & (gcol < n_groups)[None, :],
        )
        return q, 0


@triton.jit
def _scale_of(amax):
    """fp32 scale of an amax, as moe_spec.quant computes it (IEEE division, like torch's; NaN in,
    NaN out: a floor taken with IEEE maxNum would turn a NaN amax into the floor)."""
    return tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL), FP8_MAX)


@triton.jit
def _quantize(a, scale, INTERPRETER: tl.constexpr):
    """e4m3(clamp(a / scale, ±FP8_MAX)): round to nearest even, saturating.

    The interpreter's fp32→e4m3 cast mishandles ties and rounding that carries into the exponent
    (31 → 16 instead of 32); there the value is rounded to e4m3's grid in fp32 first: 3 mantissa
    bits for normals (|q| ≥ 2⁻⁶), a fixed step of 2⁻⁹ below, so the cast itself is exact.
    """
    q = tl.clamp(tl.math.div_rn(a.to(tl.float32), scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if INTERPRETER:
        bits = q.to(tl.uint32, bitcast=True)
        normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000).to(tl.float32, bitcast=True)
        subnormal = ((q * 512.0 + 12582912.0) - 12582912.0) / 512.0  # 1.5·2²³: RNE to an integer
        grid = tl.where(tl.abs(q) >= 0.015625, normal, subnormal)
        # the interpreter casts NaN to 384 (0x7C): write E4M3's NaN byte (S.1111.111) itself
        byte = grid.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(q != q, byte | 0x7F, byte).to(tl.float8e4nv, bitcast=True)
    return q.to(tl.float8e4nv)  # the GPU's saturating cast keeps NaN

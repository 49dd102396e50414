"""The grouped GEMM of the MoE layer (launched twice: GEMM1 and GEMM2) and the helpers all its kernels share.

The layer, for P = T·top_k (token, slot) pairs sorted by expert (:mod:`triton_moe.align`)::

    GEMM1   h_p = x_t · W1[e]ᵀ              x [T, K], W1[e] = [gate rows; up rows] [2I, K]
            a_p = SiLU(h_p[:I]) · h_p[I:]   fused in GEMM1's epilogue → act [P, I]
    GEMM2   y_p = w_p · (a_p · W2[e]ᵀ)      W2[e] [K, I]; routing weight w_p in the epilogue → y [P, K]
    combine out_t = Σ_j y_{t·top_k + j}     fixed order j = 0 … top_k−1 (deterministic)

``moe_gemm_kernel`` — one program = BLOCK_M sorted pairs of one expert × BLOCK_N output columns
    Rows are gathered through ``sorted_ids`` (A row = pair // A_ROW_DIV: the token in GEMM1, the
    pair itself in GEMM2); padding rows (sentinel id P) load zeros and are never stored. The
    expert's weight tile W[e][n : n+BLOCK_N, k : k+BLOCK_K] is read in its natural K-major layout.
    GEMM1 keeps two accumulators, gate columns n… and up columns I+n…, so SiLU(gate)·up happens in
    registers and the [P, 2I] pre-activation never reaches memory.

Swap-AB (``SWAP_AB``)
    Without swap the accumulator is [BLOCK_M, BLOCK_N] += A·Wᵀ: the tokens are WGMMA's M side,
    which must be 64 rows per warpgroup. With swap it is [BLOCK_N, BLOCK_M] += W·Aᵀ: the weight
    rows fill M and the few tokens become the N side (≥ 8). The accumulator is transposed back
    (``tl.trans``) before the epilogue, so everything after the K loop is shared.

FP8 W8A8 (``QUANT``: 0 bf16, 1 per-tensor, 2 per-channel, 3 128×128 block)
    Both GEMMs read E4M3 operands straight from memory — the activations are quantized before each
    GEMM (:mod:`triton_moe.kernels_rows`) — so ``tl.dot`` gets them on Triton's async-copy → WGMMA
    path with nothing in between. GEMM1's epilogue writes SiLU·up in fp32 and, under a dynamic scale,
    its amax per tensor / row / 1×128 group (``tl.atomic_max``: order-independent, hence
    deterministic), which the intermediate's quantization reads. Dequantization happens in
    registers, with the scales loaded next to the tiles:

    * per-tensor:  acc · s_a · s_w[e]                         after the K loop
    * per-channel: acc · s_a[row] · s_w[e, col]               after the K loop
    * block:       acc += (A_k·W_kᵀ) · s_a[row, k/128] · s_w[e, col/128, k/128]   every K step
                   (BLOCK_K divides 128, so one K step never straddles a scale block)

FP8 accumulation (``FP8_IMPRECISE_ACC``)
    Hopper's FP8 WGMMA accumulates in fewer bits than fp32, and Triton (sm_90) does not promote the
    partial sum to fp32 by default (notes/triton_moe.md, "FP8 promotion"). These kernels promote at
    least every 128 of K, DeepSeek-V3's interval; :func:`fp8_imprecise_acc` sets the constexpr from
    the tile. A K step of at most 128 adds its ``tl.dot`` into the fp32 ``acc`` (0); a deeper step
    passes ``max_num_imprecise_acc = 128`` to the dot, and Triton's WGMMA lowering promotes every 128
    of K inside it (one fp32 add per 256-deep step measured above the FP8 error bound:
    notes/results/gpu_lane_h200_2026-12-02.md). Other intervals are a study
    (``python -m triton_moe.lab.promotion``, on its own GEMM kernel).

NaN and inf (see ``notes/numerics.md``)
    An amax taken with IEEE maxNum (``tl.max``) drops a NaN; the amaxes here are integer maxima of
    the bits (:func:`_abs_bits`), and the quantization keeps NaN too (:mod:`triton_moe.kernels_rows`),
    so a NaN in x, in a weight (the byte 0x7F) or in the intermediate spreads through its scale group
    exactly as in :mod:`moe_spec.quant`. An intermediate beyond fp32 is ±inf after SiLU·up; GEMM2
    meets inf − inf and the token's row is NaN, where the fp64 oracle leaves the bf16 range.

Data checks (:mod:`moe_spec.contract`), in the GEMM that reads the data anyway: a weight scale
    that is not finite and positive, a routing weight that is not finite, set their bits in the
    device's error word (``error_ptr``); a pair whose id lies outside [0, E) (aligned with it
    clamped, :mod:`triton_moe.align`) gets a zero intermediate in GEMM1 and NaN for its routing
    weight in GEMM2, so its token's row is NaN and no shared FP8 scale sees it.

The interpreter (``INTERPRETER``, True only under ``TRITON_INTERPRET=1``)
    Triton's CPU interpreter (3.6.0) gets four conversions wrong: the bf16 ``tl.dot`` (garbage),
    fp32→bf16 (truncates), fp32→e4m3 (loses the carry into the exponent, ties upwards) and E4M3's
    NaN (NaN → 384, 0x7F → 480). There bf16 and E4M3 tiles are widened to fp32 before the dot
    (exact products, so the CPU computes what WGMMA with fp32 accumulation does, up to summation
    order; ``_widen`` restores NaN), and ``_cast_out`` / ``_quantize`` round onto the target grid
    before casting. On the GPU these branches do not exist in the binary.

Split-K (``SPLIT_K`` > 1, the config's ``split_k``; GEMM1 only)
    At T = 1 a layer like DeepSeek-V3 under 8-way tensor parallelism (I = 256, K = 7168) has 8
    active experts × 4 column tiles = 32 GEMM1 programs for 132 SMs, each streaming 1.8 MB of W1:
    one SM cannot pull its share of HBM bandwidth alone. Split-K gives each tile SPLIT_K programs
    (grid axis 1), program s summing the K steps [s·span, (s+1)·span). Each stores its fp32 partial
    gate and up tiles, then takes a ticket from the tile's counter (an acquire-release atomic);
    the program holding the last ticket adds the partials in the order s = 0, 1, … (so the result
    does not depend on which program finished last: bitwise reruns), runs the epilogue — SiLU is
    not linear, so it must follow the whole sum — and resets the counter for the next launch. Every
    scale is applied after the sum or per K step as without the split; the result differs from
    SPLIT_K = 1 only in the order of the fp32 additions, so batch invariance holds between calls
    whose configs share split_k.

Recompilation: the per-call sizes (``num_pairs``, ``num_rows``, ``num_tokens``, ``num_amax``,
``zero_count``) are ``do_not_specialize``; N, K, E are model constants (inputs are contiguous).
64-bit offsets: the pair ids and the expert id are widened to int64 where they scale a row or an
expert's base, so W's expert base and the row offsets of the GEMMs and the combine may pass
2³¹ − 1 elements; offsets inside one expert, the weight-scale indexes and the quantize kernels'
rows stay int32 (``moe_spec.validate`` bounds them). The amax, quantize and combine kernels are in
:mod:`triton_moe.kernels_rows`.
"""

from __future__ import annotations

import triton
import triton.language as tl

import moe_spec.quant
import moe_spec.validate
from moe_spec.quant import FORMATS, get_format

#: The ``QUANT`` constexpr of each contract format: its mode number in the registry.
QUANT_MODE = {name: fmt.mode for name, fmt in FORMATS.items()}
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


def fp8_imprecise_acc(block_k: int, quant) -> int:
    """The ``FP8_IMPRECISE_ACC`` of a GEMM whose K steps are ``block_k`` deep under ``quant`` (the
    module docstring, "FP8 accumulation"): 128 for an FP8 step deeper than 128, else 0."""
    return moe_spec.quant.FP8_BLOCK if get_format(quant).quantized and block_k > moe_spec.quant.FP8_BLOCK else 0


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
):
    """One K step of a grouped GEMM on its loaded tiles — A, the weight (GEMM1: gate) tile ``w`` and,
    under ``FUSE_SILU``, the up tile ``w_up`` — into (acc, acc_up, scale_bad). fp8_block loads the
    step's scales, checks the weight's and scales the product; every other format adds the raw
    product. Both kernels' K loops call it, so on one tile they add the same products in one order."""
    if QUANT == PER_BLOCK:
        kg = k0 // FP8_BLOCK
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
    acc, a_scale_ptr, a_row, row_ok, w_scale_ptr, expert, w_cols, col_ok, N_TOTAL, QUANT: tl.constexpr
):
    """Per-tensor / per-channel FP8: both scales once, after the K loop → (acc, a weight scale bad)."""
    bad = 0
    if QUANT == PER_TENSOR:
        s_a = tl.load(a_scale_ptr)
        s_w = tl.load(w_scale_ptr + expert)
        acc = acc * (s_a * s_w)
        bad = _scale_bad(s_w)
    elif QUANT == PER_CHANNEL:
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
):
    """The epilogue of both grouped GEMMs on an (unswapped) [BLOCK_M, BLOCK_N] tile: dequantize,
    SiLU(gate)·up and the intermediate's amax (GEMM1), routing weight (GEMM2), error bits, store.
    ``id_ok`` and ``rw`` were loaded before the K loop (``EARLY_ROUTING``) or are loaded here (:func:`_row_routing`)."""
    acc, bad = _dequant_after_loop(acc, a_scale_ptr, a_row, row_ok, w_scale_ptr, expert, offs_n, col_ok, N_TOTAL, QUANT)
    if QUANT == PER_BLOCK:
        bad = tl.max(scale_bad, axis=0)
    # a pair whose id is outside [0, E) was aligned with it clamped (triton_moe.align): GEMM1 zeroes
    # its intermediate, GEMM2 multiplies it by NaN instead of its routing weight (moe_spec.contract)
    if not EARLY_ROUTING:
        id_ok, rw = _row_routing(pair, row_ok, topk_ids_ptr, topk_weights_ptr, E, MUL_ROUTED_WEIGHT, True, BLOCK_M)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if FUSE_SILU:
        up, bad_up = _dequant_after_loop(
            acc_up, a_scale_ptr, a_row, row_ok, w_scale_ptr, expert, N + offs_n, col_ok, N_TOTAL, QUANT
        )
        bad = bad | bad_up
        acc = acc / (1.0 + tl.exp(-acc)) * up  # SiLU(gate)·up in fp32
        acc = tl.where(out_mask & id_ok[:, None], acc, 0.0)
        # the intermediate's amax, as int32 bits (NaN kept, see _abs_bits), per tensor / row / group
        if QUANT == PER_TENSOR and out_amax_ptr is not None:  # None: a static scale follows
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
    if MUL_ROUTED_WEIGHT:
        bits |= tl.where(tl.max((row_ok & ~(tl.abs(rw) < float("inf"))).to(tl.int32), axis=0) > 0, BAD_WEIGHT, 0)
        acc = acc * tl.where(id_ok | ~row_ok, rw, float("nan"))[:, None]
    tl.atomic_or(error_ptr, bits, mask=bits != 0)
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, _cast_out(acc, out_ptr.dtype.element_ty, INTERPRETER), mask=out_mask)


@triton.jit
def _split_k_sum(
    acc,
    acc_up,
    partial_ptr,
    count_ptr,
    tile,
    FUSE_SILU: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Split-K's exchange: store this program's partial tile(s), count the programs of ``tile`` that
    are done; the last one gets (Σ_s partial_s in the order s = 0, 1, …, the same, True) and resets
    the count for the next launch, the others (their partials, the same, False)."""
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    cells = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    first = partial_ptr + tile.to(tl.int64) * (SPLIT_K * 2 * TILE) + cells  # partial s: gate at 2s, up at 2s+1
    mine = first + tl.program_id(1) * (2 * TILE)
    tl.store(mine, acc)
    if FUSE_SILU:
        tl.store(mine + TILE, acc_up)
    tl.debug_barrier()  # every thread's stores precede the count's release
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    mask = (cells >= 0) & last
    # in L2 (.cg): the partials were written by other SMs during this launch
    acc = tl.load(first, mask=mask, other=0.0, cache_modifier=".cg")
    if FUSE_SILU:
        acc_up = tl.load(first + TILE, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(first + s * 2 * TILE, mask=mask, other=0.0, cache_modifier=".cg")
        if FUSE_SILU:
            acc_up += tl.load(first + s * 2 * TILE + TILE, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(count_ptr + tile, 0, mask=last)
    return acc, acc_up, last


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,  # A rows [rows, K]: bf16, or E4M3 with its scales (FP8)
    w_ptr,
    w_scale_ptr,  # expert weights [E, N_TOTAL, K] and their scales (FP8)
    out_ptr,
    out_amax_ptr,  # output rows by pair [P, N]; amax of the output (GEMM1 under FP8)
    topk_weights_ptr,
    topk_ids_ptr,  # [P] routing weights (GEMM2) and ids (both: checked, see below)
    sorted_ids_ptr,
    expert_of_block_ptr,
    num_padded_ptr,  # the Alignment (moe_spec.align)
    error_ptr,  # the device's error word (moe_spec.validate): bad scales, routing weights
    partial_ptr,
    count_ptr,  # split-K: fp32 partial tiles, a zeroed int32 count per tile (SPLIT_K > 1)
    num_pairs,  # P = T·top_k: varies per call
    N,
    K,
    E,  # output columns (I for GEMM1, hidden for GEMM2), reduction length, experts
    A_ROW_DIV: tl.constexpr,  # A row of pair p is p // A_ROW_DIV (top_k in GEMM1, 1 in GEMM2)
    FUSE_SILU: tl.constexpr,  # GEMM1: gate and up accumulators, SiLU(gate)·up epilogue
    MUL_ROUTED_WEIGHT: tl.constexpr,  # GEMM2: multiply by the routing weight before the down-cast
    QUANT: tl.constexpr,
    FP8_IMPRECISE_ACC: tl.constexpr,  # FP8 promotion (fp8_imprecise_acc): 0 = fp32 add per K step, n = every n of K
    SWAP_AB: tl.constexpr,
    INTERPRETER: tl.constexpr,  # True only under TRITON_INTERPRET=1 (see the module docstring)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,  # programs along grid axis 1, each summing its share of the K steps
    EARLY_ROUTING: tl.constexpr = False,  # GEMM2 of few K steps: the rows' ids and weights before the loop
):
    # ---- which tile: grouped ordering (GROUP_M M-blocks sweep the N tiles together, for L2) ----
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the padded total: the grid was sized for the worst case

    # ---- rows (sorted pairs of one expert), columns, this program's K steps ----
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    id_ok, rw = _row_routing(pair, row_ok, topk_ids_ptr, topk_weights_ptr, E, MUL_ROUTED_WEIGHT, EARLY_ROUTING, BLOCK_M)
    a_row = pair // A_ROW_DIV
    expert = tl.load(expert_of_block_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    N_TOTAL = 2 * N if FUSE_SILU else N  # W1 rows: gate 0…I−1, up I…2I−1
    K_GROUPS = tl.cdiv(K, FP8_BLOCK)
    N_GROUPS = tl.cdiv(N_TOTAL, FP8_BLOCK)
    k_begin = 0
    k_end = K
    if SPLIT_K > 1:  # program s of the tile: K steps [s·span, (s+1)·span), span a multiple of BLOCK_K
        span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_begin = tl.program_id(1) * span
        k_end = tl.minimum(K, k_begin + span)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None].to(tl.int64) * K + (k_begin + offs_k)[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * N_TOTAL * K + offs_n[:, None] * K + (k_begin + offs_k)[None, :]

    acc = _acc_tile(SWAP_AB, BLOCK_M, BLOCK_N)
    acc_up = _acc_tile(SWAP_AB, BLOCK_M, BLOCK_N)  # GEMM1 only; folded away otherwise
    scale_bad = tl.zeros([BLOCK_N], dtype=tl.int32)  # fp8_block: any bad weight scale of the loop
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w_up = w  # GEMM2: no up tile
        if FUSE_SILU:
            w_up = tl.load(w_ptrs + N * K, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc, acc_up, scale_bad = _k_step(
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
            FUSE_SILU,
            QUANT,
            SWAP_AB,
            INTERPRETER,
            FP8_IMPRECISE_ACC,
        )
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = _unswap(acc, SWAP_AB)
    acc_up = _unswap(acc_up, SWAP_AB)

    if SPLIT_K > 1:  # the tile's last program to finish sums the partials and runs the epilogue
        if QUANT == PER_BLOCK:  # the bad weight scales of this program's K steps
            tl.atomic_or(error_ptr, BAD_W1_SCALE if FUSE_SILU else BAD_W2_SCALE, mask=tl.max(scale_bad, axis=0) > 0)
        acc, acc_up, last = _split_k_sum(
            acc, acc_up, partial_ptr, count_ptr, pid_m * num_pid_n + pid_n, FUSE_SILU, SPLIT_K, BLOCK_M, BLOCK_N
        )
        if not last:
            return
    _epilogue(
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
        FUSE_SILU,
        MUL_ROUTED_WEIGHT,
        QUANT,
        INTERPRETER,
        BLOCK_M,
        BLOCK_N,
        EARLY_ROUTING,
    )

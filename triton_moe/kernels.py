"""The grouped GEMM of the MoE layer (launched twice: GEMM1 and GEMM2) and the helpers all its kernels share.

The layer, for P = T·top_k (token, slot) pairs sorted by expert (:mod:`triton_moe.align`)::

    GEMM1   h_p = x_t · W1[e]ᵀ              x [T, K], W1[e] = [gate rows; up rows] [2I, K]
            a_p = SiLU(h_p[:I]) · h_p[I:]   fused in GEMM1's epilogue → act [P, I] (or E4M3 aq, below)
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
    GEMM — so ``tl.dot`` gets them on Triton's async-copy → WGMMA path with nothing in between.
    x is quantized by :mod:`triton_moe.kernels_rows` — or, with ``QUANT_A``, by GEMM1 itself in its A
    load from bf16 x (:mod:`triton_moe.kernel_quant`: the same codes and scales), where
    :func:`triton_moe.plan.x_quant_in_gemm1` allows, a path the product leaves off (measured slower). The intermediate
    SiLU·up is quantized by GEMM1's epilogue itself where its scale is known in the tile (``QUANT_OUT``; THE rule is
    :func:`triton_moe.plan.epilogue_quant`): a static per-tensor scale (read, and checked into the
    error word), or — fp8_block with BLOCK_N a multiple of 128, so a tile holds whole 1×128 groups —
    each group's amax taken in registers (the tile reshaped to [BLOCK_M, BLOCK_N/128, 128]); it then
    stores the E4M3 codes (and the block scales, [P, ⌈I/128⌉]) with the same helpers, hence the same
    bits, as ``quantize_kernel`` (:func:`~triton_moe.kernel_parts._quantize_tile`). Otherwise (dynamic
    per-tensor or per-channel scales, which depend on other tiles; fp8_block with a narrower tile) the
    epilogue writes SiLU·up in fp32 and, under a dynamic scale, its amax per tensor / row / 1×128
    group (``tl.atomic_max``: order-independent, hence deterministic), which the intermediate's own
    ``quantize_kernel`` launch reads. Dequantization happens in registers, with the scales loaded
    next to the tiles:

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
from triton_moe.kernel_parts import (
    BAD_W1_SCALE,
    BAD_W2_SCALE,
    FP8_BLOCK,
    PER_BLOCK,
    _acc_tile,
    _epilogue,
    _k_step,
    _row_routing,
    _unswap,
)
from triton_moe.kernel_quant import _a_scale, _quantize_a

#: The ``QUANT`` constexpr of each contract format: its mode number in the registry.
QUANT_MODE = {name: fmt.mode for name, fmt in FORMATS.items()}


def fp8_imprecise_acc(block_k: int, quant) -> int:
    """The ``FP8_IMPRECISE_ACC`` of a GEMM whose K steps are ``block_k`` deep under ``quant`` (the
    module docstring, "FP8 accumulation"): 128 for an FP8 step deeper than 128, else 0."""
    return moe_spec.quant.FP8_BLOCK if get_format(quant).quantized and block_k > moe_spec.quant.FP8_BLOCK else 0


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,  # A rows [rows, K]: bf16, or E4M3 with its scales (FP8)
    w_ptr,
    w_scale_ptr,  # expert weights [E, N_TOTAL, K] and their scales (FP8)
    out_ptr,
    out_amax_ptr,  # output rows by pair [P, N]; amax of the output (GEMM1 under FP8), or its scale (QUANT_OUT)
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
    QUANT_OUT: tl.constexpr = False,  # GEMM1 stores the intermediate as E4M3 (triton_moe.plan.epilogue_quant)
    QUANT_A: tl.constexpr = False,  # GEMM1 reads bf16 x and quantizes it (triton_moe.plan.x_quant_in_gemm1)
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
    a_s = _a_scale(a_ptr, a_scale_ptr, a_row, row_ok, error_ptr, K, QUANT, QUANT_A, BLOCK_M, BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = offs_k < K - k0
        a_ok = row_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptrs, mask=a_ok, other=0.0)
        a, s_a = _quantize_a(a, a_ok, a_s, row_ok, QUANT, QUANT_A, INTERPRETER)  # QUANT_A: bf16 → E4M3
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
            s_a,
            QUANT_A,
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
        QUANT_OUT,
        a_s,
        QUANT_A,
    )


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

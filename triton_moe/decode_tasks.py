"""The pieces of the one-launch decode kernel (:mod:`triton_moe.decode`, whose docstring explains
them): the dependency protocol — wait, signal — the routing read in registers, the amaxes and
scales of rows in the task, and the tasks of its phases: GEMM1 (A), GEMM2 (B), the combine (C).
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_moe.kernel_parts import (
    BAD_A1_SCALE,
    BAD_A2_SCALE,
    BAD_ID,
    BAD_W1_SCALE,
    BAD_W2_SCALE,
    BAD_WEIGHT,
    FP8_BLOCK,
    PER_BLOCK,
    PER_CHANNEL,
    PER_TENSOR,
    REPEATED_ID,
    _abs_bits,
    _cast_out,
    _mma,
    _mma_scaled,
    _scale_bad,
    _scale_of,
)

#: Counter words before done1 / doneq2 / done2: ticket, exit, phase 0 / A done, amaxes, Q1 done.
TICKET, EXIT, DONE0, DONE_A, AMAX_X, AMAX_H, DONE_Q1 = (tl.constexpr(i) for i in range(7))
HEADER = tl.constexpr(8)
#: Columns one quantization task (phases Q1, Q2) converts: whole 1×128 groups.
QUANT_CHUNK = tl.constexpr(2048)


# ---- the dependency protocol -----------------------------------------------------------------


@triton.jit
def _wait(ptr, target):
    """Spin until the counter at ``ptr`` reaches ``target`` (acquire loads)."""
    seen = tl.atomic_add(ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _signal(ptr):
    """Count a finished task: every thread's stores, then one release increment."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release")


@triton.jit
def _at(vec, lanes, i):
    """vec[i] as a scalar."""
    return tl.sum(tl.where(lanes == i, vec, 0), axis=0)


@triton.jit
def _any(mask):
    """Whether any element of a 2-D mask is set."""
    return tl.max(tl.max(mask.to(tl.int32), axis=1), axis=0) > 0


@triton.jit
def _chunk_rows(experts, lanes, e, c0, BLOCK_T: tl.constexpr):
    """Rows c0 … c0 + BLOCK_T − 1 of expert ``e``'s pairs, in pair order: (pair of each row, valid)."""
    match = experts == e
    rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
    want = c0 + tl.arange(0, BLOCK_T)
    sel = match[None, :] & (rank[None, :] == want[:, None])
    return tl.sum(tl.where(sel, lanes[None, :], 0), axis=1), tl.sum(sel.to(tl.int32), axis=1) > 0


@triton.jit
def _amax_bits(ptr, rows, row_ok, start, stop, row_len, BLOCK_T: tl.constexpr):
    """Per row, the amax bits of columns [start, stop) of rows ``rows`` of a [*, row_len] matrix
    (through L2: the matrix may have been written during this launch)."""
    cols = tl.arange(0, FP8_BLOCK)
    m = tl.zeros([BLOCK_T, FP8_BLOCK], dtype=tl.int32)
    for c0 in range(start, stop, FP8_BLOCK):
        c = c0 + cols
        v = tl.load(
            ptr + rows[:, None].to(tl.int64) * row_len + c[None, :],
            mask=row_ok[:, None] & (c < stop)[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m = tl.maximum(m, _abs_bits(v))
    return tl.max(m, axis=1)


@triton.jit
def _scale_from_bits(bits):
    return _scale_of(bits.to(tl.float32, bitcast=True))


# ---- the tasks ---------------------------------------------------------------------------------


@triton.jit
def _gemm1_out(acc, acc_up, pair, row_ok, id_ok, offs_n, col_ok, h_ptr, counters_ptr, I, AMAX, INTERPRETER):
    """GEMM1's epilogue on one chunk's dequantized gate and up tiles: h = SiLU(gate)·up → h."""
    out_mask = col_ok[:, None] & row_ok[None, :]
    h = acc / (1.0 + tl.exp(-acc)) * acc_up  # SiLU(gate)·up in fp32
    h = tl.where(out_mask & id_ok[None, :], h, 0.0)  # a bad id's pair: zero (moe_spec.contract)
    if AMAX:  # fp8_tensor with a dynamic scale: the intermediate's amax
        tl.atomic_max(counters_ptr + AMAX_H, tl.max(tl.max(_abs_bits(h), axis=1), axis=0))
    h_ptrs = h_ptr + pair[None, :].to(tl.int64) * I + offs_n[:, None]
    tl.store(h_ptrs, _cast_out(h, h_ptr.dtype.element_ty, INTERPRETER), mask=out_mask)


@triton.jit
def _gemm1_task(
    x_ptr,
    xs_ptr,
    w1_ptr,
    w1_scale_ptr,
    topk_ids_ptr,
    h_ptr,
    part_ptr,
    arrive_ptr,
    counters_ptr,
    error_ptr,
    experts,
    lanes,
    e,
    n_tile,
    part,
    P,
    s_tensor,
    K,
    I,
    E,
    TOP_K: tl.constexpr,
    QUANT: tl.constexpr,
    STATIC: tl.constexpr,
    FP8_IMPRECISE_ACC: tl.constexpr,
    INTERPRETER: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Phase A, a leader's task: h[pairs of expert e, n-tile] = SiLU(x·W1_gateᵀ)·(x·W1_upᵀ); ``x``
    bf16, or under FP8 E4M3 with its scales (``xs``) from phase Q1. SPLIT = 2·s: part ``part`` only,
    the gate (even) or up (odd) rows over K slice part // 2 of s, dequantized → fp32 ``part_ptr``
    [part]; the tile's last part to arrive (``arrive_ptr``) sums the slices in order and writes h."""
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    N_TOTAL = 2 * I  # W1 rows: gate 0 … I−1, up I … 2I−1
    K_GROUPS = tl.cdiv(K, FP8_BLOCK)
    N_GROUPS = tl.cdiv(N_TOTAL, FP8_BLOCK)
    AMAX: tl.constexpr = QUANT == PER_TENSOR and not STATIC
    w_ptrs = w1_ptr + e.to(tl.int64) * N_TOTAL * K + offs_n[:, None] * K + offs_k[None, :]
    k_lo, k_hi, w_rows = 0, K, offs_n  # all of K; the gate rows in acc (and the up rows in acc_up)
    if SPLIT > 1:  # slices of whole BLOCK_K steps; the last may be empty (its partial: zeros)
        KS = tl.cdiv(tl.cdiv(K, SPLIT // 2), BLOCK_K) * BLOCK_K
        k_lo, k_hi, w_rows = (part // 2) * KS, tl.minimum((part // 2 + 1) * KS, K), (part % 2) * I + offs_n
        w_ptrs += (part % 2) * I * K
    s_ptrs = w1_scale_ptr + (e * N_GROUPS + w_rows // FP8_BLOCK) * K_GROUPS  # fp8_block: the rows' groups
    s_up_ptrs = w1_scale_ptr + (e * N_GROUPS + (I + offs_n) // FP8_BLOCK) * K_GROUPS
    n_match = tl.sum((experts == e).to(tl.int32), axis=0)
    bad = tl.full([], 0, tl.int32)
    for c0 in range(0, n_match, BLOCK_T):
        pair, row_ok = _chunk_rows(experts, lanes, e, c0, BLOCK_T)
        tok = pair // TOP_K
        raw = tl.load(topk_ids_ptr + pair, mask=row_ok, other=0)
        id_ok = (raw >= 0) & (raw < E)
        s_rows = tl.zeros([BLOCK_T], dtype=tl.float32) + s_tensor  # x's scale per row (fp8_tensor, fp8_channel)
        if QUANT == PER_CHANNEL:
            s_rows = tl.load(xs_ptr + tok * K_GROUPS, mask=row_ok, other=1.0, cache_modifier=".cg")
        x_ptrs = x_ptr + tok[:, None].to(tl.int64) * K + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)  # SPLIT = 1 only
        scale_bad = tl.zeros([BLOCK_N], dtype=tl.int32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptrs + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if SPLIT == 1:
                w_up = tl.load(w_ptrs + I * K + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if QUANT == PER_BLOCK:
                kg = k0 // FP8_BLOCK
                s_a = tl.load(xs_ptr + tok * K_GROUPS + kg, mask=row_ok, other=1.0, cache_modifier=".cg")
                s_w = tl.load(s_ptrs + kg, mask=col_ok, other=1.0)
                scale_bad |= _scale_bad(s_w)
                acc = _mma_scaled(acc, a, w, s_a, s_w, True, INTERPRETER)
                if SPLIT == 1:
                    s_wu = tl.load(s_up_ptrs + kg, mask=col_ok, other=1.0)
                    scale_bad |= _scale_bad(s_wu)
                    acc_up = _mma_scaled(acc_up, a, w_up, s_a, s_wu, True, INTERPRETER)
            else:  # bf16, or E4M3 whose masked cells load as 0 (not 0 / s: a static scale of 0 gives no NaN)
                acc = _mma(acc, a, w, True, INTERPRETER, FP8_IMPRECISE_ACC)
                if SPLIT == 1:
                    acc_up = _mma(acc_up, a, w_up, True, INTERPRETER, FP8_IMPRECISE_ACC)
        if QUANT == PER_TENSOR:  # dequantize as the grouped epilogue does (kernel_parts._dequant_after_loop)
            s_w = tl.load(w1_scale_ptr + e)
            acc = acc * (s_rows * s_w)[None, :]
            acc_up = acc_up * (s_rows * s_w)[None, :]
            bad = tl.maximum(bad, _scale_bad(s_w))
        elif QUANT == PER_CHANNEL:
            s_w = tl.load(w1_scale_ptr + e * N_TOTAL + w_rows, mask=col_ok, other=0.0)
            s_wu = tl.load(w1_scale_ptr + e * N_TOTAL + I + offs_n, mask=col_ok, other=0.0)
            acc = acc * s_rows[None, :] * s_w[:, None]
            acc_up = acc_up * s_rows[None, :] * s_wu[:, None]
            bad = tl.maximum(bad, tl.max(tl.where(col_ok, _scale_bad(s_w) | _scale_bad(s_wu), 0), axis=0))
        elif QUANT == PER_BLOCK:
            bad = tl.maximum(bad, tl.max(scale_bad, axis=0))
        if SPLIT == 1:
            _gemm1_out(acc, acc_up, pair, row_ok, id_ok, offs_n, col_ok, h_ptr, counters_ptr, I, AMAX, INTERPRETER)
        else:
            cells = part_ptr + part * P * I + pair[None, :].to(tl.int64) * I + offs_n[:, None]
            tl.store(cells, acc, mask=col_ok[:, None] & row_ok[None, :])
    if SPLIT > 1:  # arrive; the last part of the tile (p, n-tile) finishes it and resets its word
        tl.debug_barrier()
        if tl.atomic_add(arrive_ptr, 1, sem="acq_rel") == SPLIT - 1:
            for c0 in range(0, n_match, BLOCK_T):
                pair, row_ok = _chunk_rows(experts, lanes, e, c0, BLOCK_T)
                ids = tl.load(topk_ids_ptr + pair, mask=row_ok, other=0)
                mask = col_ok[:, None] & row_ok[None, :]
                cells = part_ptr + pair[None, :].to(tl.int64) * I + offs_n[:, None]
                acc = tl.load(cells, mask=mask, other=0.0, cache_modifier=".cg")  # gate, slice 0
                acc_up = tl.load(cells + P * I, mask=mask, other=0.0, cache_modifier=".cg")  # up, slice 0
                for s in tl.static_range(1, SPLIT // 2):  # slices 1 … s − 1, in order
                    acc += tl.load(cells + 2 * s * P * I, mask=mask, other=0.0, cache_modifier=".cg")
                    acc_up += tl.load(cells + (2 * s + 1) * P * I, mask=mask, other=0.0, cache_modifier=".cg")
                id_ok = (ids >= 0) & (ids < E)
                _gemm1_out(acc, acc_up, pair, row_ok, id_ok, offs_n, col_ok, h_ptr, counters_ptr, I, AMAX, INTERPRETER)
            tl.store(arrive_ptr, 0)
    tl.atomic_or(error_ptr, BAD_W1_SCALE, mask=bad > 0)


@triton.jit
def _gemm2_step(
    acc,
    scale_bad,
    w,
    k0,
    h_ptr,
    hs_ptr,
    pair,
    row_ok,
    w2_scale_ptr,
    e,
    offs_n,
    col_ok,
    K,
    I,
    QUANT: tl.constexpr,
    FP8_IMPRECISE_ACC: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One K step of GEMM2 on the loaded W2 tile ``w``: the rows' h (bf16, or E4M3 from phase Q2
    with its scales ``hs``)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(
        h_ptr + pair[:, None].to(tl.int64) * I + offs_k[None, :],
        mask=row_ok[:, None] & (offs_k < I)[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    if QUANT == PER_BLOCK:
        s_a = tl.load(
            hs_ptr + pair * tl.cdiv(I, FP8_BLOCK) + k0 // FP8_BLOCK, mask=row_ok, other=1.0, cache_modifier=".cg"
        )
        s_w = tl.load(
            w2_scale_ptr + (e * tl.cdiv(K, FP8_BLOCK) + offs_n // FP8_BLOCK) * tl.cdiv(I, FP8_BLOCK) + k0 // FP8_BLOCK,
            mask=col_ok,
            other=1.0,
        )
        scale_bad |= _scale_bad(s_w)
        acc = _mma_scaled(acc, a, w, s_a, s_w, True, INTERPRETER)
    else:
        acc = _mma(acc, a, w, True, INTERPRETER, FP8_IMPRECISE_ACC)
    return acc, scale_bad


@triton.jit
def _gemm2_task(
    w2_ptr,
    w2_scale_ptr,
    a2_scale_ptr,
    topk_weights_ptr,
    topk_ids_ptr,
    h_ptr,
    hs_ptr,
    y_ptr,
    counters_ptr,
    error_ptr,
    experts,
    lanes,
    p,
    e,
    k_tile,
    wait_ptr,
    wait_for,
    K,
    I,
    E,
    QUANT: tl.constexpr,
    STATIC: tl.constexpr,
    FP8_IMPRECISE_ACC: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Phase B, a leader's task: y[pairs of expert e, k-tile] = w_p · (h_p · W2[e, k-tile, :]ᵀ); h is
    bf16, or under FP8 E4M3 with its scales (``hs``) from phase Q2."""
    offs_n = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < K
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w2_ptr + e.to(tl.int64) * K * I + offs_n[:, None] * I + offs_k[None, :]
    # W2 does not depend on GEMM1: its first tile is on its way while this task waits
    w_first = tl.load(w_ptrs, mask=col_ok[:, None] & (offs_k < I)[None, :], other=0.0)
    _wait(wait_ptr, wait_for)
    s_tensor = 1.0
    if QUANT == PER_TENSOR:
        if STATIC:
            s_tensor = tl.load(a2_scale_ptr)
        else:
            s_tensor = _scale_from_bits(tl.load(counters_ptr + AMAX_H, cache_modifier=".cg"))
    n_match = tl.sum((experts == e).to(tl.int32), axis=0)
    bad = tl.full([], 0, tl.int32)
    for c0 in range(0, n_match, BLOCK_T):
        pair, row_ok = _chunk_rows(experts, lanes, e, c0, BLOCK_T)
        raw = tl.load(topk_ids_ptr + pair, mask=row_ok, other=0)
        id_ok = (raw >= 0) & (raw < E)
        rw = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
        s_rows = tl.zeros([BLOCK_T], dtype=tl.float32) + s_tensor
        if QUANT == PER_CHANNEL:
            s_rows = tl.load(hs_ptr + pair * tl.cdiv(I, FP8_BLOCK), mask=row_ok, other=1.0, cache_modifier=".cg")
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        scale_bad = tl.zeros([BLOCK_N], dtype=tl.int32)
        acc, scale_bad = _gemm2_step(
            acc,
            scale_bad,
            w_first,
            0,
            h_ptr,
            hs_ptr,
            pair,
            row_ok,
            w2_scale_ptr,
            e,
            offs_n,
            col_ok,
            K,
            I,
            QUANT,
            FP8_IMPRECISE_ACC,
            INTERPRETER,
            BLOCK_K,
        )
        for k0 in range(BLOCK_K, I, BLOCK_K):
            w = tl.load(w_ptrs + k0, mask=col_ok[:, None] & (offs_k < I - k0)[None, :], other=0.0)
            acc, scale_bad = _gemm2_step(
                acc,
                scale_bad,
                w,
                k0,
                h_ptr,
                hs_ptr,
                pair,
                row_ok,
                w2_scale_ptr,
                e,
                offs_n,
                col_ok,
                K,
                I,
                QUANT,
                FP8_IMPRECISE_ACC,
                INTERPRETER,
                BLOCK_K,
            )
        if QUANT == PER_TENSOR:
            s_w = tl.load(w2_scale_ptr + e)
            acc = acc * (s_rows * s_w)[None, :]
            bad = tl.maximum(bad, _scale_bad(s_w))
        elif QUANT == PER_CHANNEL:
            s_w = tl.load(w2_scale_ptr + e * K + offs_n, mask=col_ok, other=0.0)
            acc = acc * s_rows[None, :] * s_w[:, None]
            bad = tl.maximum(bad, tl.max(tl.where(col_ok, _scale_bad(s_w), 0), axis=0))
        elif QUANT == PER_BLOCK:
            bad = tl.maximum(bad, tl.max(scale_bad, axis=0))
        # a pair whose id is outside [0, E): NaN instead of its routing weight (moe_spec.contract)
        acc = acc * tl.where(id_ok | ~row_ok, rw, float("nan"))[None, :]
        y_ptrs = y_ptr + pair[None, :].to(tl.int64) * K + offs_n[:, None]
        tl.store(y_ptrs, _cast_out(acc, y_ptr.dtype.element_ty, INTERPRETER), mask=col_ok[:, None] & row_ok[None, :])
    tl.atomic_or(error_ptr, BAD_W2_SCALE, mask=bad > 0)


@triton.jit
def _combine_task(
    y_ptr,
    out_ptr,
    topk_weights_ptr,
    topk_ids_ptr,
    a1_scale_ptr,
    a2_scale_ptr,
    error_ptr,
    t_block,
    k_tile,
    num_tokens,
    K,
    E,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    STATIC: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Phase C: out[t, k-tile] = Σ_j y[t·TOP_K + j, k-tile] in fp32, j ascending, rounded once; the
    first k-tile also checks its tokens' routing (the alignment's and GEMM2's bits)."""
    toks = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens
    cols = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = tok_ok[:, None] & (cols < K)[None, :]
    total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        y_ptrs = y_ptr + (toks * TOP_K + j)[:, None].to(tl.int64) * K + cols[None, :]
        total += tl.load(y_ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    out_ptrs = out_ptr + toks[:, None].to(tl.int64) * K + cols[None, :]
    tl.store(out_ptrs, _cast_out(total, out_ptr.dtype.element_ty, INTERPRETER), mask=mask)
    if k_tile == 0:
        slots = tl.arange(0, SLOTS)
        ok = tok_ok[:, None] & (slots < TOP_K)[None, :]
        pair = toks[:, None] * TOP_K + slots[None, :]
        ids = tl.load(topk_ids_ptr + pair, mask=ok, other=0)
        in_range = (ids >= 0) & (ids < E)
        repeated = tl.zeros([BLOCK_T, SLOTS], dtype=tl.int1)
        for back in tl.static_range(1, TOP_K):  # the same id in an earlier slot of the row
            earlier = tl.load(topk_ids_ptr + pair - back, mask=ok & (slots >= back)[None, :], other=-1)
            repeated |= (slots >= back)[None, :] & (earlier == ids)
        rw = tl.load(topk_weights_ptr + pair, mask=ok, other=0.0)
        bits = tl.where(_any(ok & ~in_range), BAD_ID, 0)
        bits |= tl.where(_any(ok & in_range & repeated), REPEATED_ID, 0)
        bits |= tl.where(_any(ok & ~(tl.abs(rw) < float("inf"))), BAD_WEIGHT, 0)
        if STATIC and t_block == 0:
            bits |= tl.where(_scale_bad(tl.load(a1_scale_ptr)) > 0, BAD_A1_SCALE, 0)
            bits |= tl.where(_scale_bad(tl.load(a2_scale_ptr)) > 0, BAD_A2_SCALE, 0)
        tl.atomic_or(error_ptr, bits, mask=bits != 0)

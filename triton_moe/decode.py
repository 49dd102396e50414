"""The decode path: the whole MoE layer in ONE persistent launch, for a handful of tokens.

At decode (T·top_k pairs up to :data:`DECODE_MAX_PAIRS`) the layer only streams the weights of the
experts it hits; the grouped pipeline (:mod:`triton_moe.moe`) spends four to eight launches on it,
each with its ramp and tail. ``decode_moe_kernel`` runs every step as a *task* of one launch. P =
T·top_k (token, slot) pairs, routing read in the kernel (no sort): the **leader** of an expert is
its lowest pair index, and a leader's task serves every pair of its expert (found by comparing
``topk_ids`` with the expert in registers, in chunks of BLOCK_T pairs); other pairs' tasks only
count. Tasks, numbered in phases::

    0   x's amax, per token block            fp8_tensor with a dynamic scale only (atomic_max)
    Q1  (token, 2048 columns of K)           FP8: x → E4M3 xq [T, K] and its scales, once
    A   (pair p, n-tile of I, part)          gate and up tiles, SiLU(gate)·up → h [P, I]; with
                                             SPLIT = 2·s parts, gate or up over one of s K slices
                                             → fp32 partials, the last part to arrive sums them
    Q2  (pair p, 2048 columns of I)          FP8: h → E4M3 hq [P, I] and its scales, once
    B   (k-tile of K, pair p)                h rows of the expert's pairs · W2[e, k-tile, :]ᵀ,
                                             × routing weight → y [P, K]
    C   (k-tile, token block)                out[t] = Σ_j y[t·top_k + j], j = 0 … top_k − 1

Every MMA is in swap-AB form, ``tl.dot(W_tile, Xᵀ)``: BLOCK_N weight rows on the M side, the
expert's pairs (BLOCK_T) on the N side. h and y have the grouped pipeline's dtypes (h bf16, or
fp32 under FP8; y bf16) and every value is computed with the grouped kernels' arithmetic
(:mod:`triton_moe.kernel_parts`, :mod:`triton_moe.kernels_rows`), so a token's row is the bits
the grouped pipeline gives wherever that pipeline is batch invariant.

The dependency protocol (device counters, no grid barrier)
    A program claims the next task number from a ticket counter (``tl.atomic_add``), so tasks are
    claimed in increasing order, each by a program that is running. A task waits only on tasks
    with smaller numbers: B (leader p) spins until ``done1[p]`` counts p's NT1·SPLIT A tasks (bf16) or
    ``doneq2[p]`` its expert's Q2 tasks (FP8), C (k-tile) until ``done2[k-tile]`` counts P B tasks;
    under FP8, Q1 (fp8_tensor dynamic) waits for phase 0, A for all of Q1, Q2 for its leader's A
    tasks (fp8_tensor dynamic: every A task, the intermediate's amax being whole). A finished task's
    program stores, ``tl.debug_barrier()``, then increments its counter with release semantics; a
    waiting one spins on acquire loads and reads h / y through L2 (``.cg``). GEMM2's first W2 tile
    does not depend on GEMM1: it is loaded before the spin. The parts of an A tile (SPLIT > 1) never
    wait: each stores its partial, then counts itself in the tile's arrival word (acq_rel); the one
    that sees SPLIT − 1 reads the partials through L2, writes h, and zeroes the word for the next
    launch. Phases B and C tile K by ``BLOCK_N2`` rows (NK k-tiles).

Why it cannot deadlock, and how the counters reset themselves (the last program out zeroes them;
one int32 block per device and stream, :func:`counter_block`): notes/decode.md.

FP8 (``QUANT``; the scales as :mod:`moe_spec.quant` and the grouped pipeline compute them)
    x and h are quantized ONCE, by the Q1 / Q2 tasks, into E4M3 workspaces, and the K loops stream
    E4M3 × E4M3 tiles as the grouped kernels do (a conversion per K step in every A and B task made
    FP8 several times slower than bf16: notes/decode.md). Scales per token / pair row
    (fp8_channel), per 1×128 group (fp8_block), of all of x (phase 0) or h (``atomic_max`` in A's
    epilogue; Q2 then waits for all of A), or static. amaxes are integer maxima of the bits
    (:func:`~triton_moe.kernel_parts._abs_bits`: NaN kept, order-free). The error word's bits are
    set as the grouped kernels set them (notes/decode.md, "The data checks").

The interpreter runs programs one after another: program 0 claims every task in order and finds
every counter it waits on complete, so the CPU tests run this kernel as it is.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_spec.validate import error_word
from triton_moe.config import DecodeConfig
from triton_moe.decode_host import PAIR_LANES, decode_workspace, grid_size, num_tasks
from triton_moe.decode_tasks import (
    AMAX_H,
    AMAX_X,
    DONE0,
    DONE_A,
    DONE_Q1,
    EXIT,
    HEADER,
    QUANT_CHUNK,
    TICKET,
    _amax_bits,
    _at,
    _combine_task,
    _gemm1_task,
    _gemm2_task,
    _scale_from_bits,
    _signal,
    _wait,
)
from triton_moe.jit import INTERPRET, Bound
from triton_moe.kernel_parts import FP8_BLOCK, PER_BLOCK, PER_CHANNEL, PER_TENSOR, _abs_bits, _quantize
from triton_moe.kernels import QUANT_MODE, fp8_imprecise_acc


@triton.jit
def _quantize_task(
    src_ptr,
    dst_ptr,
    scale_ptr,
    row,
    chunk,
    row_len,
    s_tensor,
    QUANT: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """Phases Q1 and Q2: columns [chunk·QUANT_CHUNK, …) of one row of x or h → E4M3, with the scale
    ``s_tensor``, the row's (stored at scales[row, 0]) or each 1×128 group's (scales[row, g])."""
    GROUPS: tl.constexpr = QUANT_CHUNK // FP8_BLOCK
    n_groups = tl.cdiv(row_len, FP8_BLOCK)
    g = chunk * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * FP8_BLOCK + tl.arange(0, FP8_BLOCK)[None, :]
    ok = cols < row_len
    base = row.to(tl.int64) * row_len
    v = tl.load(src_ptr + base + cols, mask=ok, other=0.0, cache_modifier=".cg")
    s = tl.zeros([GROUPS, 1], dtype=tl.float32) + s_tensor
    if QUANT == PER_CHANNEL:
        one = tl.full([1], 0, tl.int32) + row
        s_row = tl.sum(_scale_from_bits(_amax_bits(src_ptr, one, one >= 0, 0, row_len, row_len, 1)), axis=0)
        s = tl.zeros([GROUPS, 1], dtype=tl.float32) + s_row
        tl.store(scale_ptr + row * n_groups, s_row, mask=chunk == 0)
    elif QUANT == PER_BLOCK:
        s_g = _scale_from_bits(tl.max(_abs_bits(v), axis=1))
        tl.store(scale_ptr + row * n_groups + g, s_g, mask=g < n_groups)
        s = s_g[:, None]
    q = _quantize(v, s, INTERPRETER)
    tl.store(dst_ptr + base + cols, q, mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def decode_moe_kernel(
    x_ptr,  # [T, K] bf16
    w1_ptr,
    w2_ptr,  # [E, 2I, K], [E, K, I]: bf16 or E4M3
    w1_scale_ptr,
    w2_scale_ptr,  # the weights' scales (FP8)
    a1_scale_ptr,
    a2_scale_ptr,  # static activation scales (fp8_tensor, STATIC)
    topk_weights_ptr,
    topk_ids_ptr,  # [T, TOP_K]
    h_ptr,  # [P, I] intermediate: bf16, fp32 under FP8
    xq_ptr,
    xs_ptr,  # FP8: x as E4M3 [T, K] and its scales [T, ⌈K/128⌉] (phase Q1)
    hq_ptr,
    hs_ptr,  # FP8: h as E4M3 [P, I] and its scales [P, ⌈I/128⌉] (phase Q2)
    y_ptr,  # [P, K] bf16: GEMM2 × routing weight, by pair
    part_ptr,  # SPLIT > 1: fp32 [SPLIT, P, I], GEMM1's dequantized partials (gate / up, K slice)
    arrive_ptr,  # SPLIT > 1: int32 [P, NT1], parts arrived per A tile, zero at entry and at exit
    out_ptr,  # [T, K] bf16
    counters_ptr,  # int32 [HEADER + 2·PAIR_LANES + ⌈K/BLOCK_N2⌉], zero at entry and at exit
    error_ptr,  # the device's error word (moe_spec.validate)
    num_tokens,  # T: varies per call
    K,
    I,
    E,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,  # TOP_K rounded up to a power of two
    QUANT: tl.constexpr,
    STATIC: tl.constexpr,  # fp8_tensor with static activation scales
    FP8_IMPRECISE_ACC: tl.constexpr,
    INTERPRETER: tl.constexpr,
    PAIRS: tl.constexpr,  # pair lanes (PAIR_LANES)
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,  # A tasks per (pair, n-tile): 1, or 2·s (gate / up × s slices of K)
    BLOCK_N2: tl.constexpr,  # W2 rows per B and C task
):
    P = num_tokens * TOP_K
    NT1 = tl.cdiv(I, BLOCK_N)
    NA = NT1 * SPLIT  # A tasks per pair
    NK = tl.cdiv(K, BLOCK_N2)
    NTB = tl.cdiv(num_tokens, BLOCK_T)
    DYNAMIC_TENSOR: tl.constexpr = QUANT == PER_TENSOR and not STATIC
    FP8: tl.constexpr = QUANT != 0
    NQ1 = tl.cdiv(K, QUANT_CHUNK)  # quantization tasks per row of x (FP8)
    NQ2 = tl.cdiv(I, QUANT_CHUNK)  # … per row of h
    Q10 = NTB if DYNAMIC_TENSOR else 0  # phase 0: x's amax per token block
    A0 = Q10 + num_tokens * NQ1 if FP8 else Q10  # phase Q1: x → E4M3 per (token, chunk)
    Q20 = A0 + P * NA
    B0 = Q20 + P * NQ2 if FP8 else Q20  # phase Q2: h → E4M3 per (pair, chunk)
    C0 = B0 + NK * P
    END = C0 + NK * NTB
    lanes = tl.arange(0, PAIRS)
    raw = tl.load(topk_ids_ptr + lanes, mask=lanes < P, other=0)
    experts = tl.where(lanes < P, tl.minimum(tl.maximum(raw, 0), E - 1).to(tl.int32), -1)  # bad ids clamped
    done1 = counters_ptr + HEADER
    doneq2 = done1 + PAIRS  # Q2 tasks done, counted at the leader of their pair's expert
    done2 = doneq2 + PAIRS

    task = tl.atomic_add(counters_ptr + TICKET, 1)
    while task < END:
        if task < Q10:  # phase 0
            rows = task * BLOCK_T + tl.arange(0, BLOCK_T)
            m = tl.max(_amax_bits(x_ptr, rows, rows < num_tokens, 0, K, K, BLOCK_T), axis=0)
            tl.atomic_max(counters_ptr + AMAX_X, m)
            _signal(counters_ptr + DONE0)
        elif task < A0:  # phase Q1: (token, chunk of K)
            s_x = 1.0
            if QUANT == PER_TENSOR:
                if STATIC:
                    s_x = tl.load(a1_scale_ptr)
                else:
                    _wait(counters_ptr + DONE0, NTB)
                    s_x = _scale_from_bits(tl.load(counters_ptr + AMAX_X, cache_modifier=".cg"))
            _quantize_task(x_ptr, xq_ptr, xs_ptr, (task - Q10) // NQ1, (task - Q10) % NQ1, K, s_x, QUANT, INTERPRETER)
            _signal(counters_ptr + DONE_Q1)
        elif task < Q20:  # phase A: (pair, n-tile, part)
            p = (task - A0) // NA
            e = _at(experts, lanes, p)
            if tl.sum(((experts == e) & (lanes < p)).to(tl.int32), axis=0) == 0:  # the leader
                s_x = 1.0
                if FP8:
                    _wait(counters_ptr + DONE_Q1, num_tokens * NQ1)
                if QUANT == PER_TENSOR:
                    if STATIC:
                        s_x = tl.load(a1_scale_ptr)
                    else:
                        s_x = _scale_from_bits(tl.load(counters_ptr + AMAX_X, cache_modifier=".cg"))
                _gemm1_task(
                    xq_ptr if FP8 else x_ptr,
                    xs_ptr,
                    w1_ptr,
                    w1_scale_ptr,
                    topk_ids_ptr,
                    h_ptr,
                    part_ptr,
                    arrive_ptr + (task - A0) // SPLIT,
                    counters_ptr,
                    error_ptr,
                    experts,
                    lanes,
                    e,
                    (task - A0) // SPLIT % NT1,
                    (task - A0) % SPLIT,
                    P,
                    s_x,
                    K,
                    I,
                    E,
                    TOP_K,
                    QUANT,
                    STATIC,
                    FP8_IMPRECISE_ACC,
                    INTERPRETER,
                    SPLIT,
                    BLOCK_T,
                    BLOCK_N,
                    BLOCK_K,
                )
            _signal(done1 + p)
            if DYNAMIC_TENSOR:
                tl.atomic_add(counters_ptr + DONE_A, 1, sem="release")
        elif task < B0:  # phase Q2: (pair, chunk of I)
            p = (task - Q20) // NQ2
            e = _at(experts, lanes, p)
            leader = tl.min(tl.where(experts == e, lanes, PAIRS), axis=0)
            s_h = 1.0
            if DYNAMIC_TENSOR:  # the intermediate's amax is whole once every A task is done
                _wait(counters_ptr + DONE_A, P * NA)
                s_h = _scale_from_bits(tl.load(counters_ptr + AMAX_H, cache_modifier=".cg"))
            else:  # the leader's A tasks wrote every row of its expert
                _wait(done1 + leader, NA)
                if QUANT == PER_TENSOR:
                    s_h = tl.load(a2_scale_ptr)
            _quantize_task(h_ptr, hq_ptr, hs_ptr, p, (task - Q20) % NQ2, I, s_h, QUANT, INTERPRETER)
            _signal(doneq2 + leader)
        elif task < C0:  # phase B: (k-tile, pair)
            k_tile = (task - B0) // P
            p = (task - B0) % P
            e = _at(experts, lanes, p)
            if tl.sum(((experts == e) & (lanes < p)).to(tl.int32), axis=0) == 0:
                wait_ptr = done1 + p
                wait_for = NA
                if FP8:  # h in E4M3: every Q2 task of the expert's rows
                    wait_ptr = doneq2 + p
                    wait_for = tl.sum((experts == e).to(tl.int32), axis=0) * NQ2
                _gemm2_task(
                    w2_ptr,
                    w2_scale_ptr,
                    a2_scale_ptr,
                    topk_weights_ptr,
                    topk_ids_ptr,
                    hq_ptr if FP8 else h_ptr,
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
                    QUANT,
                    STATIC,
                    FP8_IMPRECISE_ACC,
                    INTERPRETER,
                    BLOCK_T,
                    BLOCK_N2,
                    BLOCK_K,
                )
            _signal(done2 + k_tile)
        else:  # phase C: (k-tile, token block)
            k_tile = (task - C0) // NTB
            _wait(done2 + k_tile, P)
            _combine_task(
                y_ptr,
                out_ptr,
                topk_weights_ptr,
                topk_ids_ptr,
                a1_scale_ptr,
                a2_scale_ptr,
                error_ptr,
                (task - C0) % NTB,
                k_tile,
                num_tokens,
                K,
                E,
                TOP_K,
                SLOTS,
                STATIC,
                INTERPRETER,
                BLOCK_T,
                BLOCK_N2,
            )
        task = tl.atomic_add(counters_ptr + TICKET, 1)

    # the last program out resets every counter for the next launch (nobody waits any more)
    if tl.atomic_add(counters_ptr + EXIT, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        words = HEADER + 2 * PAIRS + NK
        z = tl.arange(0, 128)
        for z0 in range(0, words, 128):
            tl.store(counters_ptr + z0 + z, tl.zeros_like(z), mask=z0 + z < words)


# ---- the launch ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def decode_launch(T: int, top_k: int, K: int, I: int, quant, static: bool, cfg: DecodeConfig, grid: int) -> Bound:  # noqa: E741
    """The launch of one call's shape, grid and constexprs bound once (:class:`~triton_moe.jit.Bound`)."""
    return Bound(
        decode_moe_kernel,
        (grid,),
        TOP_K=top_k,
        SLOTS=1 << (top_k - 1).bit_length(),
        QUANT=QUANT_MODE[quant],
        STATIC=static,
        FP8_IMPRECISE_ACC=fp8_imprecise_acc(cfg.BLOCK_K, quant),
        INTERPRETER=INTERPRET,
        PAIRS=PAIR_LANES,
        BLOCK_T=cfg.BLOCK_T,
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        SPLIT=cfg.SPLIT,
        BLOCK_N2=cfg.block_n2,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def check_pairs(T: int, top_k: int) -> None:
    """The decode kernel holds at most PAIR_LANES pairs; a larger call is refused, naming config."""
    if T * top_k > PAIR_LANES:
        raise ValueError(
            f"config: the decode kernel serves at most {PAIR_LANES} (token, slot) pairs, got T·top_k = {T * top_k}; "
            "pass a triton_moe.TritonConfig (the grouped pipeline) or no config"
        )


def decode_fused_moe(
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
    config: DecodeConfig,
    workspace: dict | None = None,
) -> torch.Tensor:
    """The MoE layer in one launch → out [T, K] bf16. The arguments are ``fused_moe``'s, already
    validated (:func:`triton_moe.moe.fused_moe` checks them and dispatches here); ``config`` a
    checked :class:`~triton_moe.config.DecodeConfig`; ``workspace`` h, y and counters of
    :func:`decode_workspace` (default: this stream's; with ``SPLIT`` > 1 also GEMM1's partials and
    arrival counters)."""
    T, K = x.shape
    E, _, I = w2.shape
    top_k = topk_ids.shape[1]
    check_pairs(T, top_k)
    static = a1_scale is not None
    ws = workspace or decode_workspace(T, top_k, K, I, quant, x.device, config)
    out = torch.empty((T, K), dtype=torch.bfloat16, device=x.device)
    grid = grid_size(num_tasks(T, top_k, K, I, quant, static, config), quant, config, x.device)
    launch = decode_launch(T, top_k, K, I, quant, static, config, grid)
    dummy = out  # stands in for the pointers a format does not read
    launch(
        x,
        w1,
        w2,
        w1_scale if w1_scale is not None else dummy,
        w2_scale if w2_scale is not None else dummy,
        a1_scale if static else dummy,
        a2_scale if static else dummy,
        topk_weights,
        topk_ids,
        ws["h"],
        ws.get("xq", dummy),
        ws.get("xs", dummy),
        ws.get("hq", dummy),
        ws.get("hs", dummy),
        ws["y"],
        ws["part"] if config.SPLIT > 1 else dummy,
        ws["arrive"] if config.SPLIT > 1 else dummy,
        out,
        ws["counters"],
        error_word(x.device),
        T,
        K,
        I,
        E,
    )
    return out

"""The persistent grouped GEMM with TMA tensor descriptors for the expert weights (prefill path).

``moe_gemm_tma_kernel`` computes exactly what :func:`triton_moe.kernels.moe_gemm_kernel` computes
without swap-AB — GEMM1 with SiLU(gate)·up, GEMM2 with the routing weight, the three FP8 formats,
the error-word bits, the NaN rules, the id masking — with two differences in how it gets there:

Persistent schedule
    The grid is one program per SM (:func:`moe_spec.hopper.sm_count`). Program p visits tiles
    p, p + grid, p + 2·grid, … of the grouped order (GROUP_M M-blocks sweep the N tiles together,
    as in ``moe_gemm_kernel``) over the ``cdiv(num_padded, BLOCK_M)`` M-blocks that hold pairs
    (the padded total the alignment wrote on the device; ``moe_gemm_kernel`` groups over the
    worst-case count and skips the programs past it, so only its last group's order differs):
    tiles past it are never visited, nothing is read back on the host, and the launch is CUDA-graph
    capturable (the grid is min(SMs, the call's worst-case tile count), both known on the host).

Weights through TMA
    W [E, N_TOTAL, K] is viewed as one 2-D tensor [E·N_TOTAL, K] and read through a device-side
    tensor descriptor (``tl.make_tensor_descriptor``, block [BLOCK_N, BLOCK_K]); the expert's
    tile starts at row e·N_TOTAL + n. TMA zero-fills past K and past the last row. When N is not
    a multiple of BLOCK_N the last N tile also reads rows of the next block of W (the up rows, or
    the next expert's): those accumulator columns are outside [0, N), and every store, amax,
    scale check and error bit of the epilogue is masked by ``col_ok``, as in ``moe_gemm_kernel``
    (whose masked loads give zeros there instead). The A rows stay gathered by ``sorted_ids``
    with pointer loads (Hopper's TMA has no row gather); their offsets are 64-bit.

    A device-side descriptor lives in a global scratch buffer Triton asks its allocator for at
    launch; :func:`ensure_allocator` installs a torch-backed one when none is set (inside a CUDA
    graph capture the buffer then comes from the graph's pool and stays valid for its replays).
    TMA needs the row stride in bytes (K · element size) to be a multiple of 16 and a 16-byte
    aligned base; :func:`check_tma_operand` says so before the launch.

Warp specialization and loop flattening (Triton 3.6 on sm_90)
    Triton 3.6 runs its Hopper warp-specialization pass on a ``tl.range(..., warp_specialize=True)``
    loop only with num_warps = 4, and (compiled for sm_90a on the CPU with
    ``triton_moe.sm90.compile_sm90``) it specializes a persistent matmul whose operands both come
    through TMA descriptors, but fails to compile one whose A tile is a pointer gather, as here
    (``NVGPUWarpSpecialization`` pass failure; the same with the attribute on the K loop).
    ``tests/test_triton_tma.py`` checks both. So this kernel offers no warp specialization: with
    Hopper's TMA lacking a row gather, A would first have to be stored in expert order.
    ``tl.range(..., flatten=True)`` does compile on sm_90 (the nested-loop fusion pass runs there):
    the tile loop and the K loop become one software pipeline, so the next tile's loads may start
    under this tile's epilogue, at a cost in shared memory and registers (``FLATTEN``; the
    config's ``tma_flatten``). Whether it pays is what ``python -m triton_moe.lab.bench_tma --flatten``
    measures.

The K step and the epilogue are ``moe_gemm_kernel``'s functions (:mod:`triton_moe.kernels`
``_k_step``, ``_epilogue``), so on the same tile the two kernels add the same products in the same
order and finish it alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from moe_spec.hopper import TMA_ALIGN_BYTES as TMA_ALIGN
from moe_spec.hopper import sm_count
from triton_moe.jit import launch
from triton_moe.kernel_parts import FP8_BLOCK, _epilogue, _k_step, _row_routing
from triton_moe.kernel_quant import _a_scale, _quantize_a


def _torch_scratch(size: int, alignment: int, stream):
    """Triton's launch-time scratch (here: the device-side tensor descriptors), from torch's
    caching allocator on the current device — inside a CUDA graph capture, from the graph's pool."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton an allocator for device-side descriptors when none is set in this context.

    ``triton.set_allocator`` stores the allocator in a context variable (one per thread); an
    allocator someone else set is kept. Cheap enough to call before every launch.
    """
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def check_tma_operand(name: str, w: torch.Tensor) -> None:
    """Raise ValueError naming ``name`` when the weight tensor cannot be read through TMA."""
    row_bytes = w.shape[-1] * w.element_size()
    if row_bytes % TMA_ALIGN:
        raise ValueError(
            f"{name}: persistent_tma reads the weights through TMA, which needs rows of a multiple of "
            f"{TMA_ALIGN} bytes; got {w.shape[-1]} × {w.element_size()} = {row_bytes} bytes "
            f"(use persistent_tma=False for this shape)"
        )
    if w.data_ptr() % TMA_ALIGN:
        raise ValueError(f"{name}: persistent_tma needs a {TMA_ALIGN}-byte aligned weight tensor (TMA base address)")


def gemm_tma(
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
    constants: dict,
    *,
    flatten: bool,
    static: bool = False,
):
    """Launch ``moe_gemm_tma_kernel`` for one GEMM (the arguments of ``triton_moe.moe._gemm``;
    ``constants``: its constexprs for ``moe_gemm_kernel``, whose ``SWAP_AB`` must be False).

    Grid: one program per SM, or fewer when the worst case of this call (the alignment's blocks
    × N tiles, known on the host) has fewer tiles. Raises ValueError naming the weight before
    the launch when TMA cannot read it (:func:`check_tma_operand`)."""
    if constants["SWAP_AB"]:
        raise ValueError("config: persistent_tma is the non-swap-AB path; this config resolves to swap_ab=True")
    if constants["SPLIT_K"] != 1:
        raise ValueError("config: persistent_tma does not split K; this config has split_k > 1")
    check_tma_operand("w1" if constants["FUSE_SILU"] else "w2", w)
    ensure_allocator()
    tiles = routing.expert_of_block.numel() * triton.cdiv(N, constants["BLOCK_N"])
    grid = (min(sm_count(a.device), tiles),)
    dummy = out  # stands in for pointers a mode does not read
    launch(
        moe_gemm_tma_kernel,
        grid,
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
        routing.num_pairs,
        N,
        K,
        w.shape[0],
        **{k: v for k, v in constants.items() if k not in ("SWAP_AB", "SPLIT_K")},
        FLATTEN=flatten,
    )


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gemm_tma_kernel(
    a_ptr,
    a_scale_ptr,  # A rows [rows, K]: bf16, or E4M3 with its scales (FP8)
    w_ptr,
    w_scale_ptr,  # expert weights [E, N_TOTAL, K] (read as [E·N_TOTAL, K] through TMA), scales
    out_ptr,
    out_amax_ptr,  # output rows by pair [P, N]; amax of the output (GEMM1 under FP8)
    topk_weights_ptr,
    topk_ids_ptr,  # [P] routing weights (GEMM2) and ids
    sorted_ids_ptr,
    expert_of_block_ptr,
    num_padded_ptr,  # the Alignment (moe_spec.align)
    error_ptr,  # the device's error word (moe_spec.validate)
    num_pairs,  # P = T·top_k: varies per call
    N,
    K,
    E,  # output columns, reduction length, experts
    A_ROW_DIV: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_IMPRECISE_ACC: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,  # tl.range(..., flatten=True): one software pipeline across tiles
    EARLY_ROUTING: tl.constexpr = False,  # GEMM2 of few K steps: the rows' ids and weights before the loop
    QUANT_OUT: tl.constexpr = False,  # GEMM1 stores the intermediate as E4M3 (triton_moe.plan.epilogue_quant)
    QUANT_A: tl.constexpr = False,  # GEMM1 reads bf16 x and quantizes it (triton_moe.plan.x_quant_in_gemm1)
):
    if FUSE_SILU:
        N_TOTAL = 2 * N  # W1 rows: gate 0…I−1, up I…2I−1
    else:
        N_TOTAL = N
    K_GROUPS = tl.cdiv(K, FP8_BLOCK)
    N_GROUPS = tl.cdiv(N_TOTAL, FP8_BLOCK)
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * N_TOTAL, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])

    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)  # M-blocks holding pairs (device value)
    num_tiles = num_pid_m * num_pid_n
    tiles_per_group = GROUP_M * num_pid_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        # ---- which tile: the grouped order of moe_gemm_kernel ----
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % tiles_per_group) % group_size
        pid_n = (tile % tiles_per_group) // group_size

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs
        id_ok, rw = _row_routing(
            pair, row_ok, topk_ids_ptr, topk_weights_ptr, E, MUL_ROUTED_WEIGHT, EARLY_ROUTING, BLOCK_M
        )
        a_row = pair // A_ROW_DIV
        expert = tl.load(expert_of_block_ptr + pid_m)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        w_row = expert * N_TOTAL + pid_n * BLOCK_N
        a_ptrs = a_ptr + a_row[:, None].to(tl.int64) * K + offs_k[None, :]

        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GEMM1 only; folded away otherwise
        scale_bad = tl.zeros([BLOCK_N], dtype=tl.int32)  # fp8_block: any bad weight scale of the loop
        a_s = _a_scale(a_ptr, a_scale_ptr, a_row, row_ok, error_ptr, K, QUANT, QUANT_A, BLOCK_M, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a_ok = row_ok[:, None] & k_ok[None, :]
            a = tl.load(a_ptrs, mask=a_ok, other=0.0)
            a, s_a = _quantize_a(a, a_ok, a_s, row_ok, QUANT, QUANT_A, INTERPRETER)  # QUANT_A: bf16 → E4M3
            w = w_desc.load([w_row, k0])
            w_up = w  # GEMM2: no up tile
            if FUSE_SILU:
                w_up = w_desc.load([w_row + N, k0])
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
                False,
                INTERPRETER,
                FP8_IMPRECISE_ACC,
                s_a,
                QUANT_A,
            )
            a_ptrs += BLOCK_K

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

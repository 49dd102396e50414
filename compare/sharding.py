"""The MoE layer split over ranks, without a process group: the shards, the EP dispatch, each layer in one process.

:func:`shard_tp` and :func:`shard_ep` cut a contract problem into one rank's part of a tensor- or
expert-parallel layer, :func:`plan_dispatch` and :func:`combine` are the expert-parallel step's index
arithmetic, and :func:`simulate_tp` / :func:`simulate_ep` evaluate what each layer computes in one
process. :mod:`compare.distributed` holds the layers that run them on torch.distributed (and says
what each split does to the numerics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_spec.problem import MoEInputs
from moe_spec.quant import FP8_BLOCK
from moe_spec.validate import validate_moe_args

# --- sharding (no process group needed) ---------------------------------------------------------


def _check_rank(rank, world) -> None:
    for name, v in (("world", world), ("rank", rank)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if world < 1:
        raise ValueError(f"world: expected at least 1 rank, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world = {world}, got {rank}")


def _check_inputs(inputs) -> None:
    if not isinstance(inputs, MoEInputs):
        raise TypeError(f"inputs: expected a moe_spec.problem.MoEInputs, got {type(inputs).__name__}")
    validate_moe_args(**inputs.kwargs())


def token_range(T: int, rank: int, world: int) -> tuple[int, int]:
    """The tokens ``[start, stop)`` of ``rank`` when T tokens are split as evenly as possible
    (the first T mod world ranks get one more, as ``torch.tensor_split`` does)."""
    _check_rank(rank, world)
    base, extra = divmod(T, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_tp(inputs: MoEInputs, rank: int, world: int) -> MoEInputs:
    """Rank ``rank``'s part of a ``world``-way tensor-parallel layer: a valid contract problem with
    I/world intermediate channels per expert (tokens and routing unchanged)."""
    _check_inputs(inputs)
    _check_rank(rank, world)
    w1, w2, quant = inputs.w1, inputs.w2, inputs.quant
    I = w2.shape[2]  # noqa: E741
    if I % world:
        raise ValueError(f"world: {world} ranks do not divide the intermediate size I = {I}")
    part = I // world
    if quant == "fp8_block" and world > 1 and part % FP8_BLOCK:
        raise ValueError(
            f"world: fp8_block needs I/world to be a multiple of {FP8_BLOCK} (a {FP8_BLOCK}×{FP8_BLOCK} "
            f"weight-scale block must not straddle two ranks); I = {I}, world = {world} gives {part}"
        )
    gate = torch.arange(rank * part, (rank + 1) * part, device=w1.device)
    rows = torch.cat([gate, gate + I])  # this rank's gate rows, then the matching up rows
    cols = slice(rank * part, (rank + 1) * part)
    w1_scale, w2_scale = inputs.w1_scale, inputs.w2_scale
    if quant == "fp8_channel":  # one scale per W1 row follows its row; W2's rows (K) are not split
        w1_scale = w1_scale[:, rows].contiguous()
    elif quant == "fp8_block":  # blocks of 128 rows / columns, aligned to the rank boundaries
        w1_scale = w1_scale[:, rows[::FP8_BLOCK] // FP8_BLOCK].contiguous()
        w2_scale = w2_scale[:, :, rank * part // FP8_BLOCK : -(-(rank + 1) * part // FP8_BLOCK)].contiguous()
    return dataclasses.replace(
        inputs, w1=w1[:, rows].contiguous(), w2=w2[:, :, cols].contiguous(), w1_scale=w1_scale, w2_scale=w2_scale
    )


def shard_ep(inputs: MoEInputs, rank: int, world: int) -> MoEInputs:
    """Rank ``rank``'s part of a ``world``-way expert-parallel layer: its E/world experts (weights and
    scales) and its share of the tokens (:func:`token_range`), whose ``topk_ids`` stay *global*
    expert ids — the arguments :class:`EPMoE` takes, not a contract problem of their own."""
    _check_inputs(inputs)
    _check_rank(rank, world)
    E = inputs.w1.shape[0]
    if E % world:
        raise ValueError(f"world: {world} ranks do not divide the expert count E = {E}")
    mine = slice(rank * (E // world), (rank + 1) * (E // world))
    tokens = slice(*token_range(inputs.x.shape[0], rank, world))
    part = lambda t: None if t is None else t[mine].contiguous()  # noqa: E731
    return dataclasses.replace(
        inputs,
        x=inputs.x[tokens],
        topk_weights=inputs.topk_weights[tokens],
        topk_ids=inputs.topk_ids[tokens],
        w1=part(inputs.w1),
        w2=part(inputs.w2),
        w1_scale=part(inputs.w1_scale),
        w2_scale=part(inputs.w2_scale),
    )


# --- expert-parallel dispatch plan (pure index arithmetic) --------------------------------------


@dataclass
class Dispatch:
    """Where a rank's (token, slot) pairs go. Pair ``p = t·top_k + j``.

    ``order``        [P] int64  pairs in send order: by owning rank, then p (a stable sort)
    ``send_counts``  [world]    how many of them go to each rank
    ``local_ids``    [P]        each sent pair's expert id on its owner, in send order
    """

    order: torch.Tensor
    send_counts: torch.Tensor
    local_ids: torch.Tensor


def plan_dispatch(topk_ids: torch.Tensor, experts_per_rank: int, world: int) -> Dispatch:
    """The send order of :class:`EPMoE`: expert e lives on rank ``e // experts_per_rank``."""
    flat = topk_ids.reshape(-1).long()
    owner = flat // experts_per_rank
    order = torch.sort(owner, stable=True).indices
    return Dispatch(
        order=order, send_counts=torch.bincount(owner, minlength=world), local_ids=(flat % experts_per_rank)[order]
    )


def combine(y_sent: torch.Tensor, plan: Dispatch, topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = Σ_j w[t, j] · y[t, j]`` from outputs in send order, summed slot by slot in fp32
    (fp64 stays fp64)."""
    T, top_k = topk_weights.shape
    y = torch.empty_like(y_sent)
    y[plan.order] = y_sent  # back to pair order
    y = y.view(T, top_k, y.shape[-1])
    acc = torch.zeros((T, y.shape[2]), dtype=torch.promote_types(y.dtype, torch.float32), device=y.device)
    for j in range(top_k):
        acc += topk_weights[:, j, None].to(acc.dtype) * y[:, j].to(acc.dtype)
    return acc


def _expert_call(fused_moe, x_rows, local_ids, w1, w2, quant, w1_scale, w2_scale):
    """The owner's experts on the rows it received: a top-1 problem with weight 1 per row."""
    ones = torch.ones((x_rows.shape[0], 1), dtype=torch.float32, device=x_rows.device)
    return fused_moe(x_rows, w1, w2, ones, local_ids.view(-1, 1), quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)


# --- single-process evaluation of each layer's exact function -----------------------------------


def simulate_tp(inputs: MoEInputs, world: int, fused_moe: Callable) -> torch.Tensor:
    """Σ over ranks of ``fused_moe`` on each :func:`shard_tp` — what :class:`TPMoE` computes, in one
    process (summed in the output's dtype; with the fp64 oracle, exactly)."""
    parts = [fused_moe(**shard_tp(inputs, r, world).kwargs()) for r in range(world)]
    return torch.stack([p.to(torch.promote_types(p.dtype, torch.float32)) for p in parts]).sum(0)


def simulate_ep(inputs: MoEInputs, world: int, fused_moe: Callable) -> torch.Tensor:
    """What :class:`EPMoE` computes, in one process: each owner runs ``fused_moe`` on exactly the rows
    it would receive, in the same order; returns the [T, K] output of all ranks' tokens, unrounded."""
    shards = [shard_ep(inputs, r, world) for r in range(world)]
    per = shards[0].w1.shape[0]
    plans = [plan_dispatch(s.topk_ids, per, world) for s in shards]
    # pieces[src][dst]: the rows src sends to dst (split of its send order by send_counts)
    pieces = [
        list(
            zip(
                torch.split(s.x[p.order // s.topk_ids.shape[1]], p.send_counts.tolist()),
                torch.split(p.local_ids, p.send_counts.tolist()),
            )
        )
        for s, p in zip(shards, plans)
    ]
    back = [[None] * world for _ in range(world)]
    for dst, owner in enumerate(shards):
        rows = torch.cat([pieces[src][dst][0] for src in range(world)])
        ids = torch.cat([pieces[src][dst][1] for src in range(world)])
        y = _expert_call(fused_moe, rows, ids, owner.w1, owner.w2, inputs.quant, owner.w1_scale, owner.w2_scale)
        sizes = [pieces[src][dst][0].shape[0] for src in range(world)]
        for src, part in enumerate(torch.split(y, sizes)):
            back[src][dst] = part
    outs = [combine(torch.cat(back[src]), plans[src], s.topk_weights) for src, s in enumerate(shards)]
    return torch.cat(outs)

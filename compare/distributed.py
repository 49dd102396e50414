"""The MoE layer split over ranks: tensor parallel (TP) and expert parallel (EP), on torch.distributed.

Both layers call one backend's ``fused_moe`` (the contract of :mod:`moe_spec.contract`) on the
part of the layer a rank holds, and move data with collectives of the default (or a given)
process group: NCCL on GPUs, gloo on the CPU. :mod:`compare.launch` starts the ranks.

Tensor parallel, ``tp`` ranks (:func:`shard_tp`, :class:`TPMoE`)
    Every rank holds I/tp of *every* expert: the same slice of W1's gate rows and of its up rows
    (so SiLU(gate)·up pairs up inside the rank) and the matching columns of W2. The tokens and the
    routing are replicated. Each rank computes a partial output over its slice of I; the layer's
    output is their sum, one ``all_reduce`` (bf16, in place). Scales follow the rows they scale:
    a per-channel W1 scale is sliced with its rows, a per-channel W2 scale (one per output row,
    K of them) is whole on every rank, a per-tensor scale is shared, and 128×128 block scales are
    sliced by blocks — which needs I/tp to be a multiple of 128 (otherwise a block would straddle
    two ranks, and :func:`shard_tp` refuses).

Expert parallel, ``ep`` ranks (:func:`shard_ep`, :class:`EPMoE`)
    Rank r holds the E/ep experts ``[r·E/ep, (r+1)·E/ep)`` whole, and its own tokens (a serving
    stack with data-parallel attention; :func:`shard_ep` splits a batch like ``torch.tensor_split``).
    A step is two ``all_to_all`` exchanges around one local ``fused_moe``:

    1. *dispatch*: every (token, slot) pair goes to the rank owning its expert — the token's row of
       x and the expert's local id; a rank sends its pairs in a fixed order (:func:`plan_dispatch`:
       by owner, then token, then slot) and receives them concatenated by source rank (a token with
       two experts on one rank travels twice: simpler than a per-token dispatch, at most top_k× its bytes);
    2. the owner runs its experts on the received rows as a top-1 problem (one row per pair, weight
       1), so that every pair's output comes back unweighted;
    3. *combine*: the outputs travel back along the same splits and the token's home rank sums
       ``Σ_j topk_weights[t, j] · y[t, j]`` in fp32, slot by slot, then rounds once to bf16.

Determinism
    No step depends on arrival order or atomics: the dispatch order is a stable sort, the receive
    layout is the collective's (by source rank), the combine is a fixed-order sum, and TP's sum of
    two bf16 partials is exact-then-rounded, identical on both ranks. Repeated calls give the same
    bits (checked by the tests); with more than two TP ranks the bits depend on NCCL's reduction
    algorithm (pin ``NCCL_ALGO`` to keep them).

Numerics: what is the same function, what is not
    bf16 sharding changes only where sums are rounded. FP8 activations are quantized dynamically
    inside the backend, on what the rank sees. In TP, x is replicated (same scales), but the
    intermediate [pairs, I/tp] is quantized per rank: with ``fp8_block`` its 1×128 groups are the
    full layer's groups (I/tp is a multiple of 128), so TP computes the same function; with
    ``fp8_channel`` a row's scale comes from I/tp values instead of I, with ``fp8_tensor`` from the
    rank's slice. In EP, per-token (``fp8_channel``) and per-group (``fp8_block``) scales see the
    same values as in one process; ``fp8_tensor`` takes its scale from the rows an owner receives.
    :func:`simulate_tp` and :func:`simulate_ep` evaluate the exact function of each layer in one
    process (with the fp64 oracle, say), which is what the tests hold the layers to; how far that
    is from the single-process function, :mod:`compare.studies.dist_numerics` measures (``notes/distributed.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from compare.backends import BACKEND_NAMES, load_backend
from moe_spec.problem import MoEInputs
from moe_spec.quant import FP8_BLOCK, QUANT_FORMATS
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
        raise ValueError(f"world: fp8_block needs I/world to be a multiple of {FP8_BLOCK} (a {FP8_BLOCK}×{FP8_BLOCK} "
                         f"weight-scale block must not straddle two ranks); I = {I}, world = {world} gives {part}")
    gate = torch.arange(rank * part, (rank + 1) * part, device=w1.device)
    rows = torch.cat([gate, gate + I])  # this rank's gate rows, then the matching up rows
    cols = slice(rank * part, (rank + 1) * part)
    w1_scale, w2_scale = inputs.w1_scale, inputs.w2_scale
    if quant == "fp8_channel":  # one scale per W1 row follows its row; W2's rows (K) are not split
        w1_scale = w1_scale[:, rows].contiguous()
    elif quant == "fp8_block":  # blocks of 128 rows / columns, aligned to the rank boundaries
        w1_scale = w1_scale[:, rows[::FP8_BLOCK] // FP8_BLOCK].contiguous()
        w2_scale = w2_scale[:, :, rank * part // FP8_BLOCK:-(-(rank + 1) * part // FP8_BLOCK)].contiguous()
    return dataclasses.replace(inputs, w1=w1[:, rows].contiguous(), w2=w2[:, :, cols].contiguous(),
                               w1_scale=w1_scale, w2_scale=w2_scale)


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
    return dataclasses.replace(inputs, x=inputs.x[tokens], topk_weights=inputs.topk_weights[tokens],
                               topk_ids=inputs.topk_ids[tokens], w1=part(inputs.w1), w2=part(inputs.w2),
                               w1_scale=part(inputs.w1_scale), w2_scale=part(inputs.w2_scale))


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
    return Dispatch(order=order, send_counts=torch.bincount(owner, minlength=world),
                    local_ids=(flat % experts_per_rank)[order])


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
    pieces = [list(zip(torch.split(s.x[p.order // s.topk_ids.shape[1]], p.send_counts.tolist()),
                       torch.split(p.local_ids, p.send_counts.tolist()))) for s, p in zip(shards, plans)]
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


# --- the layers ---------------------------------------------------------------------------------


def _load(backend: str) -> Callable:
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {', '.join(BACKEND_NAMES)}, got {backend!r}")
    b = load_backend(backend)
    if b.missing:
        raise ValueError(f"backend: {backend} is not available here: {b.missing}")
    return b.fused_moe


#: The fields two ranks must agree on, and the argument a mismatch is reported under.
_PEER_FIELDS = {"T": "x", "K": "x", "E": "w1", "I": "w1", "top_k": "topk_ids", "quant": "quant"}


def _agree(group, device, fields: dict, refused: BaseException | None = None) -> None:
    """All ranks gather ``fields`` (ints) and whether this rank ``refused`` its arguments, then raise
    the same error everywhere if a field differs or a rank refused: a layer whose ranks disagree
    would otherwise hang in its next collective."""
    mine = torch.tensor([int(refused is not None), *fields.values()], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()
    if refused is not None:
        raise refused
    if bool(table[:, 0].any()):
        bad = table[:, 0].nonzero().flatten().tolist()
        raise RuntimeError(f"rank(s) {bad} refused their arguments (their own error says which); no collective ran")
    for i, name in enumerate(fields, start=1):
        column = table[:, i].tolist()
        if len(set(column)) > 1:
            shown = [QUANT_FORMATS[v] for v in column] if name == "quant" else column
            raise ValueError(f"{_PEER_FIELDS[name]}: the ranks disagree on {name}: {shown} (rank order); "
                             "every rank must hold the same layer")


class _Layer:
    """What both layers share: the backend, the group, and the options passed to every call."""

    _FIELDS: tuple = ()  # what the ranks of this layer must agree on (keys of _PEER_FIELDS)

    def __init__(self, backend: str = "triton_moe", *, group=None, check_peers: bool = True, **backend_options):
        if not isinstance(check_peers, bool):
            raise TypeError(f"check_peers: expected True or False, got {check_peers!r}")
        self.backend = backend
        self.fused_moe = _load(backend)
        self.group = group
        self.check_peers = check_peers
        self.options = backend_options

    def _agree(self, x, refused, values: dict | None) -> None:
        """With ``check_peers``, every rank learns whether the others accepted their arguments and
        hold the same layer; without it, a rank's refusal is raised here and its peers are not told."""
        if not self.check_peers:
            if refused is not None:
                raise refused
            return
        if isinstance(x, torch.Tensor):
            device = x.device
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        _agree(self.group, device, {k: (values or {}).get(k, 0) for k in self._FIELDS}, refused)

    def _expert(self, x, w1, w2, topk_weights, topk_ids, *, quant, w1_scale, w2_scale):
        return self.fused_moe(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale,
                              w2_scale=w2_scale, **self.options)


class TPMoE(_Layer):
    """Tensor-parallel MoE: ``TPMoE(backend)(x, w1, w2, topk_weights, topk_ids, *, quant, w1_scale,
    w2_scale)`` with this rank's :func:`shard_tp` weights and the replicated tokens → the layer's
    [T, K] bf16 output on every rank."""

    _FIELDS = ("T", "K", "E", "I", "top_k", "quant")

    def __call__(self, x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None,
                 w2_scale=None) -> torch.Tensor:
        if self.check_peers:  # without it, the backend's own checks still run before the all_reduce
            try:
                d, refused = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale,
                                               w2_scale=w2_scale), None
            except (TypeError, ValueError) as exc:
                d, refused = None, exc
            self._agree(x, refused, d and dict(T=d.T, K=d.K, E=d.E, I=d.I, top_k=d.top_k,
                                               quant=QUANT_FORMATS.index(quant)))
        out = self._expert(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)
        dist.all_reduce(out, group=self.group)
        return out


def _check_routing(x, topk_weights, topk_ids) -> None:
    """The token-side tensors are 2-D, T rows each, one id per weight (before the slicing below)."""
    for name, t in (("x", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    T = x.shape[0]
    if topk_weights.shape[0] != T:
        raise ValueError(f"topk_weights: expected shape [T={T}, top_k], got {tuple(topk_weights.shape)}")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids: expected shape {tuple(topk_weights.shape)} (as topk_weights), "
                         f"got {tuple(topk_ids.shape)}")


def _check_global_ids(topk_weights, topk_ids, num_experts: int) -> None:
    """EP's ids are global, in [0, E) with E = experts per rank × world: a range the contract's
    check of one rank's experts cannot know."""
    top_k = topk_ids.shape[1]
    if top_k > num_experts:
        raise ValueError(f"topk_ids: expected top_k <= E = {num_experts}, got top_k = {top_k}")
    if not topk_ids.shape[0]:
        return
    ids = topk_ids.long()
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"topk_ids: expected global expert ids in [0, E={num_experts}) (experts per rank × "
                         f"world), got values in [{lo}, {hi}]")
    s = ids.sort(dim=1).values
    if bool((s[:, 1:] == s[:, :-1]).any()):
        raise ValueError("topk_ids: an expert appears twice in one token's row; expected distinct ids")
    if not bool(torch.isfinite(topk_weights).all()):
        raise ValueError("topk_weights: expected finite routing weights")


class EPMoE(_Layer):
    """Expert-parallel MoE: ``EPMoE(backend)(x, w1, w2, topk_weights, topk_ids, *, quant, w1_scale,
    w2_scale)`` with this rank's tokens (x [T_r, K], global ``topk_ids``) and its :func:`shard_ep`
    experts → this rank's tokens' [T_r, K] bf16 output. T_r may differ between ranks, and be 0."""

    _FIELDS = ("K", "E", "I", "top_k", "quant")

    def __call__(self, x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None,
                 w2_scale=None) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        try:
            _check_routing(x, topk_weights, topk_ids)
            # types, dtypes, weights and scales: the contract's checks of this rank's experts, no tokens
            d = validate_moe_args(x[:0], w1, w2, topk_weights[:0, :1], topk_ids[:0, :1], quant=quant,
                                  w1_scale=w1_scale, w2_scale=w2_scale)
            _check_global_ids(topk_weights, topk_ids, d.E * world)
            refused = None
        except (TypeError, ValueError) as exc:
            d, refused = None, exc
        top_k = topk_ids.shape[1] if refused is None else 0
        self._agree(x, refused, d and dict(K=d.K, E=d.E, I=d.I, top_k=top_k, quant=QUANT_FORMATS.index(quant)))

        plan = plan_dispatch(topk_ids, d.E, world)
        recv_counts = torch.empty_like(plan.send_counts)
        dist.all_to_all_single(recv_counts, plan.send_counts, group=self.group)
        send, recv = plan.send_counts.tolist(), recv_counts.tolist()  # the splits: one host sync
        rows = x.new_empty((sum(recv), d.K))
        dist.all_to_all_single(rows, x[plan.order // top_k], recv, send, group=self.group)
        ids = plan.local_ids.new_empty(sum(recv))
        dist.all_to_all_single(ids, plan.local_ids, recv, send, group=self.group)

        y = _expert_call(self._expert, rows, ids, w1, w2, quant, w1_scale, w2_scale)

        y_back = y.new_empty((plan.order.numel(), d.K))
        dist.all_to_all_single(y_back, y, send, recv, group=self.group)
        return combine(y_back, plan, topk_weights).to(torch.bfloat16)


def layer_for(parallel: str) -> type:
    """``"tp"`` → :class:`TPMoE`, ``"ep"`` → :class:`EPMoE`; with :data:`SHARDERS` the two ways to split."""
    if parallel not in SHARDERS:
        raise ValueError(f"parallel: expected 'tp' or 'ep', got {parallel!r}")
    return {"tp": TPMoE, "ep": EPMoE}[parallel]


SHARDERS: dict[str, Callable] = {"tp": shard_tp, "ep": shard_ep}
SIMULATORS: dict[str, Callable] = {"tp": simulate_tp, "ep": simulate_ep}

__all__ = ["shard_tp", "shard_ep", "token_range", "plan_dispatch", "combine", "Dispatch", "TPMoE", "EPMoE",
           "simulate_tp", "simulate_ep", "layer_for", "SHARDERS", "SIMULATORS"]

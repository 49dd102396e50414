"""The MoE layer split over ranks: tensor parallel (TP) and expert parallel (EP), on torch.distributed.

Both layers call one backend's ``fused_moe`` (the contract of :mod:`moe_spec.contract`) on the
part of the layer a rank holds (the shards, the dispatch and the single-process functions are
:mod:`compare.sharding`'s, re-exported here), and move data with collectives of the default (or a given)
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

from collections.abc import Callable

import torch
import torch.distributed as dist

from compare.backends import BACKEND_NAMES, load_backend
from compare.sharding import (
    Dispatch,
    _expert_call,
    combine,
    plan_dispatch,
    shard_ep,
    shard_tp,
    simulate_ep,
    simulate_tp,
    token_range,
)
from moe_spec.quant import QUANT_FORMATS
from moe_spec.validate import check_runs_on, check_sizes, validate_moe_args

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


def _agree(group, device, fields: dict, refused: BaseException | None = None, extra: tuple = ()) -> list:
    """All ranks gather ``fields`` (ints), whether this rank ``refused`` its arguments and ``extra``
    ints, then raise the same error everywhere if a rank refused or a field differs: a layer whose
    ranks disagree would otherwise hang in its next collective. Returns the gathered rows (every
    rank's ``extra``, in rank order), for checks that need the other ranks' values."""
    mine = torch.tensor([int(refused is not None), *fields.values(), *extra], dtype=torch.int64, device=device)
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
            raise ValueError(
                f"{_PEER_FIELDS[name]}: the ranks disagree on {name}: {shown} (rank order); "
                "every rank must hold the same layer"
                + (
                    " (an expert-parallel rank holds E/world experts: shard_ep splits them evenly)"
                    if name == "E"
                    else ""
                )
            )
    return table[:, 1 + len(fields) :].tolist()


def _token_shape(x) -> tuple[int, int] | None:
    """(T, K) of a call whose arguments were refused, when x still says it: what a refusing rank
    needs to take part in its peers' collectives."""
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        return x.shape[0], x.shape[1]
    return None


class _Layer:
    """What both layers share: the backend, the group, and the options passed to every call.

    ``check_peers`` (default): before any collective of the layer, the ranks gather whether each
    accepted its arguments and the layer's sizes, and all raise the same error if one refused or
    they disagree. Without it (one collective fewer per call), a rank that refuses still takes part
    in the layer's collectives — sending NaN where its share of the output goes, so its peers'
    rows that needed it come out NaN rather than plausible, and nobody waits for it — then raises its
    own error; when its x is not even a [T, K] tensor it cannot, and raises at once."""

    _FIELDS: tuple = ()  # what the ranks of this layer must agree on (keys of _PEER_FIELDS)

    def __init__(self, backend: str = "triton_moe", *, group=None, check_peers: bool = True, **backend_options):
        if not isinstance(check_peers, bool):
            raise TypeError(f"check_peers: expected True or False, got {check_peers!r}")
        self.backend = backend
        self.fused_moe = _load(backend)
        self.limits = getattr(self.fused_moe, "limits", None)  # the backend's (moe_spec.validate.Limits)
        self.group = group
        self.check_peers = check_peers
        self.options = backend_options

    def _device(self, x) -> torch.device:
        """The device of this rank's collectives: x's, or (x refused: not a tensor, on meta) the group's."""
        if isinstance(x, torch.Tensor) and x.device.type in ("cpu", "cuda"):
            return x.device
        return (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(self.group) == "nccl"
            else torch.device("cpu")
        )

    def _agree(self, x, refused, values: dict | None, extra: tuple = ()) -> list:
        """With ``check_peers``, every rank learns whether the others accepted their arguments and
        hold the same layer (and their ``extra`` ints); without it, a rank's refusal is raised by the
        caller (after its share of the collectives, :meth:`_refuse_alone`)."""
        return _agree(self.group, self._device(x), {k: (values or {}).get(k, 0) for k in self._FIELDS}, refused, extra)

    def _expert(self, x, w1, w2, topk_weights, topk_ids, *, quant, w1_scale, w2_scale):
        return self.fused_moe(
            x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, **self.options
        )


class TPMoE(_Layer):
    """Tensor-parallel MoE: ``TPMoE(backend)(x, w1, w2, topk_weights, topk_ids, *, quant, w1_scale,
    w2_scale)`` with this rank's :func:`shard_tp` weights and the replicated tokens → the layer's
    [T, K] bf16 output on every rank."""

    _FIELDS = ("T", "K", "E", "I", "top_k", "quant")

    def __call__(self, x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None) -> torch.Tensor:
        try:  # the contract's checks and the backend's limits (the one size check), before any collective
            d, refused = (
                validate_moe_args(
                    x,
                    w1,
                    w2,
                    topk_weights,
                    topk_ids,
                    quant=quant,
                    w1_scale=w1_scale,
                    w2_scale=w2_scale,
                    limits=self.limits,
                ),
                None,
            )
            check_runs_on(x.device, self.limits)
        except (TypeError, ValueError) as exc:
            d, refused = None, exc
        if self.check_peers:
            self._agree(
                x, refused, d and dict(T=d.T, K=d.K, E=d.E, I=d.I, top_k=d.top_k, quant=QUANT_FORMATS.index(quant))
            )
        elif refused is not None:
            self._refuse_alone(x, refused)
        out = self._expert(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)
        dist.all_reduce(out, group=self.group)
        return out

    def _refuse_alone(self, x, refused):
        """No peer check: NaN into the all_reduce the peers are in (their output is NaN, not a
        partial sum that looks right), then this rank's error."""
        shape = _token_shape(x)
        if shape is not None:
            dist.all_reduce(
                torch.full(shape, float("nan"), dtype=torch.bfloat16, device=self._device(x)), group=self.group
            )
        raise refused


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
        raise ValueError(
            f"topk_ids: expected shape {tuple(topk_weights.shape)} (as topk_weights), got {tuple(topk_ids.shape)}"
        )


def _local_routing(topk_weights, topk_ids) -> tuple[int, int]:
    """The routing checks one rank can make alone (distinct ids in a row, finite weights); returns
    the range [lo, hi] of its ids — whether they are global ids of the layer, only the experts of
    every rank tell (:func:`_check_global_ids`)."""
    if not topk_ids.shape[0]:
        return 0, 0
    ids = topk_ids.long()
    s = ids.sort(dim=1).values
    if bool((s[:, 1:] == s[:, :-1]).any()):
        raise ValueError("topk_ids: an expert appears twice in one token's row; expected distinct ids")
    if not bool(torch.isfinite(topk_weights).all()):
        raise ValueError("topk_weights: expected finite routing weights")
    return int(ids.min()), int(ids.max())


def _check_global_ids(ranges: list, num_experts: int, rank: int) -> None:
    """EP's ids are global, in [0, E) with E the experts of all ranks: a range the contract's check of
    one rank's experts cannot know. ``ranges``: every rank's [lo, hi]; every rank raises — the one
    whose ids are out of range names topk_ids, the others name it."""
    bad = [r for r, (lo, hi) in enumerate(ranges) if lo < 0 or hi >= num_experts]
    if rank in bad:
        lo, hi = ranges[rank]
        raise ValueError(
            f"topk_ids: expected global expert ids in [0, E={num_experts}) (the experts of all "
            f"ranks), got values in [{lo}, {hi}]"
        )
    if bad:
        raise RuntimeError(f"rank(s) {bad} refused their arguments (their own error says which); no collective ran")


class EPMoE(_Layer):
    """Expert-parallel MoE: ``EPMoE(backend)(x, w1, w2, topk_weights, topk_ids, *, quant, w1_scale,
    w2_scale)`` with this rank's tokens (x [T_r, K], global ``topk_ids``) and its :func:`shard_ep`
    experts → this rank's tokens' [T_r, K] bf16 output. T_r may differ between ranks, and be 0."""

    _FIELDS = ("K", "E", "I", "top_k", "quant")

    def __call__(self, x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        try:
            _check_routing(x, topk_weights, topk_ids)
            if all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in (w1, w2)):
                # the layer's sizes as far as this rank knows them — all ranks' experts, its own tokens —
                # by the one check of every surface, in fused_moe's order, before anything is read
                check_sizes(w1.shape[0] * world, x.shape[1], w1.shape[1] // 2, topk_ids.shape[1], x.shape[0])
            # types, dtypes, weights and scales, the backend's limits: the contract's checks of this
            # rank's experts, no tokens
            d = validate_moe_args(
                x[:0],
                w1,
                w2,
                topk_weights[:0, :1],
                topk_ids[:0, :1],
                quant=quant,
                w1_scale=w1_scale,
                w2_scale=w2_scale,
                limits=self.limits,
            )
            check_runs_on(x.device, self.limits)
            ids_range = _local_routing(topk_weights, topk_ids)
            if not self.check_peers:  # alone, a rank takes the others to hold as many experts as it does
                _check_global_ids([ids_range], d.E * world, 0)
            refused = None
        except (TypeError, ValueError) as exc:
            d, refused, ids_range = None, exc, (0, 0)
        top_k, tokens = (topk_ids.shape[1], x.shape[0]) if refused is None else (0, 0)
        if self.check_peers:  # every rank's experts (E each, all agreed) say which ids are global ids
            rows = self._agree(
                x,
                refused,
                d and dict(K=d.K, E=d.E, I=d.I, top_k=top_k, quant=QUANT_FORMATS.index(quant)),
                (*ids_range, tokens),
            )
            # the layer's sizes, the same on every rank: all E·world experts, all ranks' tokens (a rank
            # receives at most their top_k pairs each: the rows of its own fused_moe call)
            check_sizes(d.E * world, d.K, d.I, top_k, sum(r[2] for r in rows))
            _check_global_ids([r[:2] for r in rows], d.E * world, rank)
        elif refused is not None:
            self._refuse_alone(x, refused)

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

    def _refuse_alone(self, x, refused):
        """No peer check: this rank sends no pair, takes the pairs its peers send it and returns NaN
        for each (their tokens that needed its experts come out NaN), then raises its error."""
        shape = _token_shape(x)
        if shape is not None:
            device, world, K = self._device(x), dist.get_world_size(self.group), shape[1]
            none = [0] * world
            counts = torch.zeros(world, dtype=torch.int64, device=device)
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.group)
            recv = recv_counts.tolist()
            bf16 = dict(dtype=torch.bfloat16, device=device)
            dist.all_to_all_single(
                torch.empty((sum(recv), K), **bf16), torch.empty((0, K), **bf16), recv, none, group=self.group
            )
            dist.all_to_all_single(
                torch.empty(sum(recv), dtype=torch.int64, device=device),
                torch.empty(0, dtype=torch.int64, device=device),
                recv,
                none,
                group=self.group,
            )
            dist.all_to_all_single(
                torch.empty((0, K), **bf16),
                torch.full((sum(recv), K), float("nan"), **bf16),
                none,
                recv,
                group=self.group,
            )
        raise refused


def layer_for(parallel: str) -> type:
    """``"tp"`` → :class:`TPMoE`, ``"ep"`` → :class:`EPMoE`; with :data:`SHARDERS` the two ways to split."""
    if parallel not in SHARDERS:
        raise ValueError(f"parallel: expected 'tp' or 'ep', got {parallel!r}")
    return {"tp": TPMoE, "ep": EPMoE}[parallel]


SHARDERS: dict[str, Callable] = {"tp": shard_tp, "ep": shard_ep}
SIMULATORS: dict[str, Callable] = {"tp": simulate_tp, "ep": simulate_ep}

__all__ = [
    "shard_tp",
    "shard_ep",
    "token_range",
    "plan_dispatch",
    "combine",
    "Dispatch",
    "TPMoE",
    "EPMoE",
    "simulate_tp",
    "simulate_ep",
    "layer_for",
    "SHARDERS",
    "SIMULATORS",
]

"""The backend router: from a measured table, the fastest correct backend for (shape, quant, T).

No single backend wins everywhere: decode (a few tokens per expert) is weight-bandwidth bound and
rewards swap-AB tiles; prefill is compute bound and rewards big tiles; FP8 support differs by
backend. So the answer to "which FP8 (or bf16) MoE backend should I use?" is a table, measured on
the card, and a rule to read it.

The table (``compare/data/router_h200.json``, written by ``python -m compare --write-router``)
holds one entry per measured case: the layer's sizes (E, K, I, top_k), the format, T, and the
backend that was fastest *among the backends that passed the tolerance policy*, with every
candidate's time for reference. :func:`choose_backend` reads it:

1. entries of the same format and the same layer sizes; if the layer was never measured, entries of
   the same format for any layer (the backend that wins most often at the nearest T);
2. among those, the entries whose T is nearest to the request in log₂ distance (1 → 8 → 32 …:
   token counts matter by ratio), the smaller T on a tie;
3. no entry for the format at all: :data:`FALLBACK` (the most general backend).

:func:`fused_moe` is the backend contract with ``backend="auto"``: it routes, then calls the chosen
backend (imported lazily). On a machine without CUDA it takes :data:`CPU_BACKEND`.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

from compare.backends import load_backend
from compare.metrics import quant_name
from compare.peers import PEERS
from compare.userkernel import is_user_kernel

TABLE_PATH = Path(__file__).parent / "data" / "router_h200.json"
FALLBACK = "triton_moe"  # implements every format of the contract
CPU_BACKEND = "torch_loop"  # the kernels need a GPU (CuTe) or run interpreted (Triton) on a CPU
FALLBACK_ORDER = ("triton_moe", "torch_grouped", "torch_loop")  # when the chosen backend fails to import


def _layer(shape) -> tuple:
    """(E, K, I, top_k) from a MoEShape, a 'name[:tpN]' spec, or a MoEDims."""
    if isinstance(shape, str):
        from moe_spec.problem import get_shape

        shape = get_shape(shape)
    if hasattr(shape, "num_experts"):
        return (shape.num_experts, shape.hidden, shape.intermediate, shape.top_k)
    return (shape.E, shape.K, shape.I, shape.top_k)


def build_table(rows: list[dict], meta: dict) -> dict:
    """A routing table from the suite's rows: per case, the fastest backend whose numerics passed."""
    cases: dict = collections.defaultdict(dict)
    layers: dict = {}
    for r in rows:
        key = (r["shape"], r["quant"], r["T"])
        layers[key] = (r["E"], r["K"], r["I"], r["top_k"])
        outside = is_user_kernel(r["backend"]) or r["backend"] in PEERS  # in the report; load_backend cannot run it
        if not outside and r.get("status") == "ok" and r.get("us") and r.get("xdiff_ok", True):
            cases[key][r["backend"]] = round(r["us"], 2)
    entries = []
    for key, cand in sorted(cases.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        shape, quant, T = key
        E, K, I, top_k = layers[key]  # noqa: E741
        entries.append(
            {
                "shape": shape,
                "E": E,
                "K": K,
                "I": I,
                "top_k": top_k,
                "quant": quant,
                "T": T,
                "backend": min(cand, key=cand.get),
                "us": cand,
            }
        )
    return {
        "device": meta.get("device"),
        "date": meta.get("date"),
        "commit": meta.get("commit"),
        "command": meta.get("command"),
        "placeholder": False,
        "rule": "fastest backend that passed the tolerance policy (compare/metrics.py) in this run",
        "entries": entries,
    }


def load_table(path=TABLE_PATH) -> dict:
    with open(path) as f:
        return json.load(f)


_default_table: dict | None = None


def _table(table) -> dict:
    global _default_table
    if table is not None:
        return table
    if _default_table is None:
        _default_table = load_table()
    return _default_table


def _nearest(entries: list[dict], T: int) -> list[dict]:
    dist = lambda e: abs(math.log2(max(e["T"], 1)) - math.log2(max(T, 1)))  # noqa: E731
    best = min(dist(e) for e in entries)
    tied = [e for e in entries if dist(e) == best]
    smallest_T = min(e["T"] for e in tied)
    return [e for e in tied if e["T"] == smallest_T]


def choose_backend(shape, quant: str | None, T: int, table: dict | None = None) -> str:
    """The backend to run this case with (see the module docstring for the rule)."""
    entries = [e for e in _table(table).get("entries", []) if e["quant"] == quant_name(quant)]
    if not entries:
        return FALLBACK
    layer = _layer(shape)
    same = [e for e in entries if (e["E"], e["K"], e["I"], e["top_k"]) == layer]
    nearest = _nearest(same or entries, T)
    votes = collections.Counter(e["backend"] for e in nearest)
    return max(sorted(votes), key=votes.get)


def fused_moe(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    *,
    quant=None,
    w1_scale=None,
    w2_scale=None,
    backend: str = "auto",
    table: dict | None = None,
    **backend_options,
):
    """The backend contract, routed: ``backend="auto"`` picks by :func:`choose_backend`.

    Any other ``backend`` name runs that backend. ``backend_options`` go to the chosen backend
    (pass them only with an explicit backend: options differ between backends).
    """
    if backend == "auto":
        from moe_spec.validate import validate_moe_args

        dims = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)
        backend = CPU_BACKEND if x.device.type != "cuda" else choose_backend(dims, quant, dims.T, table)
        chosen = load_backend(backend)
        for alternative in FALLBACK_ORDER:
            if chosen.fused_moe is not None:
                break
            chosen = load_backend(alternative)
    else:
        chosen = load_backend(backend)
        if chosen.fused_moe is None:
            raise ImportError(f"backend {backend!r} is not available: {chosen.missing}")
    return chosen.fused_moe(
        x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, **backend_options
    )

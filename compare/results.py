"""The results record (``results.json``): its shape, checked when read back, and several merged.

A record is one JSON object::

    {"meta":     {date, device, commit, command, mode, shapes, tokens, quants, backends, ...},
     "ceilings": {device, copy_tbps, bf16_tflops, fp8_tflops} or null (nothing timed),
     "rows":     [one per (shape, quant, T, backend): sizes, status, numerics, timing],
     "cases":    [one per (shape, quant, T): quantization error, per-expert table],
     "jit":      [one per (backend, quant): the JIT study], "jit_demo": {...}, "cute_ptx": {...}}

``python -m compare --merge`` reads records back (:func:`load`): every record this repository has
committed is read, including older ones (no per-expert lists in their cases; NaN and infinity
written as strings), and anything else is refused in one line naming the file and the field.
:func:`merge` makes one record of several, e.g. one H200 call per shape.
"""

from __future__ import annotations

import json
from numbers import Real

ROW_TYPES = {
    "shape": str,
    "quant": str,
    "T": int,
    "backend": str,
    "status": str,
    "E": int,
    "K": int,
    "I": int,
    "top_k": int,
}
CASE_TYPES = {"shape": str, "quant": str, "T": int}
JIT_TYPES = {"backend": str, "shape": str, "quant": str, "status": str}
NUMBERS = (
    "rel_l2",
    "max_abs",
    "max_ulp",
    "cosine",
    "xdiff",
    "quant_error",
    "err_vs_bf16",
    "us",
    "p10_us",
    "p90_us",
    "prep_us",
    "eager_us",
    "eager_ratio",
    "compiled_us",
    "compiled_ratio",
    "compiled_rel_l2",
    "separate_us",
    "fusion_speedup",
    "fused_bytes",
    "separate_bytes",
    "weight_tbps",
    "tflops",
    "pct_floor",
    "floor_us",
    "speedup",
    "median_expert_quant_error",
)
FLAGS = ("deterministic", "batch_invariant", "xdiff_ok")
LIST_META = ("shapes", "tokens", "quants", "backends")


class ResultsError(ValueError):
    """A record that is not a compare results record: one line, naming the file and the field."""


def _number(value, where: str):
    """A number, None, or the strings NaN / infinity are written as; anything else is refused."""
    if value is None or (isinstance(value, Real) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    raise ResultsError(f"{where}: expected a number, got {value!r}")


def _entries(record: dict, key: str, types: dict, name: str, required: bool) -> list:
    items = record.get(key)
    if items is None and not required:
        return []
    if not isinstance(items, list):
        raise ResultsError(f"{name}: '{key}' must be a list, got {type(items).__name__}")
    out = []
    for i, item in enumerate(items):
        where = f"{name}: {key}[{i}]"
        if not isinstance(item, dict):
            raise ResultsError(f"{where}: expected an object, got {type(item).__name__}")
        for field, kind in types.items():
            value = item.get(field)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ResultsError(f"{where}: '{field}' must be {kind.__name__}, got {value!r}")
        item = dict(item)
        for field in NUMBERS:
            if field in item:
                item[field] = _number(item[field], f"{where}.{field}")
        for field in FLAGS:
            if item.get(field) not in (None, True, False):
                raise ResultsError(f"{where}: '{field}' must be true, false or null, got {item[field]!r}")
        out.append(item)
    return out


def check(record, name: str = "results") -> dict:
    """A validated copy of ``record`` in the current shape (older records filled in)."""
    if not isinstance(record, dict):
        raise ResultsError(f"{name}: expected a JSON object with 'meta' and 'rows', got {type(record).__name__}")
    missing = [k for k in ("meta", "rows") if k not in record]
    if missing:
        raise ResultsError(f"{name}: not a compare results record (no {' or '.join(map(repr, missing))})")
    if not isinstance(record["meta"], dict):
        raise ResultsError(f"{name}: 'meta' must be an object, got {type(record['meta']).__name__}")
    out = dict(record)
    out["rows"] = _entries(record, "rows", ROW_TYPES, name, required=True)
    out["cases"] = _entries(record, "cases", CASE_TYPES, name, required=False)
    for i, case in enumerate(out["cases"]):
        experts = case.setdefault("experts", [])  # older records kept only the flagged experts' ids
        if not isinstance(experts, list) or not all(isinstance(e, dict) for e in experts):
            raise ResultsError(f"{name}: cases[{i}]: 'experts' must be a list of objects")
        case.setdefault("flagged_experts", [])
    out["jit"] = _entries(record, "jit", JIT_TYPES, name, required=False)
    for key in ("ceilings", "jit_demo", "cute_ptx"):
        if out.get(key) is not None and not isinstance(out[key], (dict, list)):
            raise ResultsError(f"{name}: '{key}' must be an object or null")
        out.setdefault(key, None)
    return out


def load(path: str) -> dict:
    """Read and check one results file (:class:`ResultsError` on any problem, one line)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"cannot read results file {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"results file {path!r} is not JSON: {exc}") from None
    return check(record, f"results file {path!r}")


# --- merging -------------------------------------------------------------------------------------


def _distinct(values: list) -> list:
    seen, out = set(), []
    for v in values:
        key = json.dumps(v, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def _union_meta(metas: list[dict]) -> dict:
    """Lists (shapes, tokens, formats, backends) united; any other field kept when the inputs agree,
    else the list of their distinct values."""
    merged: dict = {}
    for key in dict.fromkeys(k for m in metas for k in m):
        if key == "merged_from":
            continue
        values = [m[key] for m in metas if key in m]
        if key in LIST_META and all(isinstance(v, list) for v in values):
            united = _distinct([x for v in values for x in v])
            merged[key] = sorted(united) if key == "tokens" and all(isinstance(t, int) for t in united) else united
        else:
            distinct = _distinct(values)
            merged[key] = distinct[0] if len(distinct) == 1 else distinct
    merged["merged_from"] = [c for m in metas for c in (m.get("merged_from") or [m.get("command", "")])]
    return merged


def merge(records: list[dict]) -> dict:
    """Several checked records as one: rows, cases and JIT studies concatenated; metadata united
    (:func:`_union_meta`); ceilings kept per distinct run; notes kept."""
    if not records:
        raise ValueError("records: no results given")
    ceilings = _distinct([r["ceilings"] for r in records if r.get("ceilings")])
    merged = {
        "meta": _union_meta([r["meta"] for r in records]),
        "ceilings": (ceilings[0] if len(ceilings) == 1 else ceilings) or None,
        "rows": [x for r in records for x in r["rows"]],
        "cases": [x for r in records for x in r.get("cases") or []],
        "jit": [x for r in records for x in r.get("jit") or []],
        "jit_demo": next((r["jit_demo"] for r in records if r.get("jit_demo")), None),
        "cute_ptx": next((r["cute_ptx"] for r in records if r.get("cute_ptx")), None),
    }
    notes = _distinct(
        [n for r in records for n in ([r["note"]] if isinstance(r.get("note"), str) else r.get("notes") or [])]
    )
    if notes:
        merged["notes"] = notes
    return merged

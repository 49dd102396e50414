"""One backend on one case: what it declares, how far it is from the oracle, and how it behaves.

For each backend the suite asks, in this order:

1. **Does the backend implement this format?** Asked of the backend itself, not of the device: it
   is called with the case's arguments cut to T = 0 tokens. The contract checks every argument and
   refuses a format it does not implement (``NotImplementedError``) before any kernel runs, and
   returns an empty output for T = 0, so this launches nothing and gives the same answer on every
   device ("not implemented: …"). Only then: can it run *here* ("not available: needs a Hopper
   GPU" for cute_moe on a CPU)?
2. **How far from the oracle?** The four measures of :mod:`compare.metrics` against the fp64 oracle
   on the backend's own (quantized) inputs, checked against the tolerance policy; for an FP8 case,
   also against the unquantized bf16 problem ("err vs bf16": what a user sees).
3. **Bitwise deterministic?** A second call on the same inputs must give the same bits.
4. **Batch invariant?** A few tokens (:data:`PROBE_TOKENS`: the first and the last of the batch) run
   alone, T = 1, must give the same bits as inside the batch. A server batches unrelated requests;
   a kernel whose tiling or reduction order depends on the batch makes a request's answer depend on
   its neighbours. FP8 per tensor cannot be invariant: its activation scale is the batch's amax.
5. **Which experts carry the error?** The error attributed to each expert through the tokens routed
   to it (:func:`compare.metrics.kernel_error_by_expert`).

Across the backends of a case: the two kernels against each other (``xdiff``), and the per-expert
table (:func:`expert_table`) with its flags.
"""

from __future__ import annotations

import torch

import compare.metrics as metrics
from compare.backends import KERNELS, Backend
from compare.cases import Case
from moe_spec.oracle import rel_l2
from moe_spec.problem import MoEInputs
from moe_spec.validate import MoEDims

PROBE_TOKENS = 2  # tokens of each batch rerun alone for the batch-invariance column
EXPERTS_KEPT = 3  # per error column, the worst experts kept in the results besides the flagged ones


def describe(backend: Backend, dims: MoEDims, quant) -> str:
    """The config the backend will run with, in its own words."""
    if backend.missing:
        return ""
    try:
        return backend.describe(dims, quant)
    except Exception as exc:  # noqa: BLE001 - a config we cannot name is reported, not fatal
        return f"(config unknown: {type(exc).__name__})"


def _first_line(exc: BaseException) -> str:
    """The exception's first line; of a very long one (torch's dispatcher lists every backend it
    knows), the first sentence."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return line.split(". ")[0] + "." if len(line) > 300 and ". " in line else line


def refusal(exc: BaseException, declared: bool = False) -> str:
    """A backend's exception as a status. ``declared``: raised by the T = 0 probe, where a
    NotImplementedError is the backend declining the format ("not implemented"). Raised by a real
    call it means this machine lacks something ("not available": torch has no CPU kernel for
    ``_scaled_grouped_mm``). The suite only builds valid problems: any other exception is a bug."""
    if isinstance(exc, NotImplementedError):
        kind = "not implemented" if declared else f"not available: {type(exc).__name__}"
        return f"{kind}: {_first_line(exc)}"
    return f"error: {type(exc).__name__}: {_first_line(exc)}"


def call(backend: Backend, inputs: MoEInputs):
    out = backend.fused_moe(**inputs.kwargs())
    if inputs.x.is_cuda:
        torch.cuda.synchronize()
    return out


def _tokens(inputs: MoEInputs, index: slice) -> MoEInputs:
    """The same problem restricted to some tokens (same weights and scales)."""
    return MoEInputs(
        inputs.x[index].contiguous(),
        inputs.w1,
        inputs.w2,
        inputs.topk_weights[index].contiguous(),
        inputs.topk_ids[index].contiguous(),
        inputs.quant,
        inputs.w1_scale,
        inputs.w2_scale,
    )


def unavailable(backend: Backend, inputs: MoEInputs, device: str) -> str | None:
    """Why the backend will not run this problem (a status), or None: run it. See step 1 above."""
    if backend.missing:
        return f"not available: {backend.missing}"
    try:
        backend.fused_moe(**_tokens(inputs, slice(0, 0)).kwargs())
    except NotImplementedError as exc:
        return refusal(exc, declared=True)
    except Exception:  # noqa: BLE001 - the probe answers one question; the real call reports the rest
        pass
    reason = backend.unavailable(inputs.quant, device)
    return f"not available: {reason}" if reason else None


def probe_tokens(T: int) -> list[int]:
    """The tokens rerun alone: the first and the last (different tiles, the last one masked)."""
    return sorted({0, T - 1})[:PROBE_TOKENS] if T > 1 else []


def batch_invariant(backend: Backend, inputs: MoEInputs, out: torch.Tensor) -> bool | None:
    """Whether each probe token's output alone (T = 1) has the same bits as inside the batch.
    None for T = 1 (the batch is the token)."""
    tokens = probe_tokens(inputs.x.shape[0])
    if not tokens:
        return None
    return all(metrics.bitwise_equal(call(backend, _tokens(inputs, slice(t, t + 1)))[0], out[t]) for t in tokens)


def measure(backend: Backend, case: Case) -> tuple[dict, torch.Tensor | None]:
    """Steps 2-5 for one backend: (row fields, output or None when it did not run)."""
    try:
        out = call(backend, case.inputs)
        again = call(backend, case.inputs)
    except Exception as exc:  # noqa: BLE001 - every refusal or crash becomes an explicit row
        return {"status": refusal(exc)}, None
    err = metrics.errors(out, case.ref.out)
    passed, why = metrics.check(err, case.quant)
    row = {
        "status": "ok" if passed else "FAIL",
        "check": why,
        **err.as_dict(),
        "deterministic": metrics.bitwise_equal(out, again),
        "err_vs_bf16": rel_l2(out, case.ref_bf16.out) if case.quant is not None else None,
        "expert_errors": metrics.kernel_error_by_expert(
            out, case.ref.out, case.inputs.topk_ids, case.shape.num_experts
        ),
    }
    try:
        row["batch_invariant"] = batch_invariant(backend, case.inputs, out)
    except Exception as exc:  # noqa: BLE001 - a crash on one token alone is a bug of the backend
        row.update(
            status=f"error: on one token alone (T = 1): {type(exc).__name__}: {_first_line(exc)}", batch_invariant=None
        )
    return row, out


def cross_check(rows: dict, outputs: dict, quant) -> None:
    """The two kernels against each other (``xdiff``), when both ran."""
    if all(k in outputs for k in KERNELS):
        diff = rel_l2(*(outputs[k] for k in KERNELS))
        for k in KERNELS:
            rows[k]["xdiff"] = diff
            rows[k]["xdiff_ok"] = diff <= metrics.cross_backend_tolerance(quant)


# --- per expert ----------------------------------------------------------------------------------


def expert_table(ref, ref_bf16, rows: dict, quant, num_experts: int) -> list[dict]:
    """Per expert: pairs routed, quantization error (exact, from the oracle's per-pair outputs),
    each backend's attributed kernel error; flagged when one stands out (metrics.flag_outliers)."""
    tol = metrics.tolerance_for(quant)
    ids = ref.topk_ids
    quant_err: list = []
    for e in range(num_experts):
        mask = ids == e
        if quant is None or not bool(mask.any()):
            quant_err.append(None)
        else:
            quant_err.append(rel_l2(ref.pair_output[mask], ref_bf16.pair_output[mask]))
    flags_by_source = {"quant": metrics.flag_outliers(quant_err, factor=3.0, bound=tol.quant_error)}
    for name, r in rows.items():
        if "expert_errors" in r:
            flags_by_source[name] = metrics.flag_outliers(r["expert_errors"], factor=4.0, bound=tol.rel_l2)
    table = []
    for e in range(num_experts):
        pairs = int((ids == e).sum())
        if not pairs:
            continue
        table.append(
            {
                "expert": e,
                "pairs": pairs,
                "quant_error": quant_err[e],
                "kernel_error": {name: r["expert_errors"][e] for name, r in rows.items() if "expert_errors" in r},
                "flags": {src: f[e] for src, f in flags_by_source.items() if f[e]},
            }
        )
    return table


def _median(values):
    present = sorted(v for v in values if v is not None)
    return present[len(present) // 2] if present else None


def notable(experts: list, keep: int = EXPERTS_KEPT) -> list:
    """The experts worth printing: every flagged one, and the ``keep`` worst by each error column
    (a DeepSeek case routes to 256 experts; the full table would dwarf the report)."""
    chosen = {e["expert"] for e in experts if e["flags"]}
    sources = list(experts[0]["kernel_error"]) if experts else []
    columns = [lambda e: e["quant_error"]] + [(lambda name: lambda e: e["kernel_error"].get(name))(n) for n in sources]
    for column in columns:
        ranked = sorted((e for e in experts if column(e) is not None), key=column, reverse=True)
        chosen.update(e["expert"] for e in ranked[:keep])
    return [e for e in experts if e["expert"] in chosen]


def case_record(case: Case, rows: dict) -> dict:
    """The case's own entry (quantization error, per-expert table); fills each row's expert columns."""
    experts = expert_table(case.ref, case.ref_bf16, rows, case.quant, case.shape.num_experts)
    flagged = [e for e in experts if e["flags"]]
    quant_error = case.quant_error
    for name, row in rows.items():
        row.pop("expert_errors", None)
        row["quant_error"] = quant_error
        row["flagged_experts"] = sum(name in e["flags"] for e in flagged)
    return {
        **case.fields(),
        "quant_error": quant_error,
        "experts_hit": len(experts),
        "median_expert_quant_error": _median(e["quant_error"] for e in experts),
        "flagged_experts": [e["expert"] for e in flagged],
        "experts": notable(experts),
    }

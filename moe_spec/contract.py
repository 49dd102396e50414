"""The backend contract, and its vLLM-compatible spelling.

Both backends implement::

    fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None,
              a1_scale=None, a2_scale=None, **backend_options) -> Tensor[T, K] (bf16)

with the tensors of :mod:`moe_spec.problem`, ``quant`` one of the registry
:data:`moe_spec.quant.FORMATS` (weight dtype and scale shapes are the format's), activations
quantized inside the backend when ``quant`` is an fp8 format, and the output the fp64 oracle
(:mod:`moe_spec.oracle`) within the format's tolerance. ``T = 0`` returns an empty [0, K] tensor —
after the same checks as any other T (the empty-batch rule of :mod:`moe_spec.plan`: a call refused
at T = 1 is refused at T = 0 — a device the backend cannot run on included).

How close is close: the error is ``moe_spec.oracle.rel_l2_terms`` — ‖out − oracle‖₂ over the larger
of ‖oracle‖₂ and the L2 norm of the root-sum-square of the terms that add up to each output (GEMM2's
products over I, times the routing weights, over the top_k slots) — within the format's tolerance.
A kernel rounds terms, so its error scales with them; where they cancel (two experts of opposite
sign, GEMM2's sum at small K) the output is smaller than its terms and the plain relative L2 of
the output would blame the kernel for the cancellation. On data without cancellation the two
agree (``notes/numerics.md``, "Under cancellation").

Every surface, one check of the sizes. ``fused_moe``, ``fused_experts``, both ``warmup`` functions,
the transformers experts forward (``compare.hf_experts``) and the sharded layers
(``compare.distributed``) run :func:`moe_spec.validate.check_sizes` on the layer's sizes (E, K, I,
top_k, and T or the warm-up's ``max_tokens``) with the backend's :class:`moe_spec.validate.Limits`
before they allocate or compile anything: they refuse the same layers with the same words, each
naming its own argument (``w1`` in ``fused_moe``, ``E`` in a warm-up, ``gate_up_proj`` in the
transformers forward). Devices likewise (:func:`moe_spec.validate.check_runs_on`): cute_moe runs on a
CUDA device only, triton_moe on a CPU only under ``TRITON_INTERPRET=1``; anything else is refused
in one line that says what to do.

Static activation scales. ``a1_scale`` (x's) and ``a2_scale`` (the intermediate SiLU(gate)·up's)
replace the two dynamic per-tensor activation scales by calibrated ones: ``quant="fp8_tensor"``
only (the one format whose activation scale spans the whole batch), both or neither (a lone one is
refused naming the missing one), each a float32 tensor of one element — shape [] (vLLM's
``input_scale.max()``) or [1] — on the device of x. The oracle quantizes with them as given,
``e4m3(clamp(a / s, ±448))``: values beyond 448·s saturate. A backend that does not implement them
refuses them by name before any launch (both of ours implement them). With them a token's output does not depend
on the other tokens of the batch (``notes/triton_moe.md``).

Bad arguments. Every argument is checked by :func:`moe_spec.validate.validate_moe_args`; a bad one
raises TypeError (a type or dtype) or ValueError (anything else) whose message starts with the
argument's name. Nothing on the hot path reads device memory back to the host (no sync), so a call
costs the same eager as in a CUDA graph:

* Checked on the host, from metadata, before any launch, in every mode: types, dtypes, shapes,
  scale shapes, the int32 limits that remain (one expert's 2I·K elements; T·top_k·max(K, 2I)
  elements in the sorted activation copies — W1 and W2 as a whole may exceed 2³¹, their experts
  are addressed with 64-bit offsets), a backend's limits, meta tensors (refused: they have no
  data), one device, contiguity.
* Checked on the device, by the kernels that read the data anyway (or by torch ops,
  :func:`moe_spec.validate.guard_routing`), without a sync (the default ``"device"`` mode): ids
  in [0, E) and distinct within a row, routing weights finite, scales (weight and static
  activation scales) finite and positive. A
  failed check ORs its bit into the device's error word
  (:func:`moe_spec.validate.error_word`). The bad data never makes a kernel read or write out of
  bounds; what it produces:

  - an id outside [0, E): the pair is sorted and computed with the id clamped into range (under
    FP8 its intermediate is zeroed, so no shared scale sees it) and its routing weight is
    replaced by NaN — its token's output row is NaN, the other rows are unaffected;
  - a repeated id in a row: the expert is computed once per slot and the slots summed, as the
    formula ``Σ_j w[t, j]·f_{e_j}(x[t])`` reads, and flagged;
  - a NaN or inf routing weight: it multiplies its pair, so its token's row is not finite;
  - a scale (weight scale, ``a1_scale``, ``a2_scale``) that is NaN, inf, zero, negative or −0.0:
    used as given, flagged when a kernel reads it (an expert no token reaches is not read; the
    ``"sync"`` mode checks every scale). NaN and inf come out non-finite; **zero, −0.0 and a
    negative scale come out finite** — zeros, or values of flipped sign, numbers that look
    plausible. Such a call is told only by the error word, which the next call raises (below).

  How the error word reaches the caller, without a sync:

  - **the next call raises it**: each backend's ``fused_moe``, once its arguments pass, calls
    :func:`moe_spec.validate.surface_errors`, which reads a host copy of the word (pinned memory,
    refreshed by a non-blocking device→host copy at most every
    :data:`moe_spec.validate.COPY_INTERVAL_S`, on the call's stream, never during a CUDA graph
    capture; on a CPU, the word itself) and raises the ValueError naming the argument if a check
    failed. That is a call after the failing one once the device has finished it and a copy has
    landed — on a GPU typically the next call or the one after, on a CPU always the next. The call
    that raises launches nothing;
  - :func:`moe_spec.validate.poll` raises the same from the host copy, at a point the caller
    chooses, without a sync (a serving loop may poll once per step);
  - :func:`moe_spec.validate.check` reads the word itself (one sync, when the caller chooses),
    clears it and raises — the way to know about the last call, and about calls replayed inside a
    CUDA graph (no copy is captured).

  The ``"sync"`` mode (``MOE_CHECK=sync``, :func:`moe_spec.validate.set_check_mode`,
  ``with moe_spec.validate.checks("sync")``) also reads the data in ``validate_moe_args`` and
  raises before the first launch, as a debugging aid; it is skipped during a CUDA graph capture,
  where a sync is illegal (the device checks still run there).

NaN and overflow. ``x`` and the weights are data, not checked: a NaN there comes out where the
oracle has NaN — in bf16 the rows of the tokens that meet it; in FP8 every value of a scale group
that contains a NaN (or an inf) is NaN, so fp8_tensor's single activation scale makes a whole
output NaN, while fp8_channel and fp8_block keep it to the tokens that meet it. A backend may not
lose a NaN (a max, a clamp or a saturating cast that drops NaN is a bug). Overflow is not hidden
either: values beyond fp32 in the intermediate (SiLU(gate)·up) become inf in a kernel, which the
oracle models under FP8 (NaN, as above) but not in bf16, where it computes in fp64; there the
oracle's output is finite but beyond bf16's range (±inf once rounded) and the kernel's row is NaN
(inf − inf in GEMM2). ``notes/numerics.md`` has the details.

:func:`make_fused_experts` wraps such a function into vLLM's ``fused_experts`` signature so that a
serving stack can swap either backend in; ``a1_scale`` / ``a2_scale`` reach the backend only when
given. Options of vLLM that this project does not implement (int8/int4 weights, expert maps, other
activations) raise ValueError instead of being ignored.
"""

from __future__ import annotations

import functools

import torch

from moe_spec.quant import FORMATS, FP8_DTYPE, WHOLE, get_format


def quant_from_vllm(use_fp8_w8a8=False, per_channel_quant=False, block_shape=None):
    """vLLM's quantization flags → one of this project's quant formats.

    The flags describe the weight's scale groups — per tensor, per output channel, or
    ``block_shape`` = [rows, cols] — and the format is the FP8 row of the registry with that
    ``weight_group``.
    """
    if not use_fp8_w8a8:
        if per_channel_quant or block_shape is not None:
            raise ValueError("per_channel_quant/block_shape: only meaningful with use_fp8_w8a8=True")
        return None
    if block_shape is not None:
        if (
            not isinstance(block_shape, (list, tuple))
            or len(block_shape) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block_shape)
        ):
            raise TypeError(
                f"block_shape: expected None or [rows, cols] (two positive ints, e.g. [128, 128]), got {block_shape!r}"
            )
        group, arg = tuple(block_shape), "block_shape"
    else:
        group, arg = ((1, WHOLE) if per_channel_quant else (WHOLE, WHOLE)), "per_channel_quant"
    for fmt in FORMATS.values():
        if fmt.weight_dtype == FP8_DTYPE and fmt.weight_group == group:
            return fmt.name
    blocks = [list(f.weight_group) for f in FORMATS.values() if f.quantized and WHOLE not in f.weight_group]
    raise ValueError(
        f"{arg}: no fp8 format of this project has weight scale groups {list(group)}; "
        f"block_shape may be one of {blocks}"
    )


def _vllm_scale(s, w, quant):
    """vLLM keeps singleton dimensions in its scales (per-channel [E, N, 1], per-tensor [E, 1, 1]):
    a scale that equals the contract's shape up to size-1 dimensions is reshaped to it."""
    fmt = get_format(quant)
    if not (isinstance(s, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 3 and fmt.quantized):
        return s  # None, or a wrong argument that validation will name
    want = fmt.weight_scale_shape(*w.shape)
    if tuple(s.shape) != want and [d for d in s.shape if d != 1] == [d for d in want if d != 1]:
        return s.reshape(want)
    return s


def make_fused_experts(fused_moe):
    """Return ``fused_experts`` with vLLM's signature, calling ``fused_moe``."""

    @functools.wraps(fused_moe, assigned=("__module__",))
    def fused_experts(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        inplace=False,
        activation="silu",
        apply_router_weight_on_input=False,
        use_fp8_w8a8=False,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=False,
        global_num_experts=-1,
        expert_map=None,
        w1_scale=None,
        w2_scale=None,
        w1_zp=None,
        w2_zp=None,
        a1_scale=None,
        a2_scale=None,
        block_shape=None,
        **backend_options,
    ):
        unsupported = {
            "activation": activation != "silu",
            "apply_router_weight_on_input": apply_router_weight_on_input,
            "use_int8_w8a8": use_int8_w8a8,
            "use_int8_w8a16": use_int8_w8a16,
            "use_int4_w4a16": use_int4_w4a16,
            "expert_map": expert_map is not None,
            "w1_zp": w1_zp is not None,
            "w2_zp": w2_zp is not None,
        }
        bad = [name for name, hit in unsupported.items() if hit]
        if bad:
            raise ValueError(f"{bad[0]}: not supported by this backend (SiLU-gated experts, fp8 W8A8, no expert map)")
        if global_num_experts != -1 and not (isinstance(w1, torch.Tensor) and global_num_experts == w1.shape[0]):
            raise ValueError(f"global_num_experts: expected -1 or E (w1.shape[0]), got {global_num_experts}")
        quant = quant_from_vllm(use_fp8_w8a8, per_channel_quant, block_shape)
        if a1_scale is not None or a2_scale is not None:  # static activation scales (fp8_tensor)
            backend_options.update(a1_scale=a1_scale, a2_scale=a2_scale)
        if (
            inplace
            and isinstance(hidden_states, torch.Tensor)
            and hidden_states.requires_grad
            and torch.is_grad_enabled()
        ):
            raise ValueError(
                "hidden_states: inplace=True writes the output into it, but it requires grad (autograd "
                "forbids that, and the kernels have no backward); pass inplace=False or run under "
                "torch.no_grad()"
            )
        try:
            out = fused_moe(
                hidden_states,
                w1,
                w2,
                topk_weights,
                topk_ids,
                quant=quant,
                w1_scale=_vllm_scale(w1_scale, w1, quant),
                w2_scale=_vllm_scale(w2_scale, w2, quant),
                **backend_options,
            )
        except (TypeError, ValueError) as exc:  # the contract's x is vLLM's hidden_states
            if str(exc).startswith("x: "):
                raise type(exc)("hidden_states: " + str(exc)[3:]) from None
            raise
        if inplace:
            hidden_states.copy_(out)
            return hidden_states
        return out

    fused_experts.limits = getattr(fused_moe, "limits", None)  # the backend's (moe_spec.validate.Limits)
    fused_experts.__name__ = "fused_experts"
    fused_experts.__qualname__ = "fused_experts"
    fused_experts.__doc__ = "vLLM-compatible spelling of this backend's fused_moe (see moe_spec.contract).\n\n" + (
        fused_moe.__doc__ or ""
    )
    return fused_experts

"""``fused_moe``: the whole expert computation of one MoE layer in five to eight Triton launches.

::

    plan               the config, checked for the quant format (host only, cached)
    _count_kernel      topk_ids → per-chunk expert histograms
    _place_kernel      → Alignment: sorted_ids, expert_of_block, …  + checks of topk_ids
    amax_kernel        partial amaxes of x                (fp8_tensor with dynamic scales only)
    quantize_kernel    x → xq E4M3 [T, K] + scales; zeroes GEMM1's amax buffer   (FP8, unless GEMM1 does it)
    moe_gemm_kernel    GEMM1 + SiLU(gate)·up (+ amax of the intermediate) → act [P, I]
                       or, where its scale is known in the tile, → aq E4M3 [P, I] (+ block scales)
    quantize_kernel    act fp32 → E4M3 [P, I] + scales     (FP8 unless GEMM1 quantized it)
    moe_gemm_kernel    GEMM2 × routing weight (GEMM2's own tile, if any)  → y [P, K]
    combine_kernel     out[t] = Σ_j y[t·top_k + j]                        (skipped for top_k = 1)

Static activation scales (``a1_scale``, ``a2_scale``: fp8_tensor, :mod:`moe_spec.contract`): the
amax kernel and GEMM1's amax are skipped, x's quantize launch divides by ``a1_scale`` and GEMM1's
epilogue by ``a2_scale`` (each checked into the error word) — six launches instead of eight.
GEMM1's epilogue also quantizes fp8_block's intermediate when its tile holds whole 1×128 groups
(seven launches → six); THE rule is :func:`triton_moe.plan.epilogue_quant`, and
:func:`separate_act_quant` turns it off for comparisons. GEMM1 can quantize x in its A load where one
program of a decode-size tile can make x's scale (THE rule :func:`triton_moe.plan.x_quant_in_gemm1`);
that path is off in the product (measured slower, ``X_QUANT_IN_GEMM1``), so x keeps its launch.

No launch fills or zeroes a buffer: every buffer is written whole by the kernel that produces it
(the alignment writes its padding; x's quantization zeroes the amax GEMM1 accumulates into). The
exceptions are split-K's per-tile counts (configs with ``split_k`` > 1) and, where GEMM1 quantizes
x, that amax: zeroed when the workspace is made — once per eager workspace, one memset per replay
of a captured CUDA graph — and left zero by every GEMM1 launch / intermediate quantization.

Nothing here reads device data on the host, so a call is as cheap eager as in a CUDA graph and can
be captured and replayed for new routing; the buffer sizes depend only on T, top_k, E and the
config. The data checks of the contract run inside the kernels (``moe_spec.validate``: the
alignment flags bad and repeated ids, the GEMMs bad routing weights and scales, into the device's
error word; :func:`moe_spec.validate.check` raises).

Host cost per call: the argument checks' verdict is cached per signature
(:func:`moe_spec.validate.validate_moe_args`); the plan, with every launch's grid and constexprs
bound to it, per (sizes, options, device), and the intermediate buffers per (sizes, device,
stream, thread): :mod:`triton_moe.launches` (the returned output is always a new tensor).
See :mod:`triton_moe.kernels` for the arithmetic and :mod:`triton_moe.config` for the tile rule.
"""

from __future__ import annotations

import contextlib
import functools

import torch

import triton_moe.capture as capture
import triton_moe.plan as rules
from moe_spec.align import Alignment
from moe_spec.validate import (
    BAD_A1_SCALE,
    BAD_A2_SCALE,
    Limits,
    MoEDims,
    check_runs_on,
    error_word,
    surface_errors,
    validate_moe_args,
)
from triton_moe.align import MAX_EXPERTS, align_into, buffer_sizes
from triton_moe.config import DecodeConfig, TritonConfig
from triton_moe.decode import decode_fused_moe, decode_launch
from triton_moe.jit import INTERPRET
from triton_moe.kernels_tma import check_tma_operand, gemm_tma
from triton_moe.launches import (  # noqa: F401 (some read by tests as moe.X)
    AMAX_BLOCK,
    COMBINE_BLOCK,
    PARTS,
    QUANT_GROUPS,
    WORKSPACES,
    _buffers,
    _cdiv,
    _gemm_constants,
    _Launches,
    _launches,
    _numel,
    _quantize,
    _quantize_launches,
    _split,
    _workspace,
    _workspace_of,
    _workspaces,
)
from triton_moe.plan import plan

#: What this backend adds to the contract (moe_spec.validate.Limits): every surface checks it. Off
#: a GPU it runs only under Triton's interpreter, which TRITON_INTERPRET=1 selects at import.
LIMITS = Limits(
    "triton_moe",
    MAX_EXPERTS,
    cpu=None
    if INTERPRET
    else "on a CPU, set TRITON_INTERPRET=1 before Python imports triton (Triton's interpreter: slow, exact)",
)


def _gemm(
    bound,
    constants,
    a,
    a_scale,
    w,
    w_scale,
    out,
    out_amax,
    topk_weights,
    topk_ids,
    error,
    routing: Alignment,
    num_padded,
    N,
    K,
    cfg: TritonConfig,
    static=False,
    split=None,
):
    """One grouped GEMM; ``cfg`` is that GEMM's config (its kernel: grouped, through the bound launch
    ``bound``, or persistent TMA, with ``constants``)."""
    if cfg.persistent_tma:  # the persistent TMA kernel (triton_moe.kernels_tma): only when the config asks
        return gemm_tma(
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
            constants,
            flatten=cfg.tma_flatten,
            static=static,
        )
    dummy = out  # stands in for pointers a mode does not read
    bound(
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
        *(split if split is not None else (dummy, dummy)),
        routing.num_pairs,
        N,
        K,
        w.shape[0],
    )


class _Call:
    """What a ``fused_moe`` call takes from its plan, found once per call signature
    (:func:`_call_of`): the plan, the workspace's sizes, whether a GEMM reads its weight by TMA,
    and the launches bound for this shape (:class:`_Launches`; None for T = 0)."""

    __slots__ = ("plan", "sizes", "tma1", "tma2", "launches", "primed")

    def __init__(self, p, d: MoEDims, quant, device, static: bool):
        self.plan, self.tma1, self.tma2 = p, p.gemm1.persistent_tma, p.gemm2.persistent_tma
        if p.path == "decode":  # one launch (triton_moe.decode): no alignment, nothing bound here
            self.sizes = self.launches = None
            self.primed = set()  # the signatures whose captured path ran once (triton_moe.capture.prime)
            return
        tile = p.align_tile
        rules_ = p.epilogue_quant(static), p.x_quant_in_gemm1(static)
        self.sizes = (d.T, d.top_k, d.E, d.K, d.I, quant, tile, device, _split(p.config), *rules_)
        self.launches = (
            None
            if not d.T
            else _launches(
                d.T, d.top_k, d.K, d.I, quant, p.config, buffer_sizes(d.T, d.top_k, d.E, tile)["blocks"], static
            )
        )


@functools.lru_cache(maxsize=1024)
def _call_of(dims, quant, config, swap_ab, device, static: bool, eager: bool = False) -> _Call:
    return _Call(plan(dims, quant, config=config, swap_ab=swap_ab, eager=eager), dims, quant, device, static)


def forget_plans() -> None:
    """Drop the cached plans and bound launches (after a change of a module constant they read)."""
    for cached in (_call_of, _launches, _quantize_launches, _gemm_constants, decode_launch):
        cached.cache_clear()


@contextlib.contextmanager
def rule_set(switch: str, on: bool):
    """Tests and the lab only: inside the block the plan's switch ``switch`` (a module constant of
    :mod:`triton_moe.plan`: ``EPILOGUE_QUANT``, ``X_QUANT_IN_GEMM1``) is ``on``, the cached plans and
    launches dropped on entry and on exit (workspaces are keyed by the rules' answers)."""
    if not isinstance(getattr(rules, switch, None), bool):
        raise ValueError(f"switch: expected a bool constant of triton_moe.plan, got {switch!r}")
    before = getattr(rules, switch)
    setattr(rules, switch, on)
    forget_plans()
    try:
        yield
    finally:
        setattr(rules, switch, before)
        forget_plans()


def separate_act_quant():
    """Tests and the lab only: inside the block no call quantizes the FP8 intermediate in GEMM1's
    epilogue — GEMM1 writes it in fp32 and ``quantize_kernel`` quantizes it, the path every call
    took before (:data:`triton_moe.plan.EPILOGUE_QUANT` off, the cached plans and launches dropped
    on entry and on exit; workspaces are keyed by the rule's answer)."""
    return rule_set("EPILOGUE_QUANT", False)


def separate_x_quant():
    """Tests and the lab only: no GEMM1 quantizes x in its A load inside the block, the product's default
    (:data:`triton_moe.plan.X_QUANT_IN_GEMM1` off; ``rule_set("X_QUANT_IN_GEMM1", True)`` turns it on)."""
    return rule_set("X_QUANT_IN_GEMM1", False)


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
    a1_scale=None,
    a2_scale=None,
    config: TritonConfig | None = None,
    swap_ab: bool | None = None,
) -> torch.Tensor:
    """The MoE expert computation (see :mod:`moe_spec.contract`) with Triton kernels → [T, K] bf16.

    ``a1_scale`` / ``a2_scale``: static activation scales of x and of the intermediate (fp8_tensor,
    both or neither; one fp32 element each): two launches fewer (no amax of x; GEMM1 quantizes the
    intermediate), and batch-invariant rows.

    Backend options:
      ``config``   a :class:`~triton_moe.config.TritonConfig`; default: the tuned table for this
                   shape and device, else the heuristic (:func:`~triton_moe.heuristic.get_config`).
      ``swap_ab``  force swap-AB on (True) or off (False); default: the config's rule.

    The arguments, then the options and this backend's limits (:func:`~triton_moe.plan.plan`), are
    checked before any launch — T = 0 included: an empty batch returns the empty [0, K] tensor only
    when the call would run at T = 1. The data (ids, routing weights, scales) is checked by the
    kernels, without a sync (:mod:`moe_spec.contract`).
    """
    d = validate_moe_args(
        x,
        w1,
        w2,
        topk_weights,
        topk_ids,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        limits=LIMITS,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
    )
    static = a1_scale is not None  # static activation scales (validated: fp8_tensor, both given)
    eager = rules.eager_call(d, x)
    if (config is None or type(config) in (TritonConfig, DecodeConfig)) and (swap_ab is None or type(swap_ab) is bool):
        c = _call_of(d, quant, config, swap_ab, x.device, static, eager)
    else:  # raises, naming the option (or a TritonConfig subclass: planned every call)
        c = _Call(plan(d, quant, config=config, swap_ab=swap_ab, eager=eager), d, quant, x.device, static)
    check_runs_on(x.device, LIMITS)  # T = 0 included: what T = 1 refuses, T = 0 refuses
    surface_errors(x.device)  # an earlier call's failed data check raises here (moe_spec.contract)
    if d.T == 0:
        return x.new_empty((0, d.K))
    if c.launches is None:  # the plan's path: the one-launch decode kernel
        kw = dict(quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale)
        if eager and config is None:  # a CUDA graph would capture the grouped pipeline: load its kernels first
            capture.prime(fused_moe, d, c, (x, w1, w2, topk_weights, topk_ids), kw)
        return decode_fused_moe(x, w1, w2, topk_weights, topk_ids, **kw, config=c.plan.config)
    if c.tma1:  # TMA reads the weights: 16-byte rows and base, checked before any launch
        check_tma_operand("w1", w1)
    if c.tma2:
        check_tma_operand("w2", w2)
    ws = _workspace_of(c.sizes)
    error = error_word(x.device)
    routing = align_into(
        topk_ids, d.E, c.sizes[6], ws["sorted_ids"], ws["expert_of_block"], ws["expert_end"], ws["counts"], error
    )
    return expert_computation(
        x,
        w1,
        w2,
        topk_weights,
        topk_ids,
        routing,
        quant=quant,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        config=c.plan.config,
        workspace=ws,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        launches=c.launches,
    )


fused_moe.limits = LIMITS


def expert_computation(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    routing,
    *,
    quant,
    w1_scale,
    w2_scale,
    config: TritonConfig,
    workspace: dict | None = None,
    a1_scale=None,
    a2_scale=None,
    launches: _Launches | None = None,
) -> torch.Tensor:
    """Everything after the alignment: quantize x (or GEMM1 does), GEMM1 + SiLU·up, quantize the
    intermediate, GEMM2 × routing weight, combine.

    ``routing`` is the :class:`~moe_spec.align.Alignment` of ``topk_ids`` for ``config.BLOCK_M``
    (:func:`~triton_moe.align.align_block_size`); ``config`` must be resolved and checked (a
    plan's); GEMM2 runs its ``gemm2`` tile when it has one; ``workspace``: the buffers of
    :func:`_buffers` (default: new ones); ``launches``: :func:`_launches` of this call (default:
    looked up). :func:`fused_moe` is the validated entry point; the benchmark times this part alone
    (the alignment is timed separately).
    """
    T, K = x.shape
    E, I = w2.shape[0], w2.shape[2]  # noqa: E741
    top_k = topk_ids.shape[1]
    static = a1_scale is not None  # static activation scales (validated: fp8_tensor, both given)
    b = launches or _launches(T, top_k, K, I, quant, config, routing.expert_of_block.numel(), static)
    fused = b.epilogue_quant  # GEMM1's epilogue quantizes the intermediate (triton_moe.plan.epilogue_quant)
    in_gemm1 = b.x_quant_in_gemm1  # GEMM1 quantizes x in its A load (triton_moe.plan.x_quant_in_gemm1)
    ws = workspace or _buffers(T, top_k, E, K, I, quant, config.BLOCK_M, x.device, _split(config), fused, in_gemm1)
    num_padded = ws["num_padded"] if routing.expert_end is ws["expert_end"] else routing.num_padded
    error = error_word(x.device)
    cfg1, cfg2 = b.cfg1, b.cfg2
    a1, s1, act_amax = x, None, None
    if in_gemm1:  # bf16 x to GEMM1; a static scale read there; the amax made zero, kept zero (_buffers)
        s1, act_amax = a1_scale, None if fused or static else ws["act_amax"]
    elif static:
        a1, s1 = _quantize(x, quant, q=ws["xq"], scale=a1_scale, static_bit=BAD_A1_SCALE, launches=b.x_quant)
    elif b.quantized:
        act_amax = None if fused else ws["act_amax"]
        a1, s1 = _quantize(
            x, quant, q=ws["xq"], scale=ws["x_scale"], parts=ws["parts"], zero=act_amax, launches=b.x_quant
        )

    # GEMM1 + SiLU(gate)·up: bf16 intermediate, or fp32 (with its amax unless the scale is static)
    # quantized once for GEMM2 — or, ``fused``, E4M3 with its scale (static: a2_scale, read; fp8_block:
    # written) straight from GEMM1's epilogue
    act, act_amax = (ws["aq"], a2_scale if static else ws["act_scale"]) if fused else (ws["act"], act_amax)
    _gemm(
        b.gemm1,
        b.const1,
        a1,
        s1,
        w1,
        w1_scale,
        act,
        act_amax,
        topk_weights,
        topk_ids,
        error,
        routing,
        num_padded,
        I,
        K,
        cfg1,
        static=static and not fused,  # passes the amax pointer (fused: the scale) through
        split=(ws["partials"], ws["counts_split"]) if b.split else None,
    )
    if fused:
        a2, s2 = act, act_amax
    elif static:
        a2, s2 = _quantize(act, quant, q=ws["aq"], scale=a2_scale, static_bit=BAD_A2_SCALE, launches=b.act_quant)
    elif act_amax is None:
        a2, s2 = act, None
    else:  # where GEMM1 quantizes x no launch zeroes the amax before GEMM1: this one leaves it zero
        into = dict(q=ws["aq"], scale=ws["act_scale"], zero=act_amax if in_gemm1 else None)
        a2, s2 = _quantize(act, quant, act_amax, **into, launches=b.act_quant)

    # GEMM2 × routing weight; with top_k = 1 its rows are already the output
    out = torch.empty((T, K), dtype=torch.bfloat16, device=x.device)
    y = out if top_k == 1 else ws["y"]
    _gemm(
        b.gemm2, b.const2, a2, s2, w2, w2_scale, y, None, topk_weights, topk_ids, error, routing, num_padded, K, I, cfg2
    )
    if top_k > 1:
        b.combine(y, out, T, K)
    return out


def gemm2(a2, s2, w2, w2_scale, y, topk_weights, topk_ids, routing, config: TritonConfig, *, quant) -> None:
    """GEMM2 alone, launched as :func:`expert_computation` launches it: y [P, K] (bf16, by pair) =
    routing weight × (a2 [P, I] · W2[e]ᵀ), with GEMM2's tile (``config.gemm2``, else the config's
    own) and GEMM2's kernel (grouped or persistent TMA).

    ``a2``: the intermediate — bf16, or under FP8 its E4M3 copy with the scales ``s2``;
    ``routing``: the alignment of ``topk_ids`` for ``config.BLOCK_M``; ``config`` resolved and
    checked (a plan's). ``python -m triton_moe.lab.bench_gemm2`` times this launch alone."""
    top_k = topk_ids.shape[1]
    P, I = a2.shape  # noqa: E741
    K = w2.shape[1]
    b = _launches(P // top_k, top_k, K, I, quant, config, routing.expert_of_block.numel())
    _gemm(
        b.gemm2,
        b.const2,
        a2,
        s2,
        w2,
        w2_scale,
        y,
        None,
        topk_weights,
        topk_ids,
        error_word(a2.device),
        routing,
        routing.num_padded,
        K,
        I,
        b.cfg2,
    )

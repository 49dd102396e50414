"""The FP8 (W8A8) layer's host side: the activation quantization and the scales' order.

``cute_moe.fused_moe`` with ``quant`` one of ``"fp8_tensor"``, ``"fp8_channel"``, ``"fp8_block"``
(weights already E4M3 with their scales, ``moe_spec.quant``) runs::

    quantize_tokens        x [T, K] bf16 → E4M3 + scales, once per layer    quantops: amax, quantize
    gather_rows            E4M3 rows in expert-sorted order (the bytes moved as bf16 pairs)
    GEMM1                  H = (x·s_x)(W1·s_w1)ᵀ in fp32 [M_pad, 2I]        gemm + fp8_gemm
                           (gated, the plan's default: A = SiLU(H_gate)·H_up in its epilogue, fp32 [M_pad, I])
    quantize_intermediate  A = SiLU(H_gate)·H_up in fp32 + its amax (gated: A's amax), then E4M3 + scales
    GEMM2                  Y = (A·s_a)(W2·s_w2)ᵀ · routing weight → bf16     gemm + fp8_gemm
    combine                out[t] = Σ_j Y[row(t, j)]

With ``LayerPlan.gather_quant`` (:func:`cute_moe.plan.gather_quant`) x's quantization and the gather are
one launch (``quantops.GatherQuantizeRows``: E4M3 rows and scales straight into the sorted
order, after x's amax for the tensor and channel formats, with no amax launch for fp8_block).

A gated GEMM1 quantizes A in its epilogue instead (swap-AB: the amax only; ``GemmConfig.epilogue_quant``, the
plan's :func:`~cute_moe.plan.epilogue_quant`; :mod:`cute_moe.epilogue_quant`): with static scales
("static") and fp8_block tiles of whole 128-column groups ("block") it writes E4M3 ``aq`` (and the block
scales) itself — no fp32 A, no amax or quantize launch; otherwise ("amax") it writes fp32 A and its amax,
and only the quantize launch follows.  ``EPILOGUE_QUANT = False`` in :mod:`cute_moe.plan` forces the path
above.

which is, step for step, the W8A8 model of ``moe_spec.oracle``: the activations are quantized
exactly as ``moe_spec.quant.quantize_activation`` does (IEEE divisions, round to nearest even,
saturating), the intermediate from unrounded fp32 values and — for the per-tensor format — over
the T·top_k rows that exist (the padding rows of the sorted order are masked out of its amax).

Static activation scales (``a1_scale``, ``a2_scale``: fp8_tensor only, :mod:`moe_spec.contract`):
the two amax launches are skipped (x's, and the intermediate's — SiLU·up's or a gated GEMM1's), and
each quantize launch divides by the given scale (``quantops.StaticQuantizeRows``, the plain path
computing SiLU·up from h on the way), which the GEMM then reads as given: the scale tensor itself is
the activation scale, nothing is written in its place.  A scale that is not finite and positive
sets ``BAD_A1_SCALE`` / ``BAD_A2_SCALE`` in the error word and is used as given, as in triton_moe.
No value then depends on another token of the batch: a token's output is its own.

Scales in the GEMMs' order: the activation scales of x are per *token*; the GEMM reads them per *sorted
row*, so channel and block scales are gathered along the token of every sorted row
(``moe.SortedRows.token_of_row``, a small torch ``index_select``, or written there by the gathering
quantize); the intermediate is quantized in sorted order already, its padding rows told apart by
:meth:`moe_spec.align.Alignment.holds_pair`.
"""

from __future__ import annotations

import math

import torch

from moe_spec.align import Alignment
from moe_spec.hopper import sm_count
from moe_spec.quant import FP8_DTYPE, activation_scale_shape

from .gemm_args import launch_args
from .quantops import compile_gather_quantize, compile_quant_kernels
from .rowmaps import SortedRows


def _launch_quantize(
    kernels: dict,
    prefix: str,
    src: torch.Tensor,
    amax: torch.Tensor,
    quant: str,
    used: torch.Tensor,
    out=None,
):
    """E4M3 copy of ``src`` [rows, cols] and its flat scales, from the flat ``amax``, into ``out``
    (a workspace's (E4M3 [rows, cols], fp32 like ``amax``)) or new tensors."""
    rows, cols = src.shape
    if out is None:
        out = torch.empty(rows, cols, dtype=FP8_DTYPE, device=src.device), torch.empty_like(amax)
    q, scale = out
    if q.shape != (rows, cols) or q.dtype != FP8_DTYPE or scale.shape != amax.shape:
        raise ValueError(
            f"out: expected (E4M3 [{rows}, {cols}], fp32 {list(amax.shape)}), got "
            f"({q.dtype} {list(q.shape)}, {list(scale.shape)})"
        )
    kernels[prefix + "_quantize"](src, amax, q, scale, used)
    return q, scale


_constants: dict = {}  # (value, device) -> int32 [1]
_CONSTANTS_MAX = 1024


def _row_count(n: int, device) -> torch.Tensor:
    """int32 [1] holding ``n`` (a kernel's row count), made once per (n, device) outside a CUDA graph
    capture (inside one: a new tensor, filled by the graph) — no fill launch in a warm call."""
    key = (n, device)
    t = _constants.get(key)
    if t is None:
        t = torch.full((1,), n, dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(_constants) >= _CONSTANTS_MAX:
                _constants.clear()
            _constants[key] = t
    return t


def amax_sizes(quant: str, T: int, rows: int, K: int, I: int) -> tuple[int, int]:  # noqa: E741
    """fp32 elements of the two amax buffers of the layer: x's ([T, K]) and the intermediate's
    ([rows, I], in sorted order)."""
    return math.prod(activation_scale_shape(quant, T, K)), math.prod(activation_scale_shape(quant, rows, I))


def layer_amax_sizes(p, T: int, rows: int, K: int, I: int) -> tuple[int, int]:  # noqa: E741
    """:func:`amax_sizes` of plan ``p``'s fused call, less what it never reads: x's amax under fp8_block where
    the gathering quantize takes each group's amax in its warp (one stand-in element: the launch's argument),
    the intermediate's where GEMM1's epilogue quantizes per block (none)."""
    n_x, n_a = amax_sizes(p.quant, T, rows, K, I)
    if p.gather_quant and p.quant == "fp8_block":
        n_x = 1
    return n_x, (0 if p.gemm1.epilogue_quant == "block" else n_a)


def _zeroed_amax(amax, n: int, device) -> torch.Tensor:
    if amax is None:
        return torch.zeros(n, dtype=torch.float32, device=device)
    if amax.dtype != torch.float32 or amax.shape != (n,):
        raise ValueError(f"amax: expected a zeroed fp32 [{n}] buffer, got {amax.dtype} {list(amax.shape)}")
    return amax


def quantize_tokens(
    x: torch.Tensor, quant: str, *, amax: torch.Tensor | None = None, out=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_spec.quant.quantize_activation(x, quant)`` on the device: (E4M3 [T, K], fp32 scales in
    its shape — [1], [T, 1] or [T, ⌈K/128⌉]).  ``amax``: a zeroed fp32 buffer of
    :func:`amax_sizes`' first size (``fused_moe``'s alignment zeroes it), else a new one (a fill);
    ``out``: (E4M3 [T, K], flat fp32 scales) of a workspace, else new ones."""
    T, K = x.shape
    kernels = compile_quant_kernels(quant, sm_count(x.device))
    shape = activation_scale_shape(quant, T, K)
    amax = _zeroed_amax(amax, math.prod(shape), x.device)
    used = _row_count(T, x.device)
    kernels["x_amax"](x, x, amax, used, used)  # x for `a`, `used` for the row mask: read by the SiLU variant only
    q, scale = _launch_quantize(kernels, "x", x, amax, quant, used, out)
    return q, scale.view(shape)


def sorted_token_scales(
    scale: torch.Tensor, token_of_row: torch.Tensor, quant: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x's scales in the GEMM's row order (``token_of_row``: the token of every sorted row):
    [1] (tensor), [M_pad] (channel), [M_pad, ⌈K/128⌉] (block).  ``out``: the channel / block rows' buffer
    ([M_pad, 1] / [M_pad, ⌈K/128⌉] fp32, a workspace's), else a new one.  ``index_select`` into it, not
    ``scale[token_of_row]``: the same copy, without indexing's Python and allocation on every call."""
    if quant == "fp8_tensor":
        return scale
    rows = torch.index_select(scale, 0, token_of_row, out=out)
    return rows.view(-1) if quant == "fp8_channel" else rows


def _alignment_and_mask(rows) -> tuple[Alignment, torch.Tensor]:
    """(alignment, int32 row mask) of a :class:`~cute_moe.rowmaps.SortedRows` (its ``row_mask``,
    written by the alignment) or of an :class:`~moe_spec.align.Alignment` (``holds_pair``, torch ops)."""
    if isinstance(rows, SortedRows):
        return rows.alignment, rows.row_mask
    return rows, rows.holds_pair().to(torch.int32)


def silu_mul_amax(
    h: torch.Tensor, rows, quant: str, *, amax: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = SiLU(h[:, :I]) · h[:, I:]`` in fp32 from GEMM1's fp32 output h [M_pad, 2I], and its flat amax.

    ``rows`` (:class:`~cute_moe.rowmaps.SortedRows` or :class:`moe_spec.align.Alignment`): the rows
    that hold a (token, slot) pair count in the amax, the padding rows do not; A is written on the
    rows the GEMMs cover (``num_padded``, int32 [1] on the device) and left unwritten past them.
    ``amax``: a zeroed buffer (:func:`amax_sizes`' second size), else a new one; ``out``: A's buffer.
    """
    alignment, row_mask = _alignment_and_mask(rows)
    rows, two_i = h.shape
    i = two_i // 2
    kernels = compile_quant_kernels(quant, sm_count(h.device))
    amax = _zeroed_amax(amax, math.prod(activation_scale_shape(quant, rows, i)), h.device)
    a = torch.empty(rows, i, dtype=torch.float32, device=h.device) if out is None else out
    kernels["silu_amax"](h, a, amax, row_mask, alignment.num_padded)
    return a, amax


def gated_amax(a: torch.Tensor, rows, quant: str, *, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The flat amax of a gated GEMM1's fp32 output ``a = SiLU(gate)·up`` [M_pad, I] (SiLU·up already
    in its epilogue), padding rows left out as in :func:`silu_mul_amax` (``rows`` and ``amax`` are its)."""
    alignment, row_mask = _alignment_and_mask(rows)
    n = math.prod(activation_scale_shape(quant, a.shape[0], a.shape[1]))
    amax = _zeroed_amax(amax, n, a.device)
    compile_quant_kernels(quant, sm_count(a.device))["a_amax"](a, a, amax, row_mask, alignment.num_padded)
    return amax


def quantize_intermediate(
    h: torch.Tensor,
    rows,
    quant: str,
    *,
    amax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    q_out=None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(h[:, :I])·h[:, I:] of GEMM1's fp32 output h [M_pad, 2I], quantized per ``quant``
    (:func:`silu_mul_amax` — ``rows``, ``amax`` and ``out`` are its — then the quantize kernel,
    into ``q_out``: (E4M3 [M_pad, I], flat fp32 scales) of a workspace, else new ones).  ``gated``:
    h is a gated GEMM1's output, SiLU·up already, [M_pad, I] (:func:`gated_amax`; ``out`` unused).

    Returns (E4M3 [M_pad, I], fp32 scales in GEMM2's order: [1], [M_pad] or [M_pad, ⌈I/128⌉]).
    """
    if gated:
        a, amax = h, gated_amax(h, rows, quant, amax=amax)
    else:
        a, amax = silu_mul_amax(h, rows, quant, amax=amax, out=out)
    q, scale = _launch_quantize(
        compile_quant_kernels(quant, sm_count(h.device)),
        "a",
        a,
        amax,
        quant,
        _alignment_and_mask(rows)[0].num_padded,
        q_out,
    )
    return q, (scale.view(h.shape[0], -1) if quant == "fp8_block" else scale)


def fp8_buffers(ws: dict, dims, p, rows: int, scratch: torch.Tensor, static: bool) -> None:
    """Add the FP8 layer's buffers to the workspace ``ws`` of a call with ``dims`` and plan ``p``
    (``rows``: the sorted rows' worst case; ``scratch``: the alignment's zeroed buffer, which holds
    the two amaxes): the E4M3 activations, the row count of x, and — dynamic scales only — A in
    fp32 (not gated), the amaxes (:func:`layer_amax_sizes`), the scales — x's in token order only where x is
    quantized on its own or per tensor — and (channel, block) x's scales in the sorted order; then the views
    the launches take of them.
    (H, GEMM1's output, is the caller's: none where the epilogue writes ``aq`` itself.)"""
    device = scratch.device
    ws.update(
        aq=torch.empty(rows, dims.I, dtype=FP8_DTYPE, device=device),
        used=torch.full((1,), dims.T, dtype=torch.int32, device=device),  # x's rows, for its quantization
        x_sorted_e4m3=ws["x_sorted"].view(FP8_DTYPE),
    )
    if not p.gather_quant:  # x's E4M3 rows in token order, gathered as bf16 pairs
        ws["xq"] = torch.empty(dims.T, dims.K, dtype=FP8_DTYPE, device=device)
        ws["xq_pairs"] = ws["xq"].view(torch.bfloat16)
    if static:  # no amax, no scales of our own: the caller's are read as given
        return
    n_x, n_a = layer_amax_sizes(p, dims.T, rows, dims.K, dims.I)
    x_shape = activation_scale_shape(p.quant, dims.T, dims.K)
    a_shape = activation_scale_shape(p.quant, rows, dims.I)  # the intermediate's scales, whoever writes them
    a_scale = torch.empty(math.prod(a_shape), dtype=torch.float32, device=device)
    ws.update(
        a=None if p.gemm1.gated else torch.empty(rows, dims.I, dtype=torch.float32, device=device),
        x_amax=scratch[:n_x],
        a_amax=scratch[n_x : n_x + n_a] if n_a else None,  # none where the epilogue quantizes per block
        a_scale=a_scale,
        a_scale_shaped=a_scale.view(rows, -1) if p.quant == "fp8_block" else a_scale,
    )
    if not p.gather_quant or p.quant == "fp8_tensor":  # x's scales in token order (gathering: tensor's one)
        ws["x_scale"] = torch.empty(math.prod(x_shape), dtype=torch.float32, device=device)
        ws["x_scale_shaped"] = ws["x_scale"].view(x_shape)
    if p.quant != "fp8_tensor":  # x's scales in the sorted order: GEMM1's row scales
        ws["x_scale_sorted"] = torch.empty(rows, x_shape[1], dtype=torch.float32, device=device)
        ws["x_scale_sorted_flat"] = ws["x_scale_sorted"].view(-1)  # as the gathering quantize writes them


def fp8_kernels(p, num_sms: int, static: bool) -> dict:
    """The quantization kernels plan ``p`` launches (:func:`fp8_layer`'s names), compiled for ``num_sms``:
    ``x_amax`` and ``x_quantize`` (static scales: StaticQuantizeRows's, no amax) — or, where
    ``p.gather_quant``, ``x_gather_quantize`` after ``x_amax`` (none for fp8_block and static scales); for the
    intermediate ``a_amax`` (a gated GEMM1's fp32 output) or ``silu_amax`` (SiLU·up first) and ``a_quantize``
    (static: SiLU·up inside unless GEMM1 is gated) — without those GEMM1's epilogue does itself
    (``epilogue_quant``: "static" and "block" both, "amax" the amax)."""
    fused = p.gemm1.epilogue_quant
    if static:
        q = compile_quant_kernels(p.quant, num_sms, static=True)
        f = {"x_quantize": q["x_quantize_static"]}
        if p.gather_quant:  # x's codes straight into the sorted order, by the caller's scale
            f = {"x_gather_quantize": compile_gather_quantize(p.quant, num_sms, static=True)}
        if fused != "static":
            f["a_quantize"] = q["a_quantize_static" if p.gemm1.gated else "silu_quantize_static"]
        return f
    q = compile_quant_kernels(p.quant, num_sms)
    names = ["x_amax", "x_quantize"]
    if p.gather_quant:  # x quantized where its rows are gathered; its amax first unless per block
        names = [] if p.quant == "fp8_block" else ["x_amax"]
    if fused is None:  # the amax of a gated GEMM1's SiLU·up, or SiLU·up and its amax
        names.append("a_amax" if p.gemm1.gated else "silu_amax")
    if fused != "block":
        names.append("a_quantize")
    f = {name: q[name] for name in names}
    if p.gather_quant:
        f["x_gather_quantize"] = compile_gather_quantize(p.quant, num_sms)
    return f


def _x_codes(f: dict, x, p, rows: SortedRows, ws: dict, static_scale) -> torch.Tensor:
    """x's E4M3 codes in the sorted order (``ws["x_sorted_e4m3"]``) and GEMM1's activation scales, returned in
    its row order: x quantized, then its codes and scales gathered — or, where ``p.gather_quant``, quantized
    straight into the sorted order (fp8_tensor and fp8_channel after x's amax).  ``static_scale``: the
    caller's fp32 [1] (static fp8_tensor; a bad one sets ``BAD_A1_SCALE`` in either launch), else None."""
    used, num_padded, token = ws["used"], rows.alignment.num_padded, rows.token_of_row
    if static_scale is not None:
        if p.gather_quant:
            f["x_gather_quantize"](x, static_scale, ws["x_sorted_e4m3"], ws["word"], token, num_padded)
        else:
            f["x_quantize"](x, static_scale, ws["xq"], ws["word"], used)
            f["gather"](ws["xq_pairs"], ws["x_sorted"], token, num_padded)
        return static_scale
    if "x_amax" in f:  # x for `a`, `used` for the row mask: read by the SiLU variant only (none: fp8_block gathering)
        f["x_amax"](x, x, ws["x_amax"], used, used)
    if p.gather_quant:
        scale = ws["x_scale"] if p.quant == "fp8_tensor" else ws["x_scale_sorted_flat"]
        f["x_gather_quantize"](x, ws["x_amax"], ws["x_sorted_e4m3"], scale, token, num_padded)
        return ws["x_scale_sorted"] if p.quant == "fp8_block" else scale  # block: [M_pad, ⌈K/128⌉]
    f["x_quantize"](x, ws["x_amax"], ws["xq"], ws["x_scale"], used)
    f["gather"](ws["xq_pairs"], ws["x_sorted"], token, num_padded)  # the E4M3 rows moved as bf16 pairs
    return sorted_token_scales(ws["x_scale_shaped"], token, p.quant, ws.get("x_scale_sorted"))


def fp8_layer(f: dict, x, w1, w2, w1_scale, w2_scale, p, rows: SortedRows, ws: dict, a1_scale, a2_scale):
    """The fused W8A8 layer (this module's docstring), launch by launch into the workspace ``ws`` (its amax
    buffers zeroed by the alignment): x quantized once, its E4M3 rows gathered (as bf16 pairs: the gather
    moves bytes) — or, where ``p.gather_quant``, quantized into the sorted order in one launch —, GEMM1, the
    intermediate's amax and quantization — each left out where GEMM1's epilogue did it
    (``p.gemm1.epilogue_quant``) — GEMM2 with the routing weight, combine. ``f``: the call's launches
    (``moe._Call.bind``: :func:`fp8_kernels` among them); ``p``: its plan. With ``a1_scale`` and ``a2_scale``
    (static, fp32 [] or [1]): no amax launch, the quantize launches divide by the given scales."""
    num_padded = rows.alignment.num_padded
    static, fused = a1_scale is not None, p.gemm1.epilogue_quant
    # the caller's scales, as the GEMMs' activation scales too ([] viewed as [1]: no launch)
    x_scale = _x_codes(f, x, p, rows, ws, a1_scale.view(1) if static else None)
    a_scale = a2_scale.view(1) if static else ws["a_scale_shaped"]
    blocks1, blocks2 = rows.blocks[p.gemm1.tokens_tile], rows.blocks[p.gemm2.tokens_tile]
    # GEMM1's epilogue step (gemm_plan.GemmLaunch's q_scale, q_aux): static — the caller's scale and the
    # error word (BAD_A2_SCALE); block — the scales it writes; amax — the amax slots; both with the row mask
    epilogue = None
    if fused == "static":
        epilogue = (a_scale, ws["word"])
    elif fused is not None:
        epilogue = (ws["a_scale"] if fused == "block" else ws["a_amax"], rows.row_mask)
    h = ws["aq"] if fused in ("static", "block") else ws["h"]  # the E4M3 intermediate, or fp32 H
    g1 = launch_args(
        p.gemm1, ws["x_sorted_e4m3"], w1, h, blocks1, rows.weight_of_row, x_scale, w1_scale, quant=epilogue
    )
    f["gemm1"](*g1)
    if static and fused is None:  # gated: h is SiLU·up already; plain: the kernel computes SiLU·up from h first
        f["a_quantize"](h, a_scale, ws["aq"], ws["word"], num_padded)  # a bad scale: BAD_A2_SCALE
    elif not static and fused != "block":
        a = h if p.gemm1.gated else ws["a"]
        if fused is None and p.gemm1.gated:  # SiLU·up in GEMM1's epilogue: h is the fp32 intermediate [M_pad, I]
            f["a_amax"](a, a, ws["a_amax"], rows.row_mask, num_padded)
        elif fused is None:
            f["silu_amax"](h, a, ws["a_amax"], rows.row_mask, num_padded)
        f["a_quantize"](a, ws["a_amax"], ws["aq"], ws["a_scale"], num_padded)  # (amax: taken by GEMM1)
    y = ws["y"]
    f["gemm2"](*launch_args(p.gemm2, ws["aq"], w2, y, blocks2, rows.weight_of_row, a_scale, w2_scale))
    out = torch.empty(x.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    f["combine"](y, out, rows.row_of_pair)
    return out

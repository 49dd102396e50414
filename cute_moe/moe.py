"""The MoE layer on top of the grouped GEMM: align, GEMM1, SiLU·mul, GEMM2 (+ routing weight), combine.

For ``T`` tokens routed to ``top_k`` of ``E`` experts (``topk_ids``, ``topk_weights``)::

    out[t] = Σ_j  w[t, j] · ( SiLU(x[t]·W1g[e]ᵀ) ⊙ (x[t]·W1u[e]ᵀ) ) · W2[e]ᵀ ,   e = topk_ids[t, j]

with ``W1 [E, 2I, K]`` (gate rows, then up rows) and ``W2 [E, K, I]``.

Step by step (every step is device work; nothing reads routing data back to the host, so the
whole layer can be captured in a CUDA graph, an eager call costs no sync, and a new routing never
recompiles anything):

0. ``plan`` (``plan.py``): the two GEMM configs and the alignment tile, on the host.
   The routing data is checked on the device (:func:`moe_spec.validate.guard_routing`): an id
   outside [0, E) is clamped for the alignment and its pair weighted NaN, and every failed check
   sets its bit in the device's error word (:func:`moe_spec.validate.check` raises).
1. ``sort_rows``: the ``P = T·top_k`` (token, slot) pairs are sorted by expert and every expert's
   run is padded to a multiple of the plan's ``align_tile`` — :func:`moe_spec.align.align`, the
   project's reference routine (torch ops; vLLM's ``moe_align_block_size`` contract) — and the
   row maps the kernels read are derived from it: the token and the routing weight of every
   sorted row, the row of every pair.  The buffers are sized by the host-known worst case
   (:func:`moe_spec.align.max_rows`), so their sizes depend on T only; the number of *used* rows
   is a device scalar the GEMM's scheduler reads.
2. gather ``X_sorted[r] = x[token(r)]`` for the used rows (a CuTe row kernel, ``rowops.py``;
   padding rows inside a block repeat the last token: finite, and weighted 0 later).
3. GEMM1 (grouped): ``H = X_sorted · W1[e]ᵀ``  → ``[M_pad, 2I]``.
4. ``A = SiLU(H[:, :I]) ⊙ H[:, I:]``: a CuTe row kernel over the used rows only,
   fp32 math, one rounding to bf16.  (Fusing it into GEMM1's epilogue is future work: it needs
   W1's gate and up rows interleaved so that one tile holds both halves.)
5. GEMM2 (grouped): ``Y = (A · W2[e]ᵀ) · w_row`` — the routing weight of each sorted row is
   applied in fp32 in the epilogue, before rounding to bf16 (padding rows get weight 0).
6. combine: ``out[t] = Σ_j Y[row(t, j)]`` (a CuTe row kernel: fp32 sum over top_k, one rounding).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

from moe_spec.align import Alignment, align, max_rows  # noqa: E402
from moe_spec.hopper import sm_count  # noqa: E402
from moe_spec.validate import error_word, guard_routing, validate_moe_args  # noqa: E402

from .config import ALIGN_ELEMS, GemmConfig  # noqa: E402
from .plan import plan  # noqa: E402
from .ptx import compile_gemm, compile_row_kernels  # noqa: E402


@dataclass(frozen=True)
class SortedRows:
    """The shared alignment and the row maps the CuTe kernels read (device tensors).

    Attributes:
        alignment: :class:`moe_spec.align.Alignment` of the (token, slot) pairs.
        token_of_row: int64 [rows] token gathered into each sorted row (padding rows: the last
            token — any real row would do: it is finite and its routing weight is 0).
        weight_of_row: fp32 [rows] routing weight of each sorted row (0 for padding rows).
        row_of_pair: int64 [T·top_k] sorted row of pair (t, j) (row-major over (t, j)).
    """

    alignment: Alignment
    token_of_row: torch.Tensor
    weight_of_row: torch.Tensor
    row_of_pair: torch.Tensor

    @property
    def rows(self) -> int:
        return self.alignment.rows


def sort_rows(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, tile: int) -> SortedRows:
    """Align the pairs (:func:`moe_spec.align.align`, runs padded to ``tile``) and derive the row maps."""
    al = align(topk_ids, num_experts, tile)
    T, top_k = topk_ids.shape
    token_of_row = al.token_of_row(top_k).clamp_(max=max(T - 1, 0))  # the padding sentinel is T
    return SortedRows(al, token_of_row, al.weight_of_row(topk_weights), al.row_of_pair())


def gemm_blocks(alignment: Alignment, tokens_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of every ``tokens_tile``-row block int32, number of used blocks int32 [1]) for a GEMM.

    ``tokens_tile`` must divide the alignment tile, so each block lies inside one expert's run.
    Blocks past the used rows get −1 (never read: the scheduler stops at the block count).
    """
    if alignment.tile % tokens_tile:
        raise ValueError(f"tokens_tile={tokens_tile} does not divide the alignment tile {alignment.tile}")
    per_block = alignment.tile // tokens_tile
    experts = alignment.expert_of_block
    if per_block > 1:
        experts = experts.repeat_interleave(per_block)
    return experts, alignment.num_padded // tokens_tile


def _cute_tensor(t: torch.Tensor, leading_dim: int, cache: dict | None = None):
    """A 2-D/3-D operand with a dynamic layout (unit stride on ``leading_dim``), 16-B aligned.

    ``cache``: a workspace's dict of wrappers (see :func:`_workspace`): the wrapping (tens of µs
    of host time) is done once per buffer of the workspace. Only buffers the workspace owns may be
    wrapped through it — a wrapper keeps its tensor alive."""
    key = (t.data_ptr(), t.shape, t.stride(), leading_dim)
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        from cutlass.cute.runtime import from_dlpack

        hit = from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=leading_dim)
        if cache is not None:
            cache[key] = hit
    return hit


def _cute_vector(t: torch.Tensor):
    """A 1-D device array with a dynamic extent.

    Every kernel here is compiled against symbolic shapes; a tensor handed over with a static
    layout (plain ``from_dlpack``) does not carry its extent in the argument struct, and a
    kernel that reads ``shape[0]`` then sees garbage (seen on the H200: the combine kernel
    derived top_k from it).  So every argument is marked dynamic.
    """
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t).mark_layout_dynamic()


def _launch(kernel, args: tuple, device) -> None:
    """Every CuTe launch of this module: ``kernel(*args, stream)`` on ``device``'s current stream
    (one place, so a CPU test can count the launches of a call without running them)."""
    kernel(*args, _stream(device))


def check_gemm_shape(n_out: int, k: int) -> None:
    """The grouped GEMM's host check of its problem sizes: ``N_out`` and ``K`` positive multiples of
    ``ALIGN_ELEMS`` (TMA's 16-byte rows; with K = 0 no stage would ever be loaded)."""
    for name, v in (("K", k), ("N_out", n_out)):
        if v <= 0 or v % ALIGN_ELEMS:
            raise ValueError(f"grouped_gemm: {name}={v} must be a positive multiple of {ALIGN_ELEMS} "
                             f"(TMA needs 16-byte aligned bf16 rows)")


def grouped_gemm(x_sorted: torch.Tensor, w: torch.Tensor, rows: SortedRows, cfg: GemmConfig, *,
                 row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 cache: dict | None = None) -> torch.Tensor:
    """``out[r] = x_sorted[r] · w[expert(r)]ᵀ (· row_scale[r])`` for every used sorted row r.

    x_sorted: bf16 [M_pad, K]; w: bf16 [E, N_out, K] (contiguous).  Returns bf16 [M_pad, N_out]
    (rows past the used blocks are left unwritten). ``cache``: the wrappers of a workspace that
    owns ``x_sorted`` and ``out`` (:func:`_cute_tensor`).
    """
    m_pad, k = x_sorted.shape
    n_experts, n_out, k_w = w.shape
    if k_w != k:
        raise ValueError(f"grouped_gemm: K of x_sorted ({k}) and w ({k_w}) differ")
    check_gemm_shape(n_out, k)
    if cfg.row_scale != (row_scale is not None):
        raise ValueError("grouped_gemm: pass row_scale exactly when cfg.row_scale is set")
    if out is None:
        out, cache = torch.empty(m_pad, n_out, dtype=torch.bfloat16, device=x_sorted.device), None
    expert_of_block, num_blocks = gemm_blocks(rows.alignment, cfg.tokens_tile)
    if row_scale is None:
        row_scale = rows.weight_of_row  # a valid fp32 buffer the kernel never reads
    compiled = compile_gemm(cfg, sm_count(x_sorted.device))
    _launch(compiled, (
        _cute_tensor(x_sorted, 1, cache),
        _cute_tensor(w.permute(1, 2, 0), 1),  # (N_out, K, E): the expert is TMA's 3rd coordinate
        _cute_tensor(out.t(), 0, cache) if cfg.swap_ab else _cute_tensor(out, 1, cache),
        _cute_vector(expert_of_block), _cute_vector(num_blocks), _cute_vector(row_scale)), x_sorted.device)
    return out


def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None,
              swap_ab: bool | None = None, configs: tuple[GemmConfig, GemmConfig] | None = None) -> torch.Tensor:
    """The backend contract: bf16 ``[T, K]`` output of the MoE layer.

    Backend options: ``swap_ab`` forces the path (None: the rule in
    :func:`~cute_moe.config.path_rule`); ``configs`` gives the (GEMM1, GEMM2) configs outright
    (then ``swap_ab`` must be None).  The arguments, then the options and every limit of this
    backend (:func:`~cute_moe.plan.plan`), are checked on the host before the first launch — T = 0
    included — so bad input never leaves a half-run pipeline behind.
    """
    dims = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)
    p = plan(dims, quant, swap_ab=swap_ab, configs=configs)
    if dims.T == 0:
        return x.new_empty((0, dims.K))
    if x.device.type != "cuda":
        raise ValueError(f"x: cute_moe runs on a CUDA device (Hopper), got a tensor on {x.device.type}; "
                         f"on a CPU, compile_ptx() shows the kernels")
    return run_layer(x, w1, w2, topk_weights, topk_ids, dims, p)


def run_layer(x, w1, w2, topk_weights, topk_ids, dims, p) -> torch.Tensor:
    """The layer after validation and planning (``dims``, plan ``p``): no host sync.

    The routing data is checked on the device (:func:`moe_spec.validate.guard_routing`: ids clamped
    into range, a bad id's pair weighted NaN, failures ORed into the error word); the intermediate
    buffers and their CuTe wrappers are a workspace reused by the eager calls of one stream."""
    ids, weights = guard_routing(topk_ids, topk_weights, dims.E, error_word(x.device))
    rows = sort_rows(ids, weights, dims.E, p.align_tile)
    ws = _workspace(dims, p, x.device)
    x_sorted = gather_rows(x, rows, out=ws["x_sorted"], cache=ws["wraps"])
    h = grouped_gemm(x_sorted, w1, rows, p.gemm1, out=ws["h"], cache=ws["wraps"])
    a = silu_mul(h, rows, out=ws["a"], cache=ws["wraps"])
    y = grouped_gemm(a, w2, rows, p.gemm2, row_scale=rows.weight_of_row, out=ws["y"], cache=ws["wraps"])
    return combine(y, rows, dims.T, dims.top_k, cache=ws["wraps"])


#: Workspaces kept (least recently used dropped first): one per (sizes, plan, device, stream, thread).
WORKSPACES = 8
_workspaces: OrderedDict = OrderedDict()


def _workspace(dims, p, device) -> dict:
    """The intermediate buffers of one call (X_sorted, H, A, Y) and a dict for their CuTe wrappers,
    reused by the eager calls of one stream — the stream orders each call after the last, and the
    returned output is always a new tensor. Fresh (not kept) while a CUDA graph is being captured:
    a graph owns the buffers it was captured with."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (dims, p.align_tile, device, stream, threading.get_ident())
    ws = None if capturing else _workspaces.get(key)
    if ws is None:
        rows = max_rows(dims.T * dims.top_k, dims.E, p.align_tile)
        new = lambda cols: torch.empty(rows, cols, dtype=torch.bfloat16, device=device)  # noqa: E731
        ws = dict(x_sorted=new(dims.K), h=new(2 * dims.I), a=new(dims.I), y=new(dims.K), wraps={})
        if not capturing:
            _workspaces[key] = ws
            if len(_workspaces) > WORKSPACES:
                _workspaces.popitem(last=False)
    else:
        _workspaces.move_to_end(key)
    return ws


def _stream(device):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def _row_kernels(device) -> dict:
    return compile_row_kernels(sm_count(device))


def _check_row_width(fn: str, name: str, cols: int, multiple: int = ALIGN_ELEMS) -> None:
    """The row kernels walk a row in 16-byte vectors (``cols // VEC`` of them): a tail would be dropped."""
    if cols % multiple:
        raise ValueError(f"{fn}: {name} = {cols} must be a multiple of {multiple} "
                         f"(the row kernels move {ALIGN_ELEMS}-element vectors; a tail would be silently dropped)")


def gather_rows(x: torch.Tensor, rows: SortedRows, *, out: torch.Tensor | None = None,
                cache: dict | None = None) -> torch.Tensor:
    """``X_sorted[r] = x[token_of_row[r]]`` on the used rows (bf16 [M_pad, K]; other rows unwritten).
    ``out``, ``cache``: a workspace's buffer and wrappers (:func:`grouped_gemm`)."""
    _check_row_width("gather_rows", "x.shape[1]", x.shape[1])
    if out is None:
        out, cache = torch.empty(rows.rows, x.shape[1], dtype=x.dtype, device=x.device), None
    _launch(_row_kernels(x.device)["gather"], (_cute_tensor(x, 1), _cute_tensor(out, 1, cache),
                                               _cute_vector(rows.token_of_row),
                                               _cute_vector(rows.alignment.num_padded)), x.device)
    return out


def silu_mul(h: torch.Tensor, rows: SortedRows, *, out: torch.Tensor | None = None,
             cache: dict | None = None) -> torch.Tensor:
    """``SiLU(h[:, :I]) ⊙ h[:, I:]`` on the used rows (bf16 [M_pad, I]; other rows unwritten)."""
    m_pad, two_i = h.shape
    _check_row_width("silu_mul", "h.shape[1] (2I)", two_i, 2 * ALIGN_ELEMS)  # each half whole vectors
    if out is None:
        out, cache = torch.empty(m_pad, two_i // 2, dtype=h.dtype, device=h.device), None
    a = out
    _launch(_row_kernels(h.device)["silu_mul"], (_cute_tensor(h, 1, cache), _cute_tensor(a, 1, cache),
                                                 _cute_vector(rows.alignment.num_padded)), h.device)
    return a


def combine(y: torch.Tensor, rows: SortedRows, T: int, top_k: int, *, cache: dict | None = None) -> torch.Tensor:
    """``out[t] = Σ_j y[row_of_pair[t·top_k + j]]`` (rows already carry their routing weight): fp32
    sum → bf16 [T, K] (a new tensor: the output is never a workspace buffer)."""
    _check_row_width("combine", "y.shape[1]", y.shape[1])
    if rows.row_of_pair.numel() != T * top_k:
        raise ValueError(f"combine: rows has {rows.row_of_pair.numel()} (token, slot) pairs, "
                         f"T·top_k = {T}·{top_k} = {T * top_k}")
    out = torch.empty(T, y.shape[1], dtype=y.dtype, device=y.device)
    _launch(_row_kernels(y.device)["combine"], (_cute_tensor(y, 1, cache), _cute_tensor(out, 1),
                                                _cute_vector(rows.row_of_pair)), y.device)
    return out

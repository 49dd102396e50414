"""The gated FP8 GEMM1's epilogue quantizes the intermediate it computes (``GemmConfig.epilogue_quant``).

Why: under FP8 the gated GEMM1 (SiLU·up in its epilogue, :mod:`cute_moe.gemm`) used to write the
intermediate ``A = SiLU(gate)·up`` in fp32 ``[M_pad, I]``, and two launches followed it: ``RowAmax``
read A for its amax, ``QuantizeRows`` read it again and wrote E4M3 ``aq`` and the scales
(:mod:`cute_moe.quantops`) — at prefill that round trip over HBM is the FP8 layer's largest cost beside
the GEMMs (notes/cute_moe.md §6).  Here the epilogue does the same arithmetic on the fp32 registers, right
after SiLU·up, with the quantize kernels' own device helpers (:mod:`cute_moe.quantmath`: ``max_nan``,
``scale_of``, ``atomic_amax``, ``flag_bad_scale``), so each value is bit for bit what the separate launches give:

* ``"static"`` (fp8_tensor, the caller's ``a2_scale``): ``q = e4m3(a / s)`` — ``div.rn.f32`` and the
  saturating ``cvt.rn.satfinite`` of the store — and E4M3 stored straight into ``aq``; CTA 0's first
  consumer thread checks the scale (``BAD_A2_SCALE``), as ``StaticQuantizeRows`` did.
* ``"block"`` (fp8_block, whole 128-column groups in the tile): the amax of each (row, group) in
  registers, ``s = max(amax, 1e-12) / 448``, ``q = e4m3(a / s)`` into ``aq`` and ``s`` into ``a_scale``
  (one lane per row and group writes it).
* ``"amax"`` (every format, dynamic scales): A is still written in fp32, but its amax is taken here —
  fp8_tensor: each lane keeps a running maximum over its tiles and each warp issues one atomic at the
  end; fp8_channel / fp8_block: one atomic per (row, group) and tile — so only the quantize launch
  remains after GEMM1.

Rows that hold no (token, slot) pair (the padding of the sorted order, ``row_mask`` 0) add nothing to an
amax, as in ``RowAmax``; columns past ``I`` (a partial last tile) neither.  On the swap-AB path (decode) only
"amax" is built: there the tile is transposed — a token row of the intermediate is a *column* of the
accumulator, spread over the four warps — so a row's lanes are reduced within each warp and every warp adds
its own atomic.

Which lanes share a row
    A row's values in a thread are a fixed set of its accumulator registers, and a row is spread over
    several lanes of one warp.  Both facts are read from the kernel's own tiled MMA when it is traced
    (:func:`row_fragment`: ``partition_C`` of the identity tensor for every consumer thread), not assumed:
    the registers of each (row, group) cell, and the XOR lane offsets that keep a thread's rows — the
    butterfly shuffles of the reduction.  For the m64nNk32 WGMMA this gives the PTX ISA's accumulator
    fragment (notes/hopper.md §3): lane ``l`` of warp ``w`` holds rows ``16w + l/4`` and ``+ 8``, so a
    row lies in the four lanes of a quad and the offsets are 1 and 2.  Under swap-AB the token is the
    fragment's column, ``8j + 2(l mod 4) + {0, 1}``: a token's values lie in the eight lanes of one residue
    ``l mod 4`` of every warp, offsets 4, 8 and 16 within a warp.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import warp
from cutlass.tensor_utils import LayoutEnum

from moe_spec.quant import FP8_BLOCK
from moe_spec.validate import BAD_A2_SCALE

from .quantmath import atomic_amax, bfly_max_nan, flag_bad_scale, max_nan, scale_of

WARP_OFFSETS = (16, 8, 4, 2, 1)
"""The butterfly offsets of a whole warp's reduction."""


def staging_copy(cfg, c_dtype, tiled_mma):
    """The epilogue's register → shared-memory tiled copy of a C of ``c_dtype``: ``stmatrix`` for 16-bit
    values; fp32, and the E4M3 codes of ``epilogue_quant`` "static" / "block", value by value
    (``get_smem_store_op``'s universal copy: ``st.shared`` of a thread's adjacent columns, two E4M3 codes
    as one 16-bit store) over the same partition — ``stmatrix`` moves 16-bit values only.  The staging
    buffer then goes out by the kernel's TMA store, whatever the dtype."""
    stmatrix = cute.make_copy_atom(warp.StMatrix8x8x16bOp(cfg.swap_ab, 4 if cfg.tile_n >= 16 else 2), c_dtype)
    r2s_atom = stmatrix
    if cfg.c_bytes != 2:
        c_layout = LayoutEnum.COL_MAJOR if cfg.swap_ab else LayoutEnum.ROW_MAJOR
        r2s_atom = sm90.get_smem_store_op(c_layout, c_dtype, cutlass.Float32)
    return cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))


@dataclass(frozen=True)
class RowFragment:
    """Where a consumer thread's tile rows sit (static, the same in every thread).

    ``cells``: one entry per (row, group) of a thread — ``(registers, group)``: the accumulator registers
    holding that row's values in that 128-column group of the tile (``group`` counted from the tile's
    first; always 0 unless the tile is wider than 128), the first of them giving the row's coordinate;
    ``offsets``: the XOR lane offsets that join the lanes sharing a row within a warp; ``writer_mask``: their
    OR (the lane with none of those bits set writes a row's result); ``row_axis``: which coordinate of the
    accumulator is the intermediate's row (0: the tile's M, the normal path; 1: its N, swap-AB, where every
    warp holds a share of each row and writes its own atomic)."""

    cells: tuple
    offsets: tuple
    writer_mask: int
    row_axis: int = 0


_fragments: dict = {}


def row_fragment(cfg, tiled_mma) -> RowFragment:
    """The :class:`RowFragment` of ``cfg``'s tiled MMA (inside a jit context, where its coordinates are
    static): :func:`derive_fragment` of ``tiled_mma.get_slice(t).partition_C(identity)`` — the kernel's own
    ``tCcC`` — for every consumer thread ``t`` of a tile (cached per tile shape); under swap-AB of the
    transposed coordinates (the token is the tile's N), rows shared across warps."""
    key = (cfg.tile_m, cfg.tile_n, cfg.tile_warpgroups, cfg.dtype, cfg.swap_ab)
    hit = _fragments.get(key)
    if hit is None:
        identity = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
        coords = []
        for t in range(128 * cfg.tile_warpgroups):
            c = tiled_mma.get_slice(t).partition_C(identity)
            regs = [tuple(int(v) for v in c[i]) for i in range(cute.size(c))]
            coords.append([(n, m) for m, n in regs] if cfg.swap_ab else regs)
        hit = _fragments[key] = derive_fragment(coords, across_warps=cfg.swap_ab)
    return hit


def derive_fragment(coords, across_warps: bool = False) -> RowFragment:
    """The :class:`RowFragment` of an accumulator layout given as ``coords[thread][register] = (row,
    column)``, checking what the reduction relies on (ValueError otherwise): every thread's registers are
    thread 0's rows shifted by one per-thread offset (so one register partition serves every thread) in the
    same 128-column groups, and the threads of a warp sharing a row are exactly the XOR closure of the lane
    offsets found — and no thread of another warp shares it, unless ``across_warps`` (swap-AB: the coordinates
    given transposed, each warp then adds its own share of a row)."""
    threads, base = len(coords), coords[0]
    shift = []  # the row offset of each thread against thread 0
    for t, regs in enumerate(coords):
        d = regs[0][0] - base[0][0]
        if any(m - b[0] != d or n // FP8_BLOCK != b[1] // FP8_BLOCK for (m, n), b in zip(regs, base)):
            raise ValueError(f"thread {t}: its accumulator rows are not thread 0's shifted by one offset")
        shift.append(d)
    offsets = tuple(x for x in (1, 2, 4, 8, 16) if all(shift[t ^ x] == shift[t] for t in range(threads)))
    span = {0}
    for x in offsets:
        span |= {s ^ x for s in span}
    for t in range(threads):
        near = range(t - t % 32, t - t % 32 + 32) if across_warps else range(threads)
        if {u for u in near if shift[u] == shift[t]} != {t ^ s for s in span}:
            raise ValueError(f"thread {t}: the threads sharing its rows are not lanes {sorted(span)} apart")
    cells: dict = {}
    for i, (m, n) in enumerate(base):
        cells.setdefault((m, n // FP8_BLOCK), []).append(i)
    cells_ = tuple((tuple(regs), g) for (_, g), regs in sorted(cells.items()))
    return RowFragment(cells_, offsets, sum(offsets), int(across_warps))


@dataclass(frozen=True)
class EpilogueQuant:
    """One consumer thread's quantization step of the epilogue (built once per CTA by :meth:`make`; every
    method does nothing for a config without ``epilogue_quant``)."""

    cfg: object
    frag: object  # RowFragment, or None
    tCcC: object  # the thread's tile coordinate of every accumulator register
    q_scale: object  # static: the caller's scale [1]; block: a_scale (flat); amax: the amax slots (flat)
    q_aux: object  # static: the error word; block / amax: the row mask int32 [M_pad]
    n_out: object  # I: the intermediate's columns
    mma_tidx: object
    running: object  # amax under fp8_tensor: this lane's maximum over its tiles (rmem [1])

    @classmethod
    def make(cls, cfg, frag, tCcC, q_scale, q_aux, n_out, mma_tidx) -> EpilogueQuant:
        """The step of consumer thread ``mma_tidx`` (``frag``: :func:`row_fragment`'s, or None); a static
        scale is checked here, before the first tile (:meth:`check`)."""
        running = None
        if cutlass.const_expr(cfg.epilogue_quant == "amax" and cfg.quant == "fp8_tensor"):
            running = cute.make_rmem_tensor((1,), cutlass.Float32)
            running[0] = cutlass.Float32(0.0)
        step = cls(cfg, frag, tCcC, q_scale, q_aux, n_out, mma_tidx, running)
        step.check()
        return step

    @cute.jit
    def check(self) -> None:
        """static: the scale is not finite and positive → ``BAD_A2_SCALE`` (one thread of the grid)."""
        if cutlass.const_expr(self.cfg.epilogue_quant == "static"):
            bidx, _, _ = cute.arch.block_idx()
            if (bidx == 0) & (self.mma_tidx == 0):
                flag_bad_scale(self.q_scale[0], self.q_aux, BAD_A2_SCALE)

    @cute.jit
    def _cell_max(self, acc, regs, col0):
        """This lane's NaN-propagating maximum of ``|acc|`` over ``regs`` (one row, one group), columns
        past ``n_out`` left out."""
        m = cutlass.Float32(0.0)
        col_axis = 1 - self.frag.row_axis  # the intermediate's column: the tile's N, or its M under swap-AB
        for r in cutlass.range_constexpr(len(regs)):
            v = abs(acc[regs[r]])
            if col0 + self.tCcC[regs[r]][col_axis] >= self.n_out:
                v = cutlass.Float32(0.0)
            m = max_nan(m, v)
        return m

    @cute.jit
    def apply(self, acc: cute.Tensor, token_block, weight_block) -> None:
        """After SiLU·up, on the tile's fp32 activation ``acc``: static / block divide it by the scales
        (the store then converts to E4M3, saturating); amax adds it to the amax slots."""
        cfg = self.cfg
        kind = cfg.epilogue_quant
        if cutlass.const_expr(kind == "static"):
            acc.store(acc.load() / self.q_scale[0])  # div.rn.f32, as StaticQuantizeRows divides
        elif cutlass.const_expr(kind is not None):
            row0, col0 = token_block * cfg.tokens_tile, weight_block * cfg.weights_tile
            groups = (self.n_out + FP8_BLOCK - 1) // FP8_BLOCK
            writer = (cute.arch.lane_idx() & self.frag.writer_mask) == 0
            running, q_scale = self.running, self.q_scale  # written below inside run-time branches
            for c in cutlass.range_constexpr(len(self.frag.cells)):
                regs, g = self.frag.cells[c]
                row = row0 + self.tCcC[regs[0]][self.frag.row_axis]
                counts = self.q_aux[row] != 0  # padding rows of the sorted order add nothing
                lane_max = self._cell_max(acc, regs, col0)
                if cutlass.const_expr(kind == "amax" and cfg.quant == "fp8_tensor"):
                    counted = cutlass.Float32(0.0)  # neutral: every amax is ≥ 0
                    if counts:
                        counted = lane_max
                    running[0] = max_nan(running[0], counted)
                else:
                    amax = bfly_max_nan(lane_max, self.frag.offsets)  # the row's lanes: the quad
                    slot = row
                    if cutlass.const_expr(cfg.quant == "fp8_block"):
                        slot = row * groups + col0 // FP8_BLOCK + g
                    if cutlass.const_expr(kind == "amax"):
                        if counts & writer:
                            atomic_amax(q_scale.iterator + slot, amax)
                    else:  # block: the scale of (row, group), then the values divided by it
                        counted = cutlass.Float32(0.0)  # a padding row's amax stays 0, as RowAmax leaves it
                        if counts:
                            counted = amax
                        s = scale_of(counted)
                        for r in cutlass.range_constexpr(len(regs)):
                            acc[regs[r]] = acc[regs[r]] / s
                        if writer:
                            q_scale[slot] = s

    @cute.jit
    def finish(self) -> None:
        """After the thread's last tile (amax under fp8_tensor): the warp's maximum, one atomic per warp."""
        if cutlass.const_expr(self.running is not None):
            total = bfly_max_nan(self.running[0], WARP_OFFSETS)
            if cute.arch.lane_idx() == 0:
                atomic_amax(self.q_scale.iterator, total)

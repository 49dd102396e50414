"""FP8 in the one-launch decode kernel (:mod:`cute_moe.decode_kernel`): the two quantize tasks, the scales in
the GEMMs' registers and the intermediate's amax.

Under an FP8 format (W8A8, :mod:`moe_spec.quant`) a launch adds two phases to the bf16 kernel's
(:func:`~cute_moe.decode_parts.fp8_phase_starts`)::

    Q1 (token block tb)   x's 8 rows → E4M3 rows xq and their scales xs; fp8_tensor with a dynamic scale
                          first takes the amax of all of x (every Q1 task the same: x is T ≤ 64 rows);
                          then signal doneq1.  A task's producer lands its first W1 stages, then waits
                          for doneq1 = NQ1 before it copies xq rows.
    A  (leader r, n-tile) as in bf16 with E4M3 operands; each 128-deep K step into fresh block sums,
                          promoted into fp32 (× the step's block scales for fp8_block), dequantized,
                          SiLU(gate)·up in fp32 → h fp32; a dynamic fp8_tensor scale: the tile's amax into
                          ``amax`` (one atomic per warp).
    Q2 (leader r)         waits for r's A tasks (a dynamic fp8_tensor scale: every leader's, as the amax
                          must be whole), then h's rows of r's pairs → E4M3 rows hq and their scales hs;
                          then signal doneq2[r].  B waits for it instead of done1[r].
    B, C                  as in bf16, GEMM2 on E4M3 hq and W2, its sums promoted and dequantized, × the
                          routing weight in fp32, rounded once to bf16.

Every value is the grouped FP8 pipeline's (:mod:`cute_moe.moe_fp8`): x and h quantized as
``moe_spec.quant.quantize_activation`` (the quantize kernels' arithmetic, :mod:`cute_moe.quantmath`: a
warp per 128-column group, 4 values per lane, ``max.NaN`` maxima, ``q = e4m3(v / s)`` by IEEE division),
promotion and dequantization in :mod:`cute_moe.fp8_gemm`'s order, the intermediate in fp32 before its
quantization.  Static fp8_tensor scales (``a1_scale``, ``a2_scale``) replace both amaxes; a scale that is
not finite and positive sets its bit of the error word and is used as given.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from moe_spec.quant import FP8_BLOCK
from moe_spec.validate import BAD_A1_SCALE, BAD_A2_SCALE

from .activation import silu_mul
from .decode_parts import (
    CONSUMER_THREADS,
    DONE1,
    DONEQ1,
    DONEQ2,
    H_TILE,
    TOKEN_BLOCK,
    TOKENS,
    consumer_sync,
    signal,
    wait_at_least,
)
from .quantmath import atomic_amax, bfly_max_nan, flag_bad_scale, max_nan, scale_of

F32 = cutlass.Float32

LANE_VALUES = FP8_BLOCK // 32
"""Values per lane: a warp's 32 lanes hold one 128-column scale group (the quantize kernels' item)."""
WARPS = CONSUMER_THREADS // 32


@cute.jit
def warp_max(v):
    """The warp's NaN-propagating maximum of ``v``, in every lane."""
    return bfly_max_nan(v, (16, 8, 4, 2, 1))


@cute.jit
def lane_amax(v):
    """The NaN-propagating maximum of ``|v[i]|`` over a lane's :data:`LANE_VALUES` values."""
    m = F32(0.0)
    for i in cutlass.range_constexpr(LANE_VALUES):
        m = max_nan(m, abs(v[i]))
    return m


def lanes(t: cute.Tensor):
    """[rows, cols] as (1, LANE_VALUES, rows, cols / LANE_VALUES): a lane's values of (row, chunk)."""
    return cute.local_tile(t, (1, LANE_VALUES), (None, None))


@dataclass(frozen=True)
class Fp8Args:
    """The FP8 tensors of a launch: the weight scales (fp8_tensor [E], fp8_channel [E, rows], fp8_block
    [E, rows / 128, cols / 128]), the static activation scales (fp32 [1]; stand-ins when dynamic), the
    workspace's E4M3 x and h rows with their flat fp32 scales (tensor: [0]; channel: [row]; block:
    [row · groups + g]) and the intermediate's amax word (zero at entry and exit)."""

    w1_scale: object
    w2_scale: object
    a1: object
    a2: object
    xq: object
    xs: object
    hq: object
    hs: object
    amax: object


class QuantSteps:
    """The FP8 steps of :class:`~cute_moe.decode_kernel.DecodeKernel` (``self.quant``, ``self.static``)."""

    def _dynamic_tensor(self) -> bool:
        return self.quant == "fp8_tensor" and not self.static

    # ---- Q1 and Q2: the quantize tasks (consumer warpgroup) --------------------------------------------
    @cute.jit
    def quantize_x(self, tb, m_x, fp8: Fp8Args, word, red, counters, tidx):
        """Q1 task ``tb``: x's rows tb·8 … tb·8 + 7 → xq and xs (warp w: rows w and w + 4), then doneq1."""
        T, K = m_x.shape
        groups = K // FP8_BLOCK
        warp, lane = tidx // 32, tidx % 32
        vx, vq = lanes(m_x), lanes(fp8.xq)
        s = F32(1.0)
        if cutlass.const_expr(self.quant == "fp8_tensor"):
            if cutlass.const_expr(self.static):
                s = fp8.a1[0]
                if (tb == 0) & (tidx == 0):
                    flag_bad_scale(s, word, BAD_A1_SCALE)
            else:  # the amax of all of x: each warp a quarter of the items, then across the warps
                m = F32(0.0)
                for item in range(warp, T * groups, WARPS):
                    m = max_nan(m, lane_amax(vx[(0, None, item // groups, item % groups * 32 + lane)].load().to(F32)))
                m = warp_max(m)
                if lane == 0:
                    red[warp] = m
                consumer_sync()
                s = scale_of(max_nan(max_nan(red[0], red[1]), max_nan(red[2], red[3])))
                consumer_sync()  # every thread has read red: a later task may write it
                if (tb == 0) & (tidx == 0):
                    fp8.xs[0] = s
        for i in cutlass.range_constexpr(TOKEN_BLOCK // WARPS):
            t = tb * TOKEN_BLOCK + warp + i * WARPS
            if t < T:
                s = self.quantize_row(vx, vq, fp8.xs, t, groups, lane, s)
        consumer_sync()  # every thread's stores, then one release
        if tidx == 0:
            signal(counters.iterator + DONEQ1)

    @cute.jit
    def quantize_h(self, r, m_h, fp8: Fp8Args, tables, word, counters, n_leaders, done1, tidx):
        """Q2 task of leader rank ``r``: once its A tasks are done (a dynamic fp8_tensor scale: every leader's,
        ``done1`` each), the h rows of r's pairs → hq and hs (warp w: the group's members w, w + 4, …), then
        doneq2[r]."""
        _, _, s_order, s_start, s_count, _, _, _ = tables
        if tidx == 0:
            if cutlass.const_expr(self._dynamic_tensor()):
                for q in range(n_leaders):
                    wait_at_least(counters.iterator + DONE1 + q, done1)
            else:
                wait_at_least(counters.iterator + DONE1 + r, done1)
        consumer_sync()  # thread 0's acquire, then every thread's loads of h (and of the amax)
        groups = m_h.shape[1] // FP8_BLOCK
        warp, lane = tidx // 32, tidx % 32
        vh, vq = lanes(m_h), lanes(fp8.hq)
        s = F32(1.0)
        if cutlass.const_expr(self.quant == "fp8_tensor"):
            if cutlass.const_expr(self.static):
                s = fp8.a2[0]
                if (r == 0) & (tidx == 0):
                    flag_bad_scale(s, word, BAD_A2_SCALE)
            else:
                s = scale_of(fp8.amax[0])
        base, count = s_start[r], s_count[r]
        for j in range(warp, count, WARPS):
            s = self.quantize_row(vh, vq, fp8.hs, s_order[base + j], groups, lane, s)
        consumer_sync()
        if tidx == 0:
            signal(counters.iterator + DONEQ2 + r)

    @cute.jit
    def quantize_row(self, vsrc, vq, scales, row, groups, lane, s):
        """One row in the format's groups (a warp): fp8_channel its amax first, fp8_block each group's;
        ``s`` is fp8_tensor's scale.  Writes the row's scales (channel, block) and returns ``s``."""
        if cutlass.const_expr(self.quant == "fp8_channel"):
            m = F32(0.0)
            for g in range(groups):
                m = max_nan(m, lane_amax(vsrc[(0, None, row, g * 32 + lane)].load().to(F32)))
            s = scale_of(warp_max(m))
            if lane == 0:
                scales[row] = s
        for g in range(groups):
            v = vsrc[(0, None, row, g * 32 + lane)].load().to(F32)
            if cutlass.const_expr(self.quant == "fp8_block"):
                s = scale_of(warp_max(lane_amax(v)))
                if lane == 0:
                    scales[row * groups + g] = s
            vq[(0, None, row, g * 32 + lane)].store((v / s).to(vq.element_type))  # div.rn, cvt.rn.satfinite
        return s

    # ---- the GEMMs' scales ------------------------------------------------------------------------------
    @cute.jit
    def chunk_scales(self, act, tensor_scale, w_scale, e, wrows, coords, rows, chunk, by_token: cutlass.Constexpr):
        """The scales of one chunk's registers (:class:`ChunkScales`): ``act`` the activation scales (xs or hs),
        ``tensor_scale`` fp8_tensor's, ``wrows`` the first weight rows of acc0 and acc1; ``rows`` = (order,
        base, count, top_k) finds each register's pair (``by_token``: its token, x's row)."""
        s_order, base, count, top_k = rows
        arow = cute.make_rmem_tensor(cute.size(coords), cutlass.Int32)
        for i in cutlass.range_constexpr(cute.size(coords)):
            _, j = coords[i]
            row = s_order[base + cutlass.min(chunk * TOKENS + j, count - 1)]  # past the chunk's pairs: its last
            if cutlass.const_expr(by_token):
                row = row // top_k
            arow[i] = row
        return ChunkScales(act, arow, tensor_scale, w_scale, e, wrows)

    @cute.jit
    def promote(self, acc0, acc1, blk0, blk1, sc, k, groups):
        """K step ``k``'s block sums into the fp32 accumulators: ``acc += blk``; fp8_block times the step's
        scales (``groups``: the activation's scale groups per row), in :mod:`cute_moe.fp8_gemm`'s order."""
        if cutlass.const_expr(self.quant == "fp8_block"):
            sw0 = sc.w_scale[(sc.e, sc.wrows[0] // FP8_BLOCK, k)]
            sw1 = sc.w_scale[(sc.e, sc.wrows[1] // FP8_BLOCK, k)]
            for i in cutlass.range_constexpr(cute.size(acc0)):
                sa = sc.act[sc.arow[i] * groups + k]
                acc0[i] = acc0[i] + blk0[i] * (sa * sw0)
                acc1[i] = acc1[i] + blk1[i] * (sa * sw1)
        else:
            for i in cutlass.range_constexpr(cute.size(acc0)):
                acc0[i] = acc0[i] + blk0[i]
                acc1[i] = acc1[i] + blk1[i]

    @cute.jit
    def dequantize(self, acc0, acc1, sc, coords):
        """After the K loop: fp8_tensor's ``acc · (s_a · s_w[e])``, fp8_channel's ``acc · (s_a[row] · s_w[e,
        weight row])`` (fp8_block's scales are in already)."""
        if cutlass.const_expr(self.quant == "fp8_tensor"):
            s = sc.tensor_scale * sc.w_scale[sc.e]
            for i in cutlass.range_constexpr(cute.size(acc0)):
                acc0[i] = acc0[i] * s
                acc1[i] = acc1[i] * s
        elif cutlass.const_expr(self.quant == "fp8_channel"):
            for i in cutlass.range_constexpr(cute.size(acc0)):
                m, _ = coords[i]
                sa = sc.act[sc.arow[i]]
                acc0[i] = acc0[i] * (sa * sc.w_scale[(sc.e, sc.wrows[0] + m)])
                acc1[i] = acc1[i] * (sa * sc.w_scale[(sc.e, sc.wrows[1] + m)])

    @cute.jit
    def store_h_fp32(self, acc0, acc1, coords, h_rows, chunk, amax, lane):
        """A's FP8 epilogue for chunk ``chunk``: h = SiLU(gate)·up in fp32, stored unrounded into the rows of
        the chunk's pairs (``h_rows``: h, order, base, count, n-tile); a dynamic fp8_tensor scale: the
        values' amax, one atomic per warp (none for +0, the zeroed word's own value)."""
        m_h, s_order, base, count, n = h_rows
        acc0.store(silu_mul(acc0.load(), acc1.load()))
        m = F32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc0)):
            row, j = coords[i]
            if chunk * TOKENS + j < count:
                m_h[(s_order[base + chunk * TOKENS + j], n * H_TILE + row)] = acc0[i]
                if cutlass.const_expr(self._dynamic_tensor()):
                    m = max_nan(m, abs(acc0[i]))
        if cutlass.const_expr(self._dynamic_tensor()):
            m = warp_max(m)
            if lane == 0:
                if m == F32(0.0):
                    pass
                else:  # NaN fails the compare: always added
                    atomic_amax(amax.iterator, m)


@dataclass(frozen=True)
class ChunkScales:
    """The scales of one chunk of an FP8 GEMM task (built while tracing; frozen, so the K loop reads it)."""

    act: object  # the activation scales, flat (xs or hs; fp8_tensor: unused)
    arow: object  # per accumulator register: its activation row (x's token or h's pair)
    tensor_scale: object  # fp8_tensor: the activation's scale
    w_scale: object
    e: object  # the expert
    wrows: tuple  # the first weight rows of acc0 and acc1

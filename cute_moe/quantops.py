"""Dynamic FP8 quantization of activations on the device: amax, then quantize (small CuTe kernels).

Both reproduce :func:`moe_spec.quant.quantize_activation` bit for bit: the amax of the values as
given (a max is exact in any order), ``s = max(amax, 1e-12) / 448`` and ``q = e4m3(v / s)`` as IEEE
divisions (``div.rn.f32``, never a reciprocal), then ``cvt.rn.satfinite``: the reference's
clamp-then-round.  NaN is kept as the reference keeps it: every maximum is ``max.NaN.f32``, and the
atomic (an integer max on the bits of non-negative values) ranks NaN above +inf.

A work item is one *group*, 128 columns of a row held by one warp (4 values per lane); its amax
slot is ``amax[0]`` (fp8_tensor), ``amax[row]`` (fp8_channel) or ``amax[row · groups + g]``
(fp8_block), so one kernel serves the three formats and the quantize kernel finds the scale in the
same slot.  A group's amax is a warp reduction and one atomic into its slot; under fp8_tensor, where
every atomic would hit one address and serialize (notes/cute_moe.md), each lane keeps a running
maximum and a warp issues one atomic at the end — only if that maximum is not +0: the grid is 8 CTAs
per SM whatever the rows, and at decode most warps walk nothing.

* ``RowAmax``: the amax of ``x`` (bf16), of a gated GEMM1's fp32 SiLU·up intermediate, or
  (``silu=True``) of the SiLU·up intermediate written in fp32 from GEMM1's fp32 ``h`` as it goes; on
  the intermediate a row whose ``row_mask`` is 0 (padding of the sorted order) adds nothing, so a
  per-tensor scale sees the T·top_k rows the reference sees.
* ``QuantizeRows``: ``q = e4m3(v / s)`` and the scales, from the amax.
* ``GatherQuantizeRows``: x quantized into the expert-sorted order with its scales, in one launch
  (fp8_block: each group's amax in the warp that quantizes it; tensor and channel: from ``RowAmax``'s);
  ``StaticGatherQuantizeRows`` the same under a static fp8_tensor scale.
* ``StaticQuantizeRows``: fp8_tensor under a static (calibrated) scale ``s`` given by the caller:
  no amax at all, ``q = e4m3(v / s)`` with the same division and saturating cast
  (:func:`moe_spec.quant.quantize_activation_static`), optionally SiLU·up first (from GEMM1's fp32
  ``h``); a scale that is not finite and positive sets its bit of the error word.

The arithmetic (NaN-keeping maxima, the butterfly reduction, the atomic, the scale, the bad-scale check)
is :mod:`cute_moe.quantmath`'s, which the gated GEMM1's epilogue shares (:mod:`cute_moe.epilogue_quant`).

Rows are whole 16-byte E4M3 rows (``cols`` a multiple of 16); the grids walk the used rows, whose
count they read from device memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from moe_spec.hopper import sm_count
from moe_spec.quant import FP8_BLOCK
from moe_spec.validate import BAD_A1_SCALE, BAD_A2_SCALE

from .activation import silu_mul
from .cache import compile_once
from .limits import FP8_ALIGN_ELEMS
from .quantmath import atomic_amax, bfly_max_nan, flag_bad_scale, max_nan, scale_of
from .rowops import THREADS, _RowKernel
from .runtime import fake_rows, fake_stream, fake_vector

LANE_VALUES = FP8_BLOCK // 32
"""Values per lane: a warp of 32 lanes holds one 128-column group."""
WARPS = THREADS // 32


@cute.jit
def _warp_max_nan(v):
    """The warp's maximum of ``v`` in every lane, NaN-propagating (five butterfly shuffles)."""
    return bfly_max_nan(v, (16, 8, 4, 2, 1))


def _chunks(t: cute.Tensor):
    """[rows, cols] as (1, LANE_VALUES, rows, cols / LANE_VALUES): one lane's 4 values per (row, chunk)."""
    return cute.local_tile(t, (1, LANE_VALUES), (None, None))


class _GroupKernel(_RowKernel):
    """A row kernel whose work item is one (row, group): a warp per 128-column group."""

    def __init__(self, quant: str, num_sms: int):
        super().__init__(num_sms)
        self.quant = quant

    def _first_and_step(self):
        """(this warp's first work item, the grid's warp count), warp-uniform."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        return bidx * WARPS + warp, self.num_ctas * WARPS

    def _slot(self, row, group, groups):
        """Index of (row, group)'s amax / scale in the flat buffer of this format."""
        if self.quant == "fp8_tensor":
            return 0
        if self.quant == "fp8_channel":
            return row
        return row * groups + group


class RowAmax(_GroupKernel):
    """Arguments: src [rows, cols] bf16 (x) or fp32 (a gated GEMM1's intermediate) or, with ``silu``,
    h fp32 [rows, 2·cols]; a fp32 [rows, cols] (written with ``silu``; without it a stand-in of src's
    type, never touched), amax fp32 (flat, zeroed), row_mask int32 [rows] (read with ``masked``,
    default ``silu``; else a stand-in), used_rows int32 [1], stream."""

    def __init__(self, quant: str, num_sms: int, silu: bool, masked: bool | None = None):
        super().__init__(quant, num_sms)
        self.silu = silu
        self.masked = silu if masked is None else masked  # padding rows of the sorted order add nothing

    @cute.kernel
    def kernel(
        self, src: cute.Tensor, a: cute.Tensor, amax: cute.Tensor, row_mask: cute.Tensor, used_rows: cute.Tensor
    ):
        vs, va = _chunks(src), _chunks(a)
        chunks = a.shape[1] // LANE_VALUES if self.silu else src.shape[1] // LANE_VALUES
        groups = (chunks + 31) // 32
        lane = cute.arch.lane_idx()
        per_tensor = cutlass.const_expr(self.quant == "fp8_tensor")
        running = cute.make_rmem_tensor((1,), cutlass.Float32)  # fp8_tensor: this lane's maximum so far
        running[0] = cutlass.Float32(0.0)

        def group_amax(row, g, running, va):
            chunk = g * 32 + lane
            lane_max = cutlass.Float32(0.0)
            if chunk < chunks:
                if cutlass.const_expr(self.silu):
                    v = silu_mul(vs[(0, None, row, chunk)].load(), vs[(0, None, row, chunk + chunks)].load())
                    va[(0, None, row, chunk)].store(v)
                else:
                    v = vs[(0, None, row, chunk)].load().to(cutlass.Float32)
                for i in cutlass.range_constexpr(LANE_VALUES):
                    lane_max = max_nan(lane_max, abs(v[i]))
            counts = True
            if cutlass.const_expr(self.masked):
                counts = row_mask[row] != 0  # padding rows of the sorted order add nothing
            if cutlass.const_expr(per_tensor):
                if counts:
                    running[0] = max_nan(running[0], lane_max)
            else:
                group_max = _warp_max_nan(lane_max)
                if counts & (lane == 0):
                    atomic_amax(amax.iterator + self._slot(row, g, groups), group_max)

        self._for_each(used_rows[0], groups, group_amax, running, va)
        if cutlass.const_expr(per_tensor):
            total = _warp_max_nan(running[0])
            if lane == 0:  # one atomic per warp into the tensor's one slot ...
                if total == cutlass.Float32(0.0):
                    pass  # ... unless the warp has nothing to add: +0 is the zeroed slot's own value
                else:  # (a NaN fails the ordered compare, so it is always added)
                    atomic_amax(amax.iterator, total)


class QuantizeRows(_GroupKernel):
    """Arguments: src [rows, cols] (bf16 or fp32), amax fp32 (flat), q float8_e4m3fn [rows, cols],
    scale fp32 (flat, the format's shape), used_rows int32 [1], stream."""

    @cute.kernel
    def kernel(self, src: cute.Tensor, amax: cute.Tensor, q: cute.Tensor, scale: cute.Tensor, used_rows: cute.Tensor):
        vs, vq = _chunks(src), _chunks(q)
        chunks = src.shape[1] // LANE_VALUES
        groups = (chunks + 31) // 32
        lane = cute.arch.lane_idx()

        def quantize(row, g, scale, vq):
            slot = self._slot(row, g, groups)
            s = scale_of(amax[slot])  # IEEE division by 448, as moe_spec.quant computes the scale
            if lane == 0:
                # one writer per slot: the first item (tensor), the row's first group (channel), every group (block)
                if cutlass.const_expr(self.quant == "fp8_tensor"):
                    if (row == 0) & (g == 0):
                        scale[slot] = s
                elif cutlass.const_expr(self.quant == "fp8_channel"):
                    if g == 0:
                        scale[slot] = s
                else:
                    scale[slot] = s
            chunk = g * 32 + lane
            if chunk < chunks:
                v = vs[(0, None, row, chunk)].load().to(cutlass.Float32)
                vq[(0, None, row, chunk)].store((v / s).to(q.element_type))  # div.rn, cvt.rn.satfinite

        self._for_each(used_rows[0], groups, quantize, scale, vq)


class StaticQuantizeRows(_GroupKernel):
    """fp8_tensor with a static scale.  Arguments: src [rows, cols] (bf16 or fp32) or, with ``silu``,
    GEMM1's fp32 h [rows, 2·cols]; scale fp32 [1] (the caller's, read only: the GEMM takes that same
    tensor as its activation scale); q float8_e4m3fn [rows, cols]; word int32 [1] (the error word);
    used_rows int32 [1]; stream.  ``bad_bit``: the error-word bit of a scale that is not finite and
    positive (NaN fails both compares, −0.0 the first); the scale is used as given all the same."""

    def __init__(self, num_sms: int, bad_bit: int, silu: bool = False):
        super().__init__("fp8_tensor", num_sms)
        self.bad_bit, self.silu = bad_bit, silu

    @cute.kernel
    def kernel(self, src: cute.Tensor, scale: cute.Tensor, q: cute.Tensor, word: cute.Tensor, used_rows: cute.Tensor):
        vs, vq = _chunks(src), _chunks(q)
        chunks = q.shape[1] // LANE_VALUES  # with ``silu``: gate chunk c pairs with up chunk c + chunks
        groups = (chunks + 31) // 32
        lane = cute.arch.lane_idx()
        s = scale[0]
        first, _ = self._first_and_step()
        if (first == 0) & (lane == 0):  # one thread checks the scale, whatever the row count
            flag_bad_scale(s, word, self.bad_bit)

        def quantize(row, g, vq):
            chunk = g * 32 + lane
            if chunk < chunks:
                if cutlass.const_expr(self.silu):
                    v = silu_mul(vs[(0, None, row, chunk)].load(), vs[(0, None, row, chunk + chunks)].load())
                else:
                    v = vs[(0, None, row, chunk)].load().to(cutlass.Float32)
                vq[(0, None, row, chunk)].store((v / s).to(q.element_type))  # div.rn, cvt.rn.satfinite

        self._for_each(used_rows[0], groups, quantize, vq)


class _GatherGroupKernel(_GroupKernel):
    """A group kernel reading x's rows through ``token_of_row`` and writing E4M3 rows in the sorted order."""

    @staticmethod
    def _views(x: cute.Tensor, q: cute.Tensor):
        """(x's and q's per-lane chunk views, x's chunks per row, groups per row, this lane): what both
        gathering quantize kernels start from."""
        chunks = x.shape[1] // LANE_VALUES
        return _chunks(x), _chunks(q), chunks, (chunks + 31) // 32, cute.arch.lane_idx()


class GatherQuantizeRows(_GatherGroupKernel):
    """x quantized straight into the expert-sorted order: ``q[r] = e4m3(x[token_of_row[r]] / s)`` for the used
    sorted rows ``r``, and the scales in GEMM1's row order — one launch in place of x's quantize launch, the
    gather of its E4M3 rows and (channel, block) the gather of its scales.  fp8_block takes each 128-column
    group's amax in the warp that quantizes it (no amax launch: a group is one warp's); fp8_tensor and
    fp8_channel read x's amax (:class:`RowAmax` over x's T rows first: a token's scale needs its whole row, the
    tensor's every row).  The scale and the division are :class:`QuantizeRows`' (:mod:`cute_moe.quantmath`),
    so the codes and scales are the separate launches' bit for bit.

    Arguments: x bf16 [T, K]; amax fp32 (flat: x's [1] / [T]; unread under fp8_block); q float8_e4m3fn
    [M_pad, K]; scale fp32 (flat: [1], [M_pad] or [M_pad · ⌈K/128⌉]); token_of_row int64 [M_pad]; used_rows
    int32 [1] (the sorted rows the GEMMs cover); stream."""

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        amax: cute.Tensor,
        q: cute.Tensor,
        scale: cute.Tensor,
        token_of_row: cute.Tensor,
        used_rows: cute.Tensor,
    ):
        vx, vq, chunks, groups, lane = self._views(x, q)
        v = cute.make_rmem_tensor((LANE_VALUES,), cutlass.Float32)  # this lane's 4 values of the group

        def quantize(row, g, scale, vq, v):
            token = token_of_row[row]
            chunk = g * 32 + lane
            v.fill(0.0)
            if chunk < chunks:
                v.store(vx[(0, None, token, chunk)].load().to(cutlass.Float32))
            if cutlass.const_expr(self.quant == "fp8_block"):  # the group's amax: a warp's maximum
                lane_max = cutlass.Float32(0.0)
                for i in cutlass.range_constexpr(LANE_VALUES):
                    lane_max = max_nan(lane_max, abs(v[i]))
                s = scale_of(_warp_max_nan(lane_max))
                if lane == 0:
                    scale[row * groups + g] = s
            elif cutlass.const_expr(self.quant == "fp8_channel"):
                s = scale_of(amax[token])
                if (lane == 0) & (g == 0):
                    scale[row] = s
            else:
                s = scale_of(amax[0])
                if (lane == 0) & (g == 0) & (row == 0):
                    scale[0] = s
            if chunk < chunks:
                vq[(0, None, row, chunk)].store((v.load() / s).to(q.element_type))  # div.rn, cvt.rn.satfinite

        self._for_each(used_rows[0], groups, quantize, scale, vq, v)


class StaticGatherQuantizeRows(_GatherGroupKernel):
    """:class:`GatherQuantizeRows` under a static fp8_tensor scale ``s`` given by the caller: ``q[r] =
    e4m3(x[token_of_row[r]] / s)`` for the used sorted rows, no amax and no scale written (the GEMM reads the
    caller's tensor); a scale that is not finite and positive sets ``BAD_A1_SCALE`` in the error word, as
    :class:`StaticQuantizeRows` does.  Arguments: x bf16 [T, K]; scale fp32 [1]; q float8_e4m3fn [M_pad, K];
    word int32 [1]; token_of_row int64 [M_pad]; used_rows int32 [1]; stream."""

    def __init__(self, num_sms: int):
        super().__init__("fp8_tensor", num_sms)

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        scale: cute.Tensor,
        q: cute.Tensor,
        word: cute.Tensor,
        token_of_row: cute.Tensor,
        used_rows: cute.Tensor,
    ):
        vx, vq, chunks, groups, lane = self._views(x, q)
        s = scale[0]
        first, _ = self._first_and_step()
        if (first == 0) & (lane == 0):  # one thread checks the scale, whatever the row count
            flag_bad_scale(s, word, BAD_A1_SCALE)

        def quantize(row, g, vq):
            chunk = g * 32 + lane
            if chunk < chunks:
                v = vx[(0, None, token_of_row[row], chunk)].load().to(cutlass.Float32)
                vq[(0, None, row, chunk)].store((v / s).to(q.element_type))  # div.rn, cvt.rn.satfinite

        self._for_each(used_rows[0], groups, quantize, vq)


# ---- compile ---------------------------------------------------------------------------------------
def compile_quant_kernels(
    quant: str, num_sms: int | None = None, *, keep_ptx: bool = False, static: bool = False
) -> dict:
    """The compiled kernels of one FP8 format, one set per SM count (default: this GPU's).

    ``x_amax`` / ``x_quantize``: bf16 token rows; ``silu_amax``: GEMM1's fp32 output → the fp32
    SiLU·up intermediate and its amax; ``a_amax``: the amax of a gated GEMM1's fp32 intermediate (its
    padding rows masked out); ``a_quantize``: fp32 rows.  Row widths are multiples of
    ``FP8_ALIGN_ELEMS`` (16: whole 16-byte rows of E4M3).  ``keep_ptx``: each has ``.__ptx__``.

    ``static`` (fp8_tensor only): the kernels of static activation scales instead, no amax among them
    (:class:`StaticQuantizeRows`): ``x_quantize_static`` (bf16 x, bit ``BAD_A1_SCALE``),
    ``silu_quantize_static`` (SiLU·up of GEMM1's fp32 h, then quantized) and ``a_quantize_static``
    (a gated GEMM1's fp32 intermediate), both bit ``BAD_A2_SCALE``.
    """
    num_sms = sm_count() if num_sms is None else num_sms
    width = FP8_ALIGN_ELEMS
    if static:
        if quant != "fp8_tensor":
            raise ValueError(f"quant: static activation scales are per tensor (fp8_tensor), got {quant!r}")
        return compile_once(("quantops static", num_sms), _build_static(num_sms), keep_ptx=keep_ptx)

    def build(options):
        bf16, f32, fp8, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Float8E4M3FN, cutlass.Int32

        def amax(src, a, silu: bool, masked: bool | None = None):  # src, a, amax, row_mask, used_rows
            return cute.compile(
                RowAmax(quant, num_sms, silu=silu, masked=masked),
                src,
                a,
                fake_vector(f32),
                fake_vector(i32),
                fake_vector(i32),
                fake_stream(),
                options=options,
            )

        def quantize(src):  # src, amax, q, scale, used_rows
            return cute.compile(
                QuantizeRows(quant, num_sms),
                src,
                fake_vector(f32),
                fake_rows(fp8, width),
                fake_vector(f32),
                fake_vector(i32),
                fake_stream(),
                options=options,
            )

        return {
            "x_amax": amax(fake_rows(bf16, width), fake_rows(bf16, width), silu=False),
            "x_quantize": quantize(fake_rows(bf16, width)),
            "silu_amax": amax(fake_rows(f32, 2 * width), fake_rows(f32, width), silu=True),
            "a_amax": amax(fake_rows(f32, width), fake_rows(f32, width), silu=False, masked=True),
            "a_quantize": quantize(fake_rows(f32, width)),
        }

    return compile_once(("quantops", quant, num_sms), build, keep_ptx=keep_ptx)


def compile_gather_quantize(quant: str, num_sms: int | None = None, *, keep_ptx: bool = False, static: bool = False):
    """The compiled :class:`GatherQuantizeRows` of one FP8 format, per SM count (default: this GPU's): the
    plan's ``gather_quant`` (:data:`cute_moe.plan.GATHER_QUANT`); ``static`` (fp8_tensor only): the
    :class:`StaticGatherQuantizeRows` of static activation scales.  ``keep_ptx``: it has ``.__ptx__``."""
    num_sms = sm_count() if num_sms is None else num_sms
    if static and quant != "fp8_tensor":
        raise ValueError(f"quant: static activation scales are per tensor (fp8_tensor), got {quant!r}")

    def build(options):
        f32, i32 = cutlass.Float32, cutlass.Int32
        kernel = StaticGatherQuantizeRows(num_sms) if static else GatherQuantizeRows(quant, num_sms)
        return cute.compile(
            kernel,
            fake_rows(cutlass.BFloat16, FP8_ALIGN_ELEMS),
            fake_vector(f32),  # x's amax, or the caller's scale (static)
            fake_rows(cutlass.Float8E4M3FN, FP8_ALIGN_ELEMS),
            fake_vector(i32 if static else f32),  # the error word (static), or the scales written
            fake_vector(cutlass.Int64),
            fake_vector(i32),
            fake_stream(),
            options=options,
        )

    return compile_once(("gather quantize", quant, static, num_sms), build, keep_ptx=keep_ptx)


def _build_static(num_sms: int):
    """The build function of :func:`compile_quant_kernels`' static set."""

    def build(options):
        bf16, f32, fp8, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Float8E4M3FN, cutlass.Int32
        width = FP8_ALIGN_ELEMS

        def quantize(src, bad_bit: int, silu: bool = False):  # src, scale, q, word, used_rows
            return cute.compile(
                StaticQuantizeRows(num_sms, bad_bit, silu),
                src,
                fake_vector(f32),
                fake_rows(fp8, width),
                fake_vector(i32),
                fake_vector(i32),
                fake_stream(),
                options=options,
            )

        return {
            "x_quantize_static": quantize(fake_rows(bf16, width), BAD_A1_SCALE),
            "silu_quantize_static": quantize(fake_rows(f32, 2 * width), BAD_A2_SCALE, silu=True),
            "a_quantize_static": quantize(fake_rows(f32, width), BAD_A2_SCALE),
        }

    return build

"""The row kernels around the two GEMMs: gather, SiLU·mul, combine (small CuTe kernels).

All three move 16-byte vectors (8 bf16) per thread step, keep the math in fp32, and touch only the
rows that matter, whose count they read from device memory — so the host-known worst-case
padding costs nothing and a new batch never recompiles.  Each grid is persistent: 8 CTAs of 256
threads per SM walk the work with a grid-stride loop (enough loads in flight to stream HBM).

* ``GatherRows``:  ``X_sorted[r] = x[sorted_token[r]]`` for the used rows ``r``.
* ``SiluMul``:     ``a[r] = SiLU(h[r, :I]) ⊙ h[r, I:]`` for the used rows (``g / (1 + e^(−g)) · u``).
* ``CombineRows``: ``out[t] = Σ_j y[pair_row[t·k + j]]`` (the routing weight is already in y).

The unfused pipeline (``fused_moe(..., fusion="separate")``, ``unfused.py``) adds two passes that
the fused layer does in the GEMM epilogue instead:

* ``ScaleRows``:   ``y[r, c] ·= s_x · s_w`` in place (FP8 per-tensor / per-channel scales).
* ``WeightedCombineRows``: ``out[t] = Σ_j w[t·k + j] · y[pair_row[t·k + j]]`` (routing weight and
  top-k sum in one pass).

A row is walked as ``cols // VEC`` whole vectors, so a width that is not a multiple of ``VEC``
would lose its tail without a word: the host wrappers in ``moe.py`` (``gather_rows``,
``silu_mul``, ``combine``) refuse such widths before they launch anything, and the compiled
functions are built for column counts divisible by ``VEC`` (:func:`compile_row_kernels`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from moe_spec.hopper import sm_count

from .activation import silu_mul
from .cache import compile_once
from .limits import ALIGN_ELEMS
from .runtime import fake_rows, fake_scales, fake_stream, fake_vector

VEC = ALIGN_ELEMS  # bf16 per thread step: one 16-byte vector
THREADS = 256
CTAS_PER_SM = 8


def _vectors(t: cute.Tensor):
    """View a row-major [rows, cols] tensor as (1, VEC, rows, cols / VEC): a 16-byte vector per (row, chunk)."""
    return cute.local_tile(t, (1, VEC), (None, None))


class _RowKernel:
    """A persistent grid of ``CTAS_PER_SM`` CTAs of ``THREADS`` threads per SM, walking work items."""

    def __init__(self, num_sms: int):
        self.num_ctas = num_sms * CTAS_PER_SM

    @cute.jit
    def __call__(self, *args):
        """Launch ``kernel`` on the kernel's arguments: ``args`` are its tensors, then the stream."""
        self.kernel(*args[:-1]).launch(grid=[self.num_ctas, 1, 1], block=[THREADS, 1, 1], stream=args[-1])

    def _first_and_step(self):
        """(this thread's first work item, the grid's thread count): a work item per thread."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        return bidx * THREADS + tidx, self.num_ctas * THREADS

    @cute.jit
    def _for_each(self, rows, per_row, body, *written):
        """``body(row, j, *written)`` for every item (row, j) of ``rows`` × ``per_row`` this thread (or
        warp: ``_first_and_step``) owns: the grid-stride loop every row kernel walks.  ``written``: the
        tensors the body writes inside its own branches or loops, which the DSL takes as the body's
        arguments (it does not trace a write to a name of the enclosing kernel there)."""
        item, step = self._first_and_step()
        while item < rows * per_row:
            row = item // per_row
            body(row, item - row * per_row, *written)
            item += step


class GatherRows(_RowKernel):
    """Arguments: src bf16 [T, K], dst bf16 [M_pad, K], index int64 [M_pad], used_rows int32 [1], stream."""

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, index: cute.Tensor, used_rows: cute.Tensor):
        vs, vd = _vectors(src), _vectors(dst)

        def copy(row, c):
            vd[(0, None, row, c)].store(vs[(0, None, index[row], c)].load())

        self._for_each(used_rows[0], dst.shape[1] // VEC, copy)


class SiluMul(_RowKernel):
    """Arguments: h bf16 [M_pad, 2I], a bf16 [M_pad, I] (out), used_rows int32 [1], stream."""

    @cute.kernel
    def kernel(self, h: cute.Tensor, a: cute.Tensor, used_rows: cute.Tensor):
        vh, va = _vectors(h), _vectors(a)
        chunks = a.shape[1] // VEC  # gate chunk c pairs with up chunk c + chunks

        def activate(row, c):
            g = vh[(0, None, row, c)].load().to(cutlass.Float32)
            u = vh[(0, None, row, c + chunks)].load().to(cutlass.Float32)
            va[(0, None, row, c)].store(silu_mul(g, u).to(a.element_type))

        self._for_each(used_rows[0], chunks, activate)


class CombineRows(_RowKernel):
    """Arguments: y bf16 [M_pad, K], out bf16 [T, K], pair_row int64 [T·k], stream."""

    @cute.kernel
    def kernel(self, y: cute.Tensor, out: cute.Tensor, pair_row: cute.Tensor):
        vy, vo = _vectors(y), _vectors(out)
        top_k = pair_row.shape[0] // out.shape[0]
        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)

        def combine(t, c, acc):
            acc.fill(0.0)
            for j in range(top_k):
                acc.store(acc.load() + vy[(0, None, pair_row[t * top_k + j], c)].load().to(cutlass.Float32))
            vo[(0, None, t, c)].store(acc.load().to(out.element_type))

        self._for_each(out.shape[0], out.shape[1] // VEC, combine, acc)


class ScaleRows(_RowKernel):
    """Arguments: y [M_pad, N] (fp32 or bf16, scaled in place), row_expert int32 [M_pad], x_scale
    fp32 ([1] per-tensor, [M_pad] per-channel), w_scale fp32 ([E] / [E, N]), used_rows int32 [1],
    stream.  ``y[r, c] = y[r, c] · (s_x · s_w)`` — the fused epilogue's product, in its order, so
    an fp32 y comes out bit for bit what the fused GEMM writes."""

    def __init__(self, num_sms: int, quant: str, vec: int):
        super().__init__(num_sms)
        self.quant = quant
        self.vec = vec  # elements per 16-byte vector of y

    @cute.kernel
    def kernel(
        self,
        y: cute.Tensor,
        row_expert: cute.Tensor,
        x_scale: cute.Tensor,
        w_scale: cute.Tensor,
        used_rows: cute.Tensor,
    ):
        vy = cute.local_tile(y, (1, self.vec), (None, None))
        scale = cute.make_rmem_tensor((self.vec,), cutlass.Float32)

        def rescale(row, c, scale):
            e = row_expert[row]
            if cutlass.const_expr(self.quant == "fp8_tensor"):
                scale.fill(x_scale[0] * w_scale[e])
            else:
                s_x = x_scale[row]
                for j in cutlass.range_constexpr(self.vec):
                    scale[j] = s_x * w_scale[(e, c * self.vec + j)]
            v = vy[(0, None, row, c)].load().to(cutlass.Float32) * scale.load()
            vy[(0, None, row, c)].store(v.to(y.element_type))

        self._for_each(used_rows[0], y.shape[1] // self.vec, rescale, scale)


class WeightedCombineRows(_RowKernel):
    """Arguments: y bf16 [M_pad, K], out bf16 [T, K], pair_row int64 [T·k], weight fp32 [T·k], stream."""

    @cute.kernel
    def kernel(self, y: cute.Tensor, out: cute.Tensor, pair_row: cute.Tensor, weight: cute.Tensor):
        vy, vo = _vectors(y), _vectors(out)
        top_k = pair_row.shape[0] // out.shape[0]
        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)

        def combine(t, c, acc):
            acc.fill(0.0)
            for j in range(top_k):
                p = t * top_k + j
                acc.store(acc.load() + vy[(0, None, pair_row[p], c)].load().to(cutlass.Float32) * weight[p])
            vo[(0, None, t, c)].store(acc.load().to(out.element_type))

        self._for_each(out.shape[0], out.shape[1] // VEC, combine, acc)


# ---- compile ---------------------------------------------------------------------------------------
def compile_row_kernels(num_sms: int | None = None, *, keep_ptx: bool = False) -> dict:
    """The compiled ``gather`` / ``silu_mul`` / ``combine`` kernels, one set per SM count (default: this
    GPU's, :func:`moe_spec.hopper.sm_count`); ``keep_ptx``: each has ``.__ptx__``."""
    num_sms = sm_count() if num_sms is None else num_sms

    def build(options):
        bf16, i32, i64 = cutlass.BFloat16, cutlass.Int32, cutlass.Int64
        return {
            "gather": cute.compile(
                GatherRows(num_sms),
                fake_rows(bf16, VEC),
                fake_rows(bf16, VEC),
                fake_vector(i64),
                fake_vector(i32),
                fake_stream(),
                options=options,
            ),
            "silu_mul": cute.compile(
                SiluMul(num_sms),
                fake_rows(bf16, 2 * VEC),
                fake_rows(bf16, VEC),
                fake_vector(i32),
                fake_stream(),
                options=options,
            ),
            "combine": cute.compile(
                CombineRows(num_sms),
                fake_rows(bf16, VEC),
                fake_rows(bf16, VEC),
                fake_vector(i64),
                fake_stream(),
                options=options,
            ),
        }

    return compile_once(("rowops", num_sms), build, keep_ptx=keep_ptx)


def compile_unfused_kernels(quant, num_sms: int | None = None) -> dict:
    """The passes of the unfused pipeline (``fusion="separate"``, ``unfused.py``), one set per format.

    ``weighted_combine`` always; for fp8_tensor / fp8_channel also ``scale_f32`` (GEMM1's fp32
    output) and ``scale_bf16`` (GEMM2's bf16 output), the scaling passes.
    """
    num_sms = sm_count() if num_sms is None else num_sms

    def build(options):
        bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
        kernels = {
            "weighted_combine": cute.compile(
                WeightedCombineRows(num_sms),
                fake_rows(bf16, VEC),
                fake_rows(bf16, VEC),
                fake_vector(cutlass.Int64),
                fake_vector(f32),
                fake_stream(),
                options=options,
            )
        }
        if quant in ("fp8_tensor", "fp8_channel"):
            for name, dtype in (("scale_f32", f32), ("scale_bf16", bf16)):
                vec = 16 // (dtype.width // 8)  # one 16-byte vector per thread step
                kernels[name] = cute.compile(
                    ScaleRows(num_sms, quant, vec),
                    fake_rows(dtype, vec),
                    fake_vector(i32),
                    *fake_scales(quant),
                    fake_vector(i32),
                    fake_stream(),
                    options=options,
                )
        return kernels

    return compile_once(("unfused", quant, num_sms), build)

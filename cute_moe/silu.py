"""SiLU·mul between the two GEMMs, as a small CuTe kernel: ``a = SiLU(h[:, :I]) ⊙ h[:, I:]``.

``h [M_pad, 2I]`` is GEMM1's output in sorted order (gate columns, then up columns).  Each thread
handles 8 neighbouring columns of one row (16 bytes: one vector load of gate, one of up, one
vector store), computes ``g / (1 + e^(−g)) · u`` in fp32 and rounds once to bf16.  Only the
*used* rows are touched: their count (the end of the last expert's padded run) is read from
device memory, so the worst-case padding rows beyond it cost nothing and a new batch never
recompiles.  The grid is persistent (a grid-stride loop over 16-byte chunks).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

VEC = 8  # bf16 per thread step: 16 bytes
THREADS = 256


class SiluMul:
    """Arguments: h bf16 [M_pad, 2I], a bf16 [M_pad, I] (out), used_rows int32 [1], stream."""

    def __init__(self, num_ctas: int):
        self.num_ctas = num_ctas

    @cute.jit
    def __call__(self, h: cute.Tensor, a: cute.Tensor, used_rows: cute.Tensor, stream):
        self.kernel(h, a, used_rows).launch(grid=[self.num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, h: cute.Tensor, a: cute.Tensor, used_rows: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        inter = a.shape[1]
        # (8-column chunks) views: (VEC, rows, chunks) with the chunk's 8 elements contiguous
        gate = cute.local_tile(h, (1, VEC), (None, None))  # (1, VEC, rows, 2I/VEC)
        out = cute.local_tile(a, (1, VEC), (None, None))  # (1, VEC, rows, I/VEC)
        chunks = inter // VEC
        total = used_rows[0] * chunks
        i = bidx * THREADS + tidx
        while i < total:
            row = i // chunks
            c = i - row * chunks
            g = gate[(0, None, row, c)].load().to(cutlass.Float32)
            u = gate[(0, None, row, c + chunks)].load().to(cutlass.Float32)
            y = g / (1.0 + cute.math.exp(-g, fastmath=True)) * u
            out[(0, None, row, c)].store(y.to(a.element_type))
            i += self.num_ctas * THREADS

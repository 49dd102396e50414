"""The FP8 half of the grouped GEMM's consumer: scales in registers, two-level accumulation.

An FP8 (E4M3) expert GEMM multiplies quantized operands ``q_x`` and ``q_w`` whose real values are
``q_x · s_x`` and ``q_w · s_w`` (``moe_spec.quant``).  The kernel (``gemm.py``) runs the same
warp-specialized pipeline as for bf16 with ``wgmma … m64nNk32.f32.e4m3.e4m3``, and this module
supplies what happens to the fp32 sums in the consumer's registers:

Two-level accumulation (every format)
    Hopper's FP8 WGMMA adds its products into an accumulator narrower than fp32; summed over a
    long K (4096 … 14336) that costs percents.  So every K step (``tile_k`` = 128) the WGMMAs
    write a fresh *block* accumulator ``blk`` (the first one with ACCUMULATE off), the consumer
    waits for it, and :meth:`TileScales.promote` adds it into the fp32 tile accumulator ``acc``
    with an ordinary fp32 add — 128 products per promotion, as DeepGEMM and CUTLASS's FP8
    "2xAcc" kernels do.

Where each format's scales enter
    * ``fp8_tensor``:  ``acc · (s_x · s_w[e])`` after the K loop (:meth:`TileScales.dequantize`);
    * ``fp8_channel``: ``acc · (s_x[row] · s_w[e, col])`` after the K loop;
    * ``fp8_block``:   ``acc += blk · (s_x[row, k] · s_w[e, col / 128, k])`` at every promotion:
      a K step is exactly one 128-deep block of both scale grids, and a weight tile lies inside
      one 128-row block, so each K step reads one weight scale per tile and one activation scale
      per token row the thread holds.

"row" is the sorted token row and "col" the weight row (output feature) of a register.  Which
GEMM coordinate is which flips with the path: the normal path has tokens on M (``tCcC[i] = (token,
weight)``), swap-AB has weights on M (``tCcC[i] = (weight, token)``).  Every register looks its
scales up by its own coordinates; registers of one thread share rows and columns, and the compiler
keeps one load per distinct address (the CPU test counts the loads in the PTX).

The routing weight (GEMM2's ``row_scale``) is applied afterwards by the kernel's epilogue, in the
same registers, before the down-cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from moe_spec.quant import FP8_BLOCK


@dataclass(frozen=True)
class TileScales:
    """The scales of one output tile, addressed by accumulator register (built while tracing).

    Frozen, so the DSL reads it inside the K loop instead of carrying it as loop state.  Build it
    with :meth:`at`.
    """

    cfg: object
    tCcC: object  # the consumer thread's tile coordinate of every accumulator register
    x_scale: cute.Tensor
    w_scale: cute.Tensor
    expert: object
    row0: object  # first sorted token row of the tile
    col0: object  # first weight row of the tile
    last_col: object  # n_out − 1

    @classmethod
    def at(
        cls,
        cfg,
        tCcC,
        x_scale: cute.Tensor,
        w_scale: cute.Tensor,
        block_expert: cute.Tensor,
        token_block,
        weight_block,
        n_out,
    ) -> TileScales:
        """The scales of tile (token_block, weight_block) (shapes in ``gemm.GroupedGemm``).

        Registers of the last, partial weight tile that lie past ``n_out`` read the last row's
        scale — never memory past the array — and TMA drops their results.
        """
        return cls(
            cfg,
            tCcC,
            x_scale,
            w_scale,
            block_expert[token_block],
            token_block * cfg.tokens_tile,
            weight_block * cfg.weights_tile,
            n_out - 1,
        )

    def _token_weight(self, i):
        """(token, weight) coordinate of accumulator register ``i`` within the tile."""
        m, n = self.tCcC[i]
        return (n, m) if self.cfg.swap_ab else (m, n)

    def _row(self, i):
        """Sorted token row of register ``i``."""
        return self.row0 + self._token_weight(i)[0]

    def _col(self, i):
        """Weight row (output feature) of register ``i``, clamped to the last one."""
        return cutlass.min(self.col0 + self._token_weight(i)[1], self.last_col)

    def promote(self, acc: cute.Tensor, blk: cute.Tensor, k) -> None:
        """``acc += blk`` for K step ``k`` — times the step's block scales for ``fp8_block``.

        A weight tile lies inside one 128-row scale block (``GemmConfig.validate``), so the whole
        tile shares one weight scale per K step; each register adds its token row's scale.
        """
        if self.cfg.quant == "fp8_block":
            s_w = self.w_scale[(self.expert, self.col0 // FP8_BLOCK, k)]
            for i in range(cute.size(acc)):
                acc[i] = acc[i] + blk[i] * (self.x_scale[(self._row(i), k)] * s_w)
        else:
            for i in range(cute.size(acc)):
                acc[i] = acc[i] + blk[i]

    def dequantize(self, acc: cute.Tensor) -> None:
        """After the K loop: apply the per-tensor or per-channel scales (block scales are already in),
        unless the config leaves them to a separate pass (``epilogue_scales=False``)."""
        if not self.cfg.epilogue_scales:
            return
        if self.cfg.quant == "fp8_tensor":
            s = self.x_scale[0] * self.w_scale[self.expert]
            for i in range(cute.size(acc)):
                acc[i] = acc[i] * s
        elif self.cfg.quant == "fp8_channel":
            for i in range(cute.size(acc)):
                acc[i] = acc[i] * (self.x_scale[self._row(i)] * self.w_scale[(self.expert, self._col(i))])

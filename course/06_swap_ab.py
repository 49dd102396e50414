"""Step 6 — swap-AB: a handful of tokens times a weight matrix, without wasting the tensor core's M.

What is new: not an instruction but a choice of roles. A linear layer computes ``y[T, N] = x[T, K]
· w[N, K]ᵀ``. With the tokens as WGMMA's A operand, M is at least 64 rows per warpgroup: with 2
tokens, 62 of those rows multiply padding, and every stage still loads a 64-row token box. Swap
the operands and compute the transpose, ``yᵀ[N, T] = w[N, K] · x[T, K]ᵀ``:

* the **weights fill M** (128 rows: both consumer warpgroups busy with real data);
* the **tokens become N**, which WGMMA allows as small as 8 (``m64n8k16``): T rounded up to 8;
* neither operand is transposed in memory — both stay K-major, which is also the only layout
  FP8 WGMMA accepts (step 7); only the *output* changes orientation: C is the view ``yᵀ`` of
  ``y``, shape (N, T) with strides (1, N) — *M-major*.

The kernel is step 5's, unchanged except for the epilogue: the token tile is wider than T, so
each register's (m, n) is checked against C's extent before it is stored. Here a register goes
straight to global memory, which for an M-major C writes two tokens of one weight row N elements
apart; the production kernel instead stores through ``stmatrix … .trans`` into shared memory and
one TMA store per box (cute_moe/gemm.py's epilogue). The token box's rows past T lie outside the
tensor, and TMA fills them with zeros (PTX ISA, "Out of Boundary Access": the tensor map's zero-fill
mode, the one CUTLASS encodes), so the padding columns of the accumulator are exact zeros.

When to swap: :func:`swap_ab_choice` asks cute_moe's own path rule (:func:`cute_moe.plan.path_rule`,
swap while the mean tokens per expert is at most ``SWAP_AB_MAX_TOKENS_PER_EXPERT`` = WGMMA's M = 64)
and shows the padding of both paths' token tiles as the production kernel picks them (normal: 64 or
128 rows; swap-AB: 8, 16, 32 or 64 columns — the course's kernel here takes any multiple of 8). Up
to 64 tokens the normal path's 64-row tile is mostly padding and the swapped one is not; above it
the normal path's 128-token tile uses each weight stage for twice the tokens of the widest swapped
tile, and the H200 measured it faster (cute_moe/plan.py says where).
"""

from __future__ import annotations

import _common as course
import cutlass
import cutlass.cute as cute

from cute_moe.plan import SWAP_AB_MAX_TOKENS_PER_EXPERT, path_rule

BF16, F32 = cutlass.BFloat16, cutlass.Float32
STEP5 = course.load("05_persistent")
TILE_K = STEP5.TILE_K


def token_tile(tokens: int) -> int:
    """WGMMA's N for ``tokens`` tokens: a multiple of 8, at least 8."""
    return max(8, -(-tokens // 8) * 8)


def swap_ab_choice(tokens: int) -> dict:
    """Swap or not for ``tokens`` tokens per expert, by cute_moe's path rule, with each path's token tile
    (the rule's bucket) and the rows (normal) or columns (swapped) those tiles cover beyond the tokens."""
    course.require(tokens >= 1, f"tokens={tokens}: at least 1")

    def bucket(rule):  # (bound, swap_ab, token tile) of the first bucket covering the tokens
        return next(b for b in rule if tokens <= b[0])

    normal, swapped = bucket(path_rule(swap_ab=False))[2], bucket(path_rule(swap_ab=True))[2]
    rows, cols = -(-tokens // normal) * normal, -(-tokens // swapped) * swapped
    return {
        "swap": bucket(path_rule())[1],
        "threshold": SWAP_AB_MAX_TOKENS_PER_EXPERT,
        "normal_tile": normal,
        "normal_token_rows": rows,
        "normal_padding": rows - tokens,
        "swapped_tile": swapped,
        "swapped_token_cols": cols,
        "swapped_padding": cols - tokens,
    }


class SwapAbGemm(STEP5.PersistentGemm):
    """Step 5's kernel with a bounds-checked epilogue: C may be narrower than the token tile."""

    @cute.jit
    def store_tile(self, acc: cute.Tensor, thr_mma: cute.ThrMma, gC_tile: cute.Tensor, bm, bn, c: cute.Tensor):
        tCgC = thr_mma.partition_C(gC_tile)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((128, self.n)))  # (m, n) inside the tile
        rows, cols = cute.size(c, mode=[0]), cute.size(c, mode=[1])
        for r in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcC[r]
            if bm * 128 + m < rows and bn * self.n + n < cols:
                tCgC[r] = acc[r]


_compiled: dict = {}


def linear_swap_ab(x, w, stages: int = 6, ctas: int | None = None):
    """Host function: ``y[T, N] = x[T, K] · w[N, K]ᵀ`` (fp32 out) for T ≤ 256, computed as ``yᵀ = w · xᵀ``."""
    import torch

    course.require(x.dtype == w.dtype == torch.bfloat16, "x, w: bfloat16")
    course.require(1 <= x.shape[0] <= 256, f"x: 1 … 256 tokens, got {x.shape[0]}")
    course.require(x.shape[1] == w.shape[1] and x.shape[1] % TILE_K == 0, f"x, w: K equal, a multiple of {TILE_K}")
    course.require(w.shape[0] % 128 == 0, f"w: N a multiple of 128, got {w.shape[0]}")
    tokens, n_out = x.shape[0], w.shape[0]
    n = token_tile(tokens)
    y = torch.empty(tokens, n_out, dtype=torch.float32, device=x.device)
    # A = w (M = N_out), B = x (N = tokens), C = yᵀ: (N_out, T), strides (1, N_out) — M-major
    args = [course.to_cute(w, 1), course.to_cute(x, 1), course.to_cute(y.t(), 0), course.stream()]
    ctas = ctas or torch.cuda.get_device_properties(x.device).multi_processor_count
    key = (n, stages, ctas)
    if key not in _compiled:
        _compiled[key] = cute.compile(SwapAbGemm(n, stages, ctas), *args)
    _compiled[key](*args)
    return y


def ptx(tokens: int = 2, stages: int = 6, ctas: int = STEP5.H200_SMS) -> str:
    n = token_tile(tokens)
    fakes = (
        course.fake_matrix(BF16, 128, TILE_K),
        course.fake_matrix(BF16, 1, TILE_K),
        course.fake_matrix(F32, 128, 1, row_major=False),
        course.fake_stream(),
    )
    return course.compile_ptx(SwapAbGemm(n, stages, ctas), *fakes)


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        x, w = torch.randn(4, 4096, device="cuda").bfloat16(), torch.randn(14336, 4096, device="cuda").bfloat16()
    course.bench_main("06 swap-AB, 4 tokens x 14336 x 4096", lambda: linear_swap_ab(x, w), 2 * 4 * 14336 * 4096)

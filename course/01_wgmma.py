"""Step 1 — one WGMMA: ``C[64, N] = A[64, 16] · B[N, 16]ᵀ`` from shared memory.

What is new: the tensor-core instruction of Hopper, ``wgmma.mma_async.sync.aligned.m64nNk16``.
It is issued by a *warpgroup* (four contiguous warps, the first one's rank a multiple of 4: 128
threads). B always comes from shared memory through a 64-bit *matrix descriptor*; A may come from
registers or, as here, through a descriptor too. The fp32 result D lands in registers, N/2 per
thread. Three more instructions come with it: ``wgmma.fence`` (orders earlier accesses to the
accumulator and A registers before the WGMMA's; needed before the first WGMMA and after any such
access, not between WGMMAs of one shape accumulating into the same registers),
``wgmma.commit_group`` (close this thread's issued WGMMAs into a group) and ``wgmma.wait_group N``
(wait until at most the N most recent groups are pending) — the WGMMA only *starts* the multiply,
and nobody may touch the accumulator registers before the wait that covers it.

The kernel is one CTA of one warpgroup. Every thread copies a share of A and B from global into
shared memory with ordinary loads and stores (step 2 replaces that with TMA); shared memory holds
them in the swizzled layout the descriptor expects (``make_smem_layout_a/b``: K-major rows of
16 bf16 = 32 bytes, so a 32-byte swizzle: mode 3 in the descriptor's bits 62–63). Writes by ordinary
stores belong to the *generic proxy*, WGMMA runs in the *async proxy*: each thread's
``fence.proxy.async`` after its stores, then a CTA barrier, make them visible to the tensor core.

Who owns which accumulator element is fixed by the hardware (PTX ISA, "Register Fragments",
the m64nNk16 D-fragment figure). For thread ``t`` of the warpgroup (warp ``t/32``, lane ``t%32``)
and its register ``d[r]``, ``r = 0 … N/2 − 1``::

    m = 16·warp + lane/4 + 8·((r/2) mod 2)        n = 8·(r/4) + 2·(lane mod 4) + (r mod 2)

:func:`ptx_owner` writes that formula down; :func:`owner_map` reads the same map from the tiled
MMA (its thread-value layout ``tv_layout_C``); the tests hold the two equal, and the kernel writes
``owner[m, n] = 256·t + r`` from its own ``partition_C`` so the GPU test checks the registers too.
"""

from __future__ import annotations

import _common as course
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

BF16, F32, I32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
K_MAJOR = LayoutEnum.ROW_MAJOR  # unit stride along K: the natural layout of X [T, K] and W [N, K]


def ptx_owner(t: int, r: int) -> tuple[int, int]:
    """(m, n) held by register ``r`` of warpgroup thread ``t``: the PTX ISA's D-fragment figure."""
    warp, lane = t // 32, t % 32
    return 16 * warp + lane // 4 + 8 * ((r // 2) % 2), 8 * (r // 4) + 2 * (lane % 4) + r % 2


def make_tiled_mma(n: int, dtype=BF16):
    """One warpgroup's WGMMA atom m64nNk16 (m64nNk32 for 8-bit types), both operands K-major."""
    return sm90.make_trivial_tiled_mma(
        dtype, dtype, K_MAJOR.sm90_mma_major_mode(), K_MAJOR.sm90_mma_major_mode(), F32, (1, 1, 1), tiler_mn=(64, n)
    )


def _flat(t):
    return [y for x in t for y in _flat(x)] if isinstance(t, tuple) else [t]


def evaluate(shape, stride, i: int) -> int:
    """A CuTe layout ``shape:stride`` at the 1-D coordinate ``i`` (split colexicographically)."""
    out = 0
    for s, d in zip(_flat(shape), _flat(stride)):
        out, i = out + (i % s) * d, i // s
    return out


def owner_map(n: int) -> dict[tuple[int, int], tuple[int, int]]:
    """``(m, n) → (thread, register)`` read from the tiled MMA's thread-value layout of C.

    ``tv_layout_C`` maps (thread, value) to the column-major index ``m + 64·n`` of the C tile."""
    got = {}

    @cute.jit
    def probe():
        tv = make_tiled_mma(n).tv_layout_C
        got["tv"] = (tv.shape, tv.stride)

    probe()
    shape, stride = got["tv"]
    out = {}
    for t in range(128):
        for r in range(n // 2):
            idx = evaluate(shape, stride, t + 128 * r)
            out[(idx % 64, idx // 64)] = (t, r)
    return out


class OneWgmma:
    """``c[64, n] = a[64, 16] · b[n, 16]ᵀ`` (bf16 in, fp32 out) and the owner map, one warpgroup."""

    def __init__(self, n: int):
        course.require(n % 8 == 0 and 8 <= n <= 256, f"n={n}: WGMMA's N is 8 … 256 in steps of 8")
        self.n = n

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, owner: cute.Tensor, stream):
        tile = (64, self.n, 16)
        tiled_mma = make_tiled_mma(self.n)
        # (rows, 16, 1 stage), swizzled atoms: the layout the matrix descriptor describes
        sa_layout = sm90.make_smem_layout_a(K_MAJOR, tile, BF16, 1)
        sb_layout = sm90.make_smem_layout_b(K_MAJOR, tile, BF16, 1)
        self.kernel(a, b, c, owner, tiled_mma, sa_layout, sb_layout).launch(
            grid=[1, 1, 1], block=[128, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        owner: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sa_layout: cute.ComposedLayout,
        sb_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        smem = SmemAllocator()
        sA = smem.allocate_tensor(BF16, sa_layout.outer, byte_alignment=1024, swizzle=sa_layout.inner)  # (64, 16, 1)
        sB = smem.allocate_tensor(BF16, sb_layout.outer, byte_alignment=1024, swizzle=sb_layout.inner)  # (n, 16, 1)
        # every thread copies a share of the operands, element by element (generic proxy)
        for j in cutlass.range_constexpr(64 * 16 // 128):
            i = tidx + 128 * j
            sA[i // 16, i % 16, 0] = a[i // 16, i % 16]
        for j in cutlass.range_constexpr(self.n * 16 // 128):
            i = tidx + 128 * j
            sB[i // 16, i % 16, 0] = b[i // 16, i % 16]
        cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy writes → visible to WGMMA
        cute.arch.sync_threads()

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # descriptors, not data: (MMA, 1, 1, 1)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((64, self.n)))  # (m, n) of every register
        acc = cute.make_rmem_tensor(tCcC.shape, F32)  # n/2 fp32 registers per thread
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)  # D = A·B (no D read): no zeroing needed
        warpgroup.fence()
        cute.gemm(tiled_mma, acc, tCrA[None, None, 0, 0], tCrB[None, None, 0, 0], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)  # only now may the registers be read
        for r in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcC[r]
            c[m, n] = acc[r]
            owner[m, n] = tidx * 256 + r


_compiled: dict = {}


def wgmma(a, b):
    """Host function: torch bf16 ``a [64, 16]`` and ``b [n, 16]`` → (fp32 ``c [64, n]``, int32 owner)."""
    import torch

    course.require(a.dtype == b.dtype == torch.bfloat16, "a, b: bfloat16")
    course.require(tuple(a.shape) == (64, 16), f"a: shape (64, 16), got {tuple(a.shape)}")
    course.require(b.dim() == 2 and b.shape[1] == 16, f"b: shape (n, 16), got {tuple(b.shape)}")
    n = b.shape[0]
    c = torch.empty(64, n, dtype=torch.float32, device=a.device)
    owner = torch.empty(64, n, dtype=torch.int32, device=a.device)
    args = [course.to_cute(t.contiguous()) for t in (a, b, c, owner)] + [course.stream()]
    if n not in _compiled:
        _compiled[n] = cute.compile(OneWgmma(n), *args)
    _compiled[n](*args)
    return c, owner


def ptx(n: int = 64) -> str:
    """The step's PTX, compiled on the CPU from fake tensors."""
    fakes = (
        course.fake(BF16, (64, 16)),
        course.fake(BF16, (n, 16)),
        course.fake(F32, (64, n)),
        course.fake(I32, (64, n)),
        course.fake_stream(),
    )
    return course.compile_ptx(OneWgmma(n), *fakes)


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        a, b = (torch.randn(r, 16, device="cuda", dtype=torch.bfloat16) for r in (64, 256))
    course.bench_main("01 one WGMMA m64n256k16", lambda: wgmma(a, b), 2 * 64 * 256 * 16)

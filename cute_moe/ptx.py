"""The CPU PTX listing: compile a GEMM configuration without a GPU and read what it compiles to.

``compile_gemm(cfg)`` builds the kernel from *fake* tensors: every extent that depends on the
batch (M_pad, N_out, K, E, the block count) is a symbolic integer, so the compiled function
accepts any problem size and routing; only the :class:`GemmConfig` is baked in.  It compiles
through the package's one compile cache (:mod:`cute_moe.cache`), and the same compiled object
serves the CPU (to read its PTX) and the GPU (to launch it).

``compile_ptx(cfg)`` returns the PTX text: the teaching view of what WGMMA, TMA, ``setmaxnreg``
and ``stmatrix`` instructions the config produced, and the CPU test hook.  ``mma_instruction(cfg)``
names the WGMMA the config compiles to, read from the kernel's own tiled MMA.

The persistent grid is one CTA per SM: :func:`moe_spec.hopper.sm_count` — the GPU's own count
where there is one, the H200's 132 when compiling on a CPU.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from moe_spec.hopper import sm_count

from .cache import compile_once
from .config import GemmConfig
from .gemm_plan import DSL_DTYPES, GemmLaunch, KernelPlan
from .runtime import fake_scales

PTX_TYPES = {"Float32": "f32", "BFloat16": "bf16", "Float16": "f16", "Float8E4M3FN": "e4m3"}
"""DSL element type → the type suffix PTX spells in ``wgmma.mma_async`` (accumulator, A, B)."""

INDEX_DTYPES = {"int32": cutlass.Int32, "int64": cutlass.Int64}
"""The token-index dtypes a ``gather_rows`` kernel is compiled for (that of ``SortedRows.token_of_row``)."""
INDEX_DTYPE = "int64"
"""The one ``moe.sort_rows`` makes: what a warm-up (``warmup.compile_plan``) compiles a gathering GEMM1 for."""


def fake_arguments(cfg: GemmConfig, index_dtype: str = INDEX_DTYPE):
    """Symbolic stand-ins for the kernel's arguments (16-B aligned rows).

    bf16: ``(x, w, c, block_expert, num_blocks, row_scale, stream)``; an FP8 config adds
    ``(x_scale, w_scale)`` in its format's shapes (``gemm.GroupedGemm``'s docstring); a ``gather_rows``
    config adds ``(None, None, token_of_row)`` (``index_dtype``), and its x has T rows, not M_pad.
    """
    dt, out_dt = DSL_DTYPES[cfg.dtype], DSL_DTYPES[cfg.out_dtype]
    align = cfg.operand_align  # TMA needs 16-B aligned strides: 8 bf16, 16 FP8 along K
    m_pad = cute.sym_int(divisibility=cfg.tokens_tile)
    n_out = cute.sym_int(divisibility=cfg.out_align)
    k = cute.sym_int(divisibility=align)
    experts = cute.sym_int()
    x = make_fake_compact_tensor(dt, (cute.sym_int() if cfg.gather_rows else m_pad, k), stride_order=(1, 0),
                                 assumed_align=16)
    if cfg.gated:  # W1 [E, 2I, K] seen as (I, K, half, E): strides (K, 1, I·K, 2I·K); C is [M_pad, I]
        # every extent symbolic, the half's too: the call marks the whole layout dynamic
        # (runtime.cute_tensor), and a static extent here would shift the extents it passes
        w = make_fake_tensor(dt, (n_out, k, cute.sym_int(), experts),
                             stride=(cute.sym_int64(divisibility=align), 1, cute.sym_int64(divisibility=align),
                                     cute.sym_int64(divisibility=align)), assumed_align=16)
    else:  # W [E, N_out, K] seen as (N_out, K, E): strides (K, 1, N_out·K)
        w = make_fake_tensor(dt, (n_out, k, experts),
                             stride=(cute.sym_int64(divisibility=align), 1, cute.sym_int64(divisibility=align)),
                             assumed_align=16)
    c_stride = cute.sym_int64(divisibility=cfg.out_align)
    if cfg.swap_ab:  # C [M_pad, N_out] viewed as Cᵀ (N_out, M_pad), M-major
        c = make_fake_tensor(out_dt, (n_out, m_pad), stride=(1, c_stride), assumed_align=16)
    else:
        c = make_fake_tensor(out_dt, (m_pad, n_out), stride=(c_stride, 1), assumed_align=16)
    block_expert = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    num_blocks = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    row_scale = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    args = (x, w, c, block_expert, num_blocks, row_scale, make_fake_stream())
    if cfg.gather_rows:
        if index_dtype not in INDEX_DTYPES:
            raise ValueError(f"index_dtype={index_dtype!r}: token indices are one of {tuple(INDEX_DTYPES)}")
        return args + (None, None, make_fake_compact_tensor(INDEX_DTYPES[index_dtype], (cute.sym_int(),),
                                                            assumed_align=4))
    if cfg.quant is None:
        return args
    return args + fake_scales(cfg.quant)


def compile_gemm(cfg: GemmConfig, num_ctas: int | None = None, *, keep_ptx: bool = False,
                 index_dtype: str = INDEX_DTYPE):
    """The compiled grouped GEMM for ``cfg`` (cached per config and grid size; default grid: one
    CTA per SM, :func:`moe_spec.hopper.sm_count`); a ``gather_rows`` config per ``index_dtype`` too
    ("int32" or "int64": the dtype of the token indices it reads)."""
    cfg.validate()
    num_ctas = sm_count() if num_ctas is None else num_ctas
    index_dtype = index_dtype if cfg.gather_rows else INDEX_DTYPE  # only a gathering kernel reads indices

    def build(options):
        return cute.compile(GemmLaunch(cfg, num_ctas), *fake_arguments(cfg, index_dtype), options=options)

    return compile_once(("gemm", cfg.key(), num_ctas, index_dtype), build, keep_ptx=keep_ptx)


def compile_ptx(cfg: GemmConfig, num_ctas: int | None = None) -> str:
    """PTX of the kernel for ``cfg``, compiled on the CPU (no GPU needed)."""
    return compile_gemm(cfg, num_ctas, keep_ptx=True).__ptx__


@functools.cache
def mma_instruction(cfg: GemmConfig) -> str:
    """The ``wgmma.mma_async`` instruction ``cfg`` compiles to, as PTX spells it.

    Read from the kernel's own tiled MMA (:class:`~cute_moe.gemm_plan.KernelPlan`, built in a jit
    context without compiling the kernel): the atom's instruction shape and operand types.
    """
    found = {}

    @cute.jit
    def probe():
        op = KernelPlan(cfg).tiled_mma.op
        found["mnk"] = tuple(int(v) for v in op.shape_mnk)
        found["types"] = tuple(PTX_TYPES[str(t)] for t in (op.acc_dtype, op.a_dtype, op.b_dtype))

    probe()
    return "wgmma.mma_async.sync.aligned.m{}n{}k{}.".format(*found["mnk"]) + ".".join(found["types"])

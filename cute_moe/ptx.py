"""Compile a configuration without a GPU, and the one compile cache the package uses.

``compile_gemm(cfg)`` builds the kernel from *fake* tensors: every extent that depends on the
batch (M_pad, N_out, K, E, the block count) is a symbolic integer, so the compiled function
accepts any problem size and routing; only the :class:`GemmConfig` is baked in.  The same
compiled object serves the CPU (to read its PTX) and the GPU (to launch it), and
``compile_count()`` counts how many times the DSL actually ran: a T sweep or a new routing must
leave it unchanged.

``compile_ptx(cfg)`` returns the PTX text: the teaching view of what WGMMA, TMA, ``setmaxnreg``
and ``stmatrix`` instructions the config produced, and the CPU test hook.  ``mma_instruction(cfg)``
names the WGMMA the config compiles to, read from the kernel's own tiled MMA; ``compile_plan``
compiles what one layer plan runs (a warm-up walks ``cute_moe.plans_for``); ``compile_once`` keeps
the kernels other modules compile (the alignment, ``alignops.py``) in the same cache.

The persistent grid is one CTA per SM: :func:`moe_spec.hopper.sm_count` — the GPU's own count
where there is one, the H200's 132 when compiling on a CPU.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor  # noqa: E402

from moe_spec.hopper import sm_count  # noqa: E402

from .config import ALIGN_ELEMS, FP8_ALIGN_ELEMS, GemmConfig  # noqa: E402
from .gemm import GroupedGemm  # noqa: E402
from .kernel_plan import DSL_DTYPES, KernelPlan  # noqa: E402
from .quantops import QuantizeRows, RowAmax  # noqa: E402
from .rowops import CombineRows, GatherRows, ScaleRows, SiluMul, WeightedCombineRows  # noqa: E402

PTX_TYPES = {"Float32": "f32", "BFloat16": "bf16", "Float16": "f16", "Float8E4M3FN": "e4m3"}
"""DSL element type → the type suffix PTX spells in ``wgmma.mma_async`` (accumulator, A, B)."""

_cache: dict[tuple, object] = {}
_compiles = 0
_lock = threading.Lock()
_dump_dir: str | None = None


def _ptx_dir() -> str:
    global _dump_dir
    if _dump_dir is None:
        _dump_dir = tempfile.mkdtemp(prefix="cute_moe_ptx_")
    return _dump_dir


def compile_count() -> int:
    """How many kernels this process has compiled (cache misses of the compile functions)."""
    return _compiles


INDEX_DTYPES = {"int32": cutlass.Int32, "int64": cutlass.Int64}
"""The token-index dtypes a ``gather_rows`` kernel is compiled for (that of ``SortedRows.token_of_row``)."""
INDEX_DTYPE = "int64"
"""The one ``moe.sort_rows`` makes: what :func:`compile_plan` (a warm-up) compiles a gathering GEMM1 for."""


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
    return args + _fake_scales(cfg.quant)


def _fake_scales(quant: str):
    """(x_scale, w_scale) of an FP8 format: fp32, row-major (unit stride last), symbolic extents and
    strides — what ``runtime.cute_scale`` makes of a contiguous torch tensor."""
    def f32(n_dims: int):
        shape = tuple(cute.sym_int() for _ in range(n_dims))
        stride = tuple(cute.sym_int64() for _ in range(n_dims - 1)) + (1,)
        return make_fake_tensor(cutlass.Float32, shape, stride=stride, assumed_align=4)

    dims = {"fp8_tensor": (1, 1), "fp8_channel": (1, 2), "fp8_block": (2, 3)}[quant]
    return f32(dims[0]), f32(dims[1])


def compile_gemm(cfg: GemmConfig, num_ctas: int | None = None, *, keep_ptx: bool = False,
                 index_dtype: str = INDEX_DTYPE):
    """The compiled grouped GEMM for ``cfg`` (cached per config and grid size; default grid: one
    CTA per SM, :func:`moe_spec.hopper.sm_count`); a ``gather_rows`` config per ``index_dtype`` too
    ("int32" or "int64": the dtype of the token indices it reads)."""
    global _compiles
    cfg.validate()
    num_ctas = sm_count() if num_ctas is None else num_ctas
    index_dtype = index_dtype if cfg.gather_rows else INDEX_DTYPE  # only a gathering kernel reads indices
    key = (cfg.key(), num_ctas, keep_ptx, index_dtype)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        # --keep-ptx writes a file; send it to a private temp dir, never the working directory
        options = f"--keep-ptx --dump-dir {_ptx_dir()}" if keep_ptx else None
        compiled = cute.compile(GroupedGemm(cfg, num_ctas), *fake_arguments(cfg, index_dtype), options=options)
        _compiles += 1
        _cache[key] = compiled
        return compiled


def _rows_tensor(dtype, cols_divisibility=ALIGN_ELEMS, rows=None):
    rows = rows if rows is not None else cute.sym_int()
    return make_fake_tensor(dtype, (rows, cute.sym_int(divisibility=cols_divisibility)),
                            stride=(cute.sym_int64(divisibility=cols_divisibility), 1), assumed_align=16)


def compile_row_kernels(num_sms: int | None = None) -> dict:
    """The compiled gather / SiLU·mul / combine kernels (``rowops.py``), one set per SM count."""
    global _compiles
    num_sms = sm_count() if num_sms is None else num_sms
    key = ("rowops", num_sms)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            bf16, stream = cutlass.BFloat16, make_fake_stream()
            index = make_fake_compact_tensor(cutlass.Int64, (cute.sym_int(),), assumed_align=8)
            scalar = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
            hit = _cache[key] = {
                "gather": cute.compile(GatherRows(num_sms), _rows_tensor(bf16), _rows_tensor(bf16), index, scalar,
                                       stream),
                "silu_mul": cute.compile(SiluMul(num_sms), _rows_tensor(bf16, 2 * ALIGN_ELEMS), _rows_tensor(bf16), scalar,
                                         stream),
                "combine": cute.compile(CombineRows(num_sms), _rows_tensor(bf16), _rows_tensor(bf16), index, stream),
            }
            _compiles += 3
        return hit


def compile_quant_kernels(quant: str, num_sms: int | None = None, *, keep_ptx: bool = False) -> dict:
    """The compiled FP8 activation kernels of one format (``quantops.py``), one set per SM count.

    ``x_amax`` / ``x_quantize``: bf16 token rows; ``silu_amax``: GEMM1's fp32 output → the fp32
    SiLU·up intermediate and its amax; ``a_quantize``: fp32 rows.  Row widths are multiples of
    ``FP8_ALIGN_ELEMS`` (16: whole 16-byte rows of E4M3).  ``keep_ptx``: each has ``.__ptx__``.
    """
    global _compiles
    num_sms = sm_count() if num_sms is None else num_sms
    key = ("quantops", quant, num_sms, keep_ptx)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            options = f"--keep-ptx --dump-dir {_ptx_dir()}" if keep_ptx else None
            bf16, f32, stream = cutlass.BFloat16, cutlass.Float32, make_fake_stream()
            width = FP8_ALIGN_ELEMS

            def vector(dtype):
                return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=4)

            def rows(dtype, cols_divisibility=width):
                return _rows_tensor(dtype, cols_divisibility)

            fp8, i32 = cutlass.Float8E4M3FN, cutlass.Int32
            hit = _cache[key] = {
                "x_amax": cute.compile(RowAmax(quant, num_sms, silu=False), rows(bf16), rows(bf16), vector(f32),
                                       vector(i32), vector(i32), stream, options=options),
                "x_quantize": cute.compile(QuantizeRows(quant, num_sms), rows(bf16), vector(f32), rows(fp8),
                                           vector(f32), vector(i32), stream, options=options),
                "silu_amax": cute.compile(RowAmax(quant, num_sms, silu=True), rows(f32, 2 * width), rows(f32),
                                          vector(f32), vector(i32), vector(i32), stream, options=options),
                "a_quantize": cute.compile(QuantizeRows(quant, num_sms), rows(f32), vector(f32), rows(fp8),
                                           vector(f32), vector(i32), stream, options=options),
            }
            _compiles += 4
        return hit


def compile_unfused_kernels(quant, num_sms: int | None = None) -> dict:
    """The passes of the unfused pipeline (``fusion="separate"``, ``rowops.py``), one set per format.

    ``weighted_combine`` always; for fp8_tensor / fp8_channel also ``scale_f32`` (GEMM1's fp32
    output) and ``scale_bf16`` (GEMM2's bf16 output), the scaling passes.
    """
    global _compiles
    num_sms = sm_count() if num_sms is None else num_sms
    key = ("unfused", quant, num_sms)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            bf16, stream = cutlass.BFloat16, make_fake_stream()
            index = make_fake_compact_tensor(cutlass.Int64, (cute.sym_int(),), assumed_align=8)

            def vector(dtype):
                return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=4)

            hit = {"weighted_combine": cute.compile(WeightedCombineRows(num_sms), _rows_tensor(bf16), _rows_tensor(bf16),
                                                    index, vector(cutlass.Float32), stream)}
            if quant in ("fp8_tensor", "fp8_channel"):
                for name, dtype in (("scale_f32", cutlass.Float32), ("scale_bf16", bf16)):
                    vec = 16 // (dtype.width // 8)  # one 16-byte vector per thread step
                    hit[name] = cute.compile(ScaleRows(num_sms, quant, vec), _rows_tensor(dtype, vec),
                                             vector(cutlass.Int32), *_fake_scales(quant), vector(cutlass.Int32), stream)
            _cache[key] = hit
            _compiles += len(hit)
        return hit


def compile_once(key: tuple, build, *, keep_ptx: bool = False) -> dict:
    """The cache entry for kernels compiled outside this module (the alignment, ``alignops.py``):
    ``build(options)`` compiles them with ``cute.compile(..., options=options)`` and returns
    ``{name: compiled}``; it runs once per ``key`` (and ``keep_ptx``: then ``.__ptx__`` holds the
    PTX); each kernel counts in :func:`compile_count`."""
    global _compiles
    key = (*key, keep_ptx)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            hit = _cache[key] = build(f"--keep-ptx --dump-dir {_ptx_dir()}" if keep_ptx else None)
            _compiles += len(hit)
        return hit


def compile_ptx(cfg: GemmConfig, num_ctas: int | None = None) -> str:
    """PTX of the kernel for ``cfg``, compiled on the CPU (no GPU needed)."""
    return compile_gemm(cfg, num_ctas, keep_ptx=True).__ptx__


def compile_plan(plan, num_ctas: int | None = None) -> int:
    """Compile everything a layer plan (:class:`cute_moe.plan.LayerPlan`) runs — its two GEMMs, the
    row kernels, an FP8 format's quantization kernels and the unfused pipeline's passes — ahead of
    the first call: a warm-up compiles every plan of ``plans_for``.
    Returns how many kernels this call compiled (0 when all were cached)."""
    before = _compiles
    for cfg in (plan.gemm1, plan.gemm2):
        compile_gemm(cfg, num_ctas)
    compile_row_kernels(num_ctas)
    if plan.quant is not None:
        compile_quant_kernels(plan.quant, num_ctas)
    if plan.fusion == "separate":
        compile_unfused_kernels(plan.quant, num_ctas)
    return _compiles - before


@functools.lru_cache(maxsize=None)
def mma_instruction(cfg: GemmConfig) -> str:
    """The ``wgmma.mma_async`` instruction ``cfg`` compiles to, as PTX spells it.

    Read from the kernel's own tiled MMA (:class:`~cute_moe.kernel_plan.KernelPlan`, built in a jit
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

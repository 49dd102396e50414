"""How the package's kernels take torch tensors (the DSL's TVM-FFI calling convention), and the
symbolic stand-ins they compile against.

Every CuTe kernel of the package compiles with ``--enable-tvm-ffi`` (:func:`cute_moe.cache.ptx_options`)
against the ``fake_*`` stand-ins below — every extent and stride a symbolic integer, so one compile
serves every batch — and the stream :func:`fake_stream`.  A call then passes, with nothing converted
in Python:

* torch tensors as they are.  The compiled function reads each one's pointer, extents and strides
  through DLPack (torch's C exchange API: no Python object made per tensor) and checks them against
  what it was compiled for — dtype, rank, the unit stride, the divisibility of the symbolic extents
  and strides (the 16-byte rows TMA needs), an extent shared between two tensors (a GEMM's M_pad,
  N_out and K), the base alignment, one CUDA device — raising ValueError naming the argument before
  it launches;
* Python ints for scalars (``Int32``) and for pointers (``t.data_ptr()``: the alignment takes the
  routing tensors so, a pointer and a count);
* ``None`` where the function was compiled with ``None`` (a GEMM's unused optional operands);
* no stream: the function launches on the TVM-FFI environment stream of its tensors' device, which
  the call sets from torch's current stream there (a CUDA-graph capture's included).

So there is nothing to cache per tensor: a call costs one C call per launch (:func:`ffi_function`
takes the DSL's compiled object to the bare TVM-FFI function it holds, skipping its Python
keyword wrapper).  The SM count the persistent grids take is :func:`moe_spec.hopper.sm_count`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor, make_ptr


def ffi_function(compiled):
    """The bare ``tvm_ffi.Function`` of a kernel compiled with :data:`cute_moe.cache.TVM_FFI` (called positionally with
    every argument of the compiled signature but the stream), or ``compiled`` itself when it holds
    none (a stand-in)."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    return compiled if get is None else get()


def on_gpu(t: torch.Tensor) -> bool:
    """``t`` lives where the CuTe kernels launch (a CUDA device); elsewhere the host wrappers run
    their torch reference (the one place that decides, so a host-cost measurement on a CPU can
    stand in for it: ``cute_moe.lab.bench_align``)."""
    return t.device.type == "cuda"


# ---- symbolic stand-ins, for compiling ------------------------------------------------------------


def fake_stream():
    """The compile-time stream: the TVM-FFI environment stream (torch's current stream at the call),
    not an argument of the call."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def fake_rows(dtype, cols_divisibility: int):
    """A row-major [rows, cols] tensor, symbolic: 16-B aligned, unit stride along ``cols``, ``cols``
    and the row stride multiples of ``cols_divisibility``."""
    return make_fake_tensor(
        dtype,
        (cute.sym_int(), cute.sym_int(divisibility=cols_divisibility)),
        stride=(cute.sym_int64(divisibility=cols_divisibility), 1),
        assumed_align=16,
    )


def fake_vector(dtype):
    """A contiguous 1-D array, symbolic extent, aligned to one element.  (Its extent must be symbolic:
    a function compiled against a static one reads that, whatever the call passes.)"""
    return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=dtype.width // 8)


def fake_pointer(dtype):
    """A global-memory pointer to ``dtype`` elements, aligned to one element: the call passes an
    address (``t.data_ptr()``), far cheaper for the host than a tensor for a kernel that takes a
    pointer and a count."""
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=dtype.width // 8)


def fake_scales(quant: str):
    """(x_scale, w_scale) of an FP8 format: fp32, unit stride on the last dimension, symbolic extents
    and strides (a [rows, 1] array is read as the layout it was compiled for, never re-inferred)."""

    def f32(n_dims: int):
        shape = tuple(cute.sym_int() for _ in range(n_dims))
        stride = tuple(cute.sym_int64() for _ in range(n_dims - 1)) + (1,)
        return make_fake_tensor(cutlass.Float32, shape, stride=stride, assumed_align=4)

    dims = {"fp8_tensor": (1, 1), "fp8_channel": (1, 2), "fp8_block": (2, 3)}[quant]
    return f32(dims[0]), f32(dims[1])

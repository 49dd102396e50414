"""torch tensors → CuTe DSL call arguments, and the device facts a launch needs.

Every host wrapper of the package (``moe.py``, ``moe_fp8.py``, ``alignops.py``) converts its torch
tensors here, so the conversion rules live in one place:

* operands and outputs with 16-byte aligned rows (``cute_tensor``), dynamic layout with a named
  unit-stride dimension — the kernels are compiled against symbolic shapes and strides;
* 1-D device arrays (``cute_vector``) and small fp32 scale arrays of any rank (``cute_scale``),
  always with a dynamic layout: a function compiled against a *symbolic* extent that receives a
  static-layout tensor reads a garbage extent (seen on the H200: the combine kernel derived
  top_k from it);
* the current CUDA stream (the persistent grids' size, the SM count, is :func:`moe_spec.hopper.sm_count`).

The ``fake_*`` functions are the symbolic twins of these wrappers, what the kernels compile against
(:mod:`cute_moe.cache`): every extent and stride a symbolic integer, so one compile serves every batch.

Host cost.  A conversion (``from_dlpack(...).mark_layout_dynamic``) costs host time at every call
(notes/cute_moe.md, the host cost), and a wrapper holds a reference to its tensor, so wrappers are
kept only for tensors that live anyway:

* a workspace's buffers, registered with :func:`keep` (and dropped with :func:`release` when the
  workspace goes): any tensor with the same address, shape, strides and dtype as a kept one — a
  new view object of it, say ``expert_end[-1:]`` — gets the kept wrapper;
* weights (``cute_weight``): the last :data:`WEIGHT_WRAPPERS` weight views, least recently used
  dropped first.  A weight its owner frees stays allocated until it drops out (or until
  :func:`clear_wrappers`).

Every other tensor (activations, outputs, routing) is converted at each call.
"""

from __future__ import annotations

from collections import OrderedDict

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_tensor, make_ptr

#: Weight wrappers kept (least recently used dropped first).
WEIGHT_WRAPPERS = 64

_kept: dict = {}  # signature of a kept tensor -> {kind: wrapper}
_weights: OrderedDict = OrderedDict()  # (signature, kind) -> wrapper


def _signature(t: torch.Tensor) -> tuple:
    """What a wrapper encodes of ``t``: address, extents, strides, dtype, device."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device


def keep(*tensors: torch.Tensor) -> None:
    """Let the wrappers of these tensors (and of any tensor with the same signature) be reused."""
    for t in tensors:
        _kept.setdefault(_signature(t), {})


def release(*tensors: torch.Tensor) -> None:
    """Forget the wrappers of tensors given to :func:`keep` (their workspace is going away)."""
    for t in tensors:
        _kept.pop(_signature(t), None)


def clear_wrappers() -> None:
    """Drop every kept weight wrapper (the weights they hold are freed with their last owner)."""
    _weights.clear()


def _wrap(t: torch.Tensor, kind: tuple, make):
    slot = _kept.get(_signature(t)) if _kept else None
    if slot is None:
        return make(t)
    w = slot.get(kind)
    if w is None:
        w = slot[kind] = make(t)
    return w


def _tensor(t, leading_dim):
    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=leading_dim)


def _vector(t):
    return from_dlpack(t).mark_layout_dynamic()


def cute_tensor(t: torch.Tensor, leading_dim: int):
    """A 2-D/3-D operand with a dynamic layout (unit stride on ``leading_dim``), 16-B aligned."""
    return _wrap(t, ("tensor", leading_dim), lambda t: _tensor(t, leading_dim))


def cute_weight(t: torch.Tensor, leading_dim: int):
    """:func:`cute_tensor` of a weight view, kept in a bounded cache (see the module docstring)."""
    key = (_signature(t), leading_dim)
    w = _weights.get(key)
    if w is None:
        w = _weights[key] = _tensor(t, leading_dim)
        if len(_weights) > WEIGHT_WRAPPERS:
            _weights.popitem(last=False)
    else:
        _weights.move_to_end(key)
    return w


def cute_vector(t: torch.Tensor):
    """A 1-D device array with a dynamic extent."""
    return _wrap(t, ("vector",), _vector)


def cute_pointer(t: torch.Tensor):
    """The address of a contiguous tensor as a CuTe global-memory pointer (its element type, aligned
    to one element), for kernels that take a pointer and an extent: far cheaper than a wrapped
    tensor (the alignment's launches take the routing tensors so)."""
    dtype = _POINTER_TYPES.get(t.dtype)
    if dtype is None:
        dtype = _POINTER_TYPES[t.dtype] = {
            torch.int32: cutlass.Int32,
            torch.int64: cutlass.Int64,
            torch.float32: cutlass.Float32,
        }[t.dtype]
    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=t.element_size())


_POINTER_TYPES: dict = {}


def cute_scale(t: torch.Tensor):
    """A contiguous fp32 scale array of any rank (4-B aligned), unit stride on its last dimension.

    The leading dimension is named: left to inference, a [rows, 1] array would be read as unit
    stride along rows, a different layout from the one the kernel was compiled for.
    """
    return _wrap(t, ("scale",), lambda t: from_dlpack(t, assumed_align=4).mark_layout_dynamic(leading_dim=t.dim() - 1))


def on_gpu(t: torch.Tensor) -> bool:
    """``t`` lives where the CuTe kernels launch (a CUDA device); elsewhere the host wrappers run
    their torch reference (the one place that decides, so a host-cost measurement on a CPU can
    stand in for it: ``cute_moe.lab.bench_align``)."""
    return t.device.type == "cuda"


def current_stream(t: torch.Tensor):
    """The current CUDA stream of ``t``'s device, as the DSL's ``CUstream``."""
    return cuda.CUstream(torch.cuda.current_stream(t.device).cuda_stream)


# ---- symbolic stand-ins, for compiling ------------------------------------------------------------


def fake_rows(dtype, cols_divisibility: int):
    """What :func:`cute_tensor` makes of a row-major [rows, cols] tensor (``leading_dim=1``), symbolic:
    16-B aligned, ``cols`` and the row stride multiples of ``cols_divisibility``."""
    return make_fake_tensor(
        dtype,
        (cute.sym_int(), cute.sym_int(divisibility=cols_divisibility)),
        stride=(cute.sym_int64(divisibility=cols_divisibility), 1),
        assumed_align=16,
    )


def fake_vector(dtype):
    """What :func:`cute_vector` makes of a 1-D array, symbolic, aligned to one element."""
    return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=dtype.width // 8)


def fake_scales(quant: str):
    """(x_scale, w_scale) of an FP8 format as :func:`cute_scale` makes them of contiguous tensors:
    fp32, unit stride last, symbolic extents and strides."""

    def f32(n_dims: int):
        shape = tuple(cute.sym_int() for _ in range(n_dims))
        stride = tuple(cute.sym_int64() for _ in range(n_dims - 1)) + (1,)
        return make_fake_tensor(cutlass.Float32, shape, stride=stride, assumed_align=4)

    dims = {"fp8_tensor": (1, 1), "fp8_channel": (1, 2), "fp8_block": (2, 3)}[quant]
    return f32(dims[0]), f32(dims[1])

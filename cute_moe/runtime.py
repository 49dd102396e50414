"""torch tensors → CuTe DSL call arguments, and the device facts a launch needs.

Every host wrapper of the package (``moe.py``, ``moe_fp8.py``) converts its torch tensors here, so
the conversion rules live in one place:

* operands and outputs with 16-byte aligned rows (``cute_tensor``), dynamic layout with a named
  unit-stride dimension — the kernels are compiled against symbolic shapes and strides;
* 1-D device arrays (``cute_vector``) and small fp32 scale arrays of any rank (``cute_scale``),
  always with a dynamic layout: a function compiled against a *symbolic* extent that receives a
  static-layout tensor reads a garbage extent (seen on the H200: the combine kernel derived
  top_k from it);
* the current CUDA stream (the persistent grids' size, the SM count, is :func:`moe_spec.hopper.sm_count`).
"""

from __future__ import annotations

import torch


def cute_tensor(t: torch.Tensor, leading_dim: int):
    """A 2-D/3-D operand with a dynamic layout (unit stride on ``leading_dim``), 16-B aligned."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=leading_dim)


def cute_vector(t: torch.Tensor):
    """A 1-D device array with a dynamic extent."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t).mark_layout_dynamic()


def cute_scale(t: torch.Tensor):
    """A contiguous fp32 scale array of any rank (4-B aligned), unit stride on its last dimension.

    The leading dimension is named: left to inference, a [rows, 1] array would be read as unit
    stride along rows, a different layout from the one the kernel was compiled for.
    """
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=4).mark_layout_dynamic(leading_dim=t.dim() - 1)


def current_stream(t: torch.Tensor):
    """The current CUDA stream of ``t``'s device, as the DSL's ``CUstream``."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(t.device).cuda_stream)


"""What every step of the course shares: compiling to PTX without a GPU, wrapping torch tensors,
timing on a GPU, and loading a numbered step by its file name.

The course is a folder of scripts, not a package: a step loads this file (and an earlier step,
when it builds on one) with :func:`load`, which is ``importlib.util.spec_from_file_location``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported: the tiled MMAs are sm_90a's

import cutlass.cute as cute  # noqa: E402

COURSE = Path(__file__).resolve().parent


def load(name: str):
    """The course file ``name`` (e.g. ``"03_ring"``) as a module, loaded once per process."""
    key = f"course_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, COURSE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


_PTX_DIR: str | None = None


def compile_ptx(fn, *args) -> str:
    """``cute.compile(fn, *args)`` keeping the PTX (fake tensors are enough: no GPU is touched)."""
    global _PTX_DIR
    if _PTX_DIR is None:
        _PTX_DIR = tempfile.mkdtemp(prefix="course_ptx_")
    return cute.compile(fn, *args, options=f"--keep-ptx --dump-dir {_PTX_DIR}").__ptx__


def fake(dtype, shape, row_major: bool = True):
    """A fake compact tensor (static shape) for a CPU compile: row-major unless told otherwise."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    order = tuple(range(len(shape) - 1, -1, -1)) if row_major else tuple(range(len(shape)))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)


def fake_matrix(dtype, rows_divisible_by: int, cols_divisible_by: int, row_major: bool = True):
    """A fake 2-D tensor whose extents and leading stride are symbolic: the compiled kernel takes
    any size with those divisibilities (pair it with :func:`to_cute` and a ``leading_dim``)."""
    from cutlass.cute.runtime import make_fake_tensor

    rows, cols = cute.sym_int(divisibility=rows_divisible_by), cute.sym_int(divisibility=cols_divisible_by)
    if row_major:
        return make_fake_tensor(
            dtype, (rows, cols), stride=(cute.sym_int64(divisibility=cols_divisible_by), 1), assumed_align=16
        )
    return make_fake_tensor(
        dtype, (rows, cols), stride=(1, cute.sym_int64(divisibility=rows_divisible_by)), assumed_align=16
    )


def fake_stream():
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream()


def to_cute(t, leading_dim: int | None = None):
    """A torch tensor as a CuTe tensor (16-byte aligned; dynamic layout with ``leading_dim`` unit-stride)."""
    from cutlass.cute.runtime import from_dlpack

    ct = from_dlpack(t, assumed_align=16)
    return ct if leading_dim is None else ct.mark_layout_dynamic(leading_dim=leading_dim)


def stream():
    import cuda.bindings.driver as cuda
    import torch

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def require(cond: bool, message: str) -> None:
    """Bad input gets a clear error naming the argument, before anything is compiled or launched."""
    if not cond:
        raise ValueError(message)


def bench_main(name: str, run, flops: float) -> None:
    """The one-line benchmark of a step: time ``run()`` on a GPU and print one line; without a
    CUDA GPU print "needs a CUDA GPU" and exit 2."""
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        sys.exit(2)
    run()  # compile and warm up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / reps
    print(f"{name}: {us:.1f} us per call, {flops / us / 1e6:.2f} TFLOP/s")

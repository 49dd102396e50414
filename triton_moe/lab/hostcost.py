"""Host cost of an eager ``fused_moe`` call without a GPU: Triton's launch path with a stand-in driver.

An eager call on a GPU spends its host time in Python (checks, planning, buffers) and in Triton's
launch path, ``JITFunction.run`` or :mod:`triton_moe.jit`'s direct path. On a machine without a
GPU both can run for real up to the launcher's C call: :func:`stand_in_driver` makes Triton see a
CUDA device of compute capability 9.0 whose launcher does nothing, and replaces compilation by a
stand-in :class:`~triton.compiler.CompiledKernel` (counted, so the compile counter's hook still
fires on the first launch of each specialization). Everything else — binding, cache keys, the
global-value check, the direct path's key and lookup — is Triton's and this package's own code.

What it leaves out: the launcher's C call (``cuLaunchKernel``, a few µs per launch on a GPU
host) and the real driver's device and stream queries (torch calls, well under a µs).

    python -m triton_moe.lab.hostcost --shape qwen3-30b-a3b --tokens 1 64 --quant bf16

prints µs per call with every launch through ``JITFunction.run`` (``run``) and with the direct
path (``direct``), alternating, on the shape's E and top_k with K = 256, I = 128 (the host work
does not depend on K and I). Needs a process without ``TRITON_INTERPRET=1`` (the kernels must be
``JITFunction``\\ s, which is what a GPU process has).
"""

from __future__ import annotations

import contextlib
import dataclasses

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel

from moe_spec.cli import ArgumentParser, usage_error
from moe_spec.timing import host_us
from triton_moe import jit, moe


class StandInKernel(CompiledKernel):
    """A compiled kernel that records its launches instead of launching."""

    def __init__(self, name: str, signature: dict, constexprs: dict, attrs: dict, options: dict):
        self.name = name
        self.options = options
        self.src = None  # launch_metadata then carries no kernel-specific entries
        self.signature, self.constexprs, self.attrs = signature, constexprs, attrs
        self.module = self.function = object()
        self.packed_metadata = ()
        self.launches: list = []  # (grid, stream, (metadata, enter hook, exit hook), arguments) if recording
        self.record = False
        self._run = self._launch

    def _launch(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        if self.record:
            self.launches.append(((gx, gy, gz), stream, (launch_metadata, enter, exit_), args))


class _Driver:
    """What ``JITFunction.run`` and the direct path ask the driver: device, stream, target."""

    def __init__(self, stream: int):
        self.stream = stream

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return self.stream

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def stand_in_driver(stream: int = 7):
    """Inside the block Triton sees a stand-in sm_90 driver and compiles stand-in kernels; yields
    the list of :class:`StandInKernel` compiled (one per Triton compilation, in order), whose
    ``.driver.stream`` is the current stream; ``triton_moe.fused_moe`` takes CPU tensors as the
    stand-in GPU's (its device rule is lifted). For a machine without a GPU only (raises
    RuntimeError where CUDA is available: real kernels compiled before the block would be launched
    on the stand-in stream). On exit the kernels compiled inside forget their binaries
    (:func:`reset_kernel`), and the direct path forgets every entry."""
    import torch
    from triton.runtime.driver import driver

    if torch.cuda.is_available():
        raise RuntimeError(
            "stand_in_driver: for a machine without a GPU (on a GPU, time real launches: "
            "python -m compare.studies.eager)"
        )
    compiled = _Compiled()
    compiled.driver = _Driver(stream)
    kernels = []

    def fake_compile(src, target=None, options=None, **_):
        k = StandInKernel(src.fn.__name__, dict(src.signature), dict(src.constants), dict(src.attrs), dict(options))
        compiled.append(k)
        kernels.append(src.fn)
        return k

    original = triton.compiler.compile
    jit.forget_fast()
    triton.compiler.compile = fake_compile  # JITFunction.create_binder imports it per device cache
    previous = driver._active
    driver.set_active(compiled.driver)
    limits = getattr(moe, "LIMITS", None)
    if limits is not None:
        moe.LIMITS = dataclasses.replace(limits, cpu=None)  # CPU tensors stand for the stand-in GPU's
    try:
        yield compiled
    finally:
        if limits is not None:
            moe.LIMITS = limits
        triton.compiler.compile = original
        driver._active = previous  # reset_active() would look for a real driver
        for fn in kernels:
            reset_kernel(fn)
        jit.forget_fast()


class _Compiled(list):
    driver: _Driver


def reset_kernel(kernel) -> None:
    """Forget ``kernel``'s compiled binaries (Triton's per-device caches) and its direct-path entries."""
    kernel.device_caches.clear()
    jit.forget_fast(kernel)


def _op():
    import triton_moe.ops

    op = triton_moe.ops.OP
    return lambda x, w1, w2, topk_weights, topk_ids, **kw: op(x, w1, w2, topk_weights, topk_ids, **kw)


def _public():
    import triton_moe

    return triton_moe.fused_moe


def _moe():
    from triton_moe.moe import fused_moe

    return fused_moe


#: --entry: what is called (a loader, what it is)
ENTRIES = {
    "moe": (_moe, "triton_moe.moe.fused_moe, the backend function"),
    "public": (_public, "triton_moe.fused_moe, an eager call (the backend function behind moe_spec.ops.entry)"),
    "op": (_op, "torch.ops.triton_moe.fused_moe, what a compiled graph calls (the dispatcher, then the function)"),
}


def python_calls(fn, kwargs: dict) -> int:
    """Python function calls and C calls made by one ``fn(**kwargs)``: the host path's length,
    without the noise of a shared machine's clock."""
    import sys

    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn(**kwargs)
    finally:
        sys.setprofile(None)
    return count - 1  # the call of sys.setprofile(None)


def main(argv=None) -> None:
    from moe_spec.problem import MoEShape, get_shape, make_inputs
    from moe_spec.quant import FORMATS

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    p.add_argument("--quant", default="bf16", choices=[f.label for f in FORMATS.values()])
    p.add_argument("--rounds", type=int, default=3, help="alternating run/direct rounds")
    p.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="timed loops of 100 calls per round and path; a round reports the fastest loop",
    )
    p.add_argument(
        "--entry",
        default="moe",
        choices=sorted(ENTRIES),
        help="the function called: " + "; ".join(f"{k}: {v[1]}" for k, v in sorted(ENTRIES.items())),
    )
    a = p.parse_args(argv)
    if jit.INTERPRET:
        usage_error(p.prog, "measures the compiled launch path: run it without TRITON_INTERPRET=1")
    fused_moe = ENTRIES[a.entry][0]()
    shape = get_shape(a.shape)
    quant = next(f.name for f in FORMATS.values() if f.label == a.quant)
    stand_in = MoEShape(shape.label, shape.num_experts, shape.top_k, 256, 128, "host-cost stand-in")
    print(
        "| shape (E, top_k; K=256, I=128) | quant | T | launch path | µs per call (rounds) | min | launches "
        "| Python calls |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for T in a.tokens:
        kw = make_inputs(stand_in, T, quant).kwargs()
        runs: dict = {"run": [], "direct": []}
        with stand_in_driver():
            fused_moe(**kw)
            with jit.count_compilations() as counter:
                fused_moe(**kw)
            launches = len(counter.launches)
            calls = {}
            for path in runs:
                jit.FAST_LAUNCH = path == "direct"
                calls[path] = python_calls(fused_moe, kw)
            for _ in range(a.rounds):
                for path in runs:
                    jit.FAST_LAUNCH = path == "direct"
                    runs[path].append(min(host_us(fused_moe, kw, calls=100, repeats=1) for _ in range(a.repeats)))
            jit.FAST_LAUNCH = True
        for path, us in runs.items():
            print(
                f"| {shape.label} | {a.quant} | {T} | {path} | {' / '.join(f'{u:.0f}' for u in us)} | "
                f"{min(us):.0f} | {launches} | {calls[path]} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

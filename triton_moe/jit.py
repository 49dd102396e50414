"""Kernel launches and the compile counter: proof that a new batch size never recompiles.

Triton compiles one binary per *specialization key* of a kernel: the constexpr values, the dtype
of every tensor, and for integer arguments whether they equal 1 or are divisible by 16 (pointers:
whether they are 16-byte aligned). An argument such as the token count T therefore recompiles the
kernel whenever T crosses those classes (T = 1, 16, 17, …) unless it is listed in
``@triton.jit(do_not_specialize=[...])``. Every kernel of this package marks the arguments that vary
per call that way; everything else it receives (K, N, constexpr tiles) is fixed by the model.

Every launch goes through :func:`launch`. Inside ``with count_compilations() as counter:`` each
launch also records its specialization key, computed by the same binder Triton's ``JITFunction``
uses before its cache lookup (so the count means the same thing under ``TRITON_INTERPRET=1``,
where nothing is compiled), and on a GPU each real compilation reported by Triton's
``knobs.runtime.jit_cache_hook``. ``counter.new_keys`` after a warm-up is the number of
recompilations a sweep caused. ``count_compilations(dry_run=True)`` records keys without running
kernels, so a CPU test can sweep T up to 8192 in seconds. ``counter.launches`` lists every launch
in order (kernel names; a grid of zero programs launches nothing and is not listed): the launch
count of a call.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict

import triton
from triton.runtime.jit import JITFunction, create_function_from_signature

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_active: list = []  # the counters currently recording (innermost last)


class CompileCounter:
    """Specialization keys per kernel (both platforms) and real compilations (GPU only)."""

    def __init__(self, dry_run: bool = False):
        self.dry_run = dry_run
        self.keys: dict[str, set] = defaultdict(set)
        self.compilations: list[str] = []  # kernel names, from Triton's jit_cache_hook
        self.launches: list[str] = []  # kernel names, one per launch() call
        self._baseline: dict[str, int] = {}

    def record(self, name: str, key: str) -> None:
        self.keys[name].add(key)

    def total(self) -> int:
        return sum(len(v) for v in self.keys.values())

    def mark(self) -> None:
        """Remember the keys seen so far: the warm-up."""
        self._baseline = {k: len(v) for k, v in self.keys.items()}
        self.compilations.clear()

    @property
    def new_keys(self) -> dict[str, int]:
        """Kernels that saw specialization keys since :meth:`mark`, with how many."""
        out = {k: len(v) - self._baseline.get(k, 0) for k, v in self.keys.items()}
        return {k: n for k, n in out.items() if n}


_binders: dict = {}


def _binder(kernel):
    """Triton's own argument binder for ``kernel`` (a JITFunction, or the interpreter's wrapper)."""
    if kernel not in _binders:
        if isinstance(kernel, JITFunction):
            jf = kernel
        else:  # InterpretedFunction: rebuild the JITFunction the GPU path would have
            kw = kernel.kwargs
            jf = JITFunction(kernel.fn, do_not_specialize=kw.get("do_not_specialize"),
                             do_not_specialize_on_alignment=kw.get("do_not_specialize_on_alignment"))
        from triton.backends.compiler import BaseBackend

        _binders[kernel] = (create_function_from_signature(jf.signature, jf.params, BaseBackend),
                            jf.fn.__qualname__)
    return _binders[kernel]


_keys: dict = {}  # (spec, options) as given -> the key's text: a repeated launch pays a hash, not two reprs
_KEYS_MAX = 4096


def specialization_key(kernel, args, kwargs) -> str:
    """The key Triton would look its compiled-kernel cache up with (options included)."""
    bind, _ = _binder(kernel)
    _, spec, options = bind(*args, **kwargs)
    try:
        raw = (tuple(spec), tuple(options.items()))
        key = _keys.get(raw)
    except TypeError:  # an unhashable specialization value: no memo
        raw = key = None
    if key is None:
        key = repr(spec) + repr(sorted(options.items()))
        if raw is not None and len(_keys) < _KEYS_MAX:
            _keys[raw] = key
    return key


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, recorded by any active :class:`CompileCounter`."""
    if _active:
        _, name = _binder(kernel)
        key = specialization_key(kernel, args, kwargs)
        for c in _active:
            c.record(name, key)
            if grid[0]:
                c.launches.append(name)
        if any(c.dry_run for c in _active):
            return None
    if grid[0] == 0:
        return None
    return kernel.run(*args, grid=grid, warmup=False, **kwargs)  # what kernel[grid](...) calls


def _jit_cache_hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
    for c in _active:
        c.compilations.append(fn.name)
    return None


@contextlib.contextmanager
def count_compilations(dry_run: bool = False):
    """Record specialization keys (and GPU compilations) of every launch inside the block."""
    counter = CompileCounter(dry_run)
    previous = triton.knobs.runtime.jit_cache_hook
    if not INTERPRET:
        triton.knobs.runtime.jit_cache_hook = _jit_cache_hook
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)
        if not INTERPRET:
            triton.knobs.runtime.jit_cache_hook = previous


def compile_sm90(kernel, signature: dict, constexprs: dict, *, num_warps: int, num_stages: int,
                 divisible_by_16=()) -> dict:
    """Compile ``kernel`` for sm_90a without a GPU (Triton's compiler and its bundled ptxas) and
    report what the binary looks like: registers and spill bytes per thread (``ptxas -v``),
    shared memory, and the TTGIR text. Needs the compiled (not the interpreted) kernel, i.e. a
    process without ``TRITON_INTERPRET=1``; ``tests/test_triton_sm90.py`` runs it in one."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}
    src = ASTSource(kernel, signature={n: signature.get(n, "constexpr") for n in names},
                    constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(spills.group(1)) if spills else 0,
            "shared_bytes": compiled.metadata.shared, "ttgir": compiled.asm["ttgir"]}

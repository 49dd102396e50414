"""Kernel launches and the compile counter: proof that a new batch size never recompiles.

Triton compiles one binary per *specialization key*: the constexprs, every tensor's dtype, and for
integers whether they equal 1 or are divisible by 16 (pointers: 16-byte aligned). So the token count
T would recompile a kernel whenever it crosses those classes (T = 1, 16, 17, …) unless listed in
``@triton.jit(do_not_specialize=[...])``, as every per-call size of this package is.

Every launch goes through :func:`launch`. Inside ``with count_compilations() as counter:`` each
launch records its specialization key (Triton's own binder, so the count means the same under
``TRITON_INTERPRET=1``) and, on a GPU, each compilation Triton reports: ``counter.new_keys`` after
a warm-up is the recompilations a sweep caused (``dry_run=True``: keys only); ``counter.launches``.

On a GPU, :func:`launch` skips most of Triton's per-launch Python: a specialization's first launch
goes through ``JITFunction.run`` (which compiles it), later ones with the same :func:`fast_key` call
its CompiledKernel directly (``TRITON_MOE_FAST_LAUNCH=0``: off; ``python -m triton_moe.lab.hostcost``).
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict

import triton
from torch import Tensor
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
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
            jf = JITFunction(
                kernel.fn,
                do_not_specialize=kw.get("do_not_specialize"),
                do_not_specialize_on_alignment=kw.get("do_not_specialize_on_alignment"),
            )
        from triton.backends.compiler import BaseBackend

        _binders[kernel] = (create_function_from_signature(jf.signature, jf.params, BaseBackend), jf.fn.__qualname__)
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
    """``kernel[grid](*args, **kwargs)``, recorded by any active :class:`CompileCounter`.

    On a GPU a launch whose :func:`fast_key` was seen before skips Triton's ``JITFunction.run`` and
    calls the kernel it compiled then (:func:`_launch_fast`); any other goes through ``run``."""
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
    if FAST_LAUNCH and type(kernel) is JITFunction:
        return _launch_fast(kernel, grid, args, kwargs)
    return kernel.run(*args, grid=grid, warmup=False, **kwargs)  # what kernel[grid](...) calls


# ---- the direct launch path --------------------------------------------------------------------
#
# Triton's JITFunction.run spends a launch's host time in Python and in its binder
# (notes/results/host_cost_triton_cpu_2026-12-02.md): it classifies every argument (Triton 3.6.0:
# the binder ``create_function_from_signature`` writes calls ``native_specialize_impl``, C++ in
# python/src/specialize.cc, once per argument), turns the specialization and the options into a
# string cache key, looks the compiled kernel up, checks the globals the kernel read and builds the
# launch metadata. The compiled kernel depends only on what the binder puts in the key, so after
# one launch through ``run`` this module keeps the CompiledKernel under a cheaper key of the same
# classes and launches it directly — the launcher ``run`` calls, with the same arguments, on the
# current device's current stream (what ``run`` uses; CUDA-graph capture records it the same way).

#: Off: every launch goes through ``JITFunction.run`` (``TRITON_MOE_FAST_LAUNCH=0``).
FAST_LAUNCH = os.environ.get("TRITON_MOE_FAST_LAUNCH", "1") != "0"
_I32 = 2**31
_I64 = 2**63
_FAST_MAX = 256  # keys kept per kernel; past that a new key goes through run() every time
_driver = None
_launched: list = []  # kernels with a _moe_fast attribute
# Per kernel, in its ``_moe_fast`` attribute (a JITFunction hashes slowly, so no dict keyed by it):
# (per parameter "c" constexpr / "s" specialized / "n" do_not_specialize,
#  {fast key: (CompiledKernel, the values of the parameters after the positional ones)},
#  {number of positional arguments: the key function written for it}).


def _param_kinds(kernel) -> tuple:
    return tuple("c" if p.is_constexpr else "n" if p.do_not_specialize else "s" for p in kernel.params)


class _Unclassified(Exception):
    """An argument the fast key does not classify: the launch goes through ``run``."""


def _other(a, constexpr=False):
    """The class of an argument that is neither a plain ``torch.Tensor`` nor an ``int``."""
    if isinstance(a, Tensor) and not constexpr:
        return a.dtype, a.data_ptr() % 16 == 0
    if a is None or type(a) is bool or type(a) is float:
        return (type(a), a) if constexpr else (type(a),)
    if constexpr and type(a) is int:
        return (int, a)
    raise _Unclassified


_WIDTH = f"(0 if -{_I32} <= {{a}} < {_I32} else 2 if -{_I64} <= {{a}} < {_I64} else 4)"
_CLASS = {  # per parameter kind: the expression of argument {a}'s class (see fast_key)
    "c": "_other({a}, True)",
    "s": f"((({{a}}).dtype, ({{a}}).data_ptr() % 16 == 0) if type({{a}}) is Tensor else "
    f"(-1 if {{a}} == 1 else ({{a}} % 16 == 0) + {_WIDTH}) if type({{a}}) is int else _other({{a}}))",
    "n": f"((({{a}}).dtype, ({{a}}).data_ptr() % 16 == 0) if type({{a}}) is Tensor else "
    f"{_WIDTH} if type({{a}}) is int else _other({{a}}))",
}


def _key_function(kinds: tuple, nargs: int):
    """A function (prefix, *args) -> the fast key, written out for ``nargs`` positional arguments
    (no loop: this runs at every launch)."""
    names = [f"a{i}" for i in range(nargs)]
    body = ", ".join(_CLASS[kind].format(a=n) for n, kind in zip(names, kinds))
    src = (
        f"def key(prefix, {', '.join(names)}):\n    return (prefix, {body})\n"
        if nargs
        else "def key(prefix):\n    return (prefix,)\n"
    )
    namespace = {"Tensor": Tensor, "_other": _other}
    exec(src, namespace)  # noqa: S102 - the text above, built from the parameter kinds only
    return namespace["key"]


def _state(kernel):
    state = kernel.__dict__.get("_moe_fast")
    if state is None:
        state = kernel.__dict__["_moe_fast"] = (_param_kinds(kernel), {}, {})
        _launched.append(kernel)
    return state


def fast_key(kernel, args, kwargs, device=None):
    """A cheap key that fixes Triton's specialization of ``kernel(*args, **kwargs)`` on the current
    device, or None when an argument is of a kind it does not classify (then ``run`` decides).

    It holds what ``JITFunction.run``'s key is made of. In Triton 3.6.0 the binder is written by
    ``create_function_from_signature`` (``triton/runtime/jit.py``), whose ``specialize_impl`` is
    ``native_specialize_impl`` (C++, ``python/src/specialize.cc``; no Python implementation is left):
    each tensor's dtype and whether its address is 16-byte aligned; each integer's type (i32 within
    int32, i64 within int64, else u64) and, unless it is in ``do_not_specialize``, whether it equals
    1 (then the key holds the constexpr 1) and whether 16 divides it; u1 for a bool, fp32 for a
    float, a constexpr for None; the value of a positional constexpr; the keyword arguments
    (constexprs and launch options) with their values; the debug and instrumentation knobs, which
    ``run`` adds to the options; the device. Two calls with one fast key have one Triton key, so
    they run the same binary. It may split one Triton key in two (e.g. an alignment class of an
    argument in ``do_not_specialize_on_alignment``); that only costs a second slow first launch.
    """
    kinds, _, functions = _state(kernel)
    n = len(args)
    fn = functions.get(n)
    if fn is None:
        if n > len(kinds):
            return None
        fn = functions[n] = _key_function(kinds, n)
    try:
        return fn((device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, tuple(kwargs.items())), *args)
    except _Unclassified:
        return None


def _launch_fast(kernel, grid, args, kwargs):
    global _driver
    if _driver is None:
        from triton.runtime.driver import driver as _driver
    drv = _driver.active
    device = drv.get_current_device()
    key = fast_key(kernel, args, kwargs, device)
    try:
        hit = None if key is None else _state(kernel)[1].get(key)
    except TypeError:  # an unhashable keyword value
        hit = key = None
    if hit is None or kernel.pre_run_hooks or not _hooks_idle() or not _globals_unchanged(kernel):
        compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
        cache = _state(kernel)[1]
        if key is not None and isinstance(compiled, CompiledKernel) and len(cache) < _FAST_MAX:
            params = kernel.params[len(args) :]
            tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params)
            cache[key] = (compiled, tail, _entry_point(compiled))
        return compiled
    n = len(grid)
    dims = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
    return _launch_hit(hit, dims, drv.get_current_stream(device), args)


def _launch_hit(hit, dims, stream, args):
    """Launch a direct-path entry ``hit`` = (CompiledKernel, the parameters after the positional
    ones, C entry point or None) on grid ``dims``: the C launch function itself where
    :func:`_entry_point` found one, else the kernel's launcher. Returns the CompiledKernel."""
    compiled, tail, entry = hit
    gx, gy, gz = dims
    if entry is None:
        meta = (compiled.function, compiled.packed_metadata, None, None, None)
        compiled.run(gx, gy, gz, stream, *meta, *args, *tail)
    else:
        launch_c, cooperative, pdl = entry
        meta = (compiled.function, cooperative, pdl, None, None, compiled.packed_metadata, None, None, None)
        launch_c(gx, gy, gz, stream, *meta, *args, *tail)
    return compiled


def _entry_point(compiled):
    """(C launch function, cooperative grid, PDL) of ``compiled``'s CUDA launcher when its
    ``__call__`` would only forward to that function (no global or profile scratch memory to
    allocate: it then passes None for both), else None (call the launcher)."""
    launcher = compiled.run
    if (
        type(launcher).__name__ == "CudaLauncher"
        and not getattr(launcher, "global_scratch_size", 1)
        and not getattr(launcher, "profile_scratch_size", 1)
    ):
        return launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl
    return None


def forget_fast(kernel=None) -> None:
    """Drop the direct path's entries of ``kernel`` (default: of every kernel launched so far), those
    of the :class:`Bound` launches included."""
    global _generation
    _generation += 1
    for k in [kernel] if kernel is not None else list(_launched):
        state = k.__dict__.get("_moe_fast")
        if state is not None:
            state[1].clear()


_generation = 0  # forget_fast() calls so far: a Bound launch's entries are of one generation


class Bound:
    """``launch(kernel, grid, *args, **kwargs)`` with the grid and the keyword arguments bound once.

    A plan's launches have grids and constexprs that depend only on the plan and the sizes, so the
    caller builds them once (per plan and shape) and calls ``bound(*args)`` with the positional
    arguments per launch. On a GPU the direct path then keys a launch by the positional arguments'
    classes alone (:func:`fast_key` without the keyword part, which is fixed here) in a table of its
    own: no keyword dict, no hash of the constexprs, one lookup. Anything else — the first launch
    of a specialization, an active :class:`CompileCounter`, ``TRITON_MOE_FAST_LAUNCH=0``, the
    interpreter, a hook, a changed global — goes through :func:`launch`, as an unbound launch would.
    """

    __slots__ = ("kernel", "grid", "kwargs", "_dims", "_key", "_hits", "_generation")

    def __init__(self, kernel, grid, **kwargs):
        self.kernel, self.grid, self.kwargs = kernel, tuple(grid), kwargs
        n = len(self.grid)
        self._dims = (self.grid[0], self.grid[1] if n > 1 else 1, self.grid[2] if n > 2 else 1)
        self._key = None  # the key function, written at the first direct launch (it needs the argument count)
        self._hits: dict = {}  # key -> the kernel's direct-path entry (CompiledKernel, tail, C entry point)
        self._generation = _generation

    def __repr__(self) -> str:
        return f"Bound({getattr(self.kernel, '__name__', self.kernel)}, grid={self.grid})"

    def __call__(self, *args):
        kernel = self.kernel
        if _active or not FAST_LAUNCH or type(kernel) is not JITFunction or not self._dims[0]:
            return launch(kernel, self.grid, *args, **self.kwargs)
        global _driver
        if _driver is None:
            from triton.runtime.driver import driver as _driver
        drv = _driver.active
        device = drv.get_current_device()
        if self._generation != _generation:
            self._hits.clear()
            self._generation = _generation
        key_fn = self._key
        if key_fn is None:
            if len(args) > len(kernel.params):
                return launch(kernel, self.grid, *args, **self.kwargs)
            key_fn = self._key = _key_function(_param_kinds(kernel), len(args))
        try:
            key = key_fn((device, knobs.runtime.debug, knobs.compilation.instrumentation_mode), *args)
        except _Unclassified:
            return launch(kernel, self.grid, *args, **self.kwargs)
        hit = self._hits.get(key)
        if hit is None or kernel.pre_run_hooks or not _hooks_idle() or not _globals_unchanged(kernel):
            compiled = _launch_fast(kernel, self.grid, args, self.kwargs)
            entry = _state(kernel)[1].get(fast_key(kernel, args, self.kwargs, device))
            if entry is not None and entry[0] is compiled and len(self._hits) < _FAST_MAX:
                self._hits[key] = entry  # (CompiledKernel, the parameters after the positional ones, C entry)
            return compiled
        return _launch_hit(hit, self._dims, drv.get_current_stream(device), args)


_MISSING = object()


def _idle(hook) -> bool:
    return hook is None or (type(hook) is HookChain and not hook.calls)


def _hooks_idle() -> bool:
    """No launch hook would run: Triton's default hooks are empty chains, which the launcher calls
    and which do nothing; the direct path passes None instead (the launcher then calls nothing)."""
    return _idle(knobs.runtime.launch_enter_hook) and _idle(knobs.runtime.launch_exit_hook)


def _globals_unchanged(kernel) -> bool:
    """What ``run`` checks before every launch: the globals the kernel read at compile time still
    hold the values it was compiled with (``run`` raises when one changed).

    Triton keeps a deep copy of each value, so the objects never match by identity and each launch
    would compare them by value (a ``constexpr`` comparison builds new objects). The objects found
    equal last time are remembered: while every global still holds that very object, nothing changed."""
    used = kernel.used_global_vals
    seen = kernel.__dict__.get("_moe_globals_seen")
    if seen is not None and seen[0] == len(used):
        for globals_dict, name, obj in seen[1]:
            if globals_dict.get(name, _MISSING) is not obj:
                break
        else:
            return True
    verified = []
    for (name, _), (val, globals_dict) in used.items():
        now = globals_dict.get(name, _MISSING)
        if now is not val and now != val:
            return False
        verified.append((globals_dict, name, now))
    kernel._moe_globals_seen = (len(used), tuple(verified))
    return True


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

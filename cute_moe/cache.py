"""The one compile cache: every CuTe kernel of the package compiles itself through :func:`compile_once`.

Each kernel module names its entries by what is baked into the code — a config's fields, a quant
format, an index dtype, the grid size — never by tensors: the kernels are compiled against
symbolic extents and strides (:mod:`cute_moe.runtime`'s ``fake_*`` stand-ins), so one compile
serves every batch, routing and expert load, as QuACK's jit cache keys on dtypes and constants.
:func:`compile_count` counts the DSL's runs: a T sweep or a new routing must leave it unchanged.
Every kernel compiles with the DSL's TVM-FFI calling convention (:func:`ptx_options`), so it is
called with torch tensors as they are (:mod:`cute_moe.runtime`).
This module imports nothing of the package, so no kernel module sits above another to compile.
"""

from __future__ import annotations

import tempfile
import threading

_cache: dict[tuple, object] = {}
_compiles = 0
_lock = threading.RLock()
_dump_dir: str | None = None


def compile_count() -> int:
    """How many kernels this process has compiled (cache misses of :func:`compile_once`)."""
    return _compiles


TVM_FFI = "--enable-tvm-ffi"
"""The DSL's TVM-FFI calling convention: the compiled function takes torch tensors, ints and the
environment stream directly (its host side only; the kernels' PTX is the same)."""


def ptx_options(keep_ptx: bool) -> str:
    """``cute.compile``'s options: always :data:`TVM_FFI`; with ``keep_ptx`` the compiled object also
    keeps its PTX (``.__ptx__``), the file the DSL writes going to a private temporary directory,
    never the working directory."""
    global _dump_dir
    if not keep_ptx:
        return TVM_FFI
    if _dump_dir is None:
        _dump_dir = tempfile.mkdtemp(prefix="cute_moe_ptx_")
    return f"{TVM_FFI} --keep-ptx --dump-dir {_dump_dir}"


def compile_once(key: tuple, build, *, keep_ptx: bool = False):
    """The compiled kernel(s) of ``key``: ``build(options)`` runs ``cute.compile(..., options=options)``
    and returns one compiled function or ``{name: compiled}``; it runs once per ``(key, keep_ptx)``,
    and each function it returns counts once in :func:`compile_count`."""
    global _compiles
    key = (*key, keep_ptx)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            hit = _cache[key] = build(ptx_options(keep_ptx))
            _compiles += len(hit) if isinstance(hit, dict) else 1
        return hit

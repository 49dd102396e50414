"""Kernels from outside this project in the suite: your own fused-MoE function, and the named peers.

``--backends`` takes, beside this project's backends (:data:`compare.backends.BACKEND_NAMES`):

* **a kernel of yours**, ``module.path:function`` or ``path/to/file.py:function``, with either
  signature (detected from its parameter names, :func:`detect_signature`; an explicit suffix
  ``@ours`` or ``@vllm`` overrides):

  - the contract's, ``fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None,
    w2_scale=None)`` (:mod:`moe_spec.contract`): it has a ``quant`` parameter;
  - vLLM's ``fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, ..., use_fp8_w8a8=False,
    per_channel_quant=False, w1_scale=None, w2_scale=None, block_shape=None)`` or its current
    ``quant_config=`` spelling: its first parameter is ``hidden_states``, or it has
    ``use_fp8_w8a8`` or ``quant_config``. Its calls go through the vLLM adapter
    (:mod:`compare.peers.vllm`: per-channel weight scales as [E, N, 1]).

  A file is imported under a module name of its own, its folder appended to ``sys.path`` (so its
  sibling modules import); a module path is imported from the current directory or the installed
  packages. The function is imported, checked and its signature read before any work: a spec
  without a colon, a module or file that does not import, a missing or non-callable function, or a
  signature that cannot be told is one line naming ``--backends`` and exit status 2.

* **a peer**, by name (:data:`compare.peers.PEERS`): ``vllm``, ``sglang``, ``flashinfer``,
  ``sonicmoe``, through its adapter (:mod:`compare.peers`); a peer that does not import is a row
  "not installed".

Such a kernel gets every column a kernel without a plan can have — numerics against the oracle,
bitwise rerun, batch invariance, its difference from this project's kernels' output ("vs ours",
:func:`compare_with_ours`), µs, eager µs, % of floor — and what it does not expose (plan, alignment
step, config) reads "-". Around the numerics (:func:`measure`) every input tensor is copied and
compared bit for bit afterwards: a kernel that writes into its inputs gets an ``error`` row naming
them, and the inputs are restored for the backends after it. A call that raises, or returns
something other than a bf16 [T, K] tensor on x's device (:class:`WrongOutput`), is an ``error``
row; the run goes on. Each row says what its adapter converted (the ``converted`` column).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import compare.metrics as metrics
import compare.numerics as numerics
from compare.backends import BACKEND_NAMES, KERNELS, Backend, load_backend
from compare.cases import Case
from compare.peers import PEERS, Peer, adapter, parameters, takes
from moe_spec.oracle import rel_l2

OPTION = "--backends"
SIGNATURES = ("ours", "vllm")
#: parameters that mark vLLM's fused_experts signature (besides a first parameter ``hidden_states``)
VLLM_MARKERS = ("use_fp8_w8a8", "quant_config")
#: every format, for a user kernel: what it does not implement it declines itself
ALL_FORMATS = (None, "fp8_tensor", "fp8_channel", "fp8_block")
INPUTS = ("x", "w1", "w2", "topk_weights", "topk_ids", "w1_scale", "w2_scale")


class SpecError(ValueError):
    """A bad kernel spec in ``--backends``: the message is the one line the CLI prints."""

    def __init__(self, text: str, why: str):
        super().__init__(f"{OPTION}: {text!r}: {why}")


class WrongOutput(Exception):
    """A kernel returned something other than the contract's bf16 [T, K] tensor on x's device."""


@dataclass
class ExternalBackend(Backend):
    """A kernel from outside this project: a user's function or a peer's adapter."""

    origin: str = ""  # "your kernel, the contract's signature", "peer vllm (vllm...:fused_experts)", ...
    # quant -> what the adapter converts (the row's "converted" column)
    converted: Callable[[str | None], str] = field(default=lambda quant: "")


# --- the spec ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSpec:
    """``target:function[@signature]`` as given on the command line."""

    text: str
    target: str  # a module path, or a file path ending in .py
    function: str
    signature: str | None  # "ours", "vllm", or None: read it from the function

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py") or os.sep in self.target or "/" in self.target


def looks_like_kernel(item: str) -> bool:
    """Whether a ``--backends`` item is meant as a kernel spec rather than a backend name."""
    return any(c in item for c in ":./") or item.endswith(".py")


def known_name(item: str) -> bool:
    return item.lower() in BACKEND_NAMES or item.lower() in PEERS


def parse_spec(text: str) -> KernelSpec:
    """The parts of a kernel spec; SpecError for a malformed one (nothing imported yet)."""
    target, colon, function = text.strip().rpartition(":")
    if not colon:
        raise SpecError(
            text, "a kernel is given as module.path:function or path/to/file.py:function (no ':function' here)"
        )
    function, at, signature = function.partition("@")
    if at and signature.lower() not in SIGNATURES:
        raise SpecError(
            text, f"unknown signature suffix '@{signature}'; known: " + ", ".join(f"@{s}" for s in SIGNATURES)
        )
    if not target or not function:
        raise SpecError(text, "empty module/file or function name")
    if not function.isidentifier():
        raise SpecError(text, f"{function!r} is not a Python function name")
    return KernelSpec(text.strip(), target, function, signature.lower() if at else None)


def _import_file(spec: KernelSpec):
    path = Path(spec.target).expanduser()
    if not path.is_file():
        raise SpecError(spec.text, f"no such file: {str(path)!r}")
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"_compare_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.append(folder)
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import(spec: KernelSpec):
    try:
        if spec.is_file:
            return _import_file(spec)
        return importlib.import_module(spec.target)
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's spec, named
        first = (str(exc).strip().splitlines() or [""])[0]
        what = "file" if spec.is_file else "module"
        raise SpecError(spec.text, f"importing {what} {spec.target!r} failed: {type(exc).__name__}: {first}") from None


def detect_signature(fn) -> str | None:
    """ "ours" (a ``quant`` parameter), "vllm" (first parameter ``hidden_states``, or ``use_fp8_w8a8`` /
    ``quant_config``), or None when it cannot be told (neither, both, or no readable signature)."""
    names = parameters(fn)
    vllm = bool(set(names) & set(VLLM_MARKERS)) or names[:1] == ("hidden_states",)
    ours = "quant" in names
    return "vllm" if vllm and not ours else "ours" if ours and not vllm else None


def resolve(text: str) -> tuple:
    """(spec, function, signature) of a kernel spec, imported and checked; SpecError otherwise."""
    spec = parse_spec(text)
    module = _import(spec)
    if not hasattr(module, spec.function):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise SpecError(
            text,
            f"{spec.target!r} has no attribute {spec.function!r}"
            + (f"; its functions: {', '.join(public[:8])}" if public else ""),
        )
    fn = getattr(module, spec.function)
    if not callable(fn):
        raise SpecError(text, f"{spec.target}:{spec.function} is not callable ({type(fn).__name__})")
    signature = spec.signature or detect_signature(fn)
    if signature is None:
        raise SpecError(
            text,
            f"cannot tell the signature of {spec.function} from its parameters "
            f"({', '.join(parameters(fn)) or 'unreadable'}): append @ours (fused_moe(x, w1, w2, "
            "topk_weights, topk_ids, *, quant, w1_scale, w2_scale)) or @vllm (fused_experts("
            "hidden_states, w1, w2, topk_weights, topk_ids, ..., use_fp8_w8a8, ...))",
        )
    return spec, fn, signature


def check_all(items) -> None:
    """Import and check every kernel spec among the ``--backends`` items (SpecError on the first bad one)."""
    for item in items:
        if not known_name(item):
            load(item)


# --- the backends --------------------------------------------------------------------------------


def check_output(out, x: torch.Tensor) -> torch.Tensor:
    """``out`` if it is the contract's output for ``x``: a bf16 [T, K] tensor on x's device."""
    want = (x.shape[0], x.shape[1])
    if not isinstance(out, torch.Tensor):
        raise WrongOutput(f"returned a {type(out).__name__}, expected a bf16 tensor [T, K] = {list(want)}")
    if tuple(out.shape) != want:
        raise WrongOutput(f"returned shape {list(out.shape)}, expected [T, K] = {list(want)}")
    if out.dtype != torch.bfloat16:
        raise WrongOutput(f"returned dtype {out.dtype}, expected torch.bfloat16")
    if out.device != x.device:
        raise WrongOutput(f"returned a tensor on {out.device}, expected x's device {x.device}")
    return out


def _checked(fn: Callable) -> Callable:
    def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        return check_output(fn(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale), x)

    fused_moe.__name__ = getattr(fn, "__name__", "fused_moe")
    return fused_moe


def _ours(fn: Callable) -> Callable:
    """A user function with the contract's signature; scales it has no parameter for are not passed."""

    def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        return fn(x, w1, w2, topk_weights, topk_ids, **takes(fn, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale))

    return fused_moe


def _describe(dims, quant) -> str:
    return "-"  # a kernel from outside exposes no plan: its config is not guessed


def load_user(text: str) -> ExternalBackend:
    spec, fn, signature = resolve(text)
    if signature == "ours":
        run, note = _ours(fn), lambda quant: "none (the contract's signature)"
        origin = "your kernel, the contract's signature"
    else:
        vllm = adapter("vllm")
        user = Peer(spec.text, "", f"{spec.target}:{spec.function}", ALL_FORMATS, needs_cuda=False)
        run, note = vllm.make(fn, peer=user, empty_batch=False)
        origin = f"your kernel, vLLM's fused_experts signature ({vllm.spelling(fn)})"
    return ExternalBackend(spec.text, fused_moe=_checked(run), describe=_describe, origin=origin, converted=note)


def _on_cuda(name: str):
    return lambda quant, device: None if device == "cuda" else f"{name} runs on a CUDA GPU"


def load_peer(name: str) -> ExternalBackend:
    module = adapter(name)
    peer = module.PEER
    origin = f"peer {name} ({peer.entry})"
    try:
        entry = module.load()
    except Exception as exc:  # noqa: BLE001 - not installed, or installed without what the adapter calls
        first = (str(exc).strip().splitlines() or [""])[0]
        return ExternalBackend(
            name,
            missing=f"not installed: {peer.entry} ({type(exc).__name__}: {first}; pip install {peer.package})"[:300],
            origin=origin,
        )
    try:
        adapted = module.make(entry)
    except Exception as exc:  # noqa: BLE001 - an installed release the adapter does not know
        first = (str(exc).strip().splitlines() or [""])[0]
        return ExternalBackend(
            name,
            missing=f"adapter failed on this release of {peer.package}: {type(exc).__name__}: {first}"[:300],
            origin=origin,
        )
    return ExternalBackend(
        name,
        fused_moe=_checked(adapted.fused_moe),
        describe=_describe,
        origin=origin,
        converted=adapted.converted,
        check=_on_cuda(name) if peer.needs_cuda else None,
    )


_loaded: dict = {}


def load(name: str) -> Backend:
    """Any ``--backends`` item: this project's backend, a peer, or a kernel spec (SpecError when bad)."""
    if name.lower() in BACKEND_NAMES:
        return load_backend(name.lower())
    key = name.lower() if name.lower() in PEERS else name.strip()
    if key not in _loaded:
        _loaded[key] = load_peer(key) if key in PEERS else load_user(key)
    return _loaded[key]


def is_external(backend: Backend) -> bool:
    return isinstance(backend, ExternalBackend)


def is_user_kernel(name: str) -> bool:
    """A row of a user's kernel (its backend name is the spec, ``target:function``)."""
    return ":" in name


# --- the checks the suite adds for such kernels ---------------------------------------------------


def _tensors(inputs) -> dict:
    return {name: getattr(inputs, name) for name in INPUTS if isinstance(getattr(inputs, name), torch.Tensor)}


def measure(backend: Backend, case: Case) -> tuple:
    """:func:`compare.numerics.measure` with the inputs copied before and compared after, bit for bit:
    a kernel that wrote into one gets an error row naming it, and the inputs are put back."""
    before = {name: t.clone() for name, t in _tensors(case.inputs).items()}
    fields, out = numerics.measure(backend, case)
    written = [name for name, t in _tensors(case.inputs).items() if not metrics.bitwise_equal(t, before[name])]
    for name in written:
        getattr(case.inputs, name).copy_(before[name])
    if written:
        fields = {
            **fields,
            "status": f"error: wrote into its input{'s' if len(written) > 1 else ''} "
            f"{', '.join(written)} (put back for the backends after it)",
        }
    if isinstance(backend, ExternalBackend):
        fields["converted"] = backend.converted(case.quant)
    return fields, out


def compare_with_ours(rows: dict, outputs: dict, quant, backends: dict) -> None:
    """Each outside kernel's output against this project's (cute_moe's, else triton_moe's) on the same
    inputs: ``vs_ours`` (rel L2), ``vs_ours_of`` (which kernel), ``vs_ours_ok`` (within twice the
    format's tolerance, the bound the two kernels are held to)."""
    ours = next((k for k in KERNELS if k in outputs), None)
    if ours is None:
        return
    bound = metrics.cross_backend_tolerance(quant)
    for name, out in outputs.items():
        if is_external(backends.get(name)) and name in rows:
            diff = rel_l2(out, outputs[ours])
            rows[name].update(vs_ours=diff, vs_ours_of=ours, vs_ours_ok=diff <= bound)

"""What the suite runs: the spec of a run, one case with its problem and oracle, and the time budget.

A **case** is one (shape, quant format, token count T). :meth:`Case.build` draws its problem
(:func:`moe_spec.problem.make_inputs`; weights drawn once per shape and reused across T, so a T
sweep varies only the tokens and their routing) and evaluates the fp64 oracle on the *quantized*
inputs (what a kernel is given) and, for an FP8 case, on the unquantized bf16 problem as well: their
gap is the quantization error, reported separately from any kernel's error.

Without a GPU the shapes are scaled down (:func:`reduce_shape`) so that the Triton interpreter runs
the whole table in minutes; such rows say "reduced (CPU interpreter)". The interpreter's cost grows
with T, so the CPU path takes at most :data:`CPU_MAX_TOKENS` tokens per case.

:class:`Budget` is the wall-clock limit of ``--time-budget``: checked between steps, and armed as
an alarm around the steps that can run long, so that no single case overruns it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from dataclasses import dataclass

import torch

import moe_spec.problem as problem
from compare.metrics import quant_name
from moe_spec.oracle import oracle_breakdown, rel_l2
from moe_spec.problem import MoEInputs, MoEShape, make_inputs
from moe_spec.validate import MoEDims

DEFAULT_SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
DEFAULT_TOKENS_GPU = (1, 8, 32, 128, 1024, 4096)
DEFAULT_TOKENS_CPU = (1, 8, 32)
DEFAULT_QUANTS = (None, "fp8_tensor")
DEFAULT_BACKENDS = ("cute_moe", "triton_moe", "torch_grouped", "torch_loop")

# The CPU stand-in for a catalog shape: small enough for the Triton interpreter, still with
# several experts, top-k > 1, two fp8 groups along K and a real (masked) tail in every tile.
REDUCED_HIDDEN = 256
REDUCED_INTERMEDIATE = 128
REDUCED_MAX_EXPERTS = 8
REDUCED_MAX_TOP_K = 4
REDUCED_LABEL = "reduced (CPU interpreter)"
# The largest T the CPU path accepts. One interpreted triton_moe FP8 call on a reduced shape takes
# over ten seconds at T = 256 on a two-core machine, growing about linearly with T; a case makes
# several calls (run, rerun, the T = 1 probes), so a few hundred tokens is the limit.
CPU_MAX_TOKENS = 256


@dataclass
class SuiteSpec:
    """What to run. ``device`` is "cuda" or "cpu"; on the CPU the shapes are reduced.

    ``time_budget_s`` (None: no limit) stops the run after that many seconds: the case running
    then is stopped and says so in its rows, the cases after it become "skipped" rows.
    """

    shapes: tuple = DEFAULT_SHAPES
    tokens: tuple = DEFAULT_TOKENS_GPU
    quants: tuple = DEFAULT_QUANTS
    backends: tuple = DEFAULT_BACKENDS
    device: str = "cuda"
    seed: int = 0
    quick: bool = False
    jit: bool = True
    ptx: bool = True  # CPU: compile the CuTe configs the GPU suite would use and list their WGMMA lines
    outlier_expert: float = 0.0  # > 0: multiply expert 0's W1 by this (the shared-scale FP8 failure demo)
    time_budget_s: float | None = None
    hf_compiled: bool = False  # the hf backends' compiled columns (compare.timed.compile_fullgraph)
    command: str = ""
    commit: str = ""  # recorded in the report; default: `git rev-parse` of this checkout

    @property
    def reduced(self) -> bool:
        return self.device != "cuda"


def reduce_shape(shape: MoEShape) -> MoEShape:
    """The catalog shape scaled down for the CPU interpreter (same name, labelled by the suite)."""
    E = min(shape.num_experts, REDUCED_MAX_EXPERTS)
    return dataclasses.replace(
        shape,
        num_experts=E,
        top_k=min(shape.top_k, REDUCED_MAX_TOP_K, E),
        hidden=REDUCED_HIDDEN,
        intermediate=REDUCED_INTERMEDIATE,
    )


def draw_weights(shape: MoEShape, seed: int, device: str, outlier: float = 0.0):
    """The catalog's bf16 weights (moe_spec.problem.draw_weights), with ``outlier`` × expert 0's W1."""
    w1, w2 = problem.draw_weights(shape, seed, device)
    if outlier:
        w1[0] = (w1[0].float() * outlier).to(torch.bfloat16)
    return w1, w2


# --- the time budget -----------------------------------------------------------------------------


class OutOfTime(BaseException):
    """The budget ran out. A BaseException, so that the ``except Exception`` which turns a backend's
    crash into a row does not swallow it."""


class Budget:
    """``seconds`` of wall clock from now (None: unlimited)."""

    def __init__(self, seconds: float | None = None, clock=time.monotonic):
        self.seconds, self._clock = seconds, clock
        self._end = None if seconds is None else clock() + seconds

    @property
    def text(self) -> str:
        return f"time budget ({self.seconds:g} s)"

    def left(self) -> float:
        return math.inf if self._end is None else self._end - self._clock()

    def spent(self) -> bool:
        return self.left() <= 0

    def check(self) -> None:
        if self.spent():
            raise OutOfTime(self.text)

    @contextlib.contextmanager
    def armed(self):
        """Raise :class:`OutOfTime` inside the block when the budget runs out during it (a SIGALRM
        timer; checks only, off the main thread). The interpreter is Python code, so it stops at
        once; a call into C (a GPU synchronize) stops when it returns."""
        self.check()
        if self._end is None or threading.current_thread() is not threading.main_thread():
            yield
            return

        def alarm(signum, frame):
            raise OutOfTime(self.text)

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 1e-3))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


# --- one case ------------------------------------------------------------------------------------


@dataclass
class Case:
    """One (shape, quant, T): the problem every backend is given and the oracle it is measured against.

    ``full`` is the catalog shape (its label names the rows), ``shape`` what runs (reduced on a CPU).
    """

    full: MoEShape
    shape: MoEShape
    quant: str | None
    T: int
    reduced: bool
    inputs: MoEInputs | None = None
    ref: object = None  # oracle_breakdown on the (quantized) inputs
    ref_bf16: object = None  # ... and on the unquantized problem (the same object for bf16)

    @property
    def dims(self) -> MoEDims:
        s = self.shape
        return MoEDims(T=self.T, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k)

    @property
    def title(self) -> str:
        return f"{self.full.label} {quant_name(self.quant)} T={self.T}"

    def fields(self) -> dict:
        """The columns every row and case record of this case starts with."""
        s = self.shape
        return {
            "shape": self.full.label,
            "shape_note": REDUCED_LABEL if self.reduced else "",
            "E": s.num_experts,
            "K": s.hidden,
            "I": s.intermediate,
            "top_k": s.top_k,
            "T": self.T,
            "quant": quant_name(self.quant),
        }

    def row(self, backend: str, **fields) -> dict:
        return {**self.fields(), "backend": backend, **fields}

    def build(self, weights, seed: int, device: str) -> Case:
        """Draw the problem and evaluate the oracle(s); returns self."""
        bf16 = make_inputs(self.shape, self.T, None, seed=seed, device=device, weights_bf16=weights)
        self.ref_bf16 = oracle_breakdown(**bf16.kwargs())
        if self.quant is None:
            self.inputs, self.ref = bf16, self.ref_bf16
        else:
            self.inputs = make_inputs(self.shape, self.T, self.quant, seed=seed, device=device, weights_bf16=weights)
            self.ref = oracle_breakdown(**self.inputs.kwargs())
        return self

    @property
    def quant_error(self) -> float | None:
        """The oracle on the quantized problem against the oracle on the bf16 problem (None for bf16)."""
        return None if self.quant is None else rel_l2(self.ref.out, self.ref_bf16.out)

    def release(self) -> None:
        self.inputs = self.ref = self.ref_bf16 = None

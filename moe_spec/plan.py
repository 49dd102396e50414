"""What a backend decides before it launches anything: its plan for one layer call.

Both backends export the same two functions::

    plan(dims, quant=None, **backend_options) -> LayerPlan
    plans_for(E, K, I, top_k, quant=None, max_tokens=..., **backend_options) -> tuple[LayerPlan, ...]

``dims`` is a :class:`moe_spec.validate.MoEDims`. A plan is frozen and says each decision once:

``gemm1``, ``gemm2``  the backend's config object of each GEMM
``align_tile``        the row multiple every expert's run is padded to (:mod:`moe_spec.align`)
``swap_ab``           (GEMM1, GEMM2): whether each GEMM computes Cᵀ = W·Xᵀ
``mma``               (GEMM1, GEMM2): the tensor-core instruction each GEMM compiles to
``describe()``        one line for a report's config column

``fused_moe`` runs exactly its plan; the harness prints and times it; a warm-up compiles every
plan of :func:`plans_for`, which lists the distinct plans a layer chooses for T = 1 … max_tokens,
read from the buckets of the backend's rule (the tests check it against a dense sweep of T).

The empty batch
    Planning checks every backend option and every limit of the backend, and ``fused_moe`` plans
    before it looks at T: a call that would be refused at T = 1 is refused at T = 0 too, and an
    empty batch of a supported call returns the empty [0, K] tensor without launching anything.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable


@runtime_checkable
class LayerPlan(Protocol):
    """The interface both backends' plans provide (see the module docstring)."""

    quant: str | None

    @property
    def gemm1(self): ...

    @property
    def gemm2(self): ...

    @property
    def align_tile(self) -> int: ...

    @property
    def swap_ab(self) -> tuple[bool, bool]: ...

    @property
    def mma(self) -> tuple[str, str]: ...

    def describe(self) -> str: ...


def tokens_per_expert(T: int, E: int, top_k: int) -> float:
    """Mean (token, slot) pairs per expert, ``T·top_k / E``: what every tile rule keys on, known on
    the host without reading the routing."""
    return T * top_k / E


def bucket_starts(upper_bounds, E: int, top_k: int) -> list[int]:
    """The first T ≥ 1 of each bucket of a rule keyed on tokens per expert.

    ``upper_bounds`` are the buckets' inclusive upper bounds in tokens per expert, increasing (the
    last may be ``math.inf``): bucket i holds the T with ``bound[i-1] < T·top_k/E ≤ bound[i]``.
    Its first T is ``⌊bound[i-1]·E/top_k⌋ + 1`` (1 for the first bucket). A bucket that holds no
    integer T still gets a start; it lies in a later bucket, whose plan it then repeats.
    """
    starts, low = [1], None
    for bound in upper_bounds:
        if low is not None:
            starts.append(math.floor(low * E / top_k) + 1)
        low = bound
        if math.isinf(bound):
            break
    return starts

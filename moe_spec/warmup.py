"""The warm-up: compile every kernel a layer can use before the first request, in either backend.

Both backends export the same function::

    warmup(E, K, I, top_k, quant=None, max_tokens=MAX_TOKENS, device="cuda", *, dry_run=None,
           **backend_options) -> WarmupReport

Each walks its backend's ``plans_for(E, K, I, top_k, quant, max_tokens, **backend_options)`` —
the distinct plans the layer gets for T = 1 … ``max_tokens`` (:mod:`moe_spec.plan`) — and
compiles what every plan runs: both GEMMs, the alignment, the quantization and the row kernels.
Afterwards a ``fused_moe`` call of that layer (same format, same options) at any T in
1 … ``max_tokens`` compiles nothing. The warm-up never holds a copy of the tile rule: a bucket
the rule gains is a plan ``plans_for`` lists, hence a plan the warm-up compiles.

Why it matters. A cold kernel costs its compilation — hundreds of milliseconds to seconds — on
the request that first meets it; under tensor or expert parallelism every rank waits for the
slowest at the next collective, so one rank meeting a cold config stalls them all
(``notes/serving.md``).

:class:`WarmupReport` says what was compiled (kernel and config names), how many, the seconds of
each step and the total; ``covered`` holds the backend's own cache keys of everything the layer
needs, which the tests compare against a dense sweep of T. ``dry_run=True`` lists what a fresh
process would compile without compiling it (the Triton backend's default under its interpreter,
where nothing is ever compiled).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from moe_spec.problem import MoEInputs
from moe_spec.quant import get_format
from moe_spec.validate import WARMUP_NAMES, Limits, as_device, check_sizes


@dataclass(frozen=True)
class WarmupStep:
    """One step of a warm-up: ``what`` it covered (a config, a plan, the row kernels), the kernels
    it ``compiled`` (names; empty when everything was cached already) and its wall ``seconds``."""

    what: str
    compiled: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class WarmupReport:
    """What one ``warmup`` call did (see the module docstring)."""

    backend: str
    E: int
    K: int
    I: int  # noqa: E741  (the domain's name)
    top_k: int
    quant: str | None
    max_tokens: int
    mode: str  # "compiled", or "dry run: …" when nothing was compiled
    plans: tuple[str, ...]  # describe() of every plan warmed, in order of T
    steps: tuple[WarmupStep, ...]
    covered: frozenset  # the backend's cache keys of every kernel the layer needs

    @property
    def compiled(self) -> tuple[str, ...]:
        """Every kernel this warm-up compiled (or, in a dry run, would compile), step by step."""
        return tuple(name for step in self.steps for name in step.compiled)

    @property
    def count(self) -> int:
        return len(self.compiled)

    @property
    def seconds(self) -> float:
        return sum(step.seconds for step in self.steps)

    def summary(self) -> str:
        """A few lines: the layer, then each step with its kernels and seconds, then the total."""
        fmt = get_format(self.quant).label
        lines = [
            f"{self.backend} warm-up, E={self.E} K={self.K} I={self.I} top_k={self.top_k} {fmt}, "
            f"T = 1…{self.max_tokens}: {len(self.plans)} plans ({self.mode})"
        ]
        for step in self.steps:
            lines.append(f"  {step.seconds:8.3f} s  {len(step.compiled):2d} kernels  {step.what}")
        lines.append(f"  {self.seconds:8.3f} s  {self.count:2d} kernels  in all")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """JSON-ready: everything but ``covered`` (whose size is ``kernels_needed``)."""
        return {
            "backend": self.backend,
            "E": self.E,
            "K": self.K,
            "I": self.I,
            "top_k": self.top_k,
            "quant": get_format(self.quant).label,
            "max_tokens": self.max_tokens,
            "mode": self.mode,
            "plans": list(self.plans),
            "compiled": self.count,
            "kernels_needed": len(self.covered),
            "seconds": round(self.seconds, 4),
            "steps": [
                {"what": s.what, "compiled": list(s.compiled), "seconds": round(s.seconds, 4)} for s in self.steps
            ],
        }


def check_layer(E, K, I, top_k, max_tokens, limits: Limits | None = None) -> None:  # noqa: E741
    """The warm-up's sizes, by the one check every surface runs (:func:`moe_spec.validate.check_sizes`):
    a warm-up refuses exactly the layers ``fused_moe`` refuses — the int32 limits, the backend's
    ``limits`` (its expert count) — and a ``max_tokens`` whose call ``fused_moe`` would refuse,
    before anything is allocated or compiled. TypeError / ValueError naming the argument."""
    check_sizes(E, K, I, top_k, max_tokens, limits=limits, names=WARMUP_NAMES, min_tokens=1)


#: ``fused_moe``'s keyword arguments that are the contract's, not a backend's options.
CONTRACT_KEYWORDS = ("quant", "w1_scale", "w2_scale", "a1_scale", "a2_scale")


def check_options(options: dict, fused_moe, who: str) -> None:
    """A warm-up's ``**options`` are its backend's ``fused_moe`` options (its keyword-only arguments
    beyond the contract's): TypeError naming any other, before anything is compiled."""
    allowed = [
        p.name
        for p in inspect.signature(fused_moe).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name not in CONTRACT_KEYWORDS
    ]
    for name in options:
        if name not in allowed:
            raise TypeError(
                f"{name}: not an option of {who}, which takes fused_moe's backend options ({', '.join(allowed)})"
            )


def warmup_device(device) -> torch.device:
    """The warm-up's ``device`` as a ``torch.device`` (:func:`moe_spec.validate.as_device`): a bad
    name, None, or a CUDA device this machine lacks is refused naming ``device``."""
    return as_device(device, "device")


#: ``fused_moe``'s arguments that carry a layer size, and the warm-up's name for that size.
SIZE_ARGUMENTS = {"x": "K", "w2": "I", "num_experts": "E"}


def layer_plans(plans_for, E, K, I, top_k, quant, max_tokens, **options) -> tuple:  # noqa: E741
    """A backend's ``plans_for(...)``, a refusal of a layer size re-worded to name the warm-up's
    argument: the backend's limit speaks of ``x: hidden size K …``, the warm-up's caller passed ``K``."""
    try:
        return plans_for(E, K, I, top_k, quant, max_tokens, **options)
    except ValueError as exc:
        arg, _, rest = str(exc).partition(": ")
        if arg in SIZE_ARGUMENTS:
            raise ValueError(f"{SIZE_ARGUMENTS[arg]}: {rest}") from None
        raise


def placeholder_inputs(
    E: int,
    K: int,
    I: int,
    top_k: int,
    quant: str | None,
    T: int,  # noqa: E741
    device,
    ids_dtype=torch.int32,
) -> MoEInputs:
    """A valid call of the contract whose values do not matter: what a warm-up runs.

    Weights are allocated, not filled (``torch.empty``: a warm-up compiles, it does not compute
    anything worth reading); scales are 1, x is 0, every token routes to experts 0 … top_k − 1
    with weight 1 / top_k. Every tensor is a fresh allocation — 16-byte aligned, as Triton's
    specialization on pointer alignment expects of a serving call's tensors too.
    """
    fmt = get_format(quant)
    w1 = torch.empty(E, 2 * I, K, dtype=fmt.weight_dtype, device=device)
    w2 = torch.empty(E, K, I, dtype=fmt.weight_dtype, device=device)
    w1_scale = w2_scale = None
    if fmt.quantized:
        w1_scale = torch.ones(fmt.weight_scale_shape(E, 2 * I, K), dtype=torch.float32, device=device)
        w2_scale = torch.ones(fmt.weight_scale_shape(E, K, I), dtype=torch.float32, device=device)
    x = torch.zeros(T, K, dtype=torch.bfloat16, device=device)
    topk_ids = torch.arange(top_k, dtype=ids_dtype, device=device).expand(T, top_k).contiguous()
    topk_weights = torch.full((T, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
    return MoEInputs(x, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale)

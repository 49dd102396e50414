"""The recompile stall, modelled: how often some rank of R compiles in a step, and what that costs.

The setting of :mod:`compare.studies.stall`: R ranks run the same loop and meet at a collective after every
step; rank r's step has T_{r,s} tokens. A kernel that is compiled once per *specialization class*
κ(T) — Triton's default: T = 1, T divisible by 16, any other T; one class under
``do_not_specialize`` — stops a rank for c ms the first time that rank meets a class, and every
other rank waits for it at the collective.

Assumptions (each one a place where a real serving stack can differ):

A1  token counts are independent and identically distributed over ranks and steps, with a known
    distribution p(T) (in a real engine they are correlated: one burst of requests reaches every rank);
A2  every rank compiles for itself: its own in-memory and on-disk cache (ranks sharing a disk cache
    turn a peer's later compilation of the same class into a load, which is faster);
A3  a compilation costs c ms whatever the class, and compilations on several ranks in one step
    overlap: the step is c ms longer when at least one rank compiles;
A4  apart from compilations the ranks are balanced, so a rank that does not compile waits c ms at
    the collective;
A5  one specializing kernel (m kernels that specialize on the same T compile together: c is then
    their sum).

With q_κ = Σ_{T: κ(T) = κ} p(T) and S the classes compiled on every rank by the warm-up, a rank
compiles in step s (s = 0, 1, …) exactly when its class is one it has not met: the events "class κ
now, never before" are disjoint, so

    P_s            = Σ_{κ ∉ S} q_κ (1 − q_κ)^s
    P(stall in s)  = 1 − (1 − P_s)^R                   (some rank compiles)
    E[wait in s]   = c · R · (1 − P_s) · (1 − (1 − P_s)^(R − 1))   rank-ms waiting at the collective
    E[added in s]  = c · P(stall in s)                 ms added to the step

and the expectations over N steps are the sums over s < N. With compiled classes S held fixed
("which counts are already compiled"), :func:`p_some_rank_compiles` is the s = 0 term.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass


def uniform_tokens(lo: int, hi: int) -> dict[int, float]:
    """p(T) uniform on the integers lo … hi (inclusive)."""
    if not (isinstance(lo, int) and isinstance(hi, int)) or not 1 <= lo <= hi:
        raise ValueError(f"tokens: expected integers 1 <= lo <= hi, got {lo!r}, {hi!r}")
    return {T: 1.0 / (hi - lo + 1) for T in range(lo, hi + 1)}


def class_probabilities(token_probs: Mapping[int, float], key: Callable[[int], Hashable]) -> dict:
    """q_κ: the probability of each specialization class under ``token_probs``."""
    total = sum(token_probs.values())
    if not token_probs or abs(total - 1.0) > 1e-9 or min(token_probs.values()) < 0:
        raise ValueError(f"token_probs: expected non-negative probabilities summing to 1, got sum {total}")
    q: dict = {}
    for T, p in token_probs.items():
        k = key(T)
        q[k] = q.get(k, 0.0) + p
    return q


def _check(q: Mapping, ranks: int) -> None:
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks: expected a positive int, got {ranks!r}")
    if abs(sum(q.values()) - 1.0) > 1e-9:
        raise ValueError(f"q: class probabilities must sum to 1, got {sum(q.values())}")


def p_rank_compiles(q: Mapping, compiled: Iterable, step: int = 0) -> float:
    """P_s: the chance that one rank compiles in step ``step`` after a warm-up that compiled ``compiled``."""
    done = set(compiled)
    return sum(qk * (1.0 - qk) ** step for k, qk in q.items() if k not in done)


def p_some_rank_compiles(q: Mapping, compiled: Iterable, ranks: int, step: int = 0) -> float:
    """P(stall): the chance that at least one of ``ranks`` ranks compiles in that step."""
    _check(q, ranks)
    return 1.0 - (1.0 - p_rank_compiles(q, compiled, step)) ** ranks


@dataclass(frozen=True)
class Prediction:
    """Expectations over ``steps`` steps for ``ranks`` ranks (times in ms; None without a compile time)."""

    ranks: int
    steps: int
    p_stall_first_step: float  # P(some rank compiles) in the first step after the warm-up
    stalled_steps: float  # E[number of steps in which some rank compiles]
    compiles_per_rank: float  # E[compilations of one rank]
    added_ms: float | None  # E[ms added to the run] = c · stalled_steps
    wait_rank_ms: float | None  # E[rank-ms spent waiting for a compiling peer]

    def as_dict(self) -> dict:
        return asdict(self)


def predict(q: Mapping, compiled: Iterable, ranks: int, steps: int, compile_ms: float | None = None) -> Prediction:
    """The model's expectations (see the module docstring) for one (ranks, steps, compile time)."""
    _check(q, ranks)
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected a non-negative int, got {steps!r}")
    if compile_ms is not None and not compile_ms >= 0:
        raise ValueError(f"compile_ms: expected a non-negative time, got {compile_ms!r}")
    compiled = set(compiled)
    per_step = [p_rank_compiles(q, compiled, s) for s in range(steps)]
    stalled = sum(1.0 - (1.0 - p) ** ranks for p in per_step)
    waiting = sum(ranks * (1.0 - p) * (1.0 - (1.0 - p) ** (ranks - 1)) for p in per_step)
    return Prediction(
        ranks=ranks,
        steps=steps,
        p_stall_first_step=1.0 - (1.0 - per_step[0]) ** ranks if steps else 0.0,
        stalled_steps=stalled,
        compiles_per_rank=sum(per_step),
        added_ms=None if compile_ms is None else compile_ms * stalled,
        wait_rank_ms=None if compile_ms is None else compile_ms * waiting,
    )


def table(predictions: list[Prediction], step_ms: float | None = None) -> list[str]:
    """Markdown rows of predictions; with ``step_ms`` (a stall-free step) also the share of the run."""
    head = "| ranks | P(stall) first step | E[stalled steps] | E[compiles / rank] | E[added ms] | E[rank-ms waiting] |"
    rows = [head + (" added / run |" if step_ms else ""), "|---" * (6 + bool(step_ms)) + "|"]
    for p in predictions:
        ms = lambda v: "–" if v is None else f"{v:.0f}"  # noqa: E731
        row = (
            f"| {p.ranks} | {p.p_stall_first_step:.3f} | {p.stalled_steps:.2f} | {p.compiles_per_rank:.2f} "
            f"| {ms(p.added_ms)} | {ms(p.wait_rank_ms)} |"
        )
        if step_ms:
            share = "–" if p.added_ms is None else f"{100 * p.added_ms / (p.steps * step_ms + p.added_ms):.1f} %"
            row += f" {share} |"
        rows.append(row)
    return rows

"""The one-launch decode kernel's timeline: which CTA runs which task when, drawn from the kernel's plan.

    python -m cute_moe.lab.explore --layer qwen3-30b-a3b --tokens 1 --svg DIR   # writes decode_timeline.svg

The tasks, their numbers, their order and what each waits on are the kernel's own
(:mod:`cute_moe.decode_parts`: :func:`~cute_moe.decode_parts.leader_tables`, ``phase_starts``,
``a_task`` / ``b_task`` / ``c_task``, ``grid_size``); only the durations are a model
(:func:`schedule`): the CTAs streaming at an instant share the HBM rate, each at most what its ring
keeps in flight; a task pays a fixed latency; a B task issues its first W2 boxes before it waits for
its leader's h (the kernel's W2-first order), so its wait shows only where W2 is streamed before h is
whole.

The picture is a model of the schedule, not a measurement: it shows the shape of the launch — how
many CTAs GEMM1 keeps busy, where GEMM2 waits, how short the combine's tail is — and the modelled
time beside the weight-bytes floor. The measured times are in notes/decode.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decode_parts import (
    H_TILE,
    STAGES,
    TOKEN_BLOCK,
    TOKENS,
    Y_TILE,
    a_halves,
    a_task,
    b_task,
    c_task,
    done1_target,
    grid_size,
    leader_tables,
    phase_starts,
    stage_tx_bytes,
    tile_counts,
)
from .svg import Svg, num

#: The copy rate the modelled timeline shares among the CTAs: the H200's, measured by python -m compare
#: (notes/results/compare_h200_2026-12-03_fd84fba.json, ceilings.copy_tbps).
H200_COPY_TBPS = 4.2724
H200_SMS = 132
#: The picture notes/decode.md shows: (catalog shape, T) of a bf16 call the one-launch rule takes.
NOTES_TIMELINE = ("qwen3-30b-a3b", 1)

#: Colours of the phases (Okabe–Ito): A (GEMM1), B (GEMM2), C (the combine); waits in grey.
PHASE_COLOURS = {"A": "#E69F00", "B": "#0072B2", "C": "#009E73", "wait": "#d9d9d9"}
BF16 = 2  # bytes of a bf16 element


@dataclass(frozen=True)
class Task:
    """One task of the launch as the model ran it (times in µs from the launch's start)."""

    number: int
    phase: str  # "A", "B" or "C"
    what: str  # e.g. "leader 0, n-tile 3"
    cta: int
    claimed: float
    wait_from: float  # when it began to wait on another task's counter (= ready if it never waited)
    ready: float  # when what it waits on was done
    end: float
    weight_bytes: int


def _chunks(count: int) -> int:
    return -(-count // TOKENS)


def ring_rate_cap(latency_us: float) -> float:
    """Bytes per µs one CTA can stream at most (Little's law): its ring's bytes in flight per latency."""
    return STAGES * stage_tx_bytes() / latency_us


def _segments(t: int, plan: dict) -> tuple[str, str, list]:
    """(phase, words, segments) of task ``t``: ("lat", µs), ("load", bytes), ("wait", counter)."""
    lat, count = plan["latency_us"], plan["count"]
    if t < plan["b0"]:
        halves = plan["halves"]
        r, n, half = a_task(t, plan["nt1"], halves)
        rows = 2 * H_TILE // halves
        what = f"leader {r}, n-tile {n}" + (f", {('gate', 'up')[half]} rows" if halves == 2 else "")
        return "A", what, [("lat", lat), ("load", _chunks(count[r]) * rows * plan["K"] * BF16)]
    if t < plan["c0"]:
        kt, r = b_task(t - plan["b0"], plan["leaders"])
        w2 = _chunks(count[r]) * Y_TILE * plan["I"] * BF16
        first = min(w2, STAGES * stage_tx_bytes())  # the W2 boxes issued before the wait
        return (
            "B",
            f"k-tile {kt}, leader {r}",
            [("lat", lat), ("load", first), ("wait", ("A", r)), ("lat", lat), ("load", w2 - first)],
        )
    kt, tb = c_task(t - plan["c0"], plan["ntb"])
    return "C", f"k-tile {kt}, tokens {tb * TOKEN_BLOCK}…", [("wait", ("B", kt)), ("lat", lat)]


def schedule(
    ids: list[int],
    T: int,
    top_k: int,
    E: int,
    K: int,
    I: int,  # noqa: E741
    sms: int,
    bandwidth_tbs: float,
    latency_us: float = 1.0,
) -> dict:
    """The modelled run of one launch whose flattened ``topk_ids`` are ``ids``: the tasks in ticket
    order (:class:`Task`), the grid, the phase counts, the weight bytes and the floor (each hit
    expert's weights once at ``bandwidth_tbs``).

    The model is event-driven: the CTAs streaming at an instant share ``bandwidth_tbs`` equally, each
    at most :func:`ring_rate_cap`; a task pays ``latency_us`` once (its first box, its epilogue and
    signal), a B task again after its wait (its copy of h through L2); a wait ends when the counter it
    reads is complete. A CTA takes the next ticket when its task ends (the kernel's producer runs up to a
    task ahead: the model is the slower). ``latency_us`` 1 µs is an assumption, not a measurement."""
    if len(ids) != T * top_k:
        raise ValueError(f"ids: expected T·top_k = {T * top_k} ids, got {len(ids)}")
    if bandwidth_tbs <= 0 or latency_us <= 0:
        raise ValueError(f"bandwidth_tbs, latency_us: expected positive numbers, got {bandwidth_tbs}, {latency_us}")
    tables = leader_tables(ids, E)
    nt1, nk, ntb = tile_counts(T, K, I)
    grid = grid_size(T, top_k, E, K, I, sms)
    halves = a_halves(tables["n_leaders"], nt1, grid)
    b0, c0, end = phase_starts(tables["n_leaders"], nt1, nk, ntb, halves)
    plan = dict(b0=b0, c0=c0, nt1=nt1, ntb=ntb, K=K, I=I, leaders=tables["n_leaders"], count=tables["count"])
    plan.update(latency_us=latency_us, halves=halves)
    chunks = [_chunks(c) for c in tables["count"]]
    rate, cap = bandwidth_tbs * 1e6, ring_rate_cap(latency_us)
    done = {("A", r): 0 for r in range(plan["leaders"])} | {("B", kt): 0 for kt in range(nk)}
    full = {("A", r): done1_target(nt1, chunks[r], halves) for r in range(plan["leaders"])}
    full |= {("B", kt): plan["leaders"] for kt in range(nk)}
    arrived: dict[tuple, int] = {}  # halved tiles: the halves finished per (leader, n-tile)
    now, ticket, tasks = 0.0, 0, []
    running: dict[int, dict] = {}  # cta -> {t, phase, what, segs, left (of the first segment), claimed, ready, bytes}

    def claim(cta: int) -> None:
        nonlocal ticket
        if ticket < end:
            phase, what, segs = _segments(ticket, plan)
            nbytes = sum(v for k, v in segs if k == "load")
            job = dict(t=ticket, phase=phase, what=what, segs=segs, claimed=now, ready=now, bytes=nbytes)
            job["left"], job["wait_from"] = segs[0][1], now
            running[cta] = job
            ticket += 1

    for cta in range(grid):
        claim(cta)
    while running:
        loading = [c for c, j in running.items() if j["segs"][0][0] == "load"]
        share = min(cap, rate / len(loading)) if loading else 0.0
        step = float("inf")
        for j in running.values():
            kind, arg = j["segs"][0]
            if kind == "wait":
                step = 0.0 if done[arg] == full[arg] else step
            else:
                step = min(step, j["left"] / share if kind == "load" else j["left"])
        if step == float("inf"):
            raise RuntimeError("the modelled launch waits on a counter no task will complete")
        now += step
        finished = []
        for cta in sorted(running):
            j = running[cta]
            kind, arg = j["segs"][0]
            if kind == "wait":
                if done[arg] != full[arg]:
                    continue
                j["ready"] = now
            else:
                j["left"] -= step * share if kind == "load" else step
                if j["left"] > 1e-9:
                    continue
            j["segs"] = j["segs"][1:]
            while j["segs"] and j["segs"][0][0] == "load" and j["segs"][0][1] == 0:
                j["segs"] = j["segs"][1:]
            if j["segs"]:
                j["left"] = j["segs"][0][1]
                if j["segs"][0][0] == "wait":
                    j["wait_from"] = now
            else:
                finished.append(cta)
        for cta in finished:
            j = running.pop(cta)
            task = (j["t"], j["phase"], j["what"], cta, j["claimed"], j["wait_from"], j["ready"], now, j["bytes"])
            tasks.append(Task(*task))
            if j["phase"] == "A":
                r, n, _ = a_task(j["t"], nt1, halves)
                if halves == 1:
                    done[("A", r)] += 1
                else:  # the second half to finish a tile completes its chunks (the kernel: chunk by chunk)
                    arrived[(r, n)] = arrived.get((r, n), 0) + 1
                    done[("A", r)] += chunks[r] if arrived[(r, n)] == 2 else 0
            elif j["phase"] == "B":
                done[("B", b_task(j["t"] - b0, plan["leaders"])[0])] += 1
        for cta in finished:
            claim(cta)
    tasks.sort(key=lambda task: task.number)
    unique = plan["leaders"] * 3 * I * K * BF16  # each hit expert's W1 (2I × K) and W2 (K × I) once
    return {
        "tasks": tasks,
        "grid": grid,
        "phases": {"A": b0, "B": c0 - b0, "C": end - c0},
        "leaders": plan["leaders"],
        "weight_bytes": sum(task.weight_bytes for task in tasks),
        "floor_us": unique / rate,
        "model_us": max(task.end for task in tasks),
        "bandwidth_tbs": bandwidth_tbs,
        "latency_us": latency_us,
        "cta_cap_gbs": cap / 1e3,
    }


def timeline_svg(run: dict, title: str) -> str:
    """The modelled schedule as an SVG: a lane per CTA, a bar per task (colour = phase; grey = the
    part of a task spent waiting on another's counter), the floor as a red line. Every bar carries
    its task in ``data-*`` attributes."""
    tasks, grid = run["tasks"], run["grid"]
    span = max(run["model_us"], run["floor_us"])
    lane, left, top, width = 5, 60, 58, 720
    sx = width / span
    svg = Svg(left + width + 20, top + grid * lane + 50, title)
    svg.text(10, 18, title, cls="t")
    svg.text(
        10,
        34,
        f"{run['phases']['A']} A (GEMM1) + {run['phases']['B']} B (GEMM2) + {run['phases']['C']} C (combine) "
        f"tasks on {grid} CTAs; modelled {run['model_us']:.1f} µs, floor {run['floor_us']:.1f} µs "
        f"(red: weights once at {run['bandwidth_tbs']:g} TB/s)",
        cls="s",
    )
    svg.text(10, 48, "a model of the kernel's schedule (durations modelled, order and waits the kernel's)", cls="s")
    for phase, x in (("A", 0), ("B", 90), ("C", 180), ("wait", 270)):
        svg.rect(left + x, top + grid * lane + 14, 10, 10, fill=PHASE_COLOURS[phase])
        svg.text(left + x + 14, top + grid * lane + 23, {"wait": "waiting"}.get(phase, phase), cls="s")
    for c in range(0, grid, 16):
        svg.text(10, top + c * lane + lane, f"CTA {c}", cls="l")
    for task in tasks:
        y = top + task.cta * lane
        attrs = {
            "data-task": task.number,
            "data-phase": task.phase,
            "data-cta": task.cta,
            "data-start": num(round(task.claimed, 3)),
            "data-end": num(round(task.end, 3)),
        }
        bar = max((task.end - task.claimed) * sx, 0.5)
        svg.rect(left + task.claimed * sx, y, bar, lane - 1, fill=PHASE_COLOURS[task.phase], **attrs)
        if task.ready > task.wait_from:
            waited = (task.ready - task.wait_from) * sx
            svg.rect(left + task.wait_from * sx, y, waited, lane - 1, fill=PHASE_COLOURS["wait"], data_wait=task.number)
    x_floor = left + run["floor_us"] * sx
    svg.el("line", x1=x_floor, y1=top - 4, x2=x_floor, y2=top + grid * lane, stroke="#c00", stroke_width=1.5)
    for tick in range(0, int(span) + 1, max(1, int(span) // 8 or 1)):
        svg.text(left + tick * sx, top + grid * lane + 10, f"{tick} µs", cls="l")
    return svg.render()


def layer_timeline(label: str, T: int, sms: int = H200_SMS, seed: int = 0, copy_tbps: float = H200_COPY_TBPS) -> dict:
    """:func:`schedule` of a call of catalog shape ``label`` at ``T`` tokens, its routing drawn with ``seed``
    (each token's ``top_k`` distinct experts, uniformly), at ``copy_tbps`` (default: the H200's copy rate)."""
    import random

    from moe_spec.problem import get_shape

    shape = get_shape(label)
    rng = random.Random(seed)
    ids = [e for _ in range(T) for e in rng.sample(range(shape.num_experts), shape.top_k)]
    return schedule(ids, T, shape.top_k, shape.num_experts, shape.hidden, shape.intermediate, sms, copy_tbps)


def timeline_title(label: str, T: int) -> str:
    return f"cute_moe one-launch decode: {label}, T = {T} (bf16), modelled"


def notes_timeline() -> dict[str, str]:
    """The timeline notes/decode.md embeds, by file name."""
    label, T = NOTES_TIMELINE
    return {"decode_timeline.svg": timeline_svg(layer_timeline(label, T), timeline_title(label, T))}

"""The pipeline of one configuration as a timeline: ring slots, TMA loads, barriers, WGMMA batches,
the epilogue and its stores — and, for FP8 with 128×128 block scales, where the promotion goes.

The *order* of events is the kernel's protocol (``gemm.py``): the producer fills every free slot
(``producer_acquire`` waits on the slot's *empty* barrier), a consumer step waits on the slot's
*full* barrier, issues ``tile_k / K_instr`` WGMMAs as one batch, commits it, waits until at most
one batch is in flight (``wait_group(1)``) and only then releases the *previous* slot.  The
*durations* are schematic: one unit is one consumer step; a load's latency is not drawn (it lands
somewhere inside its hatched bar — the consumer's wait on *full* covers the rest).

The counts come from the configuration: stages and epilogue buffers from the
:class:`~cute_moe.config.GemmConfig`, the WGMMA instruction's K from the tiled MMA
(:func:`~cute_moe.layouts.plan_layouts`), the number of epilogue store boxes from the kernel's
own division of the tile (:func:`~cute_moe.layouts.tma_layouts`).
"""

from __future__ import annotations

from moe_spec.hopper import WARPGROUP_THREADS
from moe_spec.quant import FP8_BLOCK

from ..config import GemmConfig
from ..layouts import format_config, plan_layouts, tma_layouts
from .svg import Svg, num

PIPELINE_CSS = (
    ".ld{fill:#c6dbef}.rd{fill:#9ecae1}.mma{fill:#fdae6b}.pr{fill:#d62728}.ep{fill:#c7e9c0}"
    ".st{fill:#a1d99b}.nx{fill-opacity:.45}.ev{font-size:8px;text-anchor:middle}"
)
T0 = 1.0  # the consumer's first step starts when the first load has landed (schematic)


def epilogue_boxes(cfg: GemmConfig) -> int:
    """How many TMA store boxes the epilogue cuts one CTA tile into (the kernel's zipped_divide)."""
    shape = tma_layouts(cfg)["output_epi"]["shape"][1]
    count = 1
    for e in shape if isinstance(shape, list) else [shape]:
        count *= e
    return count


def store_threads(cfg: GemmConfig) -> tuple[int, ...]:
    """The CTA threads that issue the epilogue's TMA stores: ``gemm.py``'s ``is_store_thread``, thread
    0 of the consumer threads that share a tile (``mma_tidx == 0``) — CTA thread 128, lane 0 of warp
    4; under ping-pong the first thread of each consumer warpgroup. A TMA store is a per-thread
    instruction and its bulk async-groups are the issuing thread's, so one thread per tile stores,
    commits and waits (``tests/test_cute_store.py`` finds these threads in the PTX)."""
    step = WARPGROUP_THREADS * cfg.tile_warpgroups
    return tuple(range(WARPGROUP_THREADS, cfg.threads, step))


def _store_text(threads: tuple[int, ...]) -> str:
    """``t128 (lane 0 of warp 4)``; ping-pong: each warpgroup's store thread, joined by "or"."""
    return " or ".join(f"t{t} (lane {t % 32} of warp {t // 32})" for t in threads)


def timeline(cfg: GemmConfig, fmt: str = "bf16", k_steps: int | None = None) -> dict:
    """The events of one tile (and the start of the next) in schematic time, as plain data.

    ``fmt="fp8"``: the kernel's ``fp8_block`` config of the same GEMM
    (:func:`~cute_moe.layouts.format_config`: 128-byte rows of FP8, ``tile_k`` = 128, its own
    stages), whose every K step (one FP8_BLOCK of K) is retired (``wait_group(0)``) and promoted
    into the fp32 accumulator with its two scales.
    """
    fcfg = format_config(cfg, fmt)
    plan = plan_layouts(cfg, fmt)
    tile_k = plan["tile_k"]
    per_batch = tile_k // plan["atom_mnk"][2]
    stages, bufs = fcfg.stages, fcfg.epi_stages
    steps = k_steps if k_steps is not None else stages + 2
    promote = fmt == "fp8"
    boxes = epilogue_boxes(fcfg)
    ev: list[dict] = []
    retire: dict[int, float] = {}  # stage -> time its WGMMA batch has completed
    release: dict[int, float] = {}  # stage -> time its slot's empty barrier is arrived on
    for j in range(steps):
        c = T0 + j
        ev.append(dict(lane="consumer", kind="full", start=c, end=c, k=j, tile=0, slot=j % stages))
        if promote:  # one batch at a time: retire it, free the slot, promote the partial sum
            retire[j], release[j] = c + 0.55, c + 0.6
            if (j + 1) * tile_k % FP8_BLOCK == 0:
                ev.append(
                    dict(lane="wgmma", kind="promote", start=c + 0.62, end=c + 0.95, k=j, tile=0, slot=j % stages)
                )
        elif j > 0:  # wait_group(1) after issuing batch j: batch j-1 has retired, free its slot
            retire[j - 1], release[j - 1] = c + 0.8, c + 0.85
    if not promote:  # wait_group(0) after the K loop
        retire[steps - 1], release[steps - 1] = T0 + steps + 0.3, T0 + steps + 0.35
    for j in range(steps):
        ev.append(
            dict(
                lane="wgmma", kind="wgmma", start=T0 + j + 0.1, end=retire[j], k=j, tile=0, slot=j % stages, n=per_batch
            )
        )
        ev.append(
            dict(lane=f"slot{j % stages}", kind="read", start=T0 + j, end=release[j], k=j, tile=0, slot=j % stages)
        )
        ev.append(dict(lane="consumer", kind="empty", start=release[j], end=release[j], k=j, tile=0, slot=j % stages))
    # The producer: stage g goes to slot g mod stages once the slot's previous stage was released
    # (producer_acquire), one copy after the other; it runs on into the next tile's first stages.
    issued = -0.1
    for g in range(steps + stages):
        issued = max(issued + 0.1, release[g - stages] + 0.05 if g >= stages else 0.0)
        tile, k = (0, g) if g < steps else (1, g - steps)
        lands_by = T0 + g if tile == 0 else None
        if lands_by is not None and issued >= lands_by:
            raise AssertionError(f"stage {g} issued at {issued} after the consumer needs it ({lands_by})")
        ev.append(
            dict(
                lane="producer",
                kind="load",
                start=issued,
                end=issued + 0.1,
                k=k,
                tile=tile,
                slot=g % stages,
                lands_by=lands_by,
            )
        )
    epi0 = max(release.values()) + 0.05
    for e in range(boxes):
        t = epi0 + e
        ev.append(dict(lane="epilogue", kind="epi", start=t, end=t + 0.65, sub=e, buf=e % bufs))
        ev.append(dict(lane="store", kind="store", start=t + 0.7, end=t + 0.7 + 0.9, sub=e, buf=e % bufs))
    nxt = epi0 + boxes + 0.1
    for e in ev:
        if e["kind"] == "load" and e["tile"] == 1:
            e["lands_by"] = nxt + e["k"]
    for j in range(2):
        ev.append(
            dict(lane="consumer", kind="full", start=nxt + j, end=nxt + j, k=j, tile=1, slot=(steps + j) % stages)
        )
        ev.append(
            dict(
                lane="wgmma",
                kind="wgmma",
                start=nxt + j + 0.1,
                end=nxt + j + (0.55 if promote else 1.8),
                k=j,
                tile=1,
                slot=(steps + j) % stages,
                n=per_batch,
            )
        )
    return {
        "stages": stages,
        "epi_stages": bufs,
        "steps": steps,
        "tile_k": tile_k,
        "per_batch": per_batch,
        "instruction": plan["instruction"],
        "store_boxes": boxes,
        "promote": promote,
        "end": nxt + 2.2,
        "events": sorted(ev, key=lambda e: (e["start"], e["lane"])),
    }


def pipeline_svg(cfg: GemmConfig, fmt: str, k: int, role: str) -> str:
    """The timeline picture of :func:`timeline` for ``cfg`` (K = ``k`` for the step count caption)."""
    tl = timeline(cfg, fmt)
    stages, steps = tl["stages"], tl["steps"]
    store = store_threads(format_config(cfg, fmt))  # the threads of the kernel this picture draws
    lanes = ["producer"] + [f"slot{s}" for s in range(stages)] + ["consumer", "wgmma", "wgmma2", "epilogue", "store"]
    names = {
        "producer": "producer warp: TMA",
        "consumer": "consumers: barriers",
        "wgmma": "WGMMA batches",
        "wgmma2": "",
        "epilogue": "epilogue (consumers)",
        "store": "TMA store (" + ", ".join(f"t{t}" for t in store) + ")",
        **{f"slot{s}": f"ring slot {s}" for s in range(stages)},
    }
    u, lh, x0 = 50, 20, 150
    y0 = 150
    width = x0 + tl["end"] * u + 20
    fcfg = format_config(cfg, fmt)
    svg = Svg(
        max(width, 900),
        y0 + len(lanes) * lh + 70,
        f"pipeline timeline ({fmt}, {role})",
        css=PIPELINE_CSS,
        data_figure="pipeline",
        data_format=fmt,
        data_stages=stages,
        data_epi_stages=tl["epi_stages"],
        data_store_threads=" ".join(map(str, store)),
    )
    svg.text(
        12,
        22,
        f"{fmt} pipeline of one CTA ({role}): {fcfg.tokens_tile} tokens × {fcfg.weights_tile} "
        f"weight rows, {stages} stages of {tl['tile_k']} K",
        cls="t",
    )
    head = [
        f"each stage: TMA X + W box → slot, full barrier counts the bytes; consumers wait on full, issue "
        f"{tl['per_batch']} × {tl['instruction']}",
        (
            "wait_group(1): one batch stays in flight while the previous one retires and its slot is released "
            "(empty barrier) for the producer's next load"
            if not tl["promote"]
            else f"fp8_block ({FP8_BLOCK}×{FP8_BLOCK} weight blocks, 1×{FP8_BLOCK} token groups): every {FP8_BLOCK} "
            f"of K the partial sum is retired (wait_group(0)) and promoted: acc += P·s_a·s_w (red)"
        ),
        f"K = {k} → {k // tl['tile_k']} steps per tile ({steps} drawn); epilogue: {tl['store_boxes']} store "
        f"box(es) through {tl['epi_stages']} smem buffer(s); then the next tile, whose loads the producer has "
        f"already issued",
        "schematic time: one unit = one consumer step; a load lands somewhere inside its hatched bar",
    ]
    if tl["promote"]:
        head.append(
            "as cute_moe.fp8_gemm runs it (one promotion per scale block, a second accumulator in "
            "registers); the FP8 ring keeps the same 128-byte rows"
        )
    svg.lines(12, 42, head, cls="s")
    ly = {lane: y0 + i * lh for i, lane in enumerate(lanes)}
    for lane in lanes:
        svg.text(12, ly[lane] + 14, names[lane])
        svg.el("path", stroke="#eee", d=f"M{x0} {ly[lane] + lh}h{num(tl['end'] * u)}")
    for t in range(int(tl["end"]) + 1):
        svg.text(x0 + t * u, y0 - 6, str(t), cls="l")
    X = lambda t: x0 + t * u  # noqa: E731
    for e in tl["events"]:
        nx = " nx" if e.get("tile") == 1 else ""
        tag = f"{e['k']}" if e.get("tile") == 0 else f"+{e.get('k')}"
        common = dict(data_kind=e["kind"], data_k=e.get("k"), data_tile=e.get("tile"), data_slot=e.get("slot"))
        if e["kind"] == "load":
            svg.rect(X(e["start"]), ly["producer"] + 3, 0.08 * u, lh - 6, cls="ld" + nx, **common)
            ys = ly[f"slot{e['slot']}"]
            svg.rect(
                X(e["start"]),
                ys + 4,
                max(1, X(min(e["lands_by"], tl["end"])) - X(e["start"])),
                lh - 8,
                fill="url(#hatch)",
                data_kind="inflight",
                data_k=e["k"],
                data_tile=e["tile"],
                data_slot=e["slot"],
            )
            svg.text(X(e["start"]) + 2, ys + 14, f"TMA {tag}", cls="l")
        elif e["kind"] == "read":
            svg.rect(X(e["start"]), ly[f"slot{e['slot']}"] + 2, X(e["end"]) - X(e["start"]), lh - 4, cls="rd", **common)
            svg.text(X(e["start"]) + 3, ly[f"slot{e['slot']}"] + 14, f"k{e['k']}", cls="l")
        elif e["kind"] in ("full", "empty"):
            y = ly["consumer"]
            mark = "▼" if e["kind"] == "full" else "▲"
            svg.text(
                X(e["start"]),
                y + (9 if e["kind"] == "full" else 18),
                mark + str(e["slot"]),
                cls="ev",
                fill="#08519c" if e["kind"] == "full" else "#a63603",
                **common,
            )
        elif e["kind"] == "wgmma":
            y = ly["wgmma"] if e["k"] % 2 == 0 or tl["promote"] else ly["wgmma2"]
            svg.rect(X(e["start"]), y + 2, X(e["end"]) - X(e["start"]), lh - 4, cls="mma" + nx, data_n=e["n"], **common)
            svg.text(X(e["start"]) + 3, y + 14, f"{tag} ({e['n']}×)", cls="l")
        elif e["kind"] == "promote":
            svg.rect(X(e["start"]), ly["wgmma"] + 2, X(e["end"]) - X(e["start"]), lh - 4, cls="pr", **common)
        elif e["kind"] in ("epi", "store"):
            y = ly["epilogue" if e["kind"] == "epi" else "store"]
            svg.rect(
                X(e["start"]),
                y + 2,
                X(e["end"]) - X(e["start"]),
                lh - 4,
                cls="ep" if e["kind"] == "epi" else "st",
                data_kind=e["kind"],
                data_sub=e["sub"],
                data_buf=e["buf"],
            )
            svg.text(X(e["start"]) + 3, y + 14, f"{e['sub']}→b{e['buf']}", cls="l")
    svg.defs.append(
        '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#deebf7"/>'
        '<path d="M0 0v6" stroke="#9ecae1" stroke-width="2"/></pattern>'
    )
    yl = y0 + len(lanes) * lh + 20
    svg.lines(
        12,
        yl,
        [
            "▼s: consumers wait on slot s's full barrier   "
            "▲s: they arrive on its empty barrier (slot free)   "
            "hatched: TMA of stage k in flight   +k: the next tile's stage k",
            f"epilogue e→b: registers → {'bf16 → stmatrix' if fcfg.out_bytes == 2 else 'fp32 → st.shared'} "
            "into buffer b, fence, barrier (every consumer thread);",
            f"then one thread per tile, {_store_text(store)}, issues the TMA store of box e from b, "
            "commits it and waits for it",
        ],
        cls="s",
    )
    return svg.render()

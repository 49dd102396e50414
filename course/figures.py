"""The course's pictures, drawn from the steps' own objects (``python course/figures.py`` writes
them to notes/figures/course/; tests/test_course_cpu.py regenerates them and compares).

* ``ring_parity.svg`` — step 3's :func:`ring_position` over 3 laps of a 4-slot ring: the slot of
  every K step and the parity the consumer (full) and the producer (empty) wait on;
* ``descriptor.svg`` — the A descriptor constant of step 4's PTX, bit field by bit field;
* ``register_pool.svg`` — step 4's :func:`register_budget`: the pool at launch and after setmaxnreg;
* ``tile_walk.svg`` — step 5's :func:`tile_coordinates`: the rasterized order and the CTA of each tile;
* ``store_ring.svg``, ``pingpong.svg``, ``cluster_multicast.svg`` — what the production kernel adds
  after step 8, from the configs its layer plan runs and their PTX (:mod:`production`).

Every mark carries its value in ``data-*`` attributes so the test can read the picture back.
"""

from __future__ import annotations

import _common as course
import production
from _svg import COLOURS, Svg

OUT = course.COURSE.parent / "notes" / "figures" / "course"


def ring_parity(stages: int = 4, laps: int = 3) -> str:
    s3 = course.load("03_ring")
    steps = stages * laps
    cw, ch, x0, y0 = 34, 22, 150, 60
    svg = Svg(x0 + cw * steps + 20, y0 + ch * (stages + 2) + 74, "mbarrier parity over a ring", data_stages=stages)
    svg.text(10, 20, f"Step 3's ring: {stages} slots, K step k → slot k mod {stages}, lap k / {stages}", cls="t")
    svg.text(10, 38, "C = the parity the consumer waits on full[slot]; P = the producer's on empty[slot]", cls="s")
    for k in range(steps):
        svg.text(x0 + cw * k + cw / 2, y0 - 6, f"k={k}", cls="c l")
    for s in range(stages):
        svg.text(10, y0 + ch * s + 15, f"slot {s}")
    for k in range(steps):
        slot, parity = s3.ring_position(k, stages)
        x, y = x0 + cw * k, y0 + ch * slot
        svg.rect(
            x + 1,
            y + 1,
            cw - 2,
            ch - 2,
            cls=f"w{(k // stages) % 8}",
            data_k=k,
            data_slot=slot,
            data_consumer=parity,
            data_producer=parity ^ 1,
        )
        svg.text(x + cw / 2, y + 15, f"C{parity} P{parity ^ 1}", cls="c l")
    y = y0 + ch * stages + 24
    svg.lines(
        10,
        y,
        [
            "Colour = lap. A fresh mbarrier is in phase 0: on lap 0 the producer's parity 1 names the",
            'phase before it, and every phase before the current one is complete (PTX ISA, "Phase of',
            'the mbarrier object"), so the first lap never waits for the consumers.',
        ],
        cls="s",
    )
    return svg.render()


def descriptor() -> str:
    ex = course.load("exercises")
    value, _ = ex.descriptor_in_ptx(course.load("04_setmaxnreg").ptx(256, 4))
    fields = ex.decode_descriptor(value)
    bw, x0, y0 = 11, 10, 70
    svg = Svg(x0 + bw * 64 + 20, 230, "wgmma matrix descriptor", data_value=value)
    svg.text(10, 20, f"Step 4's A descriptor constant {value:#018x} (PTX ISA, Matrix Descriptor Format)", cls="t")
    svg.text(10, 38, "bit 63 on the left; the start address (bits 0–13) is ORed in at run time", cls="s")
    for bit in range(64):
        x = x0 + bw * (63 - bit)
        on = (value >> bit) & 1
        svg.rect(x, y0, bw - 1, 20, fill="#333" if on else "#eee", data_bit=bit, data_on=on)
    for i, (name, lo, width, unit) in enumerate(ex.FIELDS):
        x = x0 + bw * (63 - (lo + width - 1))
        svg.rect(x, y0 + 24, bw * width - 1, 6, cls=f"w{i}", data_field=name, data_lo=lo, data_width=width)
        raw = (value >> lo) & ((1 << width) - 1)
        label = f"{name} [{lo}..{lo + width - 1}] = {raw}" + (f" ×16 = {fields[name]} B" if unit else "")
        if name == "swizzle mode":
            label += f" ({fields['swizzle']})"
        svg.rect(10, y0 + 46 + 16 * i, 10, 10, cls=f"w{i}")
        svg.text(26, y0 + 55 + 16 * i, label, cls="s")
    return svg.render()


def register_pool() -> str:
    s4 = course.load("04_setmaxnreg")
    b = s4.register_budget(s4.PRODUCER_REGISTERS, s4.CONSUMER_REGISTERS, 2)
    scale, x0 = 0.012, 170
    svg = Svg(
        x0 + 65536 * scale + 40, 190, "register pool under setmaxnreg", data_pool=b["pool"], data_after=b["after"]
    )
    svg.text(10, 20, f"Step 4: {b['threads']} threads, one SM's register file (65,536) and the CTA's pool", cls="t")
    rows = [
        ("at launch", [(f"warpgroup {w}", b["launch"] * 128, w) for w in range(3)]),
        (
            "after setmaxnreg",
            [
                ("producer", s4.PRODUCER_REGISTERS * 128, 0),
                ("consumer 1", s4.CONSUMER_REGISTERS * 128, 1),
                ("consumer 2", s4.CONSUMER_REGISTERS * 128, 2),
            ],
        ),
    ]
    for i, (label, parts) in enumerate(rows):
        y, x = 50 + 50 * i, x0
        svg.text(10, y + 16, label)
        for name, regs, colour in parts:
            svg.rect(x, y, regs * scale, 24, cls=f"w{colour}", data_part=name, data_registers=regs, data_row=label)
            svg.text(x + regs * scale / 2, y + 16, f"{name}: {regs:,}", cls="c l")
            x += regs * scale
        svg.rect(x0, y, 65536 * scale, 24, cls="frame")
    svg.lines(
        10,
        160,
        [
            f"pool {b['pool']:,} = {b['launch']} × {b['threads']};  after: 40·128 + 232·256 = "
            f"{b['after']:,};  the inc blocks until the dec has returned enough"
        ],
        cls="s",
    )
    return svg.render()


def tile_walk(m_blocks: int = 10, n_blocks: int = 6, group: int = 4, grid: int = 7) -> str:
    s5 = course.load("05_persistent")
    cw, ch, x0, y0 = 40, 26, 60, 60
    svg = Svg(
        x0 + cw * n_blocks + 230, y0 + ch * m_blocks + 50, "persistent tile walk", data_group=group, data_grid=grid
    )
    svg.text(
        10, 20, f"Step 5: {m_blocks} × {n_blocks} tiles, rasterized in groups of {group} M blocks, {grid} CTAs", cls="t"
    )
    svg.text(10, 38, "number = tile id (the order of the walk); colour = the CTA that computes it", cls="s")
    for t in range(m_blocks * n_blocks):
        bm, bn = s5.tile_coordinates(t, m_blocks, n_blocks, group)
        x, y = x0 + cw * bn, y0 + ch * bm
        svg.rect(
            x + 1,
            y + 1,
            cw - 2,
            ch - 2,
            cls=f"w{t % grid % len(COLOURS)}",
            data_tile=t,
            data_m=bm,
            data_n=bn,
            data_cta=t % grid,
        )
        svg.text(x + cw / 2, y + 17, str(t), cls="c l")
    for g in range(0, m_blocks, group):
        svg.rect(x0, y0 + ch * g, cw * n_blocks, ch * min(group, m_blocks - g), cls="hi", data_group_start=g)
    for bm in range(m_blocks):
        svg.text(10, y0 + ch * bm + 17, f"M {bm}", cls="l")
    xs = x0 + cw * n_blocks + 20
    svg.lines(
        xs,
        y0 + 10,
        [
            "Red frames: groups of M blocks.",
            "Inside a group ids walk M first,",
            "then the next N block: the tiles",
            f"in flight together (ids c … c+{grid - 1})",
            "share few A and B blocks in L2.",
        ],
        cls="s",
    )
    return svg.render()


def _lanes(svg: Svg, names: list[str], x0: float, y0: float, lh: float, u: float, end: float) -> dict[str, float]:
    """Lane labels, a rule under each lane and the time ticks of a timeline; returns each lane's top."""
    ys = {name: y0 + lh * i for i, name in enumerate(names)}
    for name, y in ys.items():
        svg.text(10, y + lh * 0.65, name, cls="s")
        svg.line(x0, y + lh, x0 + u * end, y + lh, cls="ln", stroke_opacity=0.2)
    for t in range(int(end) + 1):
        svg.text(x0 + u * t, y0 - 5, str(t), cls="c l")
    return ys


def _cfg_text(cfg) -> str:
    return f"{cfg.tokens_tile} tokens × {cfg.weights_tile} weights, {cfg.stages} stages, epi_stages {cfg.epi_stages}"


def store_ring() -> str:
    r = production.store_ring()
    cfg, p, depth = r["cfg"], r["ptx"], r["depth"]
    u, x0, y0, lh = 70, 230, 120, 24
    names = (
        ["consumers: stmatrix"]
        + [f"staging buffer {b}" for b in range(cfg.epi_stages)]
        + ["TMA store reads smem", f"store thread: wait_group.read {depth}"]
    )
    end = r["tail"] + 0.5
    svg = Svg(
        x0 + u * end + 20,
        y0 + lh * len(names) + 80,
        "the epilogue's store ring",
        data_boxes=r["boxes"],
        data_epi_stages=cfg.epi_stages,
        data_depth=depth,
    )
    svg.text(
        10, 20, f"The epilogue of one tile: {r['layer']} GEMM2 at T = {production.TOKENS} ({_cfg_text(cfg)})", cls="t"
    )
    svg.lines(
        10,
        40,
        [
            f"epilogue tile {cfg.epi_tile[0]} × {cfg.epi_tile[1]}: {r['boxes']} store boxes per tile "
            f"(PTX: {p['tma_stores']} × cp.async.bulk.tensor …global.shared::cta, "
            f"{', '.join(p['stmatrix'])}, wait_group.read {p['store_waits']})",
            "sub-tile e: registers → bf16 → stmatrix into buffer e mod epi_stages, fence.proxy.async, "
            "barrier; one thread stores it by TMA (one bulk group)",
            f"then that thread waits until ≤ {depth} groups still read shared memory: the buffer the "
            "next sub-tile writes has been read out. Schematic time.",
        ],
        cls="s",
    )
    ys = _lanes(svg, names, x0, y0, lh, u, end)
    for e in r["events"]:
        x, w = x0 + u * e["start"], u * (e["end"] - e["start"])
        data = dict(data_kind=e["kind"], data_e=e["e"], data_buf=e["buf"], data_start=e["start"], data_end=e["end"])
        if e["kind"] == "stmatrix":
            svg.rect(x, ys[names[0]] + 3, w, lh - 6, cls=f"w{e['buf']}", **data)
            svg.text(x + w / 2, ys[names[0]] + 15, f"{e['e']}→b{e['buf']}", cls="c l")
            held = [f for f in r["events"] if f["kind"] == "store" and f["e"] == e["e"]][0]["end"]
            yb = ys[f"staging buffer {e['buf']}"]  # the buffer is held from its write until its store read it out
            svg.rect(
                x,
                yb + 5,
                u * (held - e["start"]),
                lh - 10,
                cls=f"w{e['buf']}",
                fill_opacity=0.45,
                stroke="#333",
                data_kind="held",
                data_e=e["e"],
                data_buf=e["buf"],
                data_start=e["start"],
                data_end=held,
            )
            svg.text(x + 3, yb + 15, f"sub-tile {e['e']}", cls="l")
        elif e["kind"] == "store":  # one row per buffer: two stores read at once
            y = ys[names[-2]] + 2 + (lh - 4) / cfg.epi_stages * e["buf"]
            svg.rect(x, y, w, (lh - 4) / cfg.epi_stages - 1, cls=f"w{e['buf']}", stroke="#333", **data)
            svg.text(x + 3, y + 8, f"box {e['e']}", cls="l")
        elif e["end"] > e["start"]:
            svg.rect(x, ys[names[-1]] + 6, w, lh - 12, cls="idle", data_waits_for=e["waits_for"], **data)
            svg.text(x + 2, ys[names[-1]] + 15, f"until box {e['waits_for']} is read", cls="l")
    x = x0 + u * r["tail"]
    svg.line(x, ys[names[-1]], x, ys[names[-1]] + lh, cls="hi", data_kind="tail", data_at=r["tail"])
    svg.lines(
        10,
        y0 + lh * len(names) + 24,
        [
            "At the CTA's exit the store thread waits with wait_group.read 0 (producer_tail, red) for the last reads; "
            "no wait is on the global writes",
            "(.read: the source has been read, PTX ISA cp.async.bulk.wait_group). The next tile's sub-tiles continue "
            "the buffer count (tiles_done · boxes + e).",
        ],
        cls="s",
    )
    return svg.render()


def pingpong() -> str:
    r = production.pingpong()
    cfg, p = r["cfg"], r["ptx"]
    u, x0, y0, lh = 34, 230, 120, 26
    names = ["tensor cores", "consumer 0 (threads 128–255)", "consumer 1 (threads 256–383)"]
    svg = Svg(
        x0 + u * r["end"] + 40,
        y0 + lh * 3 + 90,
        "ping-pong consumers",
        data_k_steps=r["k_steps"],
        data_boxes=r["boxes"],
    )
    svg.text(
        10,
        20,
        f"Ping-pong: {r['layer']} GEMM2 at T = {production.TOKENS} ({_cfg_text(cfg)}, "
        f"{cfg.tile_m} × {cfg.tile_n} per warpgroup)",
        cls="t",
    )
    svg.lines(
        10,
        40,
        [
            f"each consumer warpgroup w owns every other tile: a main loop of {r['k_steps']} K steps, "
            f"then an epilogue of {r['boxes']} store boxes (schematic: a box takes {production.WRITE} "
            "of a K step)",
            f"▼b: bar.sync b (wait for the turn)   ▲b: bar.arrive b (grant it); barriers "
            f"{production.MMA_ORDER_BARRIER_ID}+w before a main loop, {production.EPI_ORDER_BARRIER_ID}+w "
            "before an epilogue",
            f"consumer 1 opens barriers {r['initial_grants']} for consumer 0 at the start (PTX: bar.arrive "
            f"{p['order_grants']}, 256); one warpgroup's epilogue runs under the other's WGMMAs",
        ],
        cls="s",
    )
    ys = _lanes(svg, names, x0, y0, lh, u, r["end"])
    for e in r["events"]:
        x, w, y = x0 + u * e["start"], u * (e["end"] - e["start"]), ys[names[1 + e["wg"]]]
        data = dict(
            data_kind=e["kind"],
            data_tile=e["tile"],
            data_wg=e["wg"],
            data_start=e["start"],
            data_end=e["end"],
            data_waits=e["waits"],
            data_grants=e["grants"],
        )
        main = e["kind"] == "mainloop"
        svg.rect(x, y + 3, w, lh - 6, cls="w1" if main else "w2", fill_opacity=1 if e["wg"] == 0 else 0.55, **data)
        svg.text(x + 3, y + 16, f"▼{e['waits']} {'main loop' if main else 'epilogue'} tile {e['tile']}", cls="l")
        svg.text(x + w - 8, y + 16, f"▲{e['grants']}", cls="l")
        if main:
            svg.rect(
                x,
                ys[names[0]] + 3,
                w,
                lh - 6,
                cls="w1",
                fill_opacity=1 if e["wg"] == 0 else 0.55,
                data_kind="tensor",
                data_tile=e["tile"],
                data_start=e["start"],
                data_end=e["end"],
            )
            svg.text(x + 3, ys[names[0]] + 16, f"WGMMAs of consumer {e['wg']}", cls="l")
    svg.lines(
        10,
        y0 + lh * 3 + 26,
        [
            "A cooperative kernel's two warpgroups would share one tile and leave the "
            "tensor cores idle during its epilogue;",
            "the plan runs ping-pong where K is short (gemm_rules.PINGPONG_MAX_K_STEPS), so "
            "the epilogue is a large share of a tile's time.",
        ],
        cls="s",
    )
    return svg.render()


def cluster_multicast() -> str:
    r = production.multicast()
    cfg, p, half = r["cfg"], r["ptx"], r["half_rows"]
    u, x0, y0, lh = 90, 230, 130, 30
    names = [
        "CTA 0: producer",
        "CTA 0: full barriers",
        "CTA 0: consumers",
        "CTA 1: consumers",
        "CTA 1: full barriers",
        "CTA 1: producer",
    ]
    svg = Svg(
        x0 + u * r["end"] + 30,
        y0 + lh * len(names) + 80,
        "cluster multicast",
        data_half_rows=half,
        data_token_bytes=r["token_bytes"],
        data_half_bytes=r["half_bytes"],
        data_stage_bytes=cfg.stage_bytes,
    )
    svg.text(
        10,
        20,
        f"A cluster of two: {r['layer']} GEMM2 at T = {production.TOKENS} ({_cfg_text(cfg)}, cluster {cfg.cluster})",
        cls="t",
    )
    kb = lambda b: f"{b // 1024} KB"  # noqa: E731
    svg.lines(
        10,
        40,
        [
            f"two CTAs on two token blocks of one expert. Per K step CTA r loads its own token box "
            f"({kb(r['token_bytes'])}) and weight rows r·{half} … r·{half} + {half - 1} "
            f"({kb(r['half_bytes'])}), multicast into the same slot of both CTAs (lines)",
            f"each full barrier expects {kb(cfg.stage_bytes)}: its tokens and both halves (PTX: "
            f"{p['multicast_loads']} × …multicast::cluster; the rank is shifted by {p['rank_shifts']} "
            "bits: the half's rows and bytes)",
            "a slot is loaded again only when the consumers of both CTAs have released it "
            f"(mbarrier.arrive.shared::cluster, {p['remote_arrives']} in the PTX). Schematic time; "
            "CTA 1 starts late",
        ],
        cls="s",
    )
    ys = _lanes(svg, names, x0, y0, lh, u, r["end"])
    mid = {n: y + lh / 2 for n, y in ys.items()}
    for e in r["events"]:
        rank, k = e["rank"], e["k"]
        data = dict(data_kind=e["kind"], data_rank=rank, data_k=k, data_slot=e["slot"])
        if e["kind"] == "load":
            x, yp = x0 + u * e["at"], ys[f"CTA {rank}: producer"]
            if e["waited"]:  # the producer waited on the slot's empty barrier
                before = [f["at"] for f in r["events"] if f["kind"] == "load" and f["rank"] == rank and f["k"] == k - 1]
                svg.rect(
                    x0 + u * before[0] + 8,
                    yp + 9,
                    x - x0 - u * before[0] - 8,
                    lh - 18,
                    cls="idle",
                    data_kind="empty_wait",
                    data_rank=rank,
                    data_k=k,
                    data_freed_by=e["freed_by"],
                )
                svg.text(x0 + u * before[0] + 10, yp + 19, f"empty[{e['slot']}]", cls="l")
                freed = [
                    f["at"]
                    for f in r["events"]
                    if f["kind"] == "release" and f["rank"] == e["freed_by"] and f["k"] == k - cfg.stages
                ][0]  # the later release of the slot's previous use
                svg.line(
                    x0 + u * freed,
                    mid[f"CTA {e['freed_by']}: consumers"],
                    x,
                    mid[f"CTA {rank}: producer"],
                    stroke="#a63603",
                    stroke_dasharray="3,2",
                    data_kind="freed",
                    data_rank=rank,
                    data_k=k,
                    data_by=e["freed_by"],
                    data_at=freed,
                )
            svg.rect(
                x,
                yp + 4,
                8,
                lh - 8,
                cls=f"w{4 + rank}",
                data_at=e["at"],
                data_lands=e["lands"],
                data_rows=f"{e['rows'][0]}-{e['rows'][1]}",
                data_to=",".join(map(str, e["to"])),
                **data,
            )
            svg.text(x + 4, yp + (lh + 10 if rank == 0 else -2), f"k{k}", cls="c l")
            for to in e["to"]:  # the weight half lands in the same slot of every CTA
                svg.line(
                    x + 4,
                    mid[f"CTA {rank}: producer"],
                    x0 + u * e["lands"],
                    mid[f"CTA {to}: full barriers"],
                    stroke=COLOURS[4 + rank],
                    stroke_opacity=0.6,
                    data_kind="multicast",
                    data_rank=rank,
                    data_k=k,
                    data_to=to,
                )
        elif e["kind"] == "full":
            svg.text(
                x0 + u * e["at"],
                mid[f"CTA {rank}: full barriers"] + 4,
                f"▼{k}",
                cls="ev",
                fill="#08519c",
                data_at=e["at"],
                **data,
            )
        elif e["kind"] == "mma":
            x, yc = x0 + u * e["start"], ys[f"CTA {rank}: consumers"]
            svg.rect(
                x,
                yc + 4,
                u * (e["end"] - e["start"]) - 2,
                lh - 8,
                cls="w1",
                data_start=e["start"],
                data_end=e["end"],
                **data,
            )
            svg.text(x + 3, yc + 19, f"k{k} (slot {e['slot']})", cls="l")
        else:
            svg.text(
                x0 + u * e["at"],
                ys[f"CTA {rank}: consumers"] + (lh + 9 if rank == 0 else -2),
                f"▲{k}",
                cls="ev",
                fill="#a63603",
                data_at=e["at"],
                data_to=",".join(map(str, e["to"])),
                **data,
            )
    svg.lines(
        10,
        y0 + lh * len(names) + 24,
        [
            "▼k: K step k's full barrier completes: when the later of the two halves has landed, in both CTAs.  "
            "▲k: the consumers release step k's slot, arriving on the empty barrier of both CTAs",
            "grey: a producer waiting on empty[s], which completes only after the releases of both CTAs. The weight "
            "bytes from L2 to the SMs halve.",
        ],
        cls="s",
    )
    return svg.render()


FIGURES = {
    "ring_parity.svg": ring_parity,
    "descriptor.svg": descriptor,
    "register_pool.svg": register_pool,
    "tile_walk.svg": tile_walk,
    "store_ring.svg": store_ring,
    "pingpong.svg": pingpong,
    "cluster_multicast.svg": cluster_multicast,
}


def generate() -> dict[str, str]:
    return {name: draw() for name, draw in FIGURES.items()}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")

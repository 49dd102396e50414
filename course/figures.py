"""The course's pictures, drawn from the steps' own objects (``python course/figures.py`` writes
them to notes/figures/course/; tests/test_course_cpu.py regenerates them and compares).

* ``ring_parity.svg`` — step 3's :func:`ring_position` over 3 laps of a 4-slot ring: the slot of
  every K step and the parity the consumer (full) and the producer (empty) wait on;
* ``descriptor.svg`` — the A descriptor constant of step 4's PTX, bit field by bit field;
* ``register_pool.svg`` — step 4's :func:`register_budget`: the pool at launch and after setmaxnreg;
* ``tile_walk.svg`` — step 5's :func:`tile_coordinates`: the rasterized order and the CTA of each tile.

Every mark carries its value in ``data-*`` attributes so the test can read the picture back.
"""

from __future__ import annotations

import _common as course
from _svg import COLOURS, Svg

OUT = course.COURSE.parent / "notes" / "figures" / "course"


def ring_parity(stages: int = 4, laps: int = 3) -> str:
    s3 = course.load("03_ring")
    steps = stages * laps
    cw, ch, x0, y0 = 34, 22, 150, 60
    svg = Svg(x0 + cw * steps + 20, y0 + ch * (stages + 2) + 60, "mbarrier parity over a ring",
              data_stages=stages)
    svg.text(10, 20, f"Step 3's ring: {stages} slots, K step k → slot k mod {stages}, lap k / {stages}", cls="t")
    svg.text(10, 38, "C = the parity the consumer waits on full[slot]; P = the producer's on empty[slot]", cls="s")
    for k in range(steps):
        svg.text(x0 + cw * k + cw / 2, y0 - 6, f"k={k}", cls="c l")
    for s in range(stages):
        svg.text(10, y0 + ch * s + 15, f"slot {s}")
    for k in range(steps):
        slot, parity = s3.ring_position(k, stages)
        x, y = x0 + cw * k, y0 + ch * slot
        svg.rect(x + 1, y + 1, cw - 2, ch - 2, cls=f"w{(k // stages) % 8}", data_k=k, data_slot=slot,
                 data_consumer=parity, data_producer=parity ^ 1)
        svg.text(x + cw / 2, y + 15, f"C{parity} P{parity ^ 1}", cls="c l")
    y = y0 + ch * stages + 24
    svg.lines(10, y, ["Colour = lap. A fresh mbarrier is in phase 0: on lap 0 the producer's parity 1 names the",
                      "phase before it, complete by definition, so the first lap never waits for the consumers."],
              cls="s")
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
    svg = Svg(x0 + 65536 * scale + 40, 190, "register pool under setmaxnreg", data_pool=b["pool"],
              data_after=b["after"])
    svg.text(10, 20, f"Step 4: {b['threads']} threads, one SM's register file (65,536) and the CTA's pool",
             cls="t")
    rows = [("at launch", [(f"warpgroup {w}", b["launch"] * 128, w) for w in range(3)]),
            ("after setmaxnreg", [("producer", s4.PRODUCER_REGISTERS * 128, 0),
                                  ("consumer 1", s4.CONSUMER_REGISTERS * 128, 1),
                                  ("consumer 2", s4.CONSUMER_REGISTERS * 128, 2)])]
    for i, (label, parts) in enumerate(rows):
        y, x = 50 + 50 * i, x0
        svg.text(10, y + 16, label)
        for name, regs, colour in parts:
            svg.rect(x, y, regs * scale, 24, cls=f"w{colour}", data_part=name, data_registers=regs, data_row=label)
            svg.text(x + regs * scale / 2, y + 16, f"{name}: {regs:,}", cls="c l")
            x += regs * scale
        svg.rect(x0, y, 65536 * scale, 24, cls="frame")
    svg.lines(10, 160, [f"pool {b['pool']:,} = {b['launch']} × {b['threads']};  after: 40·128 + 232·256 = "
                        f"{b['after']:,};  the inc blocks until the dec has returned enough"], cls="s")
    return svg.render()


def tile_walk(m_blocks: int = 10, n_blocks: int = 6, group: int = 4, grid: int = 7) -> str:
    s5 = course.load("05_persistent")
    cw, ch, x0, y0 = 40, 26, 60, 60
    svg = Svg(x0 + cw * n_blocks + 230, y0 + ch * m_blocks + 50, "persistent tile walk",
              data_group=group, data_grid=grid)
    svg.text(10, 20, f"Step 5: {m_blocks} × {n_blocks} tiles, rasterized in groups of {group} M blocks, "
                     f"{grid} CTAs", cls="t")
    svg.text(10, 38, "number = tile id (the order of the walk); colour = the CTA that computes it", cls="s")
    for t in range(m_blocks * n_blocks):
        bm, bn = s5.tile_coordinates(t, m_blocks, n_blocks, group)
        x, y = x0 + cw * bn, y0 + ch * bm
        svg.rect(x + 1, y + 1, cw - 2, ch - 2, cls=f"w{t % grid % len(COLOURS)}", data_tile=t, data_m=bm,
                 data_n=bn, data_cta=t % grid)
        svg.text(x + cw / 2, y + 17, str(t), cls="c l")
    for g in range(0, m_blocks, group):
        svg.rect(x0, y0 + ch * g, cw * n_blocks, ch * min(group, m_blocks - g), cls="hi", data_group_start=g)
    for bm in range(m_blocks):
        svg.text(10, y0 + ch * bm + 17, f"M {bm}", cls="l")
    xs = x0 + cw * n_blocks + 20
    svg.lines(xs, y0 + 10, ["Red frames: groups of M blocks.", "Inside a group ids walk M first,",
                            "then the next N block: the tiles", f"in flight together (ids c … c+{grid - 1})",
                            "share few A and B blocks in L2."], cls="s")
    return svg.render()


FIGURES = {"ring_parity.svg": ring_parity, "descriptor.svg": descriptor, "register_pool.svg": register_pool,
           "tile_walk.svg": tile_walk}


def generate() -> dict[str, str]:
    return {name: draw() for name, draw in FIGURES.items()}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")

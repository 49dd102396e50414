"""Pictures of memory: an operand tile's 16-byte chunks and their banks, and the TMA boxes.

* :func:`smem_svg` — one K-major operand tile in shared memory at byte level: for each 16-byte
  chunk of each row, the bank group (4 banks = 16 bytes) it lands in, without a swizzle and with
  the kernel's ``S<B,M,S>`` applied to **byte** addresses as the hardware does; for 2-byte
  elements also the swizzle misread on *element* offsets (how a composed layout prints). The bank
  conflicts counted are those of a thread-level access of the ``ldmatrix`` / ``stmatrix`` kind
  (one 16-byte chunk from each of 8 rows); for WGMMA the plain layout is no question of banks: its
  descriptor cannot express it (:func:`wgmma_mode`), and TMA's 128-byte rows force the 128-byte
  swizzle mode (``notes/hopper.md`` §5).
* :func:`tma_svg` — the boxes the producer's TMA copies move: the weights as a 3-D tensor whose
  third coordinate is the expert, the tokens, and the epilogue's store boxes.

Layouts come from :func:`cute_moe.layouts.plan_layouts` and :func:`cute_moe.layouts.tma_layouts`.
"""

from __future__ import annotations

from ..config import GemmConfig
from ..layouts import evaluate, plan_layouts, size, swizzle_bytes, tma_coordinate, tma_layouts
from .svg import Svg, num

BANKS, BANK_BYTES = 32, 4  # shared memory: 32 banks of 4 bytes
BANK_GROUP_BYTES = 16  # one bank group: 4 banks, the 16 bytes of one row of a core matrix
BANK_GROUPS = BANKS * BANK_BYTES // BANK_GROUP_BYTES
CORE_MATRIX_ROWS = 8  # a WGMMA / ldmatrix core matrix: 8 rows × 16 bytes
ACCESS = "ldmatrix / stmatrix"  # the accesses whose bank conflicts the pictures count
ROWS_DRAWN = 16  # two 8-row swizzle atoms


def chunk_banks(smem: dict, elem_bytes: int, rows: int = ROWS_DRAWN) -> dict[str, list[list[int]]]:
    """``{panel: [row][chunk] → bank group}`` for the operand tile's first ``rows`` rows.

    ``plain``: the layout without its swizzle; ``swizzled``: the swizzle on byte addresses (the
    hardware); ``elements``: the swizzle applied to element offsets, then scaled to bytes.
    """
    shape, stride = smem["one_stage"]["shape"], smem["one_stage"]["stride"]
    bits, base, shift = smem["swizzle"]
    tile_rows = size(shape[0])
    per_chunk = BANK_GROUP_BYTES // elem_bytes
    chunks = size(shape[1]) * elem_bytes // BANK_GROUP_BYTES
    out: dict[str, list[list[int]]] = {"plain": [], "swizzled": [], "elements": []}
    for r in range(rows):
        offsets = [evaluate(shape, stride, r + tile_rows * j * per_chunk) for j in range(chunks)]
        out["plain"].append([(o * elem_bytes // BANK_GROUP_BYTES) % BANK_GROUPS for o in offsets])
        out["swizzled"].append(
            [(swizzle_bytes(o * elem_bytes, bits, base, shift) // BANK_GROUP_BYTES) % BANK_GROUPS for o in offsets]
        )
        out["elements"].append(
            [(swizzle_bytes(o, bits, base, shift) * elem_bytes // BANK_GROUP_BYTES) % BANK_GROUPS for o in offsets]
        )
    return out


def wgmma_mode(row_bytes: int, swizzle_bits: int) -> str | None:
    """The WGMMA descriptor's swizzle mode that reads a K-major tile whose rows are ``row_bytes`` apart,
    swizzled by ``S<swizzle_bits,4,3>`` on byte addresses; None when no mode can express it.

    [PTX ISA, "Shared Memory Matrix Layout"]: without a swizzle a core matrix is 128 contiguous
    bytes, its 8 rows 16 bytes apart; the 32-, 64- and 128-byte modes have rows of 32, 64 and 128
    bytes, their chunks XORed with the row within 8 rows (``S<1,4,3>``, ``S<2,4,3>``, ``S<3,4,3>``).
    """
    mode_row = BANK_GROUP_BYTES << swizzle_bits
    if row_bytes != mode_row or swizzle_bits > 3:
        return None
    return "no-swizzle" if swizzle_bits == 0 else f"{mode_row}-byte"


def conflict_ways(groups: list[list[int]]) -> list[int]:
    """Per chunk column: the worst number of rows of one core matrix (8 consecutive rows) that share
    a bank group (1 = conflict-free; 8 = the 8 rows of an ``ldmatrix`` / ``stmatrix`` access serialize)."""
    ways = []
    for j in range(len(groups[0])):
        worst = 1
        for r0 in range(0, len(groups), CORE_MATRIX_ROWS):
            col = [groups[r][j] for r in range(r0, min(r0 + CORE_MATRIX_ROWS, len(groups)))]
            worst = max(worst, max(col.count(g) for g in set(col)))
        ways.append(worst)
    return ways


def _wgmma_line(row_bytes: int, modes: dict) -> str:
    """What WGMMA's descriptor makes of the two layouts (``modes``: :func:`wgmma_mode` of each panel)."""
    if modes["swizzled"] is None:
        return "no WGMMA descriptor mode reads the swizzled layout"
    if modes["plain"] is not None:
        return f"WGMMA's descriptor reads both: the {modes['swizzled']} and the {modes['plain']} mode"
    return (
        f"WGMMA's descriptor reads the swizzled tile in its {modes['swizzled']} mode and cannot express the "
        f"plain one (no-swizzle rows are 16 B apart): {row_bytes}-byte TMA rows force the "
        f"{modes['swizzled']} mode"
    )


def smem_svg(cfg: GemmConfig, fmt: str) -> str:
    """Operand A's first 16 rows in one ring stage, by 16-byte chunk and bank group."""
    plan = plan_layouts(cfg, fmt)
    smem, elem = plan["smem_A"], plan["element_bytes"]
    banks = chunk_banks(smem, elem)
    panels = ["plain", "swizzled"] + (["elements"] if banks["elements"] != banks["swizzled"] else [])
    per_chunk = BANK_GROUP_BYTES // elem
    chunks = len(banks["plain"][0])
    b, m, s = smem["swizzle"]
    cw, ch = 46, 18
    pw = chunks * cw + 50
    row_bytes = chunks * BANK_GROUP_BYTES
    modes = {"plain": wgmma_mode(row_bytes, 0), "swizzled": wgmma_mode(row_bytes, b)}
    titles = {
        "plain": f"no swizzle: row r at byte r·{row_bytes}" + ("" if modes["plain"] else " (no WGMMA layout)"),
        "swizzled": f"S<{b},{m},{s}> on byte addresses (the hardware)",
        "elements": f"S<{b},{m},{s}> on {elem}-byte element offsets (read literally)",
    }
    svg = Svg(
        24 + len(panels) * pw,
        10,
        f"{fmt} operand tile in shared memory: 16-byte chunks and bank groups",
        data_figure="smem",
        data_format=fmt,
        data_swizzle=f"{b},{m},{s}",
    )
    for g in range(BANK_GROUPS):
        svg.symbol(
            f"g{g}",
            f'<rect width="{cw}" height="{ch}" class="b{g}"/>',
            f'<text x="{cw // 2}" y="13" class="c">{g}</text>',
        )
    svg.text(12, 22, f"{fmt} K-major operand in shared memory: where each 16-byte chunk lands", cls="t")
    y = svg.lines(
        12,
        42,
        [
            f"one row = {chunks * BANK_GROUP_BYTES} bytes = {chunks * per_chunk} {fmt} elements of K "
            f"(tile_k = {plan['tile_k']}), {chunks} chunks of {per_chunk}; rows are M (or N) of the tile",
            "cell = chunk (its K range on top), number and colour = bank group g (banks 4g … 4g+3) it lands in",
            f"{ACCESS} move one chunk from each of 8 rows (a chunk column): rows sharing a bank group serialize",
            _wgmma_line(row_bytes, modes),
            f"layout of one stage: {smem['text']}",
        ],
        cls="s",
    )
    y += 8
    for p, panel in enumerate(panels):
        x0 = 40 + p * pw
        svg.text(x0 - 28, y, titles[panel])
        svg.open("g", data_panel=panel, data_wgmma=(modes[panel] or "none") if panel in modes else None)
        for j in range(chunks):
            svg.text(x0 + j * cw + cw / 2, y + 16, f"k{j * per_chunk}–{j * per_chunk + per_chunk - 1}", cls="l c")
        for r, row in enumerate(banks[panel]):
            yy = y + 22 + r * ch
            for j, g in enumerate(row):  # the drawing of bank group g, placed at (row r, chunk j)
                svg.el("use", href=f"#g{g}", x=x0 + j * cw, y=yy, data_r=r, data_j=j)
            svg.text(x0 - 4, yy + 13, f"r{r}", cls="l", text_anchor="end")
        ways = conflict_ways(banks[panel])
        yy = y + 22 + ROWS_DRAWN * ch + 14
        for j, w in enumerate(ways):
            svg.text(x0 + j * cw + cw / 2, yy, "none" if w == 1 else f"{w}-way", cls="l c", data_ways=w)
        svg.close()
        svg.el("path", cls="frame", d=f"M{x0} {num(y + 22 + (1 << b) * ch)}h{chunks * cw}")
        svg.rect(x0, y + 22, chunks * cw, ROWS_DRAWN * ch, cls="frame")
        svg.text(
            x0 - 28,
            yy + 16,
            f"bank conflict of an {ACCESS} access: " + ("none" if max(ways) == 1 else f"up to {max(ways)}-way"),
            cls="s",
        )
    foot = y + 22 + ROWS_DRAWN * ch + 50
    if "elements" not in panels:
        foot = svg.lines(
            12,
            foot,
            [
                f"with {elem}-byte elements, element offsets are byte offsets: the composed "
                "layout's printed swizzle is the hardware's"
            ],
            cls="s",
        )
    svg.height = foot + 8
    return svg.render()


# ---- TMA boxes --------------------------------------------------------------------------------
WINDOW = 6  # boxes drawn along each axis of a tensor (the rest elided)


def _steps(shape, stride) -> list[tuple[int, int, int]]:
    """(extent, value, TMA coordinate) of each flattened mode whose stride is a basis step."""
    flat_shape = shape if isinstance(shape, list) else [shape]
    flat_stride = stride if isinstance(stride, list) else [stride]
    out = []
    for extent, step in zip(flat_shape, flat_stride):
        if isinstance(step, str):
            value, mode = (int(v) for v in step.split("@"))
            out.append((extent, value, mode))
    return out


def box_extent(shape, stride) -> dict[int, int]:
    """TMA coordinate → extent of a box, from the box modes of a tiled coordinate tensor."""
    return {mode: extent * value for extent, value, mode in _steps(shape, stride)}


def _window(
    svg: Svg, x, y, cell_w, cell_h, hi: tuple[int, int], cls: str, name: str, at: list[int], extent: dict[int, int]
) -> None:
    """WINDOW × WINDOW boxes (rows = TMA coordinate 1, columns = coordinate 0), one highlighted."""
    svg.open("g", data_tensor=name)
    for r in range(WINDOW):
        for c in range(WINDOW):
            svg.rect(x + c * cell_w, y + r * cell_h, cell_w, cell_h, cls=cls, stroke="#fff")
    svg.close()
    svg.rect(
        x + hi[1] * cell_w,
        y + hi[0] * cell_h,
        cell_w,
        cell_h,
        cls="hi",
        data_tensor=name,
        data_at=",".join(map(str, at)),
        data_extent=",".join(str(extent[m]) for m in sorted(extent)),
    )
    svg.text(x + WINDOW * cell_w + 4, y + 10, "…", cls="s")
    svg.text(x + 2, y + WINDOW * cell_h + 12, "⋮", cls="s")


def tma_svg(cfg: GemmConfig, n_out: int, k: int, experts: int, example=(3, 1, 2, 1)) -> str:
    """The TMA boxes of one CTA tile: (token block, weight block, K step, expert) = ``example``."""
    tma = tma_layouts(cfg)
    block, wblock, kstep, expert = example
    expert = min(expert, experts - 1)
    tok, wts, out = tma["tokens"], tma["weights"], tma["output"]
    x_at = tma_coordinate(tok["tiles"], (0, 0, block, kstep))
    w_at = tma_coordinate(wts["tiles"], (0, 0, wblock, kstep, expert))
    x_box = box_extent(tok["tiles"]["shape"][:2], tok["tiles"]["stride"][:2])
    w_box = box_extent(wts["tiles"]["shape"][:2], wts["tiles"]["stride"][:2])
    m_block, n_block = (wblock, block) if cfg.swap_ab else (block, wblock)
    c_at = tma_coordinate(out["tiles"], (0, 0, m_block, n_block))
    c_tile = box_extent(out["tiles"]["shape"][:2], out["tiles"]["stride"][:2])
    epi_shape, epi_stride = tma["output_epi"]["shape"], tma["output_epi"]["stride"]
    c_box = box_extent(epi_shape[0], epi_stride[0])
    stage_bytes = plan_layouts(cfg)["stage_bytes"]
    elem = cfg.element_bytes
    if (tok["values"] + wts["values"]) * elem != stage_bytes:
        raise AssertionError(
            f"the two TMA loads move {(tok['values'] + wts['values']) * elem} B, "
            f"the full barrier expects {stage_bytes} B"
        )
    path = "swap-AB" if cfg.swap_ab else "normal"
    svg = Svg(1000, 10, f"TMA boxes of one CTA tile ({path})", data_figure="tma", data_path=path)
    svg.text(
        12,
        22,
        f"TMA: the boxes one CTA tile moves ({path} path: {cfg.tokens_tile} tokens × "
        f"{cfg.weights_tile} weight rows, {cfg.tile_k} of K per stage)",
        cls="t",
    )
    y = svg.lines(
        12,
        42,
        [
            f"example tile: token block {block}, say of expert {expert} (block_expert[{block}]: device data, read when "
            f"the tile starts); weight block {wblock}; K step {kstep} → ring slot {kstep} mod {cfg.stages} = "
            f"{kstep % cfg.stages}",
            "TMA coordinates, innermost first: (k, row) for X; (k, row, expert) for W, the expert being the third "
            "coordinate of one 3-D tensor;",
            "(feature, token) for the output.  A copy names the box's origin; the box extents are compiled in.",
            f"one stage = ({tok['values']} + {wts['values']}) elements × {elem} B = "
            f"{(tok['values'] + wts['values']) * elem} B: the full barrier's transaction count "
            f"(KernelPlan.stage_bytes = {stage_bytes})",
        ],
        cls="s",
    )
    cell = 30
    wx, wy = 40, y + 44
    shown = min(experts, 4)
    for i in reversed(range(1, shown)):
        svg.rect(wx + 8 * i, wy - 8 * i, WINDOW * cell + 20, WINDOW * cell + 20, fill="#f4f4f4", stroke="#999")
    svg.text(wx, wy - 8 * shown - 4, f"W: {experts} experts stacked along coordinate 2", cls="s")
    _window(svg, wx, wy, cell, cell, (wblock, kstep), "b1", "weights", w_at, w_box)
    svg.lines(
        wx,
        wy + WINDOW * cell + 36,
        [
            f"W [E={experts}, N_out={n_out}, K={k}] seen as (N_out, K, E)",
            f"a cell = one box: {w_box[1]} rows × {w_box[0]} of K × 1 expert",
            f"{n_out // cfg.weights_tile} × {k // cfg.tile_k} boxes per expert",
            f"red box: expert {expert}, at TMA ({', '.join(map(str, w_at))})",
        ],
        cls="s",
    )
    xx = wx + WINDOW * cell + 110
    xh = max(10, round(cell * x_box[1] / w_box[1]))
    svg.text(xx, wy - 8 * shown - 4, "X [M_pad, K]: tokens sorted by expert", cls="s")
    _window(svg, xx, wy, cell, xh, (block, kstep), "b4", "tokens", x_at, x_box)
    svg.lines(
        xx,
        wy + WINDOW * xh + 36,
        [
            f"a cell = one box: {x_box[1]} tokens × {x_box[0]} of K",
            "(cell heights not to scale)" if xh * w_box[1] != cell * x_box[1] else "",
            f"red box at TMA ({', '.join(map(str, x_at))})",
        ],
        cls="s",
    )
    # the output tile, cut into the epilogue's store boxes (rows = tokens, columns = features)
    ox = xx + WINDOW * cell + 110
    sx = 240 / c_tile[0]
    sy = max(1.0, min(160 / c_tile[1], 8.0))
    svg.text(ox, wy - 8 * shown - 4, "Y: the output tile in TMA store boxes", cls="s")
    grid_extents = [e for e, _, _ in _steps(epi_shape[1], epi_stride[1])] or [1]
    n_boxes = 1
    for e in grid_extents:
        n_boxes *= e
    svg.open("g", data_tensor="output")
    for i in range(n_boxes):
        idx, rest = [], i
        for e in grid_extents:
            idx.append(rest % e)
            rest //= e
        offset = tma_coordinate({"stride": [s for s in _flat(epi_stride[1]) if isinstance(s, str)]}, tuple(idx))
        offset += [0] * (2 - len(offset))
        svg.rect(
            ox + offset[0] * sx,
            wy + offset[1] * sy,
            c_box[0] * sx,
            c_box[1] * sy,
            cls=f"b{2 + i % 2}",
            stroke="#333",
            data_offset=f"{offset[0]},{offset[1]}",
            data_extent=f"{c_box[0]},{c_box[1]}",
        )
    svg.close()
    svg.lines(
        ox,
        wy + c_tile[1] * sy + 24,
        [
            f"{c_tile[1]} tokens × {c_tile[0]} features "
            f"({'Cᵀ: GEMM M = features' if cfg.swap_ab else 'C: GEMM M = tokens'})",
            f"{n_boxes} store box(es) of {c_box[1]} tokens × {c_box[0]} features",
            f"tile origin at TMA ({', '.join(map(str, c_at))})",
            "Y [M_pad, N_out] row-major: coordinate 0 = feature",
        ],
        cls="s",
    )
    svg.height = wy + WINDOW * cell + 110
    return svg.render()


def _flat(x):
    return [v for e in x for v in _flat(e)] if isinstance(x, list) else [x]

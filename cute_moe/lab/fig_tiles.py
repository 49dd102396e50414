"""Pictures of who computes what: one warpgroup's accumulator fragment, and swap-AB's two tilings.

Both are drawn from :func:`cute_moe.layouts.plan_layouts` — the tiled MMA the kernel compiles
with, evaluated on the CPU — through :func:`cute_moe.layouts.accumulator_owners`.  Nothing here
knows the WGMMA register layout: every sentence written under a picture that states a pattern
(rows per warp, the 8-column repeat, the lanes behind a 16-byte chunk) is computed from the same
data and checked before it is written.
"""

from __future__ import annotations

import math

from ..config import GemmConfig
from ..layouts import accumulator_owners, format_config, plan_layouts
from .svg import Svg, num, rect_runs, warp_legend

FRAGMENT_CSS = ".frag path{fill:none;stroke-width:1}.frag .a{stroke-opacity:.55}"


def _warpgroup0(cfg: GemmConfig, plan: dict) -> dict[tuple[int, int], tuple[int, int]]:
    """Owners of the first consumer warpgroup's 64 rows (its threads 0–127 hold exactly those)."""
    owners = accumulator_owners(cfg, plan)
    mine = {mn: tr for mn, tr in owners.items() if tr[0] < 128}
    rows = {m for m, _ in mine}
    if rows != set(range(64)) or len(mine) != 64 * cfg.tile_n:
        raise AssertionError(f"warpgroup 0 of {cfg} does not hold rows 0–63 of every column")
    return mine


def _runs_in_register_order(cells: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Split one thread's (row, col) list, in register order, into horizontal runs (col, row, length)."""
    runs: list[list[int]] = []
    for r, c in cells:
        if runs and runs[-1][1] == r and runs[-1][0] + runs[-1][2] == c:
            runs[-1][2] += 1
        else:
            runs.append([c, r, 1])
    return [tuple(x) for x in runs]


def _shaded(thread: int) -> bool:
    """Alternate shades in a checkerboard of lanes, so neighbouring threads of one warp stand apart."""
    lane = thread % 32
    return (lane // 4 + lane % 4) % 2 == 1


def fragment_svg(cfg: GemmConfig, fmt: str, role: str) -> str:
    """The accumulator fragment of one warpgroup: which thread holds each (row, col) of m64nN, for
    the kernel's config of ``cfg``'s GEMM in format ``fmt`` (:func:`~cute_moe.layouts.format_config`)."""
    fcfg = format_config(cfg, fmt)
    plan = plan_layouts(cfg, fmt)
    owners = _warpgroup0(fcfg, plan)
    n = fcfg.tile_n
    m_atom, n_atom, k_atom = plan["atom_mnk"]
    regs: dict[int, list[tuple[int, int]]] = {}
    for (m, c), (t, _) in sorted(owners.items(), key=lambda kv: kv[1]):
        regs.setdefault(t, []).append((m, c))
    per_thread = len(regs[0])
    # facts stated under the picture, each checked here
    warp_rows = {w: sorted({m for (m, _), (t, _) in owners.items() if t // 32 == w}) for w in range(4)}
    bands = all(rows == list(range(16 * w, 16 * w + 16)) for w, rows in warp_rows.items())
    block_regs = per_thread * 8 // n
    pairs = all(
        len({m for m, _ in cells}) == 2
        and max(m for m, _ in cells) - min(m for m, _ in cells) == 8
        and {(m, c ^ 1) for m, c in cells} == set(cells)
        for cells in regs.values()
    )
    repeats = all(
        owners[(m, c)] == (owners[(m, c % 8)][0], owners[(m, c % 8)][1] + block_regs * (c // 8)) for (m, c) in owners
    )
    big = n > 16
    cw, ch = (3, 3) if big else (40, 13)
    x0, y0 = 44, 122
    grid_w, grid_h = n * cw, 64 * ch
    inset_h = 16 * 13 + 40 if big else 0
    width = max(x0 + grid_w + 20, 720)
    svg = Svg(
        width,
        y0 + grid_h + inset_h + 40,
        f"{plan['instruction']}: accumulator fragment of one warpgroup",
        css=FRAGMENT_CSS,
        data_figure="fragment",
        data_format=fmt,
        data_n=n,
        data_instruction=plan["instruction"],
    )
    svg.text(12, 22, f"{fmt} m{m_atom}n{n_atom}k{k_atom}: who holds each fp32 accumulator ({role})", cls="t")
    facts = [
        plan["instruction"] + f"  ({k_atom} {fmt} elements of K = {k_atom * plan['element_bytes']} B per instruction)",
        f"rows = M (64 per warpgroup), columns = N ({n}); colour = warp, shade alternates by thread; "
        f"{per_thread} registers per thread",
        "; ".join(
            (["each thread holds pairs of adjacent columns in two rows r and r+8"] if pairs else [])
            + (["warp w owns rows 16w … 16w+15"] if bands else [])
        ),
    ]
    if big and repeats:
        facts.append(
            f"every 8-column block repeats columns 0–7 with registers +{block_regs}: "
            "the enlarged corner below shows lane.register"
        )
    elif not big:
        facts.append("label = lane.register (thread = 32·warp + lane)")
    svg.lines(12, 42, facts, cls="s")
    warp_legend(svg, 12, y0 - 12, 4)
    # the threads, one path each: a horizontal stroke per run of registers, in register order
    svg.cells(x0, y0 + ch / 2, cw, ch, cls="frag")
    for t in sorted(regs):
        warp = t // 32
        d = "".join(f"M{c} {r}h{length}" for c, r, length in _runs_in_register_order(regs[t]))
        svg.el("path", cls=f"s{warp}" + (" a" if _shaded(t) else ""), data_t=t, d=d)
    svg.close()
    step = 8 if big else 1
    grid = "".join(f"M{num(x0 + c * cw)} {y0}v{grid_h}" for c in range(0, n + 1, step))
    grid += "".join(f"M{x0} {num(y0 + r * ch)}h{grid_w}" for r in range(0, 65, 8 if big else 1))
    svg.el("path", cls="grid", d=grid)
    svg.rect(x0, y0, grid_w, grid_h, cls="frame")
    for r in range(0, 64, 8):
        svg.text(x0 - 4, y0 + r * ch + min(ch, 9), str(r), cls="l", text_anchor="end")
    for c in range(0, n, 8 if big else 1):
        svg.text(x0 + c * cw, y0 - 2, str(c), cls="l")
    if not big:
        for (m, c), (t, v) in owners.items():
            svg.text(x0 + c * cw + cw / 2, y0 + m * ch + 10, f"{t % 32}.{v}", cls="l c")
    else:
        iy = y0 + grid_h + 30
        svg.text(x0, iy - 8, "rows 0–15 × columns 0–7, enlarged (lane.register):", cls="s")
        for (m, c), (t, v) in owners.items():
            if m < 16 and c < 8:
                svg.rect(
                    x0 + c * 40, iy + m * 13, 40, 13, cls=f"w{t // 32}", fill_opacity=".55" if _shaded(t) else None
                )
                svg.text(x0 + c * 40 + 20, iy + m * 13 + 10, f"{t % 32}.{v}", cls="l c")
    return svg.render()


# ---- swap-AB ----------------------------------------------------------------------------------
def _tile_panel(
    svg: Svg, cfg: GemmConfig, owners: dict, x: float, y: float, cell: float, used: int, name: str
) -> float:
    """The CTA tile in GEMM orientation (rows = M, cols = N), coloured by warp; padding greyed."""
    grid = {mn: t // 32 for mn, (t, _) in owners.items()}
    svg.cells(x, y, cell, cell, data_panel=name, data_rows=cfg.tile_m, data_cols=cfg.tile_n)
    for cx, cy, w, h, warp in rect_runs(grid, cfg.tile_m, cfg.tile_n):
        svg.rect(cx, cy, w, h, cls=f"w{warp}", data_w=warp)
    if cfg.swap_ab and used < cfg.tile_n:  # tokens are columns
        svg.rect(used, 0, cfg.tile_n - used, cfg.tile_m, cls="pad")
    elif not cfg.swap_ab and used < cfg.tile_m:  # tokens are rows
        svg.rect(0, used, cfg.tile_n, cfg.tile_m - used, cls="pad")
    svg.close()
    svg.rect(x, y, cfg.tile_n * cell, cfg.tile_m * cell, cls="frame")
    return y + cfg.tile_m * cell


def _chunk_owner(cfg: GemmConfig, owners: dict, token: int, chunk: int) -> tuple[int, list[tuple[int, int]]]:
    """The warp storing output row ``token``'s 16-byte chunk ``chunk`` (8 bf16 features), and the
    (lane, register) of each of its 8 values in feature order."""
    holders = []
    for f in range(8 * chunk, 8 * chunk + 8):
        mn = (f, token) if cfg.swap_ab else (token, f)
        holders.append(owners[mn])
    warps = {t // 32 for t, _ in holders}
    if len(warps) != 1:
        raise AssertionError(f"chunk {chunk} of token {token} is split over warps {sorted(warps)}")
    return warps.pop(), [(t % 32, v) for t, v in holders]


def _output_panel(
    svg: Svg, cfg: GemmConfig, owners: dict, x: float, y: float, cell: float, used: int, name: str
) -> float:
    """Output rows (tokens) × features, in 16-byte chunks of 8, coloured by the warp storing each chunk."""
    chunks = cfg.weights_tile // 8
    grid = {(tok, ch): _chunk_owner(cfg, owners, tok, ch)[0] for tok in range(cfg.tokens_tile) for ch in range(chunks)}
    svg.cells(x, y, cell * 8, cell, data_panel=name, data_rows=cfg.tokens_tile, data_cols=chunks)
    for cx, cy, w, h, warp in rect_runs(grid, cfg.tokens_tile, chunks):
        svg.rect(cx, cy, w, h, cls=f"w{warp}", data_w=warp)
    if used < cfg.tokens_tile:
        svg.rect(0, used, chunks, cfg.tokens_tile - used, cls="pad")
    svg.close()
    svg.el(
        "path",
        cls="grid",
        d="".join(f"M{num(x + c * 8 * cell)} {num(y)}v{num(cfg.tokens_tile * cell)}" for c in range(1, chunks)),
    )
    svg.rect(x, y, chunks * cell * 8, cfg.tokens_tile * cell, cls="frame")
    svg.rect(x, y, cell * 8, cell, cls="hi")  # the example chunk: token 0, features 0–7
    return y + cfg.tokens_tile * cell


def _lanes_text(holders: list[tuple[int, int]]) -> str:
    lanes = [lane for lane, _ in holders]
    distinct = list(dict.fromkeys(lanes))
    kind = (
        f"{len(distinct)} lanes × {8 // len(distinct)} values: one row of an 8×8 stmatrix matrix"
        if len(distinct) < 8
        else "8 lanes × 1 value: one column of an 8×8 matrix → stmatrix .trans"
    )
    return f"lanes {','.join(map(str, lanes))} ({kind})"


def swapab_svg(normal: GemmConfig, swap: GemmConfig, tokens_per_expert: float, phase: str) -> str:
    """One MoE tile computed both ways: tokens as WGMMA's M (normal) and as its N (swap-AB)."""
    if normal.swap_ab or not swap.swap_ab:
        raise ValueError("swapab_svg: pass (normal config, swap-AB config)")
    own_n = accumulator_owners(normal, plan_layouts(normal))
    own_s = accumulator_owners(swap, plan_layouts(swap))
    used_n = min(normal.tokens_tile, math.ceil(tokens_per_expert))
    used_s = min(swap.tokens_tile, math.ceil(tokens_per_expert))
    cell = max(1.0, min(8.0, 768 / max(normal.tile_n, normal.weights_tile), 384 / max(normal.tile_m, swap.tile_m)))
    x_swap = 40 + max(normal.tile_n, normal.weights_tile) * cell + 60
    waste_n = 1 - used_n / normal.tile_m
    waste_s = 1 - used_s / swap.tile_n
    head = [
        f"normal  {normal.tokens_tile} tokens × {normal.weights_tile} weight rows, "
        f"{normal.consumer_warpgroups} consumer warpgroup(s): C = X·Wᵀ, tokens fill M; "
        f"{100 * waste_n:.0f}% of the tile is padding rows",
        f"swap-AB {swap.weights_tile} weight rows × {swap.tokens_tile} tokens, "
        f"{swap.consumer_warpgroups} consumer warpgroup(s): Cᵀ = W·Xᵀ, weights fill M, tokens are N; "
        f"{100 * waste_s:.0f}% padding columns",
        "colour = warp (warp 4·g + w is warp w of consumer warpgroup g); pale = token slots beyond the expert's tokens",
    ]
    _, lanes_n = _chunk_owner(normal, own_n, 0, 0)
    _, lanes_s = _chunk_owner(swap, own_s, 0, 0)
    foot = [
        "Bottom: the output Y[token, feature] (row-major in memory), cut in 16-byte chunks of 8 features; "
        "each chunk is stored by one warp.",
        "The red chunk (token 0, features 0–7) holds the values of",
        f"  normal:  {_lanes_text(lanes_n)}",
        f"  swap-AB: {_lanes_text(lanes_s)}",
    ]
    text_w = 7 * max(len(t) for t in head + foot)
    width = max(x_swap + swap.tile_n * cell, x_swap + swap.weights_tile * cell, text_w) + 24
    warps = 4 * max(normal.consumer_warpgroups, swap.consumer_warpgroups)
    svg = Svg(
        width,
        10,
        f"swap-AB: the same MoE tile with tokens as M and as N ({phase})",
        data_figure="swapab",
        data_phase=phase,
        data_tokens_per_expert=num(tokens_per_expert),
    )
    svg.text(12, 22, f"swap-AB at {phase}: tokens as WGMMA's M, or as its N", cls="t")
    y = svg.lines(12, 42, head, cls="s")
    warp_legend(svg, 12, y + 2, warps)
    y += 30
    svg.text(40, y, f"normal: GEMM tile {normal.tile_m} (M = tokens) × {normal.tile_n} (N = weights)")
    svg.text(x_swap, y, f"swap-AB: {swap.tile_m} (M = weights) × {swap.tile_n} (N = tokens)")
    bottom = (
        max(
            _tile_panel(svg, normal, own_n, 40, y + 8, cell, used_n, "normal"),
            _tile_panel(svg, swap, own_s, x_swap, y + 8, cell, used_s, "swap"),
        )
        + 30
    )
    svg.text(40, bottom, f"normal output: {normal.tokens_tile} tokens × {normal.weights_tile} features")
    svg.text(x_swap, bottom, f"swap-AB output: {swap.tokens_tile} tokens × {swap.weights_tile} features")
    bottom = (
        max(
            _output_panel(svg, normal, own_n, 40, bottom + 8, cell, used_n, "normal-out"),
            _output_panel(svg, swap, own_s, x_swap, bottom + 8, cell, used_s, "swap-out"),
        )
        + 20
    )
    svg.height = svg.lines(12, bottom, foot, cls="s") + 4
    return svg.render()

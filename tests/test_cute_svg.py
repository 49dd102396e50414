"""The layout pictures are the kernel's layouts: parse each SVG back and compare it with the data.

Every picture is drawn from the objects the kernel compiles with; these tests read the marks back
(their ``data-*`` attributes and positions) and compare them with an independent source — the
kernel's own ``partition_C`` (``layouts.describe``), the swizzle written out in bytes here, the
configuration's counts — and check that the committed pictures under notes/figures/ are exactly
what the generator draws now.
"""

import functools
import os
import re
import xml.etree.ElementTree as ET

import pytest

from cute_moe.config import GemmConfig
from cute_moe.gemm_rules import pingpong_config
from cute_moe.lab.fig_pipeline import pipeline_svg
from cute_moe.lab.figures import notes_configs, notes_figures
from cute_moe.layouts import accumulator_owners, describe, format_config, plan_layouts, thread_value_map, tma_layouts
from moe_spec.quant import FP8_BLOCK

NS = "{http://www.w3.org/2000/svg}"
FIGURES = os.path.join(os.path.dirname(__file__), "..", "notes", "figures")


@pytest.fixture(scope="module")
def figs():
    return notes_figures()


@pytest.fixture(scope="module")
def cfgs():
    return {name: cfg for name, (cfg, _) in notes_configs().items()}


def _root(text: str):
    return ET.fromstring(text)


def _all(root, tag):
    return root.iter(NS + tag)


def _cells(group) -> dict:
    """{(row, col): data-w} of the rectangles (in cell units) of a panel group."""
    out = {}
    for r in group.iter(NS + "rect"):
        if "data-w" not in r.attrib:
            continue
        x, y, w, h = (int(float(r.get(a))) for a in ("x", "y", "width", "height"))
        for row in range(y, y + h):
            for col in range(x, x + w):
                assert (row, col) not in out, f"cell {(row, col)} drawn twice"
                out[(row, col)] = int(r.get("data-w"))
    return out


def _panel(root, name):
    return next(g for g in root.iter(NS + "g") if g.get("data-panel") == name)


# ---- the accumulator fragment -------------------------------------------------------------------
def _fragment(text: str) -> dict[int, list[tuple[int, int]]]:
    """thread → its (row, col) in register order, read back from the per-thread paths."""
    regs = {}
    for p in _all(_root(text), "path"):
        if "data-t" in p.attrib:
            cells = []
            for col, row, length in re.findall(r"M(\d+) (\d+)h(\d+)", p.get("d")):
                cells += [(int(row), int(col) + i) for i in range(int(length))]
            regs[int(p.get("data-t"))] = cells
    return regs


def test_fragment_n8_is_the_kernels_partition_c(figs, cfgs):
    """decode (swap-AB, N = 8): the picture = warpgroup 0 of the kernel's partition_C, bf16 and FP8 alike."""
    cfg = cfgs["decode_swapab"]
    kernel = {t: [tuple(mn) for mn in regs] for t, regs in enumerate(describe(cfg)["accumulators"]) if t < 128}
    for fmt, k in (("bf16", 16), ("fp8", 32)):
        text = figs[f"fragment_{fmt}_n8.svg"]
        assert f"m64n8k{k}.f32.{'bf16.bf16' if fmt == 'bf16' else 'e4m3.e4m3'}" in _root(text).get("data-instruction")
        assert _fragment(text) == kernel  # the accumulator layout does not depend on the operand type


@pytest.mark.parametrize("fmt, n", [("bf16", 256), ("fp8", 128)])
def test_fragment_prefill_is_the_tiled_mma_tv_layout(figs, cfgs, fmt, n):
    """prefill (normal path): bf16's 128×256 tile; FP8's is 128 weights wide (two accumulators)."""
    cfg = cfgs["prefill_normal"]
    assert format_config(cfg, fmt).tile_n == n
    plan = plan_layouts(cfg, fmt)
    table = thread_value_map(plan["tv_C_tiled"], plan["mma_tile_mn"][0])
    drawn = _fragment(figs[f"fragment_{fmt}_n{n}.svg"])
    assert drawn == {t: table[t] for t in range(128)}
    assert all(len(cells) == 64 * n // 128 for cells in drawn.values())


@pytest.mark.parametrize(
    "cfg",
    [
        GemmConfig(swap_ab=True, tokens_tile=8, weights_tile=128),
        GemmConfig(tokens_tile=128, weights_tile=16, consumer_warpgroups=1),
    ],
    ids=["two-warpgroups", "M-repeat"],
)
def test_accumulator_owners_equal_partition_c(cfg):
    owners = accumulator_owners(cfg, plan_layouts(cfg))
    kernel = {tuple(mn): (t, v) for t, regs in enumerate(describe(cfg)["accumulators"]) for v, mn in enumerate(regs)}
    assert owners == kernel


# ---- swap-AB ------------------------------------------------------------------------------------
def test_swapab_decode_panels_are_the_accumulators(figs, cfgs):
    root = _root(figs["swapab_decode.svg"])
    swap, normal = cfgs["decode_swapab"], cfgs["decode_normal"]
    kernel = describe(swap)["accumulators"]  # the kernel's partition_C
    warp_of = {tuple(mn): t // 32 for t, regs in enumerate(kernel) for mn in regs}
    assert _cells(_panel(root, "swap")) == warp_of
    normal_owners = accumulator_owners(normal, plan_layouts(normal))
    assert _cells(_panel(root, "normal")) == {mn: t // 32 for mn, (t, _) in normal_owners.items()}
    # the output in memory: token row, 16-byte chunk of 8 features → the one warp holding all 8 values
    out = _cells(_panel(root, "swap-out"))
    assert out == {
        (tok, f // 8): warp_of[(f, tok)] for f in range(swap.weights_tile) for tok in range(swap.tokens_tile)
    }
    # the decode story: 2 tokens per expert pad 62 of 64 normal rows, 6 of 8 swap-AB columns
    pads = [r for r in _panel(root, "normal").iter(NS + "rect") if r.get("class") == "pad"]
    assert [(r.get("y"), r.get("height")) for r in pads] == [("2", "62")]
    assert "lanes 0,4,8,12,16,20,24,28" in figs["swapab_decode.svg"]  # stmatrix .trans gathers a column


# ---- shared memory -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_smem_chunks_land_where_the_byte_swizzle_puts_them(figs, fmt):
    """Swizzle<3,4,3> written out in bytes: a K-major row is 128 B, chunk j of row r starts at byte
    128·r + 16·j, and the hardware XORs address bits 4–6 with bits 7–9."""
    root = _root(figs[f"smem_{fmt}.svg"])
    drawn = {}
    for g in _all(root, "g"):
        if g.get("data-panel"):
            drawn[g.get("data-panel")] = {
                (int(u.get("data-r")), int(u.get("data-j"))): int(u.get("href")[2:]) for u in g.iter(NS + "use")
            }
    expect_hw, expect_plain = {}, {}
    for r in range(16):
        for j in range(8):
            addr = 128 * r + 16 * j
            expect_hw[(r, j)] = ((addr ^ (((addr >> 7) & 7) << 4)) >> 4) & 7
            expect_plain[(r, j)] = (addr >> 4) & 7
    assert drawn["swizzled"] == expect_hw and drawn["plain"] == expect_plain
    ways = {
        g.get("data-panel"): [int(t.get("data-ways")) for t in g.iter(NS + "text") if t.get("data-ways")]
        for g in _all(root, "g")
        if g.get("data-panel")
    }
    assert ways["plain"] == [8] * 8 and ways["swizzled"] == [1] * 8  # unswizzled: 8-way; swizzled: none
    # reading the swizzle on 2-byte element offsets is not the hardware's pattern; on 1-byte ones it is
    assert ("elements" in drawn) == (fmt == "bf16")
    if fmt == "bf16":
        assert drawn["elements"] != expect_hw
    # the conflicts are those of ldmatrix / stmatrix (one 16-byte chunk of each of 8 rows), not WGMMA's: a
    # no-swizzle WGMMA core matrix has its 8 rows 16 B apart, so rows 128 B apart are no WGMMA layout, and
    # the swizzled tile is the descriptor's 128-byte mode [PTX ISA, "Shared Memory Matrix Layout"]
    modes = {g.get("data-panel"): g.get("data-wgmma") for g in _all(root, "g") if g.get("data-panel")}
    assert modes["plain"] == "none" and modes["swizzled"] == "128-byte" and modes.get("elements") is None
    texts = [t.text or "" for t in _all(root, "text")]
    assert sum("bank conflict of an ldmatrix / stmatrix access" in t for t in texts) == len(drawn)
    assert not any("WGMMA core-matrix read" in t for t in texts)
    assert any("cannot express the plain one" in t and "force the 128-byte mode" in t for t in texts)


# the descriptor's swizzle field (bits 62–63) in PTX: 0 no swizzle, 1 128-byte, 2 64-byte, 3 32-byte
DESCRIPTOR_MODES = {0: "no-swizzle", 1: "128-byte", 2: "64-byte", 3: "32-byte"}


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_smem_swizzled_panel_is_the_descriptor_mode_the_kernel_asks_for(figs, cfgs, fmt):
    """The mode the swizzled panel names is the one the compiled kernel ORs into its WGMMA descriptors."""
    cfg = format_config(cfgs["prefill_normal"], fmt)
    root = _root(figs[f"smem_{fmt}.svg"])
    drawn = next(g.get("data-wgmma") for g in _all(root, "g") if g.get("data-panel") == "swizzled")
    ptx = "\n".join(_ptx(cfg).lines)
    consts = {int(v) for v in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (\d+)", ptx)}
    modes = {DESCRIPTOR_MODES[v >> 62] for v in consts if v >> 62}  # the swizzled descriptors' constants
    assert modes == {drawn}


# ---- the pipeline --------------------------------------------------------------------------------
def _rects(root, kind):
    return [r for r in _all(root, "rect") if r.get("data-kind") == kind]


def _span(r):
    return float(r.get("x")), float(r.get("x")) + float(r.get("width"))


PIPELINES = [
    ("decode_swapab", "bf16"),
    ("prefill_normal", "bf16"),
    ("decode_normal", "bf16"),
    ("decode_swapab", "fp8"),
    ("prefill_normal", "fp8"),
]


@functools.cache
def _ptx(cfg: GemmConfig):
    """The compiled kernel's PTX (CPU), read by test_cute_store's walk over the CTA's thread ids."""
    from test_cute_store import Ptx

    import cute_moe

    return Ptx(cute_moe.compile_ptx(cfg))


def _store_issuers(cfg: GemmConfig) -> set[int]:
    """The threads that can execute a TMA store (cp.async.bulk.tensor … global.shared::cta) in the PTX."""
    from test_cute_store import STORE, _threads_reaching

    return set().union(*_threads_reaching(_ptx(cfg), cfg.threads, STORE).values())


@pytest.mark.parametrize("name,fmt", PIPELINES)
def test_pipeline_follows_the_kernels_protocol(figs, cfgs, name, fmt):
    cfg = format_config(cfgs[name], fmt)  # FP8: the kernel's fp8_block config of the same GEMM
    assert cfg.quant == (None if fmt == "bf16" else "fp8_block")
    root = _root(figs[f"pipeline_{'fp8_' if fmt == 'fp8' else ''}{name}.svg"])
    plan = plan_layouts(cfg, fmt)
    assert int(root.get("data-stages")) == cfg.stages
    reads = _rects(root, "read")
    steps = len(reads)
    assert {int(r.get("data-slot")) for r in reads} == set(range(cfg.stages))
    # stage k (of the running stage count) goes to slot k mod stages
    for r in _rects(root, "load") + reads:
        stage = int(r.get("data-k")) + steps * int(r.get("data-tile"))
        assert int(r.get("data-slot")) == stage % cfg.stages
    # a slot holds one stage at a time, and is refilled only after its release
    for s in range(cfg.stages):
        spans = sorted(_span(r) for r in reads if int(r.get("data-slot")) == s)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        loads = sorted(float(r.get("x")) for r in _rects(root, "load") if int(r.get("data-slot")) == s)
        assert all(load >= end for load, (_, end) in zip(loads[1:], spans))
    # each consumer step issues tile_k / K_instr WGMMAs as one batch; bf16 keeps two batches in flight, FP8 one
    mma = [r for r in _rects(root, "wgmma") if r.get("data-tile") == "0"]
    assert {int(r.get("data-n")) for r in mma} == {plan["tile_k"] // plan["atom_mnk"][2]}
    spans = [_span(r) for r in mma]
    in_flight = max(sum(a <= x < b for a, b in spans) for x, _ in spans)
    assert in_flight == (1 if fmt == "fp8" else 2)
    # a slot is released only after the batch that read it has retired
    for r, m in zip(sorted(reads, key=lambda r: int(r.get("data-k"))), sorted(mma, key=lambda r: int(r.get("data-k")))):
        assert _span(r)[1] >= _span(m)[1]
    promotions = _rects(root, "promote")
    assert len(promotions) == (steps * plan["tile_k"] // FP8_BLOCK if fmt == "fp8" else 0)
    # the epilogue: one TMA store per epilogue box, cycling through epi_stages buffers
    stores = _rects(root, "store")
    boxes = (cfg.tile_m // cfg.epi_tile[0]) * (cfg.tile_n // cfg.epi_tile[1])
    assert [int(s.get("data-buf")) for s in stores] == [e % cfg.epi_stages for e in range(boxes)]


def _store_threads_drawn(text: str) -> set[int]:
    root = _root(text)
    drawn = {int(t) for t in root.get("data-store-threads").split()}
    labels = [t.text or "" for t in _all(root, "text")]
    assert "TMA store (" + ", ".join(f"t{t}" for t in sorted(drawn)) + ")" in labels  # the store row's name
    caption = next(t for t in labels if t.startswith("then one thread per tile"))
    assert re.findall(r"t(\d+) \(lane (\d+) of warp (\d+)\)", caption) == [
        (str(t), str(t % 32), str(t // 32)) for t in sorted(drawn)
    ]
    return drawn


@pytest.mark.parametrize("name,fmt", PIPELINES + [("prefill_swapab", "bf16")])
def test_pipeline_names_the_thread_the_ptx_stores_from(figs, cfgs, name, fmt):
    """The store row and the caption name the CTA thread that executes the TMA stores in the compiled
    kernel (one thread, not a warp: each thread that runs cp.async.bulk.tensor starts its own copy)."""
    cfg = format_config(cfgs[name], fmt)
    drawn = _store_threads_drawn(figs[f"pipeline_{'fp8_' if fmt == 'fp8' else ''}{name}.svg"])
    assert drawn == _store_issuers(cfg) and len(drawn) == 1


def test_pipeline_of_a_pingpong_kernel_names_both_store_threads():
    """Ping-pong: each consumer warpgroup stores its own tiles, so the picture names two threads —
    the ones the PTX walk finds (the lab draws any config: explore --svg)."""
    cfg = pingpong_config(GemmConfig(tokens_tile=128, weights_tile=128, stages=4).validate())
    assert cfg.pingpong and cfg.consumer_warpgroups == 2
    drawn = _store_threads_drawn(pipeline_svg(cfg, "bf16", 4096, "ping-pong"))
    assert drawn == _store_issuers(cfg) and len(drawn) == 2


# ---- TMA ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["decode_swapab", "decode_normal", "prefill_normal", "prefill_swapab"])
def test_tma_boxes(figs, cfgs, name):
    cfg = cfgs[name]
    root = _root(figs[f"tma_{name}.svg"])
    hi = {r.get("data-tensor"): r for r in _all(root, "rect") if r.get("data-at")}
    block, wblock, kstep, expert = 3, 1, 2, 1  # the picture's example tile
    assert hi["weights"].get("data-at") == f"{kstep * cfg.tile_k},{wblock * cfg.weights_tile},{expert}"
    assert hi["weights"].get("data-extent") == f"{cfg.tile_k},{cfg.weights_tile}"
    assert hi["tokens"].get("data-at") == f"{kstep * cfg.tile_k},{block * cfg.tokens_tile}"
    assert hi["tokens"].get("data-extent") == f"{cfg.tile_k},{cfg.tokens_tile}"
    # the store boxes tile the CTA's output exactly: (feature, token) offsets and extents
    covered = set()
    for r in _all(root, "rect"):
        if r.get("data-offset"):
            (f0, t0), (fe, te) = ((int(v) for v in r.get(a).split(",")) for a in ("data-offset", "data-extent"))
            box = {(f, t) for f in range(f0, f0 + fe) for t in range(t0, t0 + te)}
            assert not box & covered
            covered |= box
    assert covered == {(f, t) for f in range(cfg.weights_tile) for t in range(cfg.tokens_tile)}
    # the two loads of a stage are what the full barrier counts
    tma = tma_layouts(cfg)
    stage_bytes = (tma["tokens"]["values"] + tma["weights"]["values"]) * cfg.element_bytes
    assert (
        stage_bytes
        == plan_layouts(cfg)["stage_bytes"]
        == (cfg.tokens_tile + cfg.weights_tile) * cfg.tile_k * cfg.element_bytes
    )


# ---- the committed set ---------------------------------------------------------------------------
def test_committed_figures_are_what_the_generator_draws(figs):
    committed = sorted(f for f in os.listdir(FIGURES) if f.endswith(".svg"))
    assert committed == sorted(figs), "regenerate: python -m cute_moe.lab.explore --notes-figures notes/figures"
    for name in committed:
        with open(os.path.join(FIGURES, name), encoding="utf-8") as f:
            assert f.read() == figs[name], (
                f"{name} is stale: python -m cute_moe.lab.explore --notes-figures notes/figures"
            )
    sizes = [len(t.encode()) for t in figs.values()]
    assert max(sizes) < 150_000 and sum(sizes) < 600_000


def test_notes_chapters_embed_every_figure(figs):
    """wgmma_layouts.md embeds the layout pictures, decode.md the one launch's timeline: every one, once."""
    embedded = []
    for chapter in ("wgmma_layouts.md", "decode.md"):
        with open(os.path.join(FIGURES, "..", chapter), encoding="utf-8") as f:
            embedded += sorted(set(re.findall(r"figures/([\w.]+\.svg)", f.read())))
    assert sorted(embedded) == sorted(figs)


def test_notes_config_table_is_the_path_rule(cfgs):
    """The chapter's table of the four configurations says what the path rule builds."""
    from cute_moe.lab.figures import DEFAULT_K, DEFAULT_N_OUT
    from cute_moe.plan import choose_config

    with open(os.path.join(FIGURES, "..", "wgmma_layouts.md"), encoding="utf-8") as f:
        rows = re.findall(r"^\| `(\w+)` \| ([\d.]+) \| ([^|]+) \| (\d+) × (\d+) \| (\d+) \| (\d+) \|$", f.read(), re.M)
    assert sorted(r[0] for r in rows) == sorted(cfgs)
    for name, tpe, path, tokens, weights, wgs, stages in rows:
        cfg = cfgs[name]
        rule = choose_config(float(tpe), DEFAULT_N_OUT, DEFAULT_K)
        assert cfg == choose_config(float(tpe), DEFAULT_N_OUT, DEFAULT_K, swap_ab=cfg.swap_ab)
        assert path.startswith("swap-AB" if cfg.swap_ab else "normal")
        assert ("rule's choice" in path) == (rule.swap_ab == cfg.swap_ab)
        assert (int(tokens), int(weights), int(wgs), int(stages)) == (
            cfg.tokens_tile,
            cfg.weights_tile,
            cfg.consumer_warpgroups,
            cfg.stages,
        )

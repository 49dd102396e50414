"""Three things the production kernel adds after step 8, as timelines: the epilogue's store ring,
ping-pong consumers and a cluster's weight multicast (``figures.py`` draws them).

Each timeline starts from the configuration cute_moe's layer plan runs for a catalog layer at
T = 4096 tokens (:func:`cute_moe.plan.plan`: the path rule, then the ping-pong and cluster rules
of ``cute_moe/gemm_rules.py``), counts its store boxes with the kernel's own division of a tile
(:func:`cute_moe.lab.fig_pipeline.epilogue_boxes`) and reads from that config's PTX
(:func:`cute_moe.ptx.compile_ptx`) the instructions the drawing names: the store ring's wait
depth, the order barriers' ids, the multicast loads and the rank's shifts. The *order* of events
is the kernel's protocol (``cute_moe/gemm.py``'s ``_body``, ``cute_moe/gemm_parts.py``); the
*durations* are schematic: one unit is one K step of one tile on the tensor cores.
"""

from __future__ import annotations

import functools
import re

from cute_moe.config import GemmConfig
from cute_moe.gemm_parts import EPI_ORDER_BARRIER_ID, MMA_ORDER_BARRIER_ID
from cute_moe.lab.fig_pipeline import epilogue_boxes
from cute_moe.plan import plan
from cute_moe.ptx import compile_ptx
from moe_spec.problem import get_shape
from moe_spec.validate import MoEDims

TOKENS = 4096
LAYERS = {"store_ring": "qwen3-30b-a3b", "pingpong": "deepseek-v3:tp8", "multicast": "mixtral-8x7b"}
"""The catalog layer whose GEMM2 (down projection) each timeline draws: the plan runs that GEMM on the
cooperative schedule with one CTA per tile, on ping-pong, and on clusters of two, respectively."""

WRITE = 0.5  # one epilogue sub-tile: registers → bf16 → stmatrix into its staging buffer (schematic)
READ = 1.2  # one TMA store reading its staging buffer out (schematic)
LATENCY = 1.5  # a TMA load, issue to landing (schematic)
SKEW = (0.4, 2.5)  # rank 1 of a cluster starts its producer, resp. its consumers, this much later (schematic)


def layer_gemm2(layer: str) -> tuple[GemmConfig, int]:
    """(GEMM2's config, its K steps) in the plan of ``layer`` at :data:`TOKENS` tokens."""
    s = get_shape(layer)
    cfg = plan(MoEDims(T=TOKENS, E=s.num_experts, K=s.hidden, I=s.intermediate, top_k=s.top_k)).gemm2
    return cfg, -(-s.intermediate // cfg.tile_k)  # GEMM2's K is the layer's I


@functools.cache
def ptx_facts(cfg: GemmConfig) -> dict:
    """What the drawings name, read from ``cfg``'s PTX (compiled on the CPU)."""
    text = compile_ptx(cfg)
    rank = re.search(r"mov\.u32\s+(%r\d+), %cluster_ctarank;", text)
    return {
        "tma_stores": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", text)),
        "store_waits": sorted({int(n) for n in re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+);", text)}),
        "stmatrix": sorted(set(re.findall(r"(stmatrix\.[\w.:]+)", text))),
        "order_grants": sorted({int(n) for n in re.findall(r"bar\.arrive\s+(\d+), 256;", text)}),
        "multicast_loads": len(re.findall(r"cp\.async\.bulk\.tensor[\w.:]*\.multicast::cluster", text)),
        "remote_arrives": len(re.findall(r"mbarrier\.arrive\.shared::cluster", text)),
        "rank_shifts": sorted(int(n) for n in re.findall(rf"shl\.b32\s+%r\d+, {rank.group(1)}, (\d+);", text))
        if rank
        else [],
    }


def store_ring(layer: str = LAYERS["store_ring"]) -> dict:
    """One tile's epilogue: every sub-tile is written into staging buffer ``e mod epi_stages`` by
    ``stmatrix``, fenced for the async proxy and stored by one TMA store (one bulk group); then the
    store thread waits until at most ``epi_stages − 1`` groups still read shared memory, so the next
    sub-tile's buffer has been read out (``PipelineTmaStore``: commit_group, wait_group.read)."""
    cfg, _ = layer_gemm2(layer)
    boxes, depth = epilogue_boxes(cfg), cfg.epi_stages - 1
    t, read_end, events = 0.0, [], []
    for e in range(boxes):
        buf = e % cfg.epi_stages  # the kernel's (tiles_done · boxes + e) mod epi_stages, first tile
        issue = t + WRITE  # fence.proxy.async, named barrier; the store thread issues and commits
        read_end.append(issue + READ)
        waits_for = e - depth  # the bulk group this wait_group.read waits on (< 0: none)
        done = max(issue, read_end[waits_for]) if waits_for >= 0 else issue
        events += [
            dict(kind="stmatrix", e=e, buf=buf, start=t, end=issue),
            dict(kind="store", e=e, buf=buf, start=issue, end=issue + READ),
            dict(kind="wait", e=e, buf=buf, start=issue, end=done, waits_for=waits_for),
        ]
        t = done  # the second named barrier: nobody writes a buffer before the wait above
    return {
        "layer": layer,
        "cfg": cfg,
        "boxes": boxes,
        "depth": depth,
        "tail": max(read_end),
        "events": events,
        "ptx": ptx_facts(cfg),
    }


def pingpong(layer: str = LAYERS["pingpong"], tiles: int = 5) -> dict:
    """Two consumer warpgroups taking turns: warpgroup w owns the CTA's tiles w, w + 2, … . It waits on
    ``MMA_ORDER_BARRIER_ID + w`` before its main loop and on ``EPI_ORDER_BARRIER_ID + w`` before its
    epilogue; the other warpgroup arrives on them once it has issued its tile's last WGMMA, resp.
    finished its epilogue (warpgroup 1 grants warpgroup 0 both at the start)."""
    cfg, k_steps = layer_gemm2(layer)
    boxes = epilogue_boxes(cfg)
    main_end, epi_end, events = {}, {}, []
    for i in range(tiles):
        w = i % 2
        start = max(main_end.get(i - 1, 0.0), epi_end.get(i - 2, 0.0))  # granted, and its own epilogue done
        main_end[i] = start + k_steps
        epi_start = max(main_end[i], epi_end.get(i - 1, 0.0))  # wait_group 0; the other's epilogue done
        epi_end[i] = epi_start + boxes * WRITE
        events += [
            dict(
                kind="mainloop",
                tile=i,
                wg=w,
                start=start,
                end=main_end[i],
                waits=MMA_ORDER_BARRIER_ID + w,
                grants=MMA_ORDER_BARRIER_ID + 1 - w,
            ),
            dict(
                kind="epilogue",
                tile=i,
                wg=w,
                start=epi_start,
                end=epi_end[i],
                waits=EPI_ORDER_BARRIER_ID + w,
                grants=EPI_ORDER_BARRIER_ID + 1 - w,
            ),
        ]
    return {
        "layer": layer,
        "cfg": cfg,
        "k_steps": k_steps,
        "boxes": boxes,
        "end": max(epi_end.values()),
        "initial_grants": [MMA_ORDER_BARRIER_ID, EPI_ORDER_BARRIER_ID],
        "events": events,
        "ptx": ptx_facts(cfg),
    }


def multicast(layer: str = LAYERS["multicast"], steps: int | None = None) -> dict:
    """A cluster of two CTAs on two token blocks of one expert: per K step each producer loads its own
    token box and *half* the weight box, rows ``rank · weights_tile/2 …``, multicast into the same ring
    slot of both CTAs; a CTA's full barrier completes when its tokens and both halves have landed, and
    a slot is free again only when the consumers of *both* CTAs have released it (the empty barriers
    are cluster-wide)."""
    cfg, _ = layer_gemm2(layer)
    stages, ranks = cfg.stages, range(cfg.cluster)
    steps = steps or stages + 2
    half_rows = cfg.weights_tile // cfg.cluster
    issue, start, release = ({r: [] for r in ranks} for _ in range(3))
    events = []
    for g in range(steps):
        # the slot's previous use must be released by the consumers of every CTA (cluster-wide empty barrier)
        freed_by = max(ranks, key=lambda q: release[q][g - stages]) if g >= stages else None
        free = release[freed_by][g - stages] + 0.05 if g >= stages else 0.0
        for r in ranks:
            ready = issue[r][-1] + 0.15 if g else SKEW[0] * r
            issue[r].append(max(ready, free))
            events.append(
                dict(
                    kind="load",
                    rank=r,
                    k=g,
                    slot=g % stages,
                    at=issue[r][g],
                    lands=issue[r][g] + LATENCY,
                    rows=[r * half_rows, (r + 1) * half_rows],
                    to=list(ranks),
                    waited=free > ready,
                    freed_by=freed_by if free > ready else None,
                )
            )
        landed = max(issue[r][g] for r in ranks) + LATENCY  # the later half decides, in both CTAs
        for r in ranks:
            start[r].append(max(landed, start[r][-1] + 1 if g else SKEW[1] * r))
            events += [
                dict(kind="full", rank=r, k=g, slot=g % stages, at=landed),
                dict(kind="mma", rank=r, k=g, slot=g % stages, start=start[r][g], end=start[r][g] + 1),
            ]
            if g:  # wait_group 1 after issuing step g: step g − 1 retired, its slot released in every CTA
                release[r].append(start[r][g] + 0.85)
    for r in ranks:
        release[r].append(start[r][-1] + 1.3)
        events += [
            dict(kind="release", rank=r, k=g, slot=g % stages, at=t, to=list(ranks)) for g, t in enumerate(release[r])
        ]
    token_bytes = cfg.tokens_tile * cfg.tile_k * cfg.element_bytes
    half_bytes = half_rows * cfg.tile_k * cfg.element_bytes
    return {
        "layer": layer,
        "cfg": cfg,
        "steps": steps,
        "half_rows": half_rows,
        "token_bytes": token_bytes,
        "half_bytes": half_bytes,
        "end": max(max(v) for v in release.values()),
        "events": events,
        "ptx": ptx_facts(cfg),
    }

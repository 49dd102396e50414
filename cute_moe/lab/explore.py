"""The layout explorer: what one kernel configuration does with every byte and register, on a laptop.

    python -m cute_moe.lab.explore --tokens-per-expert 2            # the decode kernel the rule picks
    python -m cute_moe.lab.explore --tokens-per-expert 512          # the prefill kernel
    python -m cute_moe.lab.explore --normal --tokens-per-expert 2   # the same GEMM without swap-AB
    python -m cute_moe.lab.explore --tokens-per-expert 2 --ptx      # ... and the instructions it compiles to, counted
    python -m cute_moe.lab.explore --tokens-per-expert 2 --ptx-file k.ptx   # ... and its whole PTX, in k.ptx
    python -m cute_moe.lab.explore --tokens-per-expert 2 --json     # everything, as data
    python -m cute_moe.lab.explore --tokens-per-expert 2 --svg DIR  # the pictures of this kernel (SVG)
    python -m cute_moe.lab.explore --notes-figures notes/figures    # the pictures notes/wgmma_layouts.md embeds
    python -m cute_moe.lab.explore --layer qwen3-30b-a3b --tokens 1 # a layer call's plan; the one launch's tasks
    python -m cute_moe.lab.explore --layer qwen3-30b-a3b --tokens 1 --svg DIR   # ... and its modelled timeline

Nothing here computes a layout of its own: the configuration comes from
:func:`cute_moe.plan.choose_config` (the path rule) or from explicit tile flags checked by
:meth:`GemmConfig.validate`; every number printed is read from :func:`cute_moe.layouts.describe`,
which evaluates the very tiled MMA and shared-memory layouts the kernel is compiled from, and
``--ptx`` / ``--ptx-file`` from :func:`cute_moe.ptx.compile_ptx`; ``--svg`` draws the same objects
(:mod:`cute_moe.lab.figures`). The grid of accumulator owners is printed in MoE
terms (rows = tokens, columns = weight rows) for both paths, so the normal and the swap-AB kernel
can be compared cell by cell: the same (token, weight) output lands in another thread's register.

``--layer SHAPE --tokens T`` shows what a whole bf16 layer call runs: the plan's description
(:func:`cute_moe.plan.plan`, its rule :func:`cute_moe.plan.one_launch`) and, where that is the one-launch
decode kernel, the launch (:func:`cute_moe.decode_parts.launch_summary`: grid, tiles, tasks per phase,
ring, counters) and a modelled timeline of its tasks (:mod:`cute_moe.lab.fig_decode`).

A problem or tile the kernel would refuse is refused here by the kernel's own checks
(:func:`cute_moe.moe.check_gemm_shape`, :meth:`GemmConfig.validate`): one line on stderr, exit 2.
"""

from __future__ import annotations

import json
import math
import sys

from moe_spec.cli import ArgumentParser

from ..config import GemmConfig
from ..moe import check_gemm_shape
from ..plan import choose_config
from .fig_decode import H200_COPY_TBPS, H200_SMS
from .fig_memory import ACCESS, chunk_banks, conflict_ways, wgmma_mode
from .figures import DEFAULT_EXPERTS, DEFAULT_K, DEFAULT_N_OUT, config_figures, notes_figures, write_figures

GRID_EDGE = 16  # rows/columns of the accumulator-owner grid shown


def build_config(args) -> GemmConfig:
    """The configuration the flags name, checked as the kernel checks it (ValueError otherwise)."""
    tpe = args.tokens_per_expert
    if not math.isfinite(tpe) or tpe < 0:
        raise ValueError(f"--tokens-per-expert: expected a finite mean ≥ 0 (T·top_k/E), got {tpe:g}")
    if args.experts < 1:
        raise ValueError(f"--experts: expected at least 1 expert, got {args.experts}")
    check_gemm_shape(args.n_out, args.k)  # the grouped GEMM's host check of N_out and K
    swap = True if args.swap_ab else False if args.normal else None
    cfg = choose_config(args.tokens_per_expert, args.n_out, args.k, swap_ab=swap)
    overrides = {
        name: getattr(args, name)
        for name in ("tokens_tile", "weights_tile", "stages")
        if getattr(args, name) is not None
    }
    if args.warpgroups is not None:
        overrides["consumer_warpgroups"] = args.warpgroups
    return cfg.replace(**overrides).validate() if overrides else cfg


def owner_grid(desc: dict, rows: int = GRID_EDGE, cols: int = GRID_EDGE) -> list[list[str]]:
    """``grid[token][weight]`` = "thread.register" holding that output, from ``accumulators_moe``."""
    owner = {}
    for thread, coords in enumerate(desc["accumulators_moe"]):
        for reg, (token, weight) in enumerate(coords):
            owner[(token, weight)] = f"{thread}.{reg}"
    tokens, weights = desc["tile"]["moe"]["tokens"], desc["tile"]["moe"]["weights"]
    return [[owner[(t, w)] for w in range(min(cols, weights))] for t in range(min(rows, tokens))]


def _ptx_summary(ptx: str) -> list[str]:
    """Distinct opcodes of the instructions a teacher points at, with their counts."""
    wanted = (
        "wgmma.mma_async",
        "cp.async.bulk.tensor",
        "stmatrix",
        "setmaxnreg",
        "mbarrier.try_wait",
        "fence.proxy.async",
    )
    counts: dict[str, int] = {}
    for line in ptx.splitlines():
        op = line.strip().split(" ")[0].rstrip(";")
        if op.startswith(wanted):
            counts[op] = counts.get(op, 0) + 1
    return [f"{n:5d} × {op}" for op, n in sorted(counts.items())]


def swizzle_lines(cfg: GemmConfig, desc: dict) -> list[str]:
    """The 128-byte swizzle of each operand's first 8 rows: where each 16-byte chunk of a row lands."""
    out = []
    tables = {}
    for name in ("A", "B"):
        s = desc["smem"][name]
        smem = {"one_stage": s["layout_one_stage"], "swizzle": s["swizzle"]}
        tables[name] = chunk_banks(smem, cfg.element_bytes, rows=min(8, _rows(smem)))
    for name in ("A", "B"):
        if name == "B" and tables["B"] == tables["A"] and desc["smem"]["B"]["swizzle"] == desc["smem"]["A"]["swizzle"]:
            out.append(f"  B ({desc['tile']['B_is']}): the same")
            continue
        banks = tables[name]
        b, m, sh = desc["smem"][name]["swizzle"]
        chunks = len(banks["plain"][0])
        per = 16 // cfg.element_bytes
        out += [
            f"Shared memory of {name} ({desc['tile'][name + '_is']}): S<{b},{m},{sh}> on byte addresses "
            f"(bits {m}..{m + b - 1} ^= bits {m + sh}..{m + sh + b - 1}); a row = {chunks} chunks of 16 B "
            f"({per} elements of K each), a chunk index = the bank group (4 of 32 banks) it lands in",
            "  row r, logical chunk j → physical chunk:   j = " + " ".join(f"{j:2d}" for j in range(chunks)),
        ]
        out += [
            f"  {'row ' + str(r):>41}" + " " * 5 + " ".join(f"{c:2d}" for c in row)
            for r, row in enumerate(banks["swizzled"])
        ]
        sw, plain = conflict_ways(banks["swizzled"]), conflict_ways(banks["plain"])
        modes = [wgmma_mode(16 * chunks, bits) for bits in (b, 0)]
        out += [
            f"  an {ACCESS} access (one chunk of each of 8 rows): {_ways(max(sw))}; "
            f"unswizzled (row r, chunk j → chunk j): {_ways(max(plain))}",
            f"  WGMMA's descriptor: {modes[0] or 'no'} swizzle mode; unswizzled rows {16 * chunks} B apart: "
            + (f"the {modes[1]} mode" if modes[1] else "no mode (no-swizzle core-matrix rows are 16 B apart)"),
        ]
    return out


def _rows(smem: dict) -> int:
    shape = smem["one_stage"]["shape"][0]
    n = 1
    for v in shape if isinstance(shape, (list, tuple)) else [shape]:
        n *= v
    return n


def _ways(w: int) -> str:
    return "8 different bank groups, no conflict" if w == 1 else f"{w} rows in one bank group: a {w}-way conflict"


def render(cfg: GemmConfig, desc: dict, ptx: str | None = None) -> str:
    tile, mma, smem, tma = desc["tile"], desc["mma"], desc["smem"], desc["tma"]
    m, n, k = tile["gemm_mnk"]
    out = [
        f"cute_moe layout explorer — {tile['path']} path",
        f"  {cfg}",
        "",
        f"GEMM tile   M×N×K = {m}×{n}×{k}: A = {tile['A_is']}, B = {tile['B_is']}, "
        f"C is {tile['C_major']}-major in memory",
        f"MoE tile    {tile['moe']['tokens']} tokens × {tile['moe']['weights']} weight rows × "
        f"{tile['moe']['k']} of K per stage",
        f"WGMMA       {mma['instruction']}, {mma['warpgroups_along_m']} consumer warpgroup(s) along M; "
        f"{tile['threads']} threads (producer warpgroup first)",
        f"Pipeline    {tile['stages']} stages × {tma['stage_bytes']} B (A + B), {tile['epi_stages']} epilogue buffers; "
        f"shared memory {smem['total_bytes']} of {smem['budget_bytes']} B",
        f"TMA         tokens box {tma['load_tokens_box']}, weights box {tma['load_weights_box']} "
        f"from {tma['weights_tensor']}; "
        f"store box {tma['store_box']}",
        "",
        f"Who holds each output (thread.register of the consumer warpgroups), first {GRID_EDGE}×{GRID_EDGE}: "
        "rows = tokens, columns = weight rows",
    ]
    grid = owner_grid(desc)
    width = max(len(c) for row in grid for c in row) + 1
    out.append("       " + "".join(f"w{w}".rjust(width) for w in range(len(grid[0]))))
    for t, row in enumerate(grid):
        out.append(f"  t{t:<4}" + "".join(c.rjust(width) for c in row))
    out += ["", *swizzle_lines(cfg, desc)]
    if ptx is not None:
        out += [
            "",
            f"PTX (compiled on this machine for sm_90a, {len(ptx.splitlines())} lines): the instructions "
            "of interest, counted (the whole PTX: --ptx-file PATH)",
        ]
        out += ["  " + line for line in _ptx_summary(ptx)]
    return "\n".join(out)


def layer_text(
    label: str,
    T: int,
    sms: int = H200_SMS,
    seed: int = 0,
    svg_dir: str | None = None,
    copy_tbps: float = H200_COPY_TBPS,
) -> tuple[str, dict]:
    """The explorer's ``--layer`` view of a bf16 call of catalog shape ``label`` at ``T`` tokens: text and data.
    ValueError (naming the option) for an unknown shape or sizes the plan refuses."""
    from moe_spec.problem import get_shape
    from moe_spec.validate import MoEDims

    from ..decode_parts import launch_summary
    from ..plan import grouped_because, one_launch, plan

    try:
        shape = get_shape(label)
    except ValueError as exc:
        raise ValueError("--layer: " + str(exc).removeprefix("shape: ")) from None
    if T < 1:
        raise ValueError(f"--tokens: expected at least 1 token, got {T}")
    E, K, I, top_k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k  # noqa: E741
    dims = MoEDims(T=T, E=E, K=K, I=I, top_k=top_k)
    p = plan(dims)
    data = {"layer": shape.label, "T": T, "E": E, "K": K, "I": I, "top_k": top_k, "plan": p.describe(), "path": p.path}
    out = [
        f"cute_moe layout explorer — {shape.label} at T = {T} (bf16): E = {E}, K = {K}, I = {I}, top_k = {top_k}",
        f"  plan: {p.describe()}",
        f"  rule: cute_moe.plan.one_launch: {'taken' if one_launch(dims) else 'not taken: ' + grouped_because(dims)}",
    ]
    if p.path != "decode":
        out.append("  the grouped pipeline: --tokens-per-expert, --n-out and --k show each GEMM's layouts")
        return "\n".join(out), data
    from .fig_decode import layer_timeline, timeline_svg, timeline_title

    launch = launch_summary(T, top_k, E, K, I, sms)
    tiles, ring, most = launch["tiles"], launch["ring"], launch["tasks_at_most"]
    run = layer_timeline(shape.label, T, sms, seed, copy_tbps)
    data.update(launch=launch, model={k: v for k, v in run.items() if k != "tasks"})
    out += [
        "",
        f"One launch   {launch['grid']} CTAs × {launch['threads']} threads (consumer warpgroup + producer warp), "
        f"one per SM of {sms}",
        f"Tasks        A (GEMM1: leader, {tiles['h_tile']} columns of I"
        f"{', gate or up rows' if launch['a_halves'] == 2 else ''}) {most['A']}, "
        f"B (GEMM2: {tiles['y_tile']} columns of K, leader) {most['B']}, "
        f"C (combine: {tiles['y_tile']} columns, {tiles['token_block']} tokens) {most['C']} — at most, "
        f"{launch['max_leaders']} experts hit; NT1 = {tiles['nt1']}, NK = {tiles['nk']}, NTB = {tiles['ntb']}",
        f"Order        B (kt, r) waits for done1[r] = {tiles['nt1']}"
        f"{' × chunks of r' if launch['a_halves'] == 2 else ''}"
        ", C (kt, ·) for done2[kt] = the experts hit: "
        "only on smaller task numbers",
        f"Ring         {ring['stages']} stages × {ring['stage_bytes']} B ({ring['tma_bytes']} B of weight boxes "
        f"by TMA, {tiles['tokens']} token rows by cp.async); shared memory ≈ {launch['smem_bytes']} B",
        f"WGMMA        {launch['wgmma']} (swap-AB: {tiles['h_tile']} weight rows × {tiles['tokens']} pairs)",
        f"Counters     {launch['counter_words']} int32 words; workspace h, y of {launch['workspace_rows']} rows",
        "",
        f"Modelled timeline (routing drawn with seed {seed}: {run['leaders']} experts hit; "
        f"{run['phases']['A']} + {run['phases']['B']} + {run['phases']['C']} tasks): {run['model_us']:.1f} µs "
        f"against the {run['floor_us']:.1f} µs floor at {copy_tbps:g} TB/s — a model, not a measurement "
        "(cute_moe.lab.fig_decode)",
    ]
    if svg_dir is not None:
        from .figures import write_figures

        paths = write_figures({"decode_timeline.svg": timeline_svg(run, timeline_title(shape.label, T))}, svg_dir)
        out += ["", "Pictures:", *("  " + path for path in paths)]
    return "\n".join(out), data


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m cute_moe.lab.explore", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tokens-per-expert",
        type=float,
        help="mean routed tokens per expert (T·top_k/E); the path rule picks the kernel [2]",
    )
    ap.add_argument(
        "--n-out",
        type=int,
        help=f"output features of the GEMM [{DEFAULT_N_OUT}: Mixtral-8x7B GEMM1, 2·I]",
    )
    ap.add_argument("--k", type=int, help=f"reduction size K [{DEFAULT_K}]")
    ap.add_argument(
        "--experts",
        type=int,
        help=f"number of experts, for the TMA picture [{DEFAULT_EXPERTS}]",
    )
    path = ap.add_mutually_exclusive_group()
    path.add_argument("--swap-ab", action="store_true", help="force the swap-AB path")
    path.add_argument("--normal", action="store_true", help="force the normal path")
    ap.add_argument("--tokens-tile", type=int, help="override the tokens per CTA tile")
    ap.add_argument("--weights-tile", type=int, help="override the weight rows per CTA tile")
    ap.add_argument("--stages", type=int, help="override the pipeline depth")
    ap.add_argument("--warpgroups", type=int, choices=(1, 2), help="override the consumer warpgroups")
    ap.add_argument(
        "--ptx",
        action="store_true",
        help="compile to PTX (a few seconds on a CPU, most of it importing the CuTe DSL; "
        "notes/cute_moe.md §5) and count the instructions of interest",
    )
    ap.add_argument(
        "--ptx-file",
        metavar="PATH",
        help="compile to PTX and write the whole PTX into PATH ('-': print it alone on stdout)",
    )
    ap.add_argument("--layer", metavar="SHAPE", help="a catalog shape: show the plan of its bf16 call at --tokens")
    ap.add_argument("--tokens", type=int, help="tokens of the --layer call [1]")
    ap.add_argument("--sms", type=int, help=f"SMs of the GPU, for --layer's grid [{H200_SMS}]")
    ap.add_argument("--seed", type=int, help="seed of the routing --layer's timeline draws [0]")
    ap.add_argument(
        "--copy-tbps",
        type=float,
        help=f"copy rate (TB/s) --layer's timeline model shares among the CTAs [{H200_COPY_TBPS}: the H200's]",
    )
    ap.add_argument("--json", action="store_true", help="print layouts.describe_json(config) instead")
    ap.add_argument("--svg", metavar="DIR", help="also write this kernel's pictures (SVG) into DIR")
    ap.add_argument(
        "--notes-figures",
        metavar="DIR",
        help="write the pictures notes/wgmma_layouts.md and notes/decode.md embed into DIR (and nothing else)",
    )
    args = ap.parse_args(argv)
    layer_only = [f for f in ("tokens", "sms", "seed", "copy_tbps") if getattr(args, f) is not None]
    gemm_only = [f for f in ("tokens_per_expert", "n_out", "k", "experts", "tokens_tile", "weights_tile", "stages")]
    gemm_only = [f for f in gemm_only + ["warpgroups"] if getattr(args, f) is not None]
    gemm_only += [f for f in ("swap_ab", "normal", "ptx", "ptx_file") if getattr(args, f)]
    refused = None
    if args.layer is None and layer_only:
        refused = f"--{layer_only[0].replace('_', '-')}: an option of --layer SHAPE, which was not given"
    elif args.layer is not None and gemm_only:
        refused = f"--{gemm_only[0].replace('_', '-')}: a GEMM option, not one of --layer (which shows the plan's own)"
    elif args.json and args.svg:
        refused = "--svg: not with --json (which prints the data alone)"
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    for name, default in (("tokens_per_expert", 2.0), ("n_out", DEFAULT_N_OUT), ("k", DEFAULT_K)):
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    args.experts = DEFAULT_EXPERTS if args.experts is None else args.experts
    if args.notes_figures:
        for path in write_figures(notes_figures(), args.notes_figures):
            print(path)
        return 0
    if args.layer is not None:
        tokens, sms = 1 if args.tokens is None else args.tokens, H200_SMS if args.sms is None else args.sms
        seed, rate = args.seed or 0, H200_COPY_TBPS if args.copy_tbps is None else args.copy_tbps
        if sms < 1:
            print(f"error: --sms: expected at least 1 SM, got {sms}", file=sys.stderr)
            return 2
        if not math.isfinite(rate) or rate <= 0:
            print(f"error: --copy-tbps: expected a positive rate in TB/s, got {rate:g}", file=sys.stderr)
            return 2
        try:
            text, data = layer_text(args.layer, tokens, sms, seed, args.svg, rate)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(data) if args.json else text)
        return 0
    try:
        cfg = build_config(args)
    except (TypeError, ValueError) as exc:  # what the kernel would refuse: its own check names the limit
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from ..layouts import describe, describe_json

    if args.json:
        print(json.dumps({"config": cfg.as_dict(), **describe_json(cfg)}))
        return 0
    ptx = None
    if args.ptx or args.ptx_file:
        from ..ptx import compile_ptx

        ptx = compile_ptx(cfg)
    if args.ptx_file == "-":
        print(ptx, end="")
        return 0
    print(render(cfg, describe(cfg), ptx if args.ptx else None))
    if args.ptx_file:
        with open(args.ptx_file, "w") as f:
            f.write(ptx)
        print(f"\nthe whole PTX ({len(ptx.splitlines())} lines) written to {args.ptx_file}")
    if args.svg:
        figs = config_figures(cfg, args.tokens_per_expert, args.n_out, args.k, args.experts)
        print("", "Pictures:", *("  " + p for p in write_figures(figs, args.svg)), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The layout explorer: what one kernel configuration does with every byte and register, on a laptop.

    python -m cute_moe.explore --tokens-per-expert 2            # the decode kernel the rule picks
    python -m cute_moe.explore --tokens-per-expert 512          # the prefill kernel
    python -m cute_moe.explore --normal --tokens-per-expert 2   # the same GEMM without swap-AB
    python -m cute_moe.explore --tokens-per-expert 2 --ptx      # ... and the instructions it compiles to
    python -m cute_moe.explore --tokens-per-expert 2 --json     # everything, as data

Nothing here computes a layout of its own: the configuration comes from
:func:`cute_moe.config.choose_config` (the path rule) or from explicit tile flags checked by
:meth:`GemmConfig.validate`; every number printed is read from :func:`cute_moe.layouts.describe`,
which evaluates the very tiled MMA and shared-memory layouts the kernel is compiled from, and
``--ptx`` from :func:`cute_moe.ptx.compile_ptx`. The grid of accumulator owners is printed in MoE
terms (rows = tokens, columns = weight rows) for both paths, so the normal and the swap-AB kernel
can be compared cell by cell: the same (token, weight) output lands in another thread's register.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from .config import GemmConfig, choose_config

GRID_EDGE = 16  # rows/columns of the accumulator-owner grid shown


def build_config(args) -> GemmConfig:
    swap = True if args.swap_ab else False if args.normal else None
    cfg = choose_config(args.tokens_per_expert, args.n_out, args.k, swap_ab=swap)
    overrides = {name: getattr(args, name) for name in ("tokens_tile", "weights_tile", "stages")
                 if getattr(args, name) is not None}
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
    wanted = ("wgmma.mma_async", "cp.async.bulk.tensor", "stmatrix", "setmaxnreg", "mbarrier.try_wait",
              "fence.proxy.async")
    counts: dict[str, int] = {}
    for line in ptx.splitlines():
        op = line.strip().split(" ")[0].rstrip(";")
        if op.startswith(wanted):
            counts[op] = counts.get(op, 0) + 1
    return [f"{n:5d} × {op}" for op, n in sorted(counts.items())]


def render(cfg: GemmConfig, desc: dict, ptx: str | None = None) -> str:
    tile, mma, smem, tma = desc["tile"], desc["mma"], desc["smem"], desc["tma"]
    m, n, k = tile["gemm_mnk"]
    out = [
        f"cute_moe layout explorer — {tile['path']} path",
        f"  {cfg}",
        "",
        f"GEMM tile   M×N×K = {m}×{n}×{k}: A = {tile['A_is']}, B = {tile['B_is']}, C is {tile['C_major']}-major in memory",
        f"MoE tile    {tile['moe']['tokens']} tokens × {tile['moe']['weights']} weight rows × {tile['moe']['k']} of K per stage",
        f"WGMMA       {mma['instruction']}, {mma['warpgroups_along_m']} consumer warpgroup(s) along M; "
        f"{tile['threads']} threads (producer warpgroup first)",
        f"Pipeline    {tile['stages']} stages × {tma['stage_bytes']} B (A + B), {tile['epi_stages']} epilogue buffers; "
        f"shared memory {smem['total_bytes']} of {smem['budget_bytes']} B",
        f"TMA         tokens box {tma['load_tokens_box']}, weights box {tma['load_weights_box']} from {tma['weights_tensor']}; "
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
    out += ["", "Swizzle (byte addresses, as the hardware applies it): the 8 rows of the first atom of each operand"]
    for name in ("A", "B"):
        s = smem[name]
        rows = ", ".join(f"r{r['row']}→chunk {r['chunk16']}" for r in s["atom_rows"])
        out.append(f"  {name} S<{','.join(map(str, s['swizzle']))}>: {rows}")
    if ptx is not None:
        out += ["", "PTX (compiled on this machine for sm_90a): instructions of interest"]
        out += ["  " + line for line in _ptx_summary(ptx)]
        wgmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", ptx)))
        out += [f"  {w}" for w in wgmma]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cute_moe.explore", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-expert", type=float, default=2.0,
                    help="mean routed tokens per expert (T·top_k/E); the path rule picks the kernel [2]")
    ap.add_argument("--n-out", type=int, default=28672, help="output features of the GEMM [28672: Mixtral GEMM1]")
    ap.add_argument("--k", type=int, default=4096, help="reduction size K [4096]")
    path = ap.add_mutually_exclusive_group()
    path.add_argument("--swap-ab", action="store_true", help="force the swap-AB path")
    path.add_argument("--normal", action="store_true", help="force the normal path")
    ap.add_argument("--tokens-tile", type=int, help="override the tokens per CTA tile")
    ap.add_argument("--weights-tile", type=int, help="override the weight rows per CTA tile")
    ap.add_argument("--stages", type=int, help="override the pipeline depth")
    ap.add_argument("--warpgroups", type=int, choices=(1, 2), help="override the consumer warpgroups")
    ap.add_argument("--ptx", action="store_true",
                    help="compile to PTX and list the instructions (under a second on a CPU: notes/cute_moe.md §5)")
    ap.add_argument("--json", action="store_true", help="print layouts.describe_json(config) instead")
    args = ap.parse_args(argv)
    try:
        cfg = build_config(args)
    except ValueError as exc:  # an unsupported tile: the config names the limit
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .layouts import describe, describe_json

    if args.json:
        print(json.dumps({"config": cfg.as_dict(), **describe_json(cfg)}))
        return 0
    ptx = None
    if args.ptx:
        from .ptx import compile_ptx

        ptx = compile_ptx(cfg)
    print(render(cfg, describe(cfg), ptx))
    return 0


if __name__ == "__main__":
    sys.exit(main())

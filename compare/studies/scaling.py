"""``python -m compare.studies.scaling``: the MoE layer on two GPUs, tensor- and expert-parallel, against one.

For each catalog shape of the compare suite (``compare.cases.DEFAULT_SHAPES``), format and token
count T, the same layer on the same T tokens, three ways:

=========  ==================================================================================
1 GPU      the backend's ``fused_moe`` on the whole layer (rank 0; the other rank idles)
TP = 2     :class:`compare.distributed.TPMoE`: each GPU holds I/2 of every expert and all T
           tokens; one ``all_reduce`` of the [T, K] output
EP = 2     :class:`compare.distributed.EPMoE`: each GPU holds E/2 experts and T/2 tokens;
           ``all_to_all`` dispatch of the routed pairs and combine
=========  ==================================================================================

Timing is eager — EP sizes its buffers from the routing on the host, so its step cannot be
captured in a CUDA graph, and the one-GPU call is timed the same way for a fair ratio: per
iteration a barrier, the call, a device synchronize; an iteration counts the slowest rank; the
median over ``--iters`` after ``--warmup`` calls. Launch gaps and host syncs (the contract's argument
checks among them) are included, so these
numbers are not comparable with the CUDA-graph times of ``python -m compare``. Every row also
checks TP's and EP's output against the one-GPU output (relative L2) and counts the pairs EP sent
to the other GPU. Writes ``scaling.json`` and ``scaling.md`` after every row (``--deadline-s`` cuts
the tail, never the whole run).

    python -m compare.studies.scaling --out notes/results                  # 2 GPUs: the measurement
    python -m compare.studies.scaling --out /tmp/s --tokens 4 --iters 1    # no GPUs: gloo + interpreter, reduced shapes
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from compare.backends import load_backend
from compare.cases import DEFAULT_SHAPES, reduce_shape
from compare.distributed import EPMoE, TPMoE, plan_dispatch, shard_ep, shard_tp, token_range
from compare.launch import default_backend, rank_device, run_ranks
from moe_spec.cli import ArgumentParser
from moe_spec.oracle import rel_l2
from moe_spec.problem import MoEInputs, MoEShape, draw_weights, get_shape, route
from moe_spec.quant import quantize_weight
from moe_spec.runinfo import git_commit as _git_commit

WORLD = 2
TOKENS = (1, 8, 128, 1024, 4096)
QUANTS = ("bf16", "fp8_tensor")


@dataclass(frozen=True)
class ScalingSpec:
    shapes: tuple
    tokens: tuple = TOKENS
    quants: tuple = QUANTS
    backend: str = "triton_moe"
    iters: int = 20
    warmup: int = 3
    seed: int = 0
    deadline_s: float = 420.0
    out: str = "notes/results"
    command: str = ""
    meta: tuple = ()  # (key, value) pairs recorded in the report


def _weights(shape, quant, seed, device) -> tuple:
    """(w1, w2, w1_scale, w2_scale) of the whole layer, drawn on ``device`` (same seed on every rank)."""
    w1, w2 = draw_weights(shape, seed, device)
    if quant is None:
        return w1, w2, None, None
    (w1, s1), (w2, s2) = quantize_weight(w1, quant), quantize_weight(w2, quant)
    return w1, w2, s1, s2


def _inputs(shape, T, quant, weights, seed, device) -> MoEInputs:
    g = torch.Generator().manual_seed(seed + T)
    x = torch.randn(T, shape.hidden, generator=g).to(torch.bfloat16)
    tw, ti = route(torch.randn(T, shape.num_experts, generator=g), shape.top_k)
    w1, w2, s1, s2 = weights
    return MoEInputs(x.to(device), w1, w2, tw.to(device), ti.to(device), quant, s1, s2)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_us(call, spec: ScalingSpec, device) -> float:
    """Median over iterations of the slowest rank's time for ``call`` (µs), eager."""
    for _ in range(spec.warmup):
        call()
    samples = []
    for _ in range(spec.iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e6)
    slowest = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def _gather_rows(out, T, rank, world, device):
    """Rank 0 gets the [T, K] concatenation of every rank's token rows (padded all_gather)."""
    rows = -(-T // world)
    padded = torch.zeros((rows, out.shape[1]), dtype=out.dtype, device=device)
    padded[: out.shape[0]] = out
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    bounds = [token_range(T, r, world) for r in range(world)]
    return torch.cat([p[: stop - start] for p, (start, stop) in zip(parts, bounds)])


def _case(spec, shape, quant, T, weights, rank, world, device) -> dict:
    fused_moe = load_backend(spec.backend).fused_moe
    inp = _inputs(shape, T, quant, weights, spec.seed, device)
    row = {"shape": shape.label, "quant": quant or "bf16", "T": T}
    try:  # on every rank, so that a backend's refusal (host-side, the same everywhere) skips the row everywhere
        single = fused_moe(**inp.kwargs())
    except (NotImplementedError, ValueError) as exc:
        row["refused"] = f"{type(exc).__name__}: {exc}"
        return row
    row["one_gpu_us"] = _time_us((lambda: fused_moe(**inp.kwargs())) if rank == 0 else (lambda: None), spec, device)
    for name, shard, layer in (("tp", shard_tp, TPMoE), ("ep", shard_ep, EPMoE)):
        try:
            part = shard(inp, rank, world)
        except ValueError as exc:  # e.g. fp8_block with I/2 not a multiple of 128: said, not run
            row[f"{name}_refused"] = str(exc)
            continue
        run = layer(spec.backend, check_peers=False)
        call = lambda: run(**part.kwargs())  # noqa: E731
        out = call()
        row[f"{name}_us"] = _time_us(call, spec, device)
        full = out if name == "tp" else _gather_rows(out, T, rank, world, device)
        if rank == 0:
            row[f"{name}_rel_l2_vs_one_gpu"] = rel_l2(full, single)
            row[f"{name}_speedup"] = row["one_gpu_us"] / row[f"{name}_us"]
        if name == "ep":
            counts = plan_dispatch(part.topk_ids, part.w1.shape[0], world).send_counts
            remote = torch.tensor([int(counts.sum() - counts[rank])], device=device)
            dist.all_reduce(remote)
            row["ep_pairs_sent_remote"] = int(remote)
    return row


def _rank_main(rank: int, world: int, spec: ScalingSpec) -> list:
    device = rank_device(dist.get_backend(), rank)
    start, rows = time.monotonic(), []
    for name in spec.shapes:
        shape = spec_shape(name, device)
        for quant in (None if q == "bf16" else q for q in spec.quants):
            weights = _weights(shape, quant, spec.seed, device)
            for T in spec.tokens:
                go = torch.tensor([int(time.monotonic() - start < spec.deadline_s)], device=device)
                dist.broadcast(go, 0)  # rank 0's clock decides, so the ranks skip together
                if not int(go):
                    continue
                rows.append(_case(spec, shape, quant, T, weights, rank, world, device))
                if rank == 0:
                    write(spec, rows)
            del weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def spec_shape(name, device) -> MoEShape:
    """The catalog shape; on the CPU its reduced stand-in (the interpreter runs the kernels). A
    :class:`~moe_spec.problem.MoEShape` is taken as it is (the tests' tiny layer)."""
    if isinstance(name, MoEShape):
        return name
    shape = get_shape(name)
    if device.type != "cuda":
        shape = replace(reduce_shape(shape), name=f"{shape.name} (reduced)", tp=1)
    return shape


def markdown(spec: ScalingSpec, rows: list) -> str:
    m = dict(spec.meta)
    lines = [
        "# The MoE layer on two GPUs: tensor parallel and expert parallel against one",
        "",
        f"date {m.get('date')}, device {m.get('device')}, commit `{m.get('commit')}`, command `{spec.command}`",
        "",
        f"Mode: {m.get('mode')}. Backend {spec.backend}; eager timing, median of {spec.iters} iterations after "
        f"{spec.warmup} warm-up calls, slowest rank per iteration (launch gaps and host syncs included).",
        "",
        "| shape | quant | T | 1 GPU µs | TP=2 µs | TP speedup | EP=2 µs | EP speedup | EP pairs sent across | "
        "TP rel L2 vs 1 GPU | EP rel L2 vs 1 GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda r, k, fmt: format(r[k], fmt) if k in r else ("refused" if k.split("_")[0] + "_refused" in r else "–")  # noqa: E731
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['shape']} | {r['quant']} | {r['T']} | refused by {spec.backend} |" + " |" * 7)
            continue
        lines.append(
            f"| {r['shape']} | {r['quant']} | {r['T']} | {r['one_gpu_us']:.1f} | {f(r, 'tp_us', '.1f')} "
            f"| {f(r, 'tp_speedup', '.2f')} | {f(r, 'ep_us', '.1f')} | {f(r, 'ep_speedup', '.2f')} "
            f"| {r.get('ep_pairs_sent_remote', '–')} | {f(r, 'tp_rel_l2_vs_one_gpu', '.1e')} "
            f"| {f(r, 'ep_rel_l2_vs_one_gpu', '.1e')} |"
        )
    refusals = sorted({r[k] for r in rows for k in ("refused", "tp_refused", "ep_refused") if k in r})
    lines += [""] + [f"- refused: {msg}" for msg in refusals]
    return "\n".join(lines) + "\n"


def write(spec: ScalingSpec, rows: list) -> None:
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(
        json.dumps({"meta": dict(spec.meta), "spec": asdict(spec), "rows": rows}, indent=1) + "\n"
    )
    (out / "scaling.md").write_text(markdown(spec, rows))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = ArgumentParser(prog="python -m compare.studies.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for scaling.json / scaling.md (e.g. notes/results)")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="catalog shapes [%(default)s]")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts T [%(default)s]")
    p.add_argument("--quant", default=",".join(QUANTS), help="bf16 and/or fp8 formats [%(default)s]")
    p.add_argument("--backend", default="triton_moe", help="triton_moe or cute_moe (bf16) [%(default)s]")
    p.add_argument("--iters", type=int, help="timed calls per row [GPU 20, CPU 2]")
    p.add_argument("--warmup", type=int, help="untimed calls first [GPU 3, CPU 1]")
    p.add_argument("--deadline-s", type=float, default=420.0, help="start no new row after this [%(default)s]")
    a = p.parse_args(argv)
    on_gpu = default_backend(WORLD) == "nccl"
    spec = ScalingSpec(
        shapes=tuple(s for s in a.shapes.split(",") if s),
        tokens=tuple(int(t) for t in a.tokens.split(",") if t),
        quants=tuple(q for q in a.quant.split(",") if q),
        backend=a.backend,
        iters=a.iters or (20 if on_gpu else 2),
        warmup=a.warmup if a.warmup is not None else (3 if on_gpu else 1),
        deadline_s=a.deadline_s,
        out=a.out,
        command="python -m compare.studies.scaling " + " ".join(argv),
    )
    for s in spec.shapes:
        get_shape(s)  # an unknown shape is named now, not in a rank
    run_scaling(spec)
    print((Path(spec.out) / "scaling.md").read_text(), end="")
    return 0


def run_scaling(spec: ScalingSpec) -> list:
    """Every row of ``spec`` on two ranks; the files in ``spec.out`` are rewritten after each row."""
    spec = replace(spec, meta=tuple(_meta().items()))
    rows = run_ranks(_rank_main, WORLD, (spec,), timeout_s=spec.deadline_s + 300)[0]
    write(spec, rows)
    return rows


def _meta() -> dict:
    on_gpu = default_backend(WORLD) == "nccl"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{WORLD} × {torch.cuda.get_device_name()}"
        if on_gpu
        else f"CPU ({platform.processor() or platform.machine()}), {WORLD} processes",
        "commit": _git_commit(),
        "torch": torch.__version__,
        "mode": "gpu (NCCL)"
        if on_gpu
        else "cpu: gloo + Triton interpreter on reduced shapes; checks the script, times say nothing about GPUs",
    }


if __name__ == "__main__":
    sys.exit(main())

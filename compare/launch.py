"""Start ``world`` ranks of a function on this machine, with a process group, a deadline and errors.

:func:`run_ranks` spawns one process per rank (``torch.multiprocessing``, start method "spawn"),
joins them into a process group — NCCL with one GPU per rank when there are enough GPUs, else gloo
on the CPU (where Triton runs through its interpreter) — calls ``fn(rank, world, *args)`` in each
and returns the ranks' return values, in rank order. The rendezvous is a file in a private
temporary directory: no port to pick, nothing shared with another run.

Failures are never silent and never hang:

* a rank that raises ends the run: the others are terminated and :class:`RankError` carries the
  failing rank's traceback (what the child printed is in the message, not lost in a log);
* a run that is not done ``timeout_s`` after the spawn (start-up included) is killed and raises
  :class:`RankError` naming the ranks still running; the process group's timeout is the same, so
  a rank blocked in a collective whose peer died gives up as well;
* a SIGTERM to the calling process kills the ranks too (no orphans left in a collective).
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank failed, or the ranks did not finish in time."""


def default_backend(world: int) -> str:
    """ "nccl" when this machine has ``world`` CUDA GPUs, else "gloo"."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def rank_device(backend: str, rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _entry(rank, fn, world, backend, rendezvous, timeout_s, out_dir, args):
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # ranks share the cores: one thread each keeps them from thrashing
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        backend,
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world, *args)
        dist.barrier()  # no rank tears the group down while a peer still needs it
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def run_ranks(
    fn: Callable, world: int, args: tuple = (), *, backend: str | None = None, timeout_s: float = 300.0
) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; its return values (picklable: move tensors to
    the CPU) in rank order. ``fn`` must be importable by name (a module-level function)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected a positive int, got {world!r}")
    backend = backend or default_backend(world)
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not (torch.cuda.is_available() and torch.cuda.device_count() >= world):
        raise ValueError(
            f"backend: nccl needs {world} CUDA GPUs, found "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        )
    previous = os.environ.get("TRITON_INTERPRET")
    if backend == "gloo" and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton at import: must be set before the spawn
    try:
        with tempfile.TemporaryDirectory(prefix="moe_ranks_") as d:
            ctx = mp.start_processes(
                _entry,
                args=(fn, world, backend, os.path.join(d, "rendezvous"), timeout_s, d, args),
                nprocs=world,
                join=False,
                start_method="spawn",
            )
            _join(ctx, timeout_s)
            results = []
            for r in range(world):
                with open(os.path.join(d, f"rank{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _terminated(signum, frame):
    raise RankError(f"terminated by signal {signum}: ranks killed")


def _join(ctx, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None  # so the finally runs
    try:
        while not ctx.join(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise RankError(
                    f"ranks {alive} still running after {limit_s:.0f} s: killed "
                    "(a hang in a collective, or a timeout too short for this machine)"
                )
    except mp.ProcessRaisedException as exc:  # the child's traceback is the message
        raise RankError(f"rank {exc.error_index} failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise RankError(f"rank {exc.error_index} exited with code {exc.exit_code} ({exc})") from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()

"""The scheduler of the CPU models of the one-launch decode kernel's protocol (tests/test_cute_decode.py for bf16,
tests/test_cute_decode_fp8.py for FP8): every CTA as two generators, its producer warp and its consumer
warpgroup, each yielding the condition it waits on; a random scheduler steps one whose condition holds, with at
most ``resident`` CTAs started at a time (a CTA not started holds no ticket)."""

import random
from collections import deque


class Cta:
    """One CTA's shared state: its task queue, ring slots taken by the producer, stages issued and consumed."""

    def __init__(self):
        self.queue, self.taken, self.issued, self.consumed = deque(), 0, 0, 0


def schedule(producer, consumer, grid: int, resident: int, seed: int, finished: list, end: int) -> None:
    """Run ``grid`` CTAs (``producer(cta)`` and ``consumer(cta)`` generators) to the end; raise RuntimeError on a
    deadlock (no generator's condition holds), naming how many of ``end`` tasks are in ``finished``."""
    rng = random.Random(seed)
    waiting = list(range(grid))
    running = []  # [generator, condition, cta]
    while waiting or running:
        while waiting and len({a[2] for a in running}) < resident:
            c, cta = Cta(), waiting.pop(0)
            running += [[gen, next(gen), cta] for gen in (producer(c), consumer(c))]
        ready = [a for a in running if a[1]()]
        if not ready:
            raise RuntimeError(f"deadlock: {len(finished)} of {end} tasks finished")
        a = rng.choice(ready)
        try:
            a[1] = next(a[0])
        except StopIteration:
            running.remove(a)

"""Timing shared by both backends: CUDA-graph replay with a cold L2, ceilings, rooflines, wall clock.

How a call is timed (:func:`time_cuda_graph`)
    The caller builds ``n_sets`` independent input sets (own weights, own activations) and gives
    ``make_call(i)``, a zero-argument function running the code under test on set ``i``. After a
    warm-up (which also triggers any JIT compilation), one CUDA graph is captured that runs
    set 0, 1, …, n_sets−1, ``rounds`` times over. Because consecutive calls read different
    weights and the sets together are several times the 60 MB L2, every call starts with its
    weights out of cache — the decode situation, where each layer's experts are read once per step.
    The graph is replayed ``replays`` times, each replay timed with CUDA events; a sample is the
    replay time divided by the calls in it. Launch overhead disappears (one graph launch per
    replay), the gaps between kernels inside a call stay in (they are part of the call's cost).
    :func:`sets_for_cold_l2` says how many sets that needs.

Ceilings (:func:`measure_ceilings`)
    Measured in the same process, on the same card, at the start of a run: device-to-device copy
    bandwidth (bytes read + written), a bf16 8192³ matmul and an fp8 e4m3 ``torch._scaled_mm``.

Roofline (:func:`roofline`)
    The floor of a call is max(bytes / bandwidth, flops / matmul rate); ``pct_of_floor`` =
    floor / measured · 100 says how close a kernel is to the best the card can do.

Wall clock (:func:`wall_us`, :func:`host_us`)
    ``time.perf_counter`` around ``calls`` back-to-back calls, ``repeats`` times; the median µs per
    call. With a ``sync`` (``torch.cuda.synchronize``) ending each repeat it is an eager call's
    cost, host and GPU together (``compare.timed.eager_sets_us``); without one, and with launches that do not
    reach a GPU, it is the host's time alone (:func:`host_us`, ``triton_moe.lab.hostcost``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

L2_BYTES = 60 * 1024**2  # H100/H200: 50 MB usable on H100 PCIe, 60 MB (reported) on H200


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    samples: int
    calls_per_sample: int

    def as_dict(self) -> dict:
        return asdict(self)


def sets_for_cold_l2(bytes_per_set: int, l2_bytes: int = L2_BYTES, factor: float = 3.0, max_sets: int = 64) -> int:
    """How many distinct input sets make a rotation whose footprint is ``factor`` × the L2."""
    if bytes_per_set <= 0:
        return max_sets
    return max(2, min(max_sets, math.ceil(factor * l2_bytes / bytes_per_set)))


def _percentile(xs: list, q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _require_cuda():
    if not torch.cuda.is_available():
        raise RuntimeError("timing: a CUDA device is required")


def time_cuda_graph(
    make_call: Callable[[int], Callable[[], object]],
    n_sets: int,
    *,
    rounds: int = 0,
    replays: int = 30,
    warmup: int = 2,
    min_calls: int = 20,
    use_graph: bool = True,
) -> Timing:
    """Median / spread of one call's time, CUDA-graph replayed over rotated input sets (cold L2).

    ``rounds`` (default: enough for ``min_calls`` calls per replay) repeats the rotation inside the
    graph. ``use_graph=False`` times eager launches the same way (for code that cannot be captured).
    """
    _require_cuda()
    calls = [make_call(i) for i in range(n_sets)]
    rounds = rounds or max(1, math.ceil(min_calls / n_sets))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def body():
        for _ in range(rounds):
            for c in calls:
                c()

    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        run = graph.replay
    else:
        run = body
    run()  # one untimed replay: graph upload
    torch.cuda.synchronize()
    per_call = rounds * n_sets
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / per_call)
    calls = None  # the sets freed (body() is not called again)
    return Timing(
        median_us=statistics.median(samples),
        p10_us=_percentile(samples, 0.1),
        p90_us=_percentile(samples, 0.9),
        min_us=min(samples),
        samples=len(samples),
        calls_per_sample=per_call,
    )


@dataclass
class Ceilings:
    """What this card did in this run: the denominators of every roofline row."""

    device: str
    copy_tbps: float  # bytes read + written per second, device-to-device copy
    bf16_tflops: float  # dense bf16 matmul 8192³
    fp8_tflops: float | None  # torch._scaled_mm e4m3 8192³ (None where unavailable)

    def as_dict(self) -> dict:
        return asdict(self)


def _time_eager(fn, iters: int) -> float:
    """Mean ms of ``fn`` over ``iters`` launches after a warm-up (large ops: overhead negligible)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def measure_ceilings(n: int = 8192, copy_bytes: int = 2 * 1024**3) -> Ceilings:
    """Copy bandwidth and bf16 / fp8 matmul rates of the current GPU, measured now (random data)."""
    _require_cuda()
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = _time_eager(lambda: dst.copy_(src), 10)
    copy_tbps = 2 * copy_bytes / (ms * 1e-3) / 1e12
    src = dst = None  # free the copy buffers before the matmuls
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_eager(lambda: a @ b, 10)
    bf16 = 2 * n**3 / (ms * 1e-3) / 1e12
    fp8 = None
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major B, as cuBLASLt wants
        one = torch.ones((), device="cuda")
        ms = _time_eager(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10)
        fp8 = 2 * n**3 / (ms * 1e-3) / 1e12
    except (RuntimeError, AttributeError, TypeError):
        pass
    return Ceilings(device=torch.cuda.get_device_name(), copy_tbps=copy_tbps, bf16_tflops=bf16, fp8_tflops=fp8)


def roofline(
    bytes_moved: float, flops: float, ceilings: Ceilings, matmul: str = "bf16", measured_us: float | None = None
) -> dict:
    """Floor of a call from its bytes and FLOPs against this run's ceilings; % of floor if timed."""
    rate = ceilings.bf16_tflops if matmul == "bf16" else (ceilings.fp8_tflops or ceilings.bf16_tflops * 2)
    mem_us = bytes_moved / (ceilings.copy_tbps * 1e12) * 1e6
    math_us = flops / (rate * 1e12) * 1e6
    row = {
        "bytes": bytes_moved,
        "flops": flops,
        "floor_us": max(mem_us, math_us),
        "memory_us": mem_us,
        "compute_us": math_us,
        "bound": "memory" if mem_us >= math_us else "compute",
        "intensity_flop_per_byte": flops / bytes_moved if bytes_moved else float("inf"),
    }
    if measured_us:
        row["tbps"] = bytes_moved / (measured_us * 1e-6) / 1e12
        row["tflops"] = flops / (measured_us * 1e-6) / 1e12
        row["pct_of_floor"] = 100.0 * row["floor_us"] / measured_us
    return row


def moe_traffic(
    T: int,
    K: int,
    I: int,
    top_k: int,
    experts_hit: int,
    weight_bytes: float = 2.0,  # noqa: E741
    scale_bytes: int = 0,
) -> tuple:
    """(bytes, flops) of the expert computation: the least it must read and write, and its MACs·2.

    Bytes: the weights of every expert that received a token (W1 and W2: 3·I·K elements each) plus
    their scales, the bf16 tokens read once and the bf16 output written once. Intermediates are
    not counted (a perfectly fused kernel keeps them on chip), so the floor is honest.
    """
    bytes_moved = experts_hit * (3 * I * K * weight_bytes + scale_bytes) + 2 * T * K * 2
    flops = 2 * T * top_k * 3 * I * K
    return bytes_moved, flops


def wall_us(
    runs: Sequence[Callable[[], object]], *, calls: int, repeats: int, sync: Callable[[], object] = lambda: None
) -> float:
    """Median over ``repeats`` of the wall µs per call of ``calls`` calls going round ``runs``
    (``runs[i % len(runs)]``), ``sync()`` ending each repeat; after a warm-up of one call of each
    run and a ``sync()``."""
    if not runs or calls < 1 or repeats < 1:
        raise ValueError(
            f"wall_us: expected runs, calls >= 1, repeats >= 1; got {len(runs)} runs, "
            f"calls = {calls}, repeats = {repeats}"
        )
    for run in runs:
        run()
    sync()
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            runs[i % len(runs)]()
        sync()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_call)


def host_us(fn: Callable, kwargs: dict, calls: int = 200, repeats: int = 5) -> float:
    """Median over ``repeats`` of the µs per ``fn(**kwargs)`` (``calls`` per repeat, after one call),
    no synchronization: the host's time when the launches are stand-ins."""
    return wall_us([lambda: fn(**kwargs)], calls=calls, repeats=repeats)

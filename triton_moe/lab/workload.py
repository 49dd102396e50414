"""The benchmark workload of triton_moe: catalog weights on the GPU and input sets for one
(shape, T, quant), with the checks and timings the bench and the autotuner both run on them."""

from __future__ import annotations

import torch

from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import draw_weights, route
from moe_spec.quant import get_format, quantize_weight
from moe_spec.timing import moe_traffic, roofline, sets_for_cold_l2, time_cuda_graph
from triton_moe.align import align_block_size
from triton_moe.heuristic import get_config
from triton_moe.moe import expert_computation, fused_moe

_weight_cache: dict = {}


def make_weights(shape, quant, seed: int, device="cuda"):
    """Expert weights of ``shape`` from :func:`moe_spec.problem.draw_weights` (bf16, N(0, 1/fan_in),
    drawn on ``device``), quantized a few experts at a time so the fp32 temporaries stay small."""
    key = (shape, quant, seed, str(device))
    if key not in _weight_cache:
        w1, w2 = draw_weights(shape, seed, device=device)
        s1 = s2 = None
        if get_format(quant).quantized:
            E = shape.num_experts
            step = max(1, (1 << 28) // (2 * shape.intermediate * shape.hidden))
            parts1 = [quantize_weight(w1[e : e + step], quant) for e in range(0, E, step)]
            parts2 = [quantize_weight(w2[e : e + step], quant) for e in range(0, E, step)]
            w1, s1 = torch.cat([p[0] for p in parts1]), torch.cat([p[1] for p in parts1])
            w2, s2 = torch.cat([p[0] for p in parts2]), torch.cat([p[1] for p in parts2])
        _weight_cache[key] = (w1, w2, s1, s2)
    return _weight_cache[key]


def weight_bytes(shape, quant) -> int:
    """Bytes of all experts' W1 and W2: the format's weight dtype (1 byte under FP8, 2 under bf16)."""
    return shape.num_experts * shape.weight_elements() * get_format(quant).weight_dtype.itemsize


def drop_weights():
    _weight_cache.clear()
    torch.cuda.empty_cache()


class Problem:
    """``n_sets`` input sets of one (shape, T, quant) on the GPU, for checking and timing."""

    def __init__(self, shape, T: int, quant, n_sets: int = 0, seed: int = 0):
        self.shape, self.T, self.quant = shape, T, quant
        self.n_sets = n_sets or sets_for_cold_l2(weight_bytes(shape, quant))
        self.sets = []
        for i in range(self.n_sets):
            w1, w2, s1, s2 = make_weights(shape, quant, seed + i)
            g = torch.Generator(device="cuda").manual_seed(1000 * seed + 7 * i + T)
            x = torch.randn(T, shape.hidden, generator=g, device="cuda").to(torch.bfloat16)
            logits = torch.randn(T, shape.num_experts, generator=g, device="cuda")
            tw, ids = route(logits, shape.top_k)
            self.sets.append(
                dict(x=x, w1=w1, w2=w2, topk_weights=tw, topk_ids=ids, quant=quant, w1_scale=s1, w2_scale=s2)
            )
        self.experts_hit = int(self.sets[0]["topk_ids"].unique().numel())

    def config(self, cfg=None):
        s = self.shape
        cfg = cfg or get_config(self.T, s.num_experts, s.top_k, s.intermediate, s.hidden, self.quant)
        return cfg.resolved().check(self.quant)

    def time(self, cfg=None) -> float:
        """Median µs of the expert computation (alignment excluded), cold L2."""
        cfg = self.config(cfg)
        routings = [align_block_size(st["topk_ids"], self.shape.num_experts, cfg.BLOCK_M) for st in self.sets]

        def make_call(i):
            st, r = self.sets[i], routings[i]
            return lambda: expert_computation(
                st["x"],
                st["w1"],
                st["w2"],
                st["topk_weights"],
                st["topk_ids"],
                r,
                quant=self.quant,
                w1_scale=st["w1_scale"],
                w2_scale=st["w2_scale"],
                config=cfg,
            )

        return time_cuda_graph(make_call, self.n_sets, replays=15, min_calls=10).median_us

    def time_align(self, block_m: int) -> float:
        def make_call(i):
            return lambda: align_block_size(self.sets[i]["topk_ids"], self.shape.num_experts, block_m)

        return time_cuda_graph(make_call, self.n_sets, replays=15, min_calls=10).median_us

    def check(self, cfg=None) -> dict:
        """rel L2 vs the fp64 oracle, bit-identical rerun, and CUDA-graph replay equal to eager."""
        st = self.sets[0]
        out = fused_moe(**st, config=cfg)
        again = fused_moe(**st, config=cfg)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fused_moe(**st, config=cfg)  # warm-up on the capture stream
            with torch.cuda.graph(graph):
                captured = fused_moe(**st, config=cfg)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        return {
            "rel_l2": rel_l2(out, oracle(**st)),
            "bit_identical": bool(torch.equal(out, again)),
            "graph_equal": bool(torch.equal(out, captured)),
        }

    def roofline(self, us: float, ceilings) -> dict:
        s = self.shape
        fmt = get_format(self.quant)
        b, f = moe_traffic(self.T, s.hidden, s.intermediate, s.top_k, self.experts_hit, fmt.weight_dtype.itemsize)
        return roofline(b, f, ceilings, "fp8" if fmt.quantized else "bf16", us)

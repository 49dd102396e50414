"""What gets compiled: the CuTe configs' PTX on a CPU. (The JIT study — what a layer compiles, from
empty caches, and that nothing compiles after its warm-up — is :mod:`compare.warm_study`.)

**CuTe PTX** (:func:`cute_ptx_summary`). Without a GPU cute_moe cannot run, but it compiles: the
configs it would choose for the GPU suite are compiled to PTX here, and their WGMMA instructions
listed — the tile each warpgroup issues, visible on a laptop.
"""

from __future__ import annotations

import time

from compare.metrics import quant_name
from moe_spec.problem import get_shape
from moe_spec.validate import MoEDims


def wgmma_lines(ptx: str) -> dict:
    """Distinct WGMMA instructions of a PTX text (operands stripped) with their counts."""
    found: dict = {}
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("wgmma.mma_async"):
            op = line.split()[0]
            found[op] = found.get(op, 0) + 1
    return found


def cute_ptx_summary(shapes, tokens, quants=(None,)) -> dict:
    """The configs cute_moe's own plan picks for the GPU suite, compiled here, with their WGMMA lines.

    Each (shape, T, format) goes through ``cute_moe.plan`` — the backend's one decision — so this
    listing cannot drift from what ``fused_moe`` runs; a format the backend refuses is listed as such.
    Each config is named by the plan's own ``describe()`` (its GEMM's part), as the results name it; a plan of
    the one-launch path (``path == "decode"``) lists its one kernel, ``decode``.
    """
    try:
        import cute_moe
    except Exception as exc:  # noqa: BLE001
        return {"status": f"not available: import cute_moe failed: {type(exc).__name__}: {exc}"[:240]}
    used: dict = {}
    named: dict = {}
    refused: dict = {}
    for spec in shapes:
        shape = get_shape(spec)
        for quant in quants:
            for T in tokens:
                dims = MoEDims(T=T, E=shape.num_experts, K=shape.hidden, I=shape.intermediate, top_k=shape.top_k)
                try:
                    p = cute_moe.plan(dims, quant)
                except (NotImplementedError, ValueError) as exc:
                    refused.setdefault(quant_name(quant), str(exc))
                    break
                words = p.describe().split(" | ")  # "G1 <tile> <mma>", "G2 …": the results' config column
                if p.path == "decode":  # "decode 1-launch <tile> <mma>": the whole layer in one kernel
                    kernels = (("decode", "decode", words[0]),)
                else:
                    kernels = (("G1", p.gemm1, words[0]), ("G2", p.gemm2, words[1]))
                for gemm, cfg, said in kernels:
                    used.setdefault(cfg, []).append(f"{shape.label} {quant_name(quant)} T={T} {gemm}")
                    named.setdefault(cfg, said.split(" ", 1)[1])
    configs = []
    for cfg, where in used.items():
        entry = {
            "config": cfg.as_dict() if hasattr(cfg, "as_dict") else repr(cfg),
            "describe": named[cfg],
            "used_by": where,
        }
        start = time.perf_counter()
        try:
            if cfg == "decode":
                from cute_moe.decode import compile_decode

                ptx = compile_decode(keep_ptx=True).__ptx__
            else:
                ptx = cute_moe.compile_ptx(cfg)
            entry.update(
                wgmma=wgmma_lines(ptx), ptx_lines=ptx.count("\n"), compile_s=round(time.perf_counter() - start, 2)
            )
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"[:240]
        configs.append(entry)
    return {"status": "ok", "configs": configs, "refused": refused}

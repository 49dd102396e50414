"""The kernel's layouts as plain data (JSON-serialisable), computed on the CPU.

``describe(cfg)`` builds the :class:`~cute_moe.gemm.KernelPlan` — the *same* tiled MMA and
shared-memory layouts the kernel is compiled from — inside a jit context, reads their (static)
shapes and strides back as Python tuples, and evaluates them here.  Tests, notes and a layout
explorer all read this one dict.

A CuTe layout is a function ``shape:stride``: a coordinate, written as one integer ``i``, is
split colexicographically over the (flattened) shape, ``i = c0 + s0·(c1 + s1·(c2 + …))``, and the
result is ``Σ c_j · stride_j``.  ``evaluate`` below is that definition, nothing more.

What the dict holds (all thread numbers are *consumer* threads, 0 … 128·warpgroups − 1; the
kernel's thread id is that plus 128, the producer warpgroup coming first):

* ``tile``: GEMM (M, N, K) and MoE (tokens, weights) extents, path, pipeline depth, smem budget.
* ``mma``: the WGMMA instruction shape and the tiled MMA's thread-value layouts (``tv_A``,
  ``tv_B``, ``tv_C`` as shape/stride) mapping ``(thread, value)`` to a column-major coordinate of
  the operand tile: A (m, k), B (n, k), C (m, n).  WGMMA reads A and B from shared memory, so
  every thread of a warpgroup names the whole 64×16 (resp. N×16) slice: their thread stride is 0
  and ``A_coords_every_thread`` / ``B_coords_every_thread`` list it once.
* ``accumulators``: for every consumer thread, the (m, n) of each of its fp32 accumulator
  registers, in register order, over the whole CTA tile — produced by the kernel's own
  ``thr_mma.partition_C(identity)``.
  ``accumulators_moe`` is the same list as (token, weight) pairs: for swap-AB, (n, m).
* ``smem``: per operand (and the epilogue buffer) the element layout of one stage, its swizzle
  ``S<B,M,S>`` and, for the first swizzle atom (8 rows), the *physical* 16-byte chunk and bank of
  every row's first element.  The swizzle is applied to byte addresses, as the hardware does:
  ``addr ^= ((addr >> (M+S)) & (2^B − 1)) << M`` (for 128 B: bits 4‥6 ^= bits 7‥9).
* ``tma``: the box each TMA copy moves (rows × tile_k for loads, the epilogue tile for stores).
"""

from __future__ import annotations

import os
import re
import warnings

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning  # noqa: E402

from .config import SMEM_BUDGET_BYTES, GemmConfig  # noqa: E402
from .gemm import KernelPlan  # noqa: E402


# ---- a layout is a function: the pure-Python definition ----------------------------------------
def _flatten(t):
    if isinstance(t, tuple):
        out = []
        for x in t:
            out.extend(_flatten(x))
        return out
    return [t]


def evaluate(shape, stride, i: int) -> int:
    """The CuTe layout ``shape:stride`` applied to the 1-D coordinate ``i``."""
    offset = 0
    for s, d in zip(_flatten(shape), _flatten(stride)):
        offset += (i % s) * d
        i //= s
    return offset


def size(shape) -> int:
    n = 1
    for s in _flatten(shape):
        n *= s
    return n


def swizzle_bytes(addr: int, bits: int, base: int, shift: int) -> int:
    """CuTe's ``Swizzle<B, M, S>`` on a byte address: XOR bits [M, M+B) with bits [M+S, M+S+B)."""
    mask = ((1 << bits) - 1) << (base + shift)
    return addr ^ ((addr & mask) >> shift)


# ---- reading the plan inside a jit context --------------------------------------------------
def _layout(l):
    return {"shape": l.shape, "stride": l.stride}


def _swizzle(composed) -> tuple[int, int, int]:
    b, m, s = (int(v) for v in re.match(r"S<(\d+),(\d+),(\d+)>", str(composed.inner)).groups())
    return b, m, s


_PTX_TYPE = {"Float32": "f32", "BFloat16": "bf16", "Float16": "f16", "Float8E4M3FN": "e4m3"}
"""DSL element type → the type suffix PTX spells in ``wgmma.mma_async`` (accumulator, A, B)."""


def _raw_plan(cfg: GemmConfig) -> dict:
    raw: dict = {}

    @cute.jit
    def probe():
        plan = KernelPlan(cfg)
        mma = plan.tiled_mma
        raw["tv_A"] = _layout(mma.tv_layout_A)
        raw["tv_B"] = _layout(mma.tv_layout_B)
        raw["tv_C"] = _layout(mma.tv_layout_C)
        # the WGMMA atom the tiled MMA repeats: instruction shape and operand types, from the op itself
        raw["atom_mnk"] = tuple(int(v) for v in mma.op.shape_mnk)
        raw["atom_types"] = tuple(_PTX_TYPE[str(t)] for t in (mma.op.acc_dtype, mma.op.a_dtype, mma.op.b_dtype))
        for name, staged, one in (("A", plan.a_smem_staged, cute.slice_(plan.a_smem_staged, (None, None, 0))),
                                  ("B", plan.b_smem_staged, cute.slice_(plan.b_smem_staged, (None, None, 0))),
                                  ("C", plan.epi_smem_staged, plan.epi_smem_one)):
            raw["smem_" + name] = {"one_stage": _layout(one.outer), "swizzle": _swizzle(staged),
                                   "cosize_staged": int(cute.cosize(staged)), "text": str(staged)}
        raw["stage_bytes"] = int(plan.stage_bytes)
        # Accumulator ownership exactly as the kernel computes it: each consumer thread's slice
        # of the tiled MMA applied to an identity tensor over the CTA tile (static coordinates).
        identity = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
        acc = []
        for t in cutlass.range_constexpr(128 * cfg.consumer_warpgroups):
            coords = mma.get_slice(t).partition_C(identity)
            acc.append([tuple(int(v) for v in coords[i]) for i in range(cute.size(coords))])
        raw["accumulators"] = acc

    with warnings.catch_warnings():  # the per-thread loop is host-side bookkeeping, unrolled on purpose
        warnings.simplefilter("ignore", category=DSLOptimizationWarning)
        probe()
    return raw


def _tv_table(tv: dict, rows: int) -> list[list[list[int]]]:
    """[thread][value] → (row, col) of a column-major (rows × …) tile."""
    t_shape, v_shape = tv["shape"]
    t_stride, v_stride = tv["stride"]
    table = []
    for t in range(size(t_shape)):
        base = evaluate(t_shape, t_stride, t)
        table.append([[(base + evaluate(v_shape, v_stride, v)) % rows,
                       (base + evaluate(v_shape, v_stride, v)) // rows] for v in range(size(v_shape))])
    return table


def _smem_rows(smem: dict, elem_bytes: int, rows_to_show: int = 8) -> list[dict]:
    """Physical placement of element (row, 0) for the first swizzle atom's rows."""
    shape, stride = smem["one_stage"]["shape"], smem["one_stage"]["stride"]
    b, m, s = smem["swizzle"]
    n_rows = size(shape[0])
    out = []
    for r in range(min(rows_to_show, n_rows)):
        logical = evaluate(shape, stride, r) * elem_bytes  # (row r, k 0): 1-D coordinate r
        physical = swizzle_bytes(logical, b, m, s)
        out.append({"row": r, "logical_byte": logical, "physical_byte": physical,
                    "chunk16": (physical >> 4) & 7, "bank": (physical >> 2) & 31})
    return out


def describe(cfg: GemmConfig) -> dict:
    """Everything a reader needs to draw the kernel's data movement for ``cfg`` (plain data)."""
    cfg.validate()
    raw = _raw_plan(cfg)
    accumulators = raw["accumulators"]
    moe = [[(n, m) if cfg.swap_ab else (m, n) for (m, n) in regs] for regs in accumulators]
    # WGMMA reads A and B from shared memory: the thread mode has stride 0, every thread of the
    # warpgroup names the same (row, k) list, so one thread's table says it all.
    tv_a = _tv_table(raw["tv_A"], 64)[0]
    tv_b = _tv_table(raw["tv_B"], cfg.tile_n)[0]
    smem = {}
    for name in ("A", "B", "C"):
        s = raw["smem_" + name]
        elem = cfg.out_bytes if name == "C" else cfg.element_bytes
        smem[name] = {"layout_one_stage": s["one_stage"], "swizzle": list(s["swizzle"]), "printed": s["text"],
                      "bytes_staged": s["cosize_staged"] * elem, "atom_rows": _smem_rows(s, elem)}
    smem["total_bytes"] = cfg.smem_bytes()
    smem["budget_bytes"] = SMEM_BUDGET_BYTES
    operand = ("weights", "tokens") if cfg.swap_ab else ("tokens", "weights")
    return {
        "config": cfg.as_dict(),
        "tile": {"path": "swap_ab" if cfg.swap_ab else "normal",
                 "gemm_mnk": [cfg.tile_m, cfg.tile_n, cfg.tile_k],
                 "moe": {"tokens": cfg.tokens_tile, "weights": cfg.weights_tile, "k": cfg.tile_k},
                 "A_is": operand[0], "B_is": operand[1],
                 "C_major": "M" if cfg.swap_ab else "N",
                 "threads": cfg.threads, "consumer_threads": 128 * cfg.consumer_warpgroups,
                 "stages": cfg.stages, "epi_stages": cfg.epi_stages},
        "mma": {"instruction": "wgmma.mma_async.sync.aligned.m{}n{}k{}.".format(*raw["atom_mnk"])
                               + ".".join(raw["atom_types"]),
                "atom_mnk": list(raw["atom_mnk"]), "warpgroups_along_m": cfg.consumer_warpgroups,
                "tv_A": raw["tv_A"], "tv_B": raw["tv_B"], "tv_C": raw["tv_C"],
                "A_coords_every_thread": tv_a, "B_coords_every_thread": tv_b},
        "accumulators": accumulators,
        "accumulators_moe": moe,
        "smem": smem,
        "tma": {"load_tokens_box": [cfg.tokens_tile, cfg.tile_k], "load_weights_box": [cfg.weights_tile, cfg.tile_k],
                "weights_tensor": "(N_out, K, E): expert = 3rd TMA coordinate",
                "store_box": list(cfg.epi_tile), "stage_bytes": raw["stage_bytes"]},
    }


def _json_ready(x):
    if isinstance(x, dict):
        return {k: _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    return x


def describe_json(cfg: GemmConfig) -> dict:
    """:func:`describe` with every tuple turned into a list (``json.dumps``-ready)."""
    return _json_ready(describe(cfg))

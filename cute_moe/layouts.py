"""The kernel's layouts as plain data (JSON-serialisable), computed on the CPU.

``describe(cfg)`` builds the :class:`~cute_moe.gemm_plan.KernelPlan` — the *same* tiled MMA and
shared-memory layouts the kernel is compiled from — inside a jit context, reads their (static)
shapes and strides back as Python tuples, and evaluates them here.  Tests, notes and a layout
explorer all read this one dict.

A CuTe layout is a function ``shape:stride``: a coordinate, written as one integer ``i``, is
split colexicographically over the (flattened) shape, ``i = c0 + s0·(c1 + s1·(c2 + …))``, and the
result is ``Σ c_j · stride_j``.  ``evaluate`` below is that definition, nothing more.

What the dict holds (all thread numbers are *consumer* threads, 0 … 128·warpgroups − 1; the
kernel's thread id is that plus 128, the producer warpgroup coming first; under ping-pong the
threads of one tile's warpgroup, 0 … 127, each consumer warpgroup owning its tiles the same way):

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

For the pictures (:mod:`cute_moe.lab.figures`) three lighter readers of the same plan:
:func:`plan_layouts` (the static layouts, for bf16 or FP8 operands, without the per-thread loop),
:func:`accumulator_owners` (``(m, n) → (thread, register)`` from the tiled MMA's TV layout; a test
holds it equal to ``partition_C``) and :func:`tma_layouts` (the kernel's TMA coordinate tensors,
whose strides name the TMA coordinate each tile index moves — the expert is the weights' third).
"""

from __future__ import annotations

import re
import warnings

import cutlass
import cutlass.cute as cute
from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
from cutlass.cute.nvgpu import cpasync

from .config import SMEM_BUDGET_BYTES, GemmConfig
from .gemm_plan import KernelPlan, fake_arguments
from .limits import gemm1_out_dtype
from .plan import choose_config
from .ptx import PTX_TYPES


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


FORMAT_QUANT = {"bf16": None, "fp8": "fp8_block"}
"""Operand formats the pictures draw, and the ``quant`` each stands for: bf16, and FP8 with 128×128
block scales (the format whose scales change along K, promoted with them every K step)."""


def format_config(cfg: GemmConfig, fmt: str) -> GemmConfig:
    """The config the kernel builds for ``cfg``'s GEMM in operand format ``fmt``.

    ``cfg`` itself in its own format; otherwise the path rule's config
    (:func:`~cute_moe.plan.choose_config`) for the same path, token tile (the rule's bucket) and
    row scale under ``fmt``'s quant, with the layer's output dtype (an FP8 GEMM1 writes fp32).  One
    stage keeps its 128-byte swizzled rows (64 bf16 or 128 FP8 elements of K); an FP8 tile is at
    most 128 weights wide (two accumulators), and the ring as deep as the shared memory allows.
    """
    quant = FORMAT_QUANT[fmt]
    if quant == cfg.quant:
        return cfg
    out_dtype = "bfloat16" if cfg.row_scale else gemm1_out_dtype(quant)
    return choose_config(
        cfg.tokens_tile,
        cfg.weights_tile,
        cfg.tile_k,
        swap_ab=cfg.swap_ab,
        row_scale=cfg.row_scale,
        quant=quant,
        out_dtype=out_dtype,
    )


def _read_plan(plan: KernelPlan, raw: dict) -> None:
    """Copy the static facts of a plan (inside a jit context) into plain data."""
    mma = plan.tiled_mma
    raw["tv_A"] = _layout(mma.tv_layout_A)
    raw["tv_B"] = _layout(mma.tv_layout_B)
    raw["tv_C"] = _layout(mma.tv_layout_C)
    # the whole tiled MMA (every consumer warpgroup): its (M, N) tile and the C thread-value layout
    raw["mma_tile_mn"] = (int(mma.get_tile_size(0)), int(mma.get_tile_size(1)))
    raw["tv_C_tiled"] = _layout(mma.tv_layout_C_tiled)
    # the WGMMA atom the tiled MMA repeats: instruction shape and operand types, from the op itself
    raw["atom_mnk"] = tuple(int(v) for v in mma.op.shape_mnk)
    raw["atom_types"] = tuple(PTX_TYPES[str(t)] for t in (mma.op.acc_dtype, mma.op.a_dtype, mma.op.b_dtype))
    for name, staged, one in (
        ("A", plan.a_smem_staged, cute.slice_(plan.a_smem_staged, (None, None, 0))),
        ("B", plan.b_smem_staged, cute.slice_(plan.b_smem_staged, (None, None, 0))),
        ("C", plan.epi_smem_staged, plan.epi_smem_one),
    ):
        raw["smem_" + name] = {
            "one_stage": _layout(one.outer),
            "swizzle": _swizzle(staged),
            "cosize_staged": int(cute.cosize(staged)),
            "text": str(staged),
        }
    raw["stage_bytes"] = int(plan.stage_bytes)


def _instruction(raw: dict) -> str:
    return "wgmma.mma_async.sync.aligned.m{}n{}k{}.".format(*raw["atom_mnk"]) + ".".join(raw["atom_types"])


def _quietly(fn) -> None:
    with warnings.catch_warnings():  # host-side bookkeeping loops are unrolled on purpose
        warnings.simplefilter("ignore", category=DSLOptimizationWarning)
        fn()


def _raw_plan(cfg: GemmConfig) -> dict:
    raw: dict = {}

    @cute.jit
    def probe():
        plan = KernelPlan(cfg)
        _read_plan(plan, raw)
        # Accumulator ownership exactly as the kernel computes it: each consumer thread's slice
        # of the tiled MMA applied to an identity tensor over the CTA tile (static coordinates).
        # Ping-pong: the threads of the one warpgroup that owns a tile (both own tiles the same way).
        identity = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
        acc = []
        for t in cutlass.range_constexpr(128 * cfg.tile_warpgroups):
            coords = plan.tiled_mma.get_slice(t).partition_C(identity)
            acc.append([tuple(int(v) for v in coords[i]) for i in range(cute.size(coords))])
        raw["accumulators"] = acc

    _quietly(probe)
    return raw


def plan_layouts(cfg: GemmConfig, fmt: str = "bf16") -> dict:
    """The plan's static layouts for operand format ``fmt`` (no per-thread loop: fast), of the
    config :func:`format_config` gives.

    Keys: ``tv_A``/``tv_B``/``tv_C``, ``atom_mnk``, ``atom_types``, ``instruction``,
    ``smem_A``/``smem_B``/``smem_C`` (one stage's outer layout, swizzle ``(B, M, S)``, cosize of
    the ring, printed form), ``stage_bytes``, ``element_bytes``, ``tile_k``.
    """
    fcfg = format_config(cfg, fmt)
    raw: dict = {}

    @cute.jit
    def probe():
        _read_plan(KernelPlan(fcfg), raw)

    _quietly(probe)
    raw["instruction"] = _instruction(raw)
    raw["element_bytes"] = fcfg.element_bytes
    raw["tile_k"] = fcfg.tile_k
    return raw


def _static(x):
    """A shape or stride of a TMA coordinate tensor as data: ints, the string ``"value@mode"`` for a
    ScaledBasis (a step of ``value`` along TMA coordinate ``mode``), None for a dynamic extent."""
    if isinstance(x, tuple):
        return [_static(v) for v in x]
    if isinstance(x, int):
        return x
    if isinstance(x, cute.ScaledBasis):
        mode = x.mode
        return f"{int(x.value)}@{int(mode[0] if isinstance(mode, (list, tuple)) else mode)}"
    return None


def tma_layouts(cfg: GemmConfig) -> dict:
    """The TMA copies of the kernel as data, traced on the CPU with symbolic problem sizes.

    The same ``make_tiled_tma_atom`` / ``local_tile`` calls as ``GroupedGemm`` make, on the fake
    arguments of :func:`cute_moe.gemm_plan.fake_arguments`.  For ``tokens`` and ``weights`` (loads) and
    ``output`` (the store), ``tiles`` is the tiled coordinate tensor (box modes first, then the
    block indices; for the weights the last index is the expert), whose strides say which TMA
    coordinate each index moves (``"value@mode"``); ``values`` is the elements one copy moves.
    ``output_epi`` is one CTA tile divided into epilogue sub-tiles, as the epilogue divides it.
    """
    raw: dict = {}

    @cute.jit
    def probe(x: cute.Tensor, w: cute.Tensor, c: cute.Tensor):
        plan = KernelPlan(cfg)
        loads = (
            ("tokens", x, plan.x_smem_one, (cfg.tokens_tile, cfg.tile_k)),
            ("weights", w, plan.w_smem_one, (cfg.weights_tile, cfg.tile_k)),
        )
        for name, tensor, one, box in loads:
            atom, coords = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), tensor, one, box)
            tiles = cute.local_tile(coords, box, (None,) * cute.rank(coords))
            raw[name] = {
                "box": list(box),
                "values": int(cute.size(atom.layout_src_tv, mode=[1])),
                "tiles": {"shape": _static(tiles.layout.shape), "stride": _static(tiles.layout.stride)},
            }
        atom, coords = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, plan.epi_smem_one, cfg.epi_tile
        )
        tiles = cute.local_tile(coords, (cfg.tile_m, cfg.tile_n), (None, None))
        raw["output"] = {
            "box": list(cfg.epi_tile),
            "values": int(cute.size(atom.layout_src_tv, mode=[1])),
            "tiles": {"shape": _static(tiles.layout.shape), "stride": _static(tiles.layout.stride)},
        }
        epi = cute.zipped_divide(tiles[(None, None, 0, 0)], cfg.epi_tile)
        raw["output_epi"] = {"shape": _static(epi.layout.shape), "stride": _static(epi.layout.stride)}

    x, w, c = fake_arguments(cfg)[:3]
    _quietly(lambda: cute.compile(probe, x, w, c))
    return raw


def tma_coordinate(tiles: dict, index: tuple) -> list[int]:
    """The TMA coordinates (innermost first) of the element ``index`` (one integer per flattened
    mode) of a tiled coordinate tensor from :func:`tma_layouts`."""
    coord: dict[int, int] = {}
    for i, step in zip(index, _flatten(_tuples(tiles["stride"]))):
        if isinstance(step, str):  # "value@mode"; an int stride (0) does not move the box
            value, mode = (int(v) for v in step.split("@"))
            coord[mode] = coord.get(mode, 0) + i * value
    return [coord.get(m, 0) for m in range(max(coord, default=-1) + 1)]


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def thread_value_map(tv: dict, rows: int) -> list[list[tuple[int, int]]]:
    """``[thread][value]`` → (row, col) of a column-major tile with ``rows`` rows, from a TV layout."""
    t_shape, v_shape = tv["shape"]
    t_stride, v_stride = tv["stride"]
    out = []
    for t in range(size(t_shape)):
        base = evaluate(t_shape, t_stride, t)
        offsets = [base + evaluate(v_shape, v_stride, v) for v in range(size(v_shape))]
        out.append([(o % rows, o // rows) for o in offsets])
    return out


def accumulator_owners(cfg: GemmConfig, plan: dict) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(m, n): (consumer thread, register)}`` over the CTA tile, from a :func:`plan_layouts` dict.

    Evaluates the tiled MMA's ``tv_C_tiled`` (every consumer warpgroup's threads over the
    ``mma_tile_mn`` tile).  A CTA tile taller than that tile repeats it along M, the repeats
    following the atom's registers in each thread's fragment — what ``partition_C`` gives the
    kernel (a test compares the two).
    """
    tile_m, tile_n = plan["mma_tile_mn"]
    table = thread_value_map(plan["tv_C_tiled"], tile_m)
    per_thread = len(table[0])
    owners = {}
    for rep in range(cfg.tile_m // tile_m):
        for t, regs in enumerate(table):
            for v, (m, n) in enumerate(regs):
                owners[(m + rep * tile_m, n)] = (t, v + rep * per_thread)
    return owners


def _tv_table(tv: dict, rows: int) -> list[list[list[int]]]:
    """[thread][value] → [row, col] of a column-major (rows × …) tile."""
    return [[list(rc) for rc in regs] for regs in thread_value_map(tv, rows)]


def _smem_rows(smem: dict, elem_bytes: int, rows_to_show: int = 8) -> list[dict]:
    """Physical placement of element (row, 0) for the first swizzle atom's rows."""
    shape, stride = smem["one_stage"]["shape"], smem["one_stage"]["stride"]
    b, m, s = smem["swizzle"]
    n_rows = size(shape[0])
    out = []
    for r in range(min(rows_to_show, n_rows)):
        logical = evaluate(shape, stride, r) * elem_bytes  # (row r, k 0): 1-D coordinate r
        physical = swizzle_bytes(logical, b, m, s)
        out.append(
            {
                "row": r,
                "logical_byte": logical,
                "physical_byte": physical,
                "chunk16": (physical >> 4) & 7,
                "bank": (physical >> 2) & 31,
            }
        )
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
        elem = cfg.c_bytes if name == "C" else cfg.element_bytes
        smem[name] = {
            "layout_one_stage": s["one_stage"],
            "swizzle": list(s["swizzle"]),
            "printed": s["text"],
            "bytes_staged": s["cosize_staged"] * elem,
            "atom_rows": _smem_rows(s, elem),
        }
    smem["total_bytes"] = cfg.smem_bytes()
    smem["budget_bytes"] = SMEM_BUDGET_BYTES
    operand = ("weights", "tokens") if cfg.swap_ab else ("tokens", "weights")
    return {
        "config": cfg.as_dict(),
        "tile": {
            "path": "swap_ab" if cfg.swap_ab else "normal",
            "gemm_mnk": [cfg.tile_m, cfg.tile_n, cfg.tile_k],
            "moe": {"tokens": cfg.tokens_tile, "weights": cfg.weights_tile, "k": cfg.tile_k},
            "A_is": operand[0],
            "B_is": operand[1],
            "C_major": "M" if cfg.swap_ab else "N",
            "threads": cfg.threads,
            "consumer_threads": 128 * cfg.consumer_warpgroups,
            "schedule": cfg.schedule,
            "tile_threads": 128 * cfg.tile_warpgroups,
            "stages": cfg.stages,
            "epi_stages": cfg.epi_stages,
        },
        "mma": {
            "instruction": _instruction(raw),
            "atom_mnk": list(raw["atom_mnk"]),
            "warpgroups_along_m": cfg.tile_warpgroups,
            "tv_A": raw["tv_A"],
            "tv_B": raw["tv_B"],
            "tv_C": raw["tv_C"],
            "A_coords_every_thread": tv_a,
            "B_coords_every_thread": tv_b,
        },
        "accumulators": accumulators,
        "accumulators_moe": moe,
        "smem": smem,
        "tma": {
            "load_tokens_box": [cfg.tokens_tile, cfg.tile_k],
            "load_weights_box": [cfg.weights_tile, cfg.tile_k],
            "weights_tensor": (
                "(I, K, 2, E): gate / up = 3rd, expert = 4th TMA coordinate; two boxes per stage"
                if cfg.gated
                else "(N_out, K, E): expert = 3rd TMA coordinate"
            ),
            "store_box": list(cfg.epi_tile),
            "stage_bytes": raw["stage_bytes"],
        },
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

"""The Triton backend's plan for one layer call: the tile config of both GEMMs, and what follows.

:func:`plan` makes every decision of a ``fused_moe`` call on the host, before anything runs: the
:class:`~triton_moe.config.TritonConfig` (given, or the tuned table / heuristic of
:func:`~triton_moe.heuristic.get_config`, with swap-AB forced or by the rule), checked against the
quant format and this backend's limits — so a call it refuses is refused whatever T (the
empty-batch rule of :mod:`moe_spec.plan`). :func:`plans_for` lists every plan a layer can get.

The path (:func:`uses_decode`, THE rule): a call in a format of :data:`DECODE_FORMATS` with at most
:data:`DECODE_MAX_PAIRS` (token, slot) pairs and no backend option runs the one-launch decode
kernel (:mod:`triton_moe.decode`, its tile a :class:`~triton_moe.config.DecodeConfig`); so does a
call run eagerly — on a CUDA device, no CUDA graph being captured — with at most
:data:`EAGER_DECODE_MAX_PAIRS` pairs in any format; every other call the grouped pipeline.
A ``config=TritonConfig(...)`` or a ``swap_ab`` forces the
grouped pipeline at any T, a ``config=DecodeConfig(...)`` the decode kernel (any format, up to its
pair lanes).

The FP8 intermediate (:func:`epilogue_quant`, THE rule): where its scale is known inside one GEMM1
tile — a static fp8_tensor scale, or fp8_block's 1×128 groups when GEMM1's BLOCK_N holds whole
groups — GEMM1's epilogue writes its E4M3 codes (and block scales) itself; otherwise GEMM1 writes it
in fp32 and ``quantize_kernel`` quantizes it. The launches (:mod:`triton_moe.launches`), the
warm-up and the tests read this rule; none restates it.

x's quantization (:func:`x_quant_in_gemm1`, THE rule, off by :data:`X_QUANT_IN_GEMM1`): on
decode-size GEMM1 tiles (at most 32 rows), where one program can make x's scale itself — fp8_block's
1×128 groups when a K step is one group, a static fp8_tensor scale, fp8_channel's row scale in a
pre-pass over K where that costs little beside the weight tile — GEMM1 reads bf16 x and quantizes it
in its A load; otherwise ``quantize_kernel`` quantizes x in a launch of its own. The switch is off:
measured slower (see the constant).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

import torch

from moe_spec.quant import FP8_BLOCK, check_quant
from moe_spec.validate import MoEDims
from triton_moe.align import check_num_experts
from triton_moe.config import DecodeConfig, TritonConfig, mma_instruction
from triton_moe.heuristic import get_config, rule_starts

#: How far :func:`plans_for` looks by default (the largest batch the harness runs, doubled).
MAX_TOKENS = 8192

#: The decode path's reach in (token, slot) pairs, T·top_k (:func:`uses_decode`): where the H200 has
#: measured the decode kernel faster than the grouped pipeline (notes/decode.md, "Which calls take
#: it"); the kernel itself serves up to its PAIR_LANES.
DECODE_MAX_PAIRS = 2
#: The formats the rule sends to the decode kernel by default ("bf16" for None); the others keep
#: the grouped pipeline at every T unless a DecodeConfig asks — or the call runs eagerly (below).
DECODE_FORMATS = ("bf16",)
#: The decode path's reach, in pairs and in every format, for a call run eagerly (on a CUDA device with
#: no CUDA graph being captured: :func:`runs_eagerly`). Eagerly a call pays its host path and every
#: launch (the grouped pipeline's five to eight); where the layer's device time is short that host time
#: is the call, and one launch is faster up to this many pairs, not past it (both paths timed eagerly
#: on one machine: notes/decode.md, "Which calls take it"). Both paths compute the same function, with
#: the same bits wherever the grouped pipeline's tile keeps the K order (tests/test_triton_eager_path.py).
EAGER_DECODE_MAX_PAIRS = 8

#: Whether :func:`epilogue_quant` may ever answer True. The product leaves it True; tests and the lab
#: set it False to run the separate path (fp32 intermediate → ``quantize_kernel``) on the same call,
#: for comparison — through :func:`triton_moe.moe.separate_act_quant`, which also drops the cached
#: launches and plans that read it.
EPILOGUE_QUANT = True

#: Whether :func:`x_quant_in_gemm1` may ever answer True. Off in the product: measured slower than x's own
#: quantize launch in every cell of ``python -m triton_moe.lab.bench_x_quant`` (notes/triton_moe.md, "FP8 data
#: flow"). Tests and the lab turn it on with ``triton_moe.moe.rule_set("X_QUANT_IN_GEMM1", True)``.
X_QUANT_IN_GEMM1 = False
#: The largest GEMM1 BLOCK_M whose A load quantizes x (:func:`x_quant_in_gemm1`): the decode-size tiles.
X_QUANT_MAX_BLOCK_M = 32


def runs_eagerly(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` runs eagerly for the path rule (:data:`EAGER_DECODE_MAX_PAIRS`): on a CUDA
    device, with no CUDA graph being captured on the current stream. Off the GPU (the interpreter) no
    launch costs host time worth a path of its own: False."""
    return x.is_cuda and torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()


def eager_call(dims: MoEDims, x: torch.Tensor) -> bool:
    """The ``eager`` a ``fused_moe`` call passes to :func:`plan`: within :data:`EAGER_DECODE_MAX_PAIRS`,
    whether it :func:`runs_eagerly`; past that reach the rule does not weigh it, so CUDA is not asked."""
    return dims.T * dims.top_k <= EAGER_DECODE_MAX_PAIRS and runs_eagerly(x)


def uses_decode(T: int, top_k: int, quant: str | None = None, config=None, swap_ab=None, eager: bool = False) -> bool:
    """THE path rule: the one-launch decode kernel when no backend option is given for at most
    DECODE_MAX_PAIRS pairs of a format in DECODE_FORMATS — and, for a call run ``eager`` (no CUDA graph
    being captured), for at most EAGER_DECODE_MAX_PAIRS pairs of any format — or when the option is a
    DecodeConfig; else the grouped pipeline. Every format runs on both paths."""
    if isinstance(config, DecodeConfig):
        return True
    if config is not None or swap_ab is not None:
        return False
    pairs = T * top_k
    if eager and pairs <= EAGER_DECODE_MAX_PAIRS:
        return True
    return (quant or "bf16") in DECODE_FORMATS and pairs <= DECODE_MAX_PAIRS


def epilogue_quant(gemm1: TritonConfig, quant: str | None, static: bool = False) -> bool:
    """THE rule of the FP8 intermediate: True when GEMM1's epilogue quantizes it to E4M3 itself (no
    fp32 intermediate, no ``quantize_kernel`` launch for it), for a grouped GEMM1 of config ``gemm1``.

    * fp8_tensor with static scales (``static``: ``a2_scale`` given): the scale is a number every
      tile reads;
    * fp8_block when ``gemm1.BLOCK_N`` is a multiple of 128: tiles start at multiples of BLOCK_N,
      so each holds whole 1×128 groups of its rows and finds their amaxes in registers.

    Not dynamic fp8_tensor nor fp8_channel: their scale is the amax of the whole tensor / the whole
    row, which other GEMM1 tiles produce; nor bf16 (nothing to quantize); nor while
    :data:`EPILOGUE_QUANT` is off."""
    if not EPILOGUE_QUANT:
        return False
    if quant == "fp8_tensor":
        return static
    if quant == "fp8_block":
        return gemm1.BLOCK_N % FP8_BLOCK == 0
    return False


def x_quant_in_gemm1(gemm1: TritonConfig, quant: str | None, static: bool = False) -> bool:
    """THE rule of x's quantization: True when GEMM1 reads bf16 x and quantizes it to E4M3 in its A
    load (no ``xq`` buffer, no ``quantize_kernel`` launch for x), for a grouped GEMM1 of config ``gemm1``.

    Only for tiles of at most :data:`X_QUANT_MAX_BLOCK_M` rows: the A tile then goes global →
    registers → shared memory instead of straight to WGMMA; compiled for sm_90a (tests/test_triton_sm90.py)
    the 16- and 32-row tiles do not spill, the 64- and 128-row prefill tiles spill hundreds of bytes
    more per thread — and at prefill the separate pass is small beside the GEMMs. Then:

    * fp8_block when ``gemm1.BLOCK_K`` is a multiple of 128 (with the check's BLOCK_K | 128: 128):
      each K step holds one whole 1×128 group of each row, so its amax, scale and codes come from
      the tile in registers;
    * fp8_tensor with static scales (``static``: ``a1_scale`` given): a number every program reads;
    * fp8_channel when ``BLOCK_M · (2·split_k + 1) <= BLOCK_N``: the row scale needs the whole row,
      so every program first reads its rows over all of K (bf16) for their amax, then again (bf16,
      not E4M3) in its K loop — 2·BM·K + BM·K/split_k bytes more per program than the separate
      path, against the 2·BN·K/split_k bytes of gate and up weights it streams; the rule keeps the
      extra at most half of that. A cost model, not a measurement.

    Not dynamic fp8_tensor (its scale is the amax of all of x, other programs' rows), nor bf16, nor
    while :data:`X_QUANT_IN_GEMM1` is off."""
    if not X_QUANT_IN_GEMM1 or gemm1.BLOCK_M > X_QUANT_MAX_BLOCK_M:
        return False
    if quant == "fp8_tensor":
        return static
    if quant == "fp8_block":
        return gemm1.BLOCK_K % FP8_BLOCK == 0
    if quant == "fp8_channel":
        return gemm1.BLOCK_M * (2 * gemm1.split_k + 1) <= gemm1.BLOCK_N
    return False


@dataclass(frozen=True)
class LayerPlan:
    """What ``fused_moe`` runs for one layer call (see :mod:`moe_spec.plan` for the interface).

    ``path`` is ``"grouped"`` or ``"decode"``. Grouped: GEMM1 and GEMM2 share ``config`` (a
    :class:`TritonConfig`, resolved and checked): its BLOCK_M is the alignment tile, which both
    GEMMs read; GEMM2 runs its own tile when the config has a ``gemm2``. ``gemm1`` / ``gemm2`` are
    the configs each GEMM launches with (:meth:`~triton_moe.config.TritonConfig.gemm1_config`,
    ``gemm2_config``). Decode: ``config`` is the one launch's :class:`DecodeConfig`; both GEMMs
    are its swap-AB dot (:meth:`~triton_moe.config.DecodeConfig.gemm_tile`; GEMM2's with its
    ``block_n2`` rows), nothing is aligned and ``align_tile`` is its token tile.
    """

    config: TritonConfig | DecodeConfig
    quant: str | None = None

    @property
    def path(self) -> str:
        return "decode" if isinstance(self.config, DecodeConfig) else "grouped"

    @functools.cached_property  # a plan is cached per call signature (moe._cached_plan): once per plan
    def gemm1(self) -> TritonConfig:
        if self.path == "decode":
            return self.config.gemm_tile()
        return self.config.gemm1_config()

    @functools.cached_property
    def gemm2(self) -> TritonConfig:
        if self.path == "decode":  # its W2 tile has block_n2 rows
            return replace(self.config.gemm_tile(), BLOCK_N=self.config.block_n2)
        return self.config.gemm2_config()

    @property
    def align_tile(self) -> int:
        return self.config.BLOCK_T if self.path == "decode" else self.config.BLOCK_M

    @property
    def swap_ab(self) -> tuple[bool, bool]:
        return self.gemm1.swap_ab, self.gemm2.swap_ab

    @property
    def mma(self) -> tuple[str, str]:
        """The instruction each GEMM compiles to, implied by the tile and the dtype
        (:func:`~triton_moe.config.mma_instruction`; not read from a compiled kernel)."""
        return mma_instruction(self.gemm1, self.quant), mma_instruction(self.gemm2, self.quant)

    def epilogue_quant(self, static: bool = False) -> bool:
        """Whether GEMM1's epilogue quantizes the FP8 intermediate (:func:`epilogue_quant`; ``static``:
        the call passes static activation scales). Never on the decode path (its own kernel)."""
        return self.path == "grouped" and epilogue_quant(self.gemm1, self.quant, static)

    def x_quant_in_gemm1(self, static: bool = False) -> bool:
        """Whether GEMM1 quantizes x in its A load (:func:`x_quant_in_gemm1`; ``static``: the call
        passes static activation scales). Never on the decode path (its own kernel)."""
        return self.path == "grouped" and x_quant_in_gemm1(self.gemm1, self.quant, static)

    def describe(self) -> str:
        """One line: GEMM1's tile and instruction, then ``; G2 …`` GEMM2's where it has its own;
        a decode plan: ``decode 1-launch``, its tile (BT: pairs per MMA) and instruction."""
        if self.path == "decode":
            return f"decode 1-launch {_describe(self.gemm1, self.mma[0], block_m=False)} BT{self.config.BLOCK_T}"
        line = _describe(self.gemm1, self.mma[0])
        if self.config.gemm2 is None:
            return line
        return f"{line}; G2 {_describe(self.gemm2, self.mma[1], block_m=False)}"


def _describe(c: TritonConfig, mma: str, block_m: bool = True) -> str:
    kind, shape = re.match(r"(\w+)\.\S*?(m\d+n\d+k\d+)", mma).groups()  # ("wgmma", "m64n16k16")
    return (
        f"{'swap-AB ' if c.swap_ab else ''}{f'BM{c.BLOCK_M} ' if block_m else ''}BN{c.BLOCK_N} BK{c.BLOCK_K} "
        f"w{c.num_warps} s{c.num_stages} {kind} {shape}"
    )


def check_options(config, swap_ab) -> None:
    """Raise TypeError naming the backend option that has the wrong type (before any launch):
    a dict is not a config, and ``swap_ab="no"`` must not read as True."""
    if config is not None and not isinstance(config, (TritonConfig, DecodeConfig)):
        raise TypeError(
            f"config: expected a triton_moe.TritonConfig, a triton_moe.config.DecodeConfig or None, "
            f"got {type(config).__name__}"
        )
    if swap_ab is not None and not isinstance(swap_ab, bool):
        raise TypeError(f"swap_ab: expected True, False or None, got {swap_ab!r}")
    if swap_ab is not None and isinstance(config, DecodeConfig):
        raise ValueError("swap_ab: the decode kernel has one form (swap-AB); pass swap_ab with a TritonConfig or none")


def plan(
    dims: MoEDims,
    quant: str | None = None,
    *,
    config: TritonConfig | None = None,
    swap_ab: bool | None = None,
    eager: bool = False,
) -> LayerPlan:
    """The plan of one ``fused_moe`` call with sizes ``dims`` (a :class:`moe_spec.validate.MoEDims`).

    Options (those of ``fused_moe``): ``config`` a :class:`TritonConfig` (default: the tuned table
    for this shape and device, else the heuristic); ``swap_ab`` forces swap-AB on or off for both
    GEMMs (default: the config's, else the rule). ``eager``: the call runs eagerly on a CUDA device
    (no CUDA graph being captured), which :func:`uses_decode` weighs; False: the plan a CUDA graph
    captures, the one compare's graph timing and config column name. Raises TypeError / ValueError
    naming a bad option, a config that cannot run ``quant``, or an expert count the alignment does not
    support.
    """
    if not isinstance(dims, MoEDims):
        raise TypeError(f"dims: expected a moe_spec.validate.MoEDims, got {type(dims).__name__}")
    check_options(config, swap_ab)
    check_quant(quant)
    check_num_experts(dims.E)
    if uses_decode(dims.T, dims.top_k, quant, config, swap_ab, eager):
        return LayerPlan((config or DecodeConfig()).check(quant), quant)
    if config is None:
        config = get_config(dims.T, dims.E, dims.top_k, dims.I, dims.K, quant)
    if swap_ab is not None:
        config = config.replace_both(swap_ab=swap_ab)
    return LayerPlan(config.resolved().check(quant), quant)


def plans_for(
    E: int,
    K: int,
    I: int,
    top_k: int,
    quant: str | None = None,  # noqa: E741
    max_tokens: int = MAX_TOKENS,
    **options,
) -> tuple[LayerPlan, ...]:
    """Every distinct plan this layer gets for T = 1 … ``max_tokens`` on this device (with the same
    ``options``), in order of T: the plan at the first T of each bucket of the config rule
    (:func:`~triton_moe.heuristic.rule_starts`) — where CUDA is present, first the decode plan if an eager
    call of T = 1 takes it (:data:`EAGER_DECODE_MAX_PAIRS`; not on a machine without CUDA, so a warm-up's
    dry run there leaves the decode kernel out), then the plans a CUDA graph captures."""
    if options.get("config") is not None:
        starts = [1]
    else:  # the decode plan up to the path rule's reach, then the grouped buckets past it
        first = DECODE_MAX_PAIRS // top_k + 1 if uses_decode(1, top_k, quant, **options) else 1
        starts = [1] + sorted({max(s, first) for s in rule_starts(E, top_k, I, K, quant)})
    plans = [plan(MoEDims(T=T, E=E, K=K, I=I, top_k=top_k), quant, **options) for T in starts if T <= max_tokens]
    if torch.cuda.is_available() and uses_decode(1, top_k, quant, eager=True, **options):  # eager calls run here
        plans.insert(0, plan(MoEDims(T=1, E=E, K=K, I=I, top_k=top_k), quant, eager=True, **options))
    return tuple(dict.fromkeys(plans))

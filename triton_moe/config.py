"""Launch configurations: the tile of each GEMM, checked, and what the tile implies.

A :class:`TritonConfig` fixes the tile every program of the grouped GEMM works on. ``BLOCK_M``
is also the granularity of the token alignment (each expert's run of (token, slot) pairs is padded
to a multiple of it), so GEMM1 and GEMM2 of one call share it. The rest of the tile
(:class:`GemmTile`: BLOCK_N, BLOCK_K, GROUP_M, warps, stages, swap-AB, kernel) GEMM2 may set for
itself (:class:`Gemm2Tile`, the config's ``gemm2``): GEMM2 multiplies [P, I] by W2ᵀ, so its
reduction is only I long (256 at DeepSeek-V3 under TP8: 2–4 K steps per tile) and it keeps one
accumulator where GEMM1 keeps two (gate and up) — a wider or deeper tile fits its registers and
shared memory where GEMM1's would not. Without ``gemm2`` GEMM2 runs GEMM1's tile.

The swap-AB rule (:func:`choose_swap_ab`)
    Hopper's WGMMA multiplies a 64-row A operand per warpgroup. Without swap, A is the token tile
    [BLOCK_M, BLOCK_K]; when few tokens reach an expert the config uses BLOCK_M = 16 or 32 and
    Triton falls back to the older mma.sync path or wastes most of the 64 rows on padding. With
    swap-AB the kernel computes Cᵀ = W·Xᵀ: the expert's weight rows (BLOCK_N ≥ 64 of them) are
    the A operand and fill M = 64, the tokens become the narrow N side (8…256 in steps of 8).
    THE rule: swap exactly when ``BLOCK_M < 64`` — the token tile is too short to fill one WGMMA
    — and ``BLOCK_N ≥ 64``. It is a property of the tile, not of the dtype: bf16 and FP8 both use
    it. ``swap_ab=True/False`` in a config or in ``fused_moe(..., swap_ab=...)`` overrides it for
    comparisons; ``python -m triton_moe.lab.bench`` (its swap-AB sweep) measures where it pays off.

Which config a call gets (a tuned table, else the heuristic) is :mod:`triton_moe.heuristic`; the
instruction a tile compiles to is :func:`mma_instruction`; :mod:`triton_moe.plan` puts them
together for one call.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields, replace

from moe_spec.hopper import SMEM_PER_CTA_BYTES, WARPGROUP_THREADS, WGMMA_M, WGMMA_N_MAX, WGMMA_N_STEP, wgmma_k
from moe_spec.quant import FP8_BLOCK, get_format

#: Shared memory one program may use: Hopper's opt-in limit per CTA (:mod:`moe_spec.hopper`).
SMEM_LIMIT = SMEM_PER_CTA_BYTES

#: The smallest tile Triton's tl.dot accepts along M, N and K.
MIN_DOT = 16

#: The largest extent of a TMA box along any dimension (the weight tile of ``persistent_tma``).
TMA_BOX_MAX = 256

#: A GEMM2 of at most this many ``BLOCK_K`` steps reads its rows' ids and routing weights before its
#: K loop (``EARLY_ROUTING``): a short loop cannot hide the epilogue's dependent gathers, a long one
#: hides them anyway and would only hold them in registers (notes/triton_moe.md, "The routing checks
#: in the GEMM epilogue"; measured in notes/results/triton_drift_h200_2026-12-03.md).
EARLY_ROUTING_MAX_K_STEPS = 4

#: num_warps values a config may ask for (Triton: a power of two; 16 warps = 512 threads).
NUM_WARPS = (1, 2, 4, 8, 16)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name}: expected an int, got {v!r} ({type(v).__name__})")


@dataclass(frozen=True)
class GemmTile:
    """The fields of one GEMM's tile that GEMM1 and GEMM2 each set for themselves — GEMM1 in
    :class:`TritonConfig`, GEMM2 in its :class:`Gemm2Tile` — declared once, for both.

    ``swap_ab=None`` means "apply :func:`choose_swap_ab`". ``persistent_tma`` runs the GEMM with
    :func:`triton_moe.kernels_tma.moe_gemm_tma_kernel` (one program per SM looping over the tiles,
    expert weights through TMA descriptors) instead of ``moe_gemm_kernel``; it is the non-swap-AB
    path, so the resolved tile must not swap. ``tma_flatten`` (only with ``persistent_tma``) asks
    Triton to flatten its tile and K loops into one software pipeline (``tl.range(...,
    flatten=True)``). Neither is chosen by the heuristic (a shipped table turns ``persistent_tma``
    on where it measured faster): ``python -m triton_moe.lab.bench_tma`` measures them.
    """

    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool | None = None
    persistent_tma: bool = False
    tma_flatten: bool = False

    def _check_tile(self, prefix: str = "") -> None:
        """The checks of these fields, type first, then value; each message starts with ``prefix`` +
        the field's name."""
        for name in ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"):
            _int(prefix + name, getattr(self, name))
        if self.swap_ab is not None and not isinstance(self.swap_ab, bool):
            raise TypeError(f"{prefix}swap_ab: expected True, False or None, got {self.swap_ab!r}")
        for name in ("persistent_tma", "tma_flatten"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{prefix}{name}: expected True or False, got {getattr(self, name)!r}")
        for name in ("BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if not _pow2(v) or v < MIN_DOT:
                raise ValueError(f"{prefix}{name}={v}: must be a power of two >= {MIN_DOT} (16, 32, 64, 128, …)")
        if self.GROUP_M < 1:
            raise ValueError(f"{prefix}GROUP_M={self.GROUP_M}: must be >= 1 (M-blocks per rasterization group)")
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"{prefix}num_warps={self.num_warps}: must be one of {', '.join(map(str, NUM_WARPS))}")
        if self.num_stages < 1:
            raise ValueError(f"{prefix}num_stages={self.num_stages}: must be >= 1")
        if self.persistent_tma and self.swap_ab:
            raise ValueError(
                f"{prefix}persistent_tma=True: the persistent TMA kernel is the non-swap-AB path; "
                "it cannot run with swap_ab=True"
            )
        if self.persistent_tma and max(self.BLOCK_N, self.BLOCK_K) > TMA_BOX_MAX:
            raise ValueError(
                f"{prefix}persistent_tma=True: a TMA box spans at most {TMA_BOX_MAX} rows and columns; "
                f"got the weight tile BLOCK_N={self.BLOCK_N} × BLOCK_K={self.BLOCK_K}"
            )
        if self.tma_flatten and not self.persistent_tma:
            raise ValueError(
                f"{prefix}tma_flatten=True: flattens the persistent kernel's loops; it needs persistent_tma=True"
            )


#: The names of :class:`GemmTile`'s fields: what GEMM2's own tile may set.
TILE_FIELDS = tuple(f.name for f in fields(GemmTile))


@dataclass(frozen=True)
class Gemm2Tile(GemmTile):
    """GEMM2's own tile: exactly the fields of :class:`GemmTile` — every field of
    :class:`TritonConfig` but ``BLOCK_M`` (the alignment tile, which both GEMMs read, so the config
    owns it) and ``split_k`` (GEMM2 never splits K: its K is the intermediate size I, and even at
    T = 1 it has hidden / BLOCK_N programs per expert).

    A whole tile, not a difference: a field left out takes its default here, not GEMM1's value
    (``swap_ab=None``: the swap-AB rule on (BLOCK_M, this BLOCK_N)). The fields are checked as
    :class:`TritonConfig` checks them; each message starts with ``gemm2.`` and the field's name.
    """

    def __post_init__(self):
        self._check_tile("gemm2.")

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        """``BLOCK_NxBLOCK_K/g<GROUP_M>w<num_warps>s<num_stages>`` (``+tma`` for the persistent kernel)."""
        return f"{self.BLOCK_N}x{self.BLOCK_K}/g{self.GROUP_M}w{self.num_warps}s{self.num_stages}" + (
            "+tma" if self.persistent_tma else ""
        )


@dataclass(frozen=True)
class _AlignmentTile:
    BLOCK_M: int  # TritonConfig's first field: a dataclass takes its bases' fields last base first


@dataclass(frozen=True)
class TritonConfig(GemmTile, _AlignmentTile):
    """The tile of one grouped-GEMM program, and how it is scheduled: ``BLOCK_M``, the fields of
    :class:`GemmTile` (in that order: ``TritonConfig(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
    num_stages, swap_ab, ...)``), ``split_k`` and ``gemm2``.

    :meth:`resolved` fixes a ``swap_ab`` of None by the rule.
    ``split_k`` > 1 splits GEMM1's K (the hidden size) over that many programs per tile, summed in a
    fixed order by the last of them (:mod:`triton_moe.kernels`): for decode layers whose GEMM1
    has too few tiles to fill the GPU; not with ``persistent_tma``.
    ``gemm2`` (a :class:`Gemm2Tile`, or None) is GEMM2's own tile; BLOCK_M stays this config's.
    None: GEMM2 runs this tile (without the split). :meth:`gemm1_config` / :meth:`gemm2_config`
    give the config each GEMM launches with.

    Every field is checked when the config is built (type first, then value; the message starts
    with the field's name): BLOCK_M, BLOCK_N, BLOCK_K powers of two ≥ 16; GROUP_M ≥ 1; num_warps
    in :data:`NUM_WARPS`; num_stages ≥ 1; swap_ab None or a bool; persistent_tma a bool, not with
    swap_ab=True nor a weight tile beyond a TMA box (BLOCK_N, BLOCK_K ≤ 256); tma_flatten a bool,
    only with persistent_tma; split_k an int ≥ 1, 1 with persistent_tma; gemm2 None or a
    :class:`Gemm2Tile` (whose own fields are checked the same way, named ``gemm2.<field>``).
    What depends on the quant format too (FP8's BLOCK_K, shared memory) is :meth:`check`.
    """

    split_k: int = 1
    gemm2: Gemm2Tile | None = None

    def __post_init__(self):
        for name in ("BLOCK_M", "split_k"):
            _int(name, getattr(self, name))
        if not _pow2(self.BLOCK_M) or self.BLOCK_M < MIN_DOT:
            raise ValueError(f"BLOCK_M={self.BLOCK_M}: must be a power of two >= {MIN_DOT} (16, 32, 64, 128, …)")
        self._check_tile()
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k}: must be >= 1 (programs sharing one tile's K steps)")
        if self.split_k > 1 and self.persistent_tma:
            raise ValueError(
                f"split_k={self.split_k}: the persistent TMA kernel does not split K; "
                "use split_k=1 with persistent_tma=True"
            )
        if self.gemm2 is not None and not isinstance(self.gemm2, Gemm2Tile):
            raise TypeError(
                f"gemm2: expected a triton_moe.config.Gemm2Tile or None, got {self.gemm2!r} "
                f"({type(self.gemm2).__name__}); a table's dict goes through TritonConfig.from_dict"
            )

    @classmethod
    def from_dict(cls, d: dict) -> TritonConfig:
        """The inverse of :meth:`as_dict` (a tuned table's entry): ``gemm2`` as a dict or null.
        Raises ValueError naming a key that is not a field."""
        d = dict(d)
        g = d.get("gemm2")
        for prefix, keys, known in (("", d, cls), ("gemm2.", g if isinstance(g, dict) else {}, Gemm2Tile)):
            names = [f.name for f in fields(known)]
            unknown = [k for k in keys if k not in names]
            if unknown:
                raise ValueError(
                    f"{prefix}{unknown[0]}: not a field of {known.__name__} (its fields: {', '.join(names)})"
                )
        if isinstance(g, dict):
            d["gemm2"] = Gemm2Tile(**g)
        return cls(**d)

    def resolved(self) -> TritonConfig:
        """This config with swap-AB decided by the rule (:func:`choose_swap_ab`) where it is None,
        for GEMM1's tile and GEMM2's own; raises ValueError when the persistent TMA kernel's tile
        (GEMM1's, or ``gemm2``'s) resolves to swap-AB."""
        cfg = self
        if self.swap_ab is None:
            swap = choose_swap_ab(self.BLOCK_M, self.BLOCK_N)
            if swap and self.persistent_tma:
                raise ValueError(
                    f"config: persistent_tma is the non-swap-AB path, but BLOCK_M={self.BLOCK_M} < "
                    f"{WGMMA_M} <= BLOCK_N={self.BLOCK_N} resolves to swap-AB; pass swap_ab=False or "
                    f"BLOCK_M >= {WGMMA_M}"
                )
            cfg = replace(cfg, swap_ab=swap)
        g = self.gemm2
        if g is not None and g.swap_ab is None:
            swap = choose_swap_ab(self.BLOCK_M, g.BLOCK_N)
            if swap and g.persistent_tma:
                raise ValueError(
                    f"config.gemm2: persistent_tma is the non-swap-AB path, but BLOCK_M={self.BLOCK_M} < "
                    f"{WGMMA_M} <= gemm2.BLOCK_N={g.BLOCK_N} resolves to swap-AB; pass "
                    f"gemm2.swap_ab=False or BLOCK_M >= {WGMMA_M}"
                )
            cfg = replace(cfg, gemm2=replace(g, swap_ab=swap))
        return cfg

    def gemm1_config(self) -> TritonConfig:
        """The config GEMM1 launches with: this one without ``gemm2``."""
        return self if self.gemm2 is None else replace(self, gemm2=None)

    def gemm2_config(self) -> TritonConfig:
        """The config GEMM2 launches with: BLOCK_M this one's, the rest ``gemm2``'s (or, without
        it, this tile's), ``split_k`` 1 (only GEMM1 splits K), no ``gemm2``."""
        return _gemm2_config(self)

    def replace_both(self, **changes) -> TritonConfig:
        """A copy with ``changes`` made to GEMM1's fields and, with a ``gemm2``, to the same fields
        of it (those it has): what a per-call option such as ``swap_ab`` forces for both GEMMs."""
        g = self.gemm2
        if g is not None:
            own = {k: v for k, v in changes.items() if k in TILE_FIELDS}
            if own:
                changes = {**changes, "gemm2": replace(g, **own)}
        return replace(self, **changes)

    def smem_bytes(self, quant: str | None, gemm: int = 1) -> int:
        """Shared memory of the pipelined operand tiles of one GEMM with this tile: A plus, for
        GEMM1 (``gemm=1``), the gate and up weight tiles, for GEMM2 (``gemm=2``) one weight tile.
        Without a ``gemm2`` GEMM1 is the larger of the two. Both operands have the format's weight
        dtype (activations are quantized to it): 1 byte under FP8, 2 under bf16. ``tma_flatten``
        adds two more stages of the weight tiles: the most Triton 3.6 added on sm_90 in the configs
        compiled on the CPU (e.g. fp8 GEMM1 128×128×128, 4 stages: 196 640 → 262 176 bytes)."""
        nbytes = get_format(quant).weight_dtype.itemsize
        weights = (2 if gemm == 1 else 1) * self.BLOCK_N * self.BLOCK_K * nbytes
        per_stage = self.BLOCK_M * self.BLOCK_K * nbytes + weights
        return per_stage * self.num_stages + (2 * weights if self.tma_flatten else 0)

    def check(self, quant: str | None) -> TritonConfig:
        """Raise ValueError (naming ``config``, or ``config.gemm2`` for GEMM2's own tile) when this
        config cannot run ``quant``; else return it.

        Every rule is a property of the tile and the format alone: the kernels mask partial tiles
        in M, N and K, so any K and I work with any valid tile (the CPU tests use K = 160, I = 80
        under 64-wide tiles); fp8_block's BLOCK_K | 128 keeps one K step inside one scale block."""
        self._check_gemm(quant, 1, "config")
        if self.gemm2 is not None:
            self.resolved()  # raises when gemm2's persistent tile resolves to swap-AB
            self.gemm2_config()._check_gemm(quant, 2, "config.gemm2")
        return self

    def _check_gemm(self, quant: str | None, gemm: int, name: str) -> None:
        fmt = get_format(quant)
        if fmt.scales_along_k and FP8_BLOCK % self.BLOCK_K:
            raise ValueError(
                f"{name}: {fmt.label} needs BLOCK_K to divide {FP8_BLOCK} (one scale per K step), "
                f"got BLOCK_K={self.BLOCK_K}"
            )
        if self.persistent_tma:
            replace(self, gemm2=None).resolved()  # raises when the tile resolves to swap-AB
        if fmt.quantized and self.BLOCK_K < 32:
            raise ValueError(f"{name}: FP8 needs BLOCK_K >= 32 (one WGMMA K step), got {self.BLOCK_K}")
        smem = self.smem_bytes(quant, gemm)
        if smem > SMEM_LIMIT:
            raise ValueError(
                f"{name}: {smem} bytes of pipelined tiles exceed the {SMEM_LIMIT}-byte shared memory "
                f"of one Hopper SM; lower num_stages={self.num_stages} or the tile"
            )

    def fits(self, quant: str | None) -> bool:
        """Whether :meth:`check` accepts this config (False instead of the ValueError)."""
        try:
            self.check(quant)
            return True
        except ValueError:
            return False

    def as_dict(self) -> dict:
        """The fields as a dict (``gemm2`` a dict or None): a tuned table's entry, read back by
        :meth:`from_dict`."""
        return asdict(self)

    def tile_label(self) -> str:
        """``BLOCK_MxBLOCK_NxBLOCK_K/g<GROUP_M>w<num_warps>s<num_stages>``, the study reports' tile
        column; with a ``gemm2``, `` G2 `` and its tile as :meth:`Gemm2Tile.label` writes it."""
        own = f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K}/g{self.GROUP_M}w{self.num_warps}s{self.num_stages}"
        return own if self.gemm2 is None else f"{own} G2 {self.gemm2.label()}"


@functools.lru_cache(maxsize=1024)
def _gemm2_config(cfg: TritonConfig) -> TritonConfig:
    g = cfg.gemm2
    if g is None:
        return replace(cfg, split_k=1)
    return TritonConfig(cfg.BLOCK_M, **asdict(g))


def choose_swap_ab(block_m: int, block_n: int) -> bool:
    """THE swap-AB rule: swap when the token tile cannot fill WGMMA's M = 64 but the weight tile can."""
    return block_m < WGMMA_M and block_n >= WGMMA_M


def mma_instruction(cfg: TritonConfig, quant: str | None) -> str:
    """The tensor-core instruction a GEMM with the resolved ``cfg`` compiles to, as PTX spells it.

    Not read from a compiled kernel: implied by the tile, ``num_warps`` and the operand dtype
    under Triton 3.6's MMA selection on sm_90 (tests/test_triton_plan.py compiles a set of configs
    on the CPU and checks this against their PTX). The dot is (M × N) = (BLOCK_N × BLOCK_M) under
    swap-AB, else (BLOCK_M × BLOCK_N). An M that is a multiple of 64 gets WGMMA (``wgmma``,
    M = 64 per warpgroup): the warpgroups stack along M as far as it reaches, the rest split N,
    and the instruction's N is the largest multiple of 8 (≤ 256) dividing N that fits one
    warpgroup's share; its K is 32 bytes of operand: 16 bf16, 32 fp8. Any other M falls back to
    Ampere's ``mma.sync`` m16n8k16, which takes FP8 operands converted to fp16 in registers.
    """
    m, n = (cfg.BLOCK_N, cfg.BLOCK_M) if cfg.resolved().swap_ab else (cfg.BLOCK_M, cfg.BLOCK_N)
    fp8 = get_format(quant).quantized
    warpgroups = cfg.num_warps * 32 // WARPGROUP_THREADS
    if m % WGMMA_M or warpgroups == 0:
        types = "f16.f16" if fp8 else "bf16.bf16"
        return f"mma.sync.aligned.m16n8k16.row.col.f32.{types}.f32"
    types = "e4m3.e4m3" if fp8 else "bf16.bf16"
    k = wgmma_k(get_format(quant).weight_dtype.itemsize)
    along_m = min(warpgroups, m // WGMMA_M)
    per_warpgroup = max(n // max(warpgroups // along_m, 1), WGMMA_N_STEP)
    inst_n = next(v for v in range(WGMMA_N_MAX, 0, -WGMMA_N_STEP) if n % v == 0 and v <= per_warpgroup)
    return f"wgmma.mma_async.sync.aligned.m{WGMMA_M}n{inst_n}k{k}.f32.{types}"


@dataclass(frozen=True)
class DecodeConfig:
    """The tile of the one-launch decode kernel (:mod:`triton_moe.decode`), one for all its phases.

    ``BLOCK_N`` weight rows per task — W1's gate and up rows in GEMM1, W2's rows (output columns)
    in GEMM2 and the combine — are the MMA's M side (swap-AB form: ``tl.dot(W_tile, Xᵀ)``);
    ``BLOCK_T`` pairs of one expert are its N side (an expert with more pairs is served in chunks
    of ``BLOCK_T``); ``BLOCK_K`` the reduction step (K in GEMM1, I in GEMM2). Checked when built
    (type, then value; the message names the field); what depends on the format is :meth:`check`.
    ``SPLIT`` = 2·s GEMM1 tasks per (pair, n-tile), gate or up rows over one of s K slices, the last
    to arrive summing the fp32 partials in a fixed order (1: one task, all of K): more SMs stream W1
    where I is narrow. ``BLOCK_N2`` W2 rows per GEMM2 and combine task (0: ``BLOCK_N``).
    """

    BLOCK_N: int = 64
    BLOCK_K: int = 128
    BLOCK_T: int = 16
    num_warps: int = 4
    num_stages: int = 4
    SPLIT: int = 1
    BLOCK_N2: int = 0

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K", "BLOCK_T", "num_warps", "num_stages", "SPLIT", "BLOCK_N2"):
            _int(name, getattr(self, name))
        if self.SPLIT not in (1, 2, 4, 8, 16):
            raise ValueError(f"SPLIT={self.SPLIT}: must be 1 or an even power of two (2, 4, 8, 16)")
        if self.BLOCK_N2 and (not _pow2(self.BLOCK_N2) or self.BLOCK_N2 < MIN_DOT):
            raise ValueError(f"BLOCK_N2={self.BLOCK_N2}: must be 0 (= BLOCK_N) or a power of two >= {MIN_DOT}")
        for name in ("BLOCK_N", "BLOCK_K", "BLOCK_T"):
            v = getattr(self, name)
            if not _pow2(v) or v < MIN_DOT:
                raise ValueError(f"{name}={v}: must be a power of two >= {MIN_DOT} (16, 32, 64, 128, …)")
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"num_warps={self.num_warps}: must be one of {', '.join(map(str, NUM_WARPS))}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages}: must be >= 1")

    @property
    def block_n2(self) -> int:  # W2 rows per GEMM2 and combine task
        return self.BLOCK_N2 or self.BLOCK_N

    def smem_bytes(self, quant: str | None) -> int:
        """Shared memory of the larger GEMM's pipelined tiles in the format's weight dtype: GEMM1's
        gate and up tiles (one where SPLIT > 1) or GEMM2's, and the token tile, per stage."""
        per_row = self.BLOCK_K * get_format(quant).weight_dtype.itemsize * self.num_stages
        return max(self.BLOCK_N * (2 if self.SPLIT == 1 else 1) + self.BLOCK_T, self.block_n2 + self.BLOCK_T) * per_row

    def check(self, quant: str | None) -> DecodeConfig:
        """Raise ValueError naming ``config`` when this tile cannot run ``quant`` (the rules of
        :meth:`TritonConfig.check`: fp8_block's BLOCK_K divides 128, FP8's BLOCK_K ≥ 32, shared
        memory); else return it."""
        fmt = get_format(quant)
        if fmt.scales_along_k and FP8_BLOCK % self.BLOCK_K:
            raise ValueError(
                f"config: {fmt.label} needs BLOCK_K to divide {FP8_BLOCK} (one scale per K step), "
                f"got BLOCK_K={self.BLOCK_K}"
            )
        if fmt.quantized and self.BLOCK_K < 32:
            raise ValueError(f"config: FP8 needs BLOCK_K >= 32 (one WGMMA K step), got {self.BLOCK_K}")
        smem = self.smem_bytes(quant)
        if smem > SMEM_LIMIT:
            raise ValueError(
                f"config: {smem} bytes of pipelined tiles exceed the {SMEM_LIMIT}-byte shared memory "
                f"of one Hopper SM; lower num_stages={self.num_stages} or the tile"
            )
        return self

    @property
    def split_k(self) -> int:
        """GEMM1's K slices (SPLIT // 2, at least 1): what changes the summation order."""
        return max(1, self.SPLIT // 2)

    def gemm_tile(self) -> TritonConfig:
        """The same dot as a grouped-GEMM tile (BLOCK_M = BLOCK_T tokens, swap-AB): what
        :func:`mma_instruction` reads."""
        return TritonConfig(self.BLOCK_T, self.BLOCK_N, self.BLOCK_K, 1, self.num_warps, self.num_stages, True)

    def label(self) -> str:
        """``BLOCK_NxBLOCK_KxBLOCK_T/w<num_warps>s<num_stages>[/split<SPLIT>][/n2=<BLOCK_N2>]``."""
        knobs = (f"/split{self.SPLIT}" if self.SPLIT != 1 else "") + (f"/n2={self.BLOCK_N2}" if self.BLOCK_N2 else "")
        return f"{self.BLOCK_N}x{self.BLOCK_K}x{self.BLOCK_T}/w{self.num_warps}s{self.num_stages}{knobs}"

    def as_dict(self) -> dict:
        return asdict(self)

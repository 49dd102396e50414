"""The layout facts notes/hopper.md states, checked against the code (CPU: layout data and PTX).

Each test names the section of the chapter it keeps true. A change of the kernel, the DSL or the
path rule that breaks one of them must change the chapter too.
"""

import functools
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cute_moe = pytest.importorskip("cute_moe")

from cute_moe import gemm  # noqa: E402
from cute_moe.config import GemmConfig, max_stages  # noqa: E402
from cute_moe.layouts import describe as _describe  # noqa: E402
from cute_moe.plan import choose_config, layer_configs  # noqa: E402

describe = functools.lru_cache(maxsize=None)(_describe)  # one layout build per config per session

SWAP = choose_config(2, 28672, 4096)  # the chapter's running example: swap-AB 128 × 8
NORMAL = choose_config(500, 28672, 4096)  # prefill: normal 128 × 256


def _cfg(**kw):
    cfg = GemmConfig(**kw)
    return cfg.replace(stages=max_stages(cfg)).validate()


NORMAL_128 = _cfg(tokens_tile=128, weights_tile=128)  # the 128 × 256 tile's layouts, at half the build time
LAYOUTS = [
    _cfg(tokens_tile=64, weights_tile=64, consumer_warpgroups=1),
    NORMAL_128,
    SWAP,
    _cfg(swap_ab=True, tokens_tile=32, weights_tile=128),
]


def test_running_example_is_what_the_path_rule_picks():
    assert (SWAP.swap_ab, SWAP.tile_m, SWAP.tile_n, SWAP.tile_k, SWAP.stages, SWAP.consumer_warpgroups) == (
        True,
        128,
        8,
        64,
        8,
        2,
    )
    assert (NORMAL.swap_ab, NORMAL.tile_m, NORMAL.tile_n) == (False, 128, 256)


@pytest.mark.parametrize("cfg", LAYOUTS, ids=lambda c: f"{'swap' if c.swap_ab else 'normal'}-{c.tile_m}x{c.tile_n}")
def test_accumulator_owner_formula(cfg):
    # §3: row = 64·wg + 16·warp + lane/4 + 8·((i/2) mod 2), col = 8·(i/4) + 2·(lane mod 4) + (i mod 2)
    acc = describe(cfg)["accumulators"]
    for t, regs in enumerate(acc):
        wg, warp, lane = t // 128, (t % 128) // 32, t % 32
        assert len(regs) == cfg.tile_n // 2
        for i, (m, n) in enumerate(regs):
            assert (m, n) == (
                64 * wg + 16 * warp + lane // 4 + 8 * ((i // 2) % 2),
                8 * (i // 4) + 2 * (lane % 4) + i % 2,
            ), (t, i)
    assert acc[37][:4] == [(17, 2), (17, 3), (25, 2), (25, 3)]


def _descriptor_fields(value: int) -> dict:
    return {
        "swizzle_mode": value >> 62,
        "stride_bytes": ((value >> 32) & 0x3FFF) << 4,
        "leading_bytes": ((value >> 16) & 0x3FFF) << 4,
    }


def test_descriptors_ask_for_the_128_byte_swizzle():
    # §5: the constant ORed into the A descriptor: swizzle mode 1 (128 B), stride offset 1024 B;
    # B (8 tokens, one 8-row group) has stride 0; start addresses masked to multiples of 1024 B
    ptx = cute_moe.compile_ptx(SWAP)
    consts = {int(v) for v in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (\d+);", ptx)}
    fields = [_descriptor_fields(v) for v in consts]
    assert {"swizzle_mode": 1, "stride_bytes": 1024, "leading_bytes": 16} in fields
    assert {"swizzle_mode": 1, "stride_bytes": 0, "leading_bytes": 16} in fields
    assert re.search(r"and\.b32\s+%r\d+, %r\d+, 16320;", ptx)


def test_epilogue_stmatrix_and_store_boxes():
    # §3 and §5: normal 128 × 256 → 8 sub-tiles of 128 × 32, two stmatrix.x4 and one TMA box each;
    # swap-AB 128 × 8 → one sub-tile, one stmatrix.x2.trans, two boxes (256 contiguous bytes > 128)
    store = r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta"
    normal, swap = cute_moe.compile_ptx(NORMAL), cute_moe.compile_ptx(SWAP)
    assert re.findall(r"stmatrix\S+", normal) == ["stmatrix.sync.aligned.m8n8.x4.shared.b16"] * 16
    assert len(re.findall(store, normal)) == NORMAL.tile_n // NORMAL.epi_tile[1] == 8
    assert re.findall(r"stmatrix\S+", swap) == ["stmatrix.sync.aligned.m8n8.x2.trans.shared.b16"]
    assert len(re.findall(store, swap)) == SWAP.epi_tile[0] * 2 // 128 == 2


def test_staging_swizzles():
    # §5: normal staging rows are 32 bf16 = 64 B (S<2,4,3>); swap-AB's M-major rows 64 bf16 = 128 B
    assert NORMAL_128.epi_tile == NORMAL.epi_tile == (128, 32)
    assert describe(NORMAL_128)["smem"]["C"]["swizzle"] == [2, 4, 3]
    assert describe(SWAP)["smem"]["C"]["swizzle"] == [3, 4, 3]
    assert describe(SWAP)["smem"]["A"]["swizzle"] == [3, 4, 3]


REGISTERS_PER_SM = 65_536  # §1: an H100/H200 SM's 32-bit registers
DECODE_GEMM1 = layer_configs(8, 8, 4096, 14336, 2)[0]  # §0's table: GEMM1 at decode, gated and gathering


def _launch_registers(cfg, capfd) -> int:
    """Registers per thread the kernel is launched with: ptxas's ``-v`` report for its PTX (the DSL's own
    toolchain, ``remarks{ptx}``), the count every warp starts at."""
    import cutlass.cute as cute

    from cute_moe.gemm_plan import GemmLaunch, fake_arguments

    capfd.readouterr()
    cute.compile(GemmLaunch(cfg, 132), *fake_arguments(cfg), options="remarks{ptx}")
    used = re.findall(r"Used (\d+) registers", "".join(capfd.readouterr()))
    assert len(used) == 1, used
    return int(used[0])


@pytest.mark.parametrize(
    "cfg, pool, split",
    [(SWAP, 64_512, 64_512), (NORMAL, 64_512, 64_512), (DECODE_GEMM1, 59_392, 34_816)],
    ids=["running-example", "prefill-normal", "decode-gemm1"],
)
def test_register_budget(cfg, pool, split, capfd):
    """§7: the setmaxnreg split must fit the CTA's pool — the launch's registers per thread × the CTA's
    threads — not the SM's register file: the running example's 40 · 128 + 232 · 256 = 64,512 = 168 · 384
    uses its pool exactly; the decode GEMM1 (256 threads, 232 per thread at launch) uses 34,816 of 59,392."""
    for n in (gemm.PRODUCER_REGISTERS, gemm.CONSUMER_REGISTERS):  # immediates in 24 … 256, multiples of 8
        assert 24 <= n <= 256 and n % 8 == 0
    ptx = cute_moe.compile_ptx(cfg)
    assert re.search(rf"\.reqntid {cfg.threads}, 1, 1\b", ptx) and re.search(r"\.minnctapersm 1\b", ptx)
    per_thread = _launch_registers(cfg, capfd)
    # .minnctapersm 1: ptxas keeps one CTA's threads within the SM's file, allocating in steps of 8 per thread
    assert per_thread <= REGISTERS_PER_SM // cfg.threads // 8 * 8
    used = 128 * gemm.PRODUCER_REGISTERS + 128 * cfg.consumer_warpgroups * gemm.CONSUMER_REGISTERS
    assert (per_thread * cfg.threads, used) == (pool, split)
    assert used <= per_thread * cfg.threads  # else a consumer warpgroup's setmaxnreg.inc would wait forever
    if cfg is SWAP:
        # the notes' counter-example: 32 / 240 fits the SM's 65,536 but asks 1,024 more than the pool holds
        other = 128 * 32 + 256 * 240
        assert other == REGISTERS_PER_SM and other - per_thread * cfg.threads == 1_024

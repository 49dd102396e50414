"""The layout explorer (python -m cute_moe.explore) reads the kernel's own layout data faithfully."""

import pytest

from cute_moe import explore
from cute_moe.config import choose_config
from cute_moe.layouts import describe


@pytest.mark.parametrize("swap", [True, False])
def test_owner_grid_inverts_the_gemm_accumulators(swap):
    cfg = choose_config(2, 28672, 4096, swap_ab=swap)
    desc = describe(cfg)
    grid = explore.owner_grid(desc)
    owners = [cell for row in grid for cell in row]
    assert len(set(owners)) == len(owners)  # one (thread, register) per output
    # Independently, from the GEMM-space accumulators: (m, n) is (token, weight) normally, (weight, token) swapped.
    for thread, coords in enumerate(desc["accumulators"]):
        for reg, (m, n) in enumerate(coords):
            token, weight = (n, m) if swap else (m, n)
            if token < len(grid) and weight < len(grid[0]):
                assert grid[token][weight] == f"{thread}.{reg}"


def test_cli_prints_the_rule_s_kernel_and_rejects_a_bad_tile(capsys):
    assert explore.main(["--tokens-per-expert", "2"]) == 0
    text = capsys.readouterr().out
    assert "swap_ab path" in text and "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16" in text
    assert explore.main(["--swap-ab", "--tokens-tile", "12"]) == 2
    assert "multiple of 8" in capsys.readouterr().err

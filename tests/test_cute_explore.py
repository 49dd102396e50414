"""The layout explorer (python -m cute_moe.lab.explore) reads the kernel's own layout data faithfully,
explains it, draws it, and refuses what the kernel refuses."""

import xml.etree.ElementTree as ET

import pytest

from cute_moe.lab import explore
from cute_moe.layouts import describe
from cute_moe.plan import choose_config


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


def test_cli_prints_the_rule_s_kernel_and_explains_the_swizzle(capsys):
    assert explore.main(["--tokens-per-expert", "2"]) == 0
    text = capsys.readouterr().out
    assert "swap_ab path" in text and "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16" in text
    # the swizzle is a permutation of the 16-byte chunks of each row: row r's chunk j lands in chunk j XOR r
    lines = text.splitlines()
    for r in range(8):
        row = next(line for line in lines if line.strip().startswith(f"row {r} "))
        assert row.split()[2:] == [str(j ^ r) for j in range(8)]
    assert "no conflict" in text and "8-way conflict" in text
    # the conflicts are ldmatrix / stmatrix's; WGMMA's descriptor has no mode for unswizzled 128-byte rows
    assert "an ldmatrix / stmatrix access (one chunk of each of 8 rows)" in text and "WGMMA core-matrix" not in text
    assert "WGMMA's descriptor: 128-byte swizzle mode; unswizzled rows 128 B apart: no mode" in text


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tokens-per-expert", "-1"], "--tokens-per-expert: expected a finite mean ≥ 0"),
        (["--tokens-per-expert", "nan"], "--tokens-per-expert"),
        (["--k", "4100"], "grouped_gemm: K=4100 must be a positive multiple of 8"),
        (["--n-out", "12"], "grouped_gemm: N_out=12 must be a positive multiple of 8"),
        (["--k", "0"], "K=0"),
        (["--experts", "0"], "--experts"),
        (["--swap-ab", "--tokens-tile", "12"], "multiple of 8"),
        (["--swap-ab", "--weights-tile", "256"], "at most 128"),
        (["--stages", "1"], "at least 2 stages"),
        (["--normal", "--tokens-per-expert", "512", "--stages", "8"], "shared memory over budget"),
    ],
)
def test_cli_refuses_what_the_kernel_refuses(capsys, argv, needle):
    assert explore.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_cli_draws_the_kernel(tmp_path, capsys):
    assert explore.main(["--tokens-per-expert", "2", "--svg", str(tmp_path)]) == 0
    assert "Pictures:" in capsys.readouterr().out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        [
            "fragment_bf16.svg",
            "fragment_fp8.svg",
            "smem_bf16.svg",
            "smem_fp8.svg",
            "swapab.svg",
            "pipeline_bf16.svg",
            "pipeline_fp8.svg",
            "tma.svg",
        ]
    )
    roots = {n: ET.parse(tmp_path / n).getroot() for n in names}
    assert roots["fragment_fp8.svg"].get("data-n") == "8"
    assert "m64n8k32" in roots["fragment_fp8.svg"].get("data-instruction")

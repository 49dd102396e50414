"""The course's steps against torch on a GPU (the H200 lane: python3 -m pytest -m gpu -q tests/test_course_gpu.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
COURSE = Path(__file__).resolve().parents[1] / "course"
pytestmark = pytest.mark.gpu


def step(name: str):
    if str(COURSE) not in sys.path:
        sys.path.insert(0, str(COURSE))
    if "_common" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_common", COURSE / "_common.py")
        sys.modules["_common"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["_common"])
    return sys.modules["_common"].load(name)


def bf16(*shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)


def reference(a, b):
    return a.float() @ b.float().T


@pytest.mark.parametrize("n", [8, 24, 64, 256])
def test_01_one_wgmma(n):
    s1 = step("01_wgmma")
    a, b = bf16(64, 16), bf16(n, 16, seed=1)
    c, owner = s1.wgmma(a, b)
    torch.testing.assert_close(c, reference(a, b), atol=1e-3, rtol=1e-3)
    # the kernel wrote owner[m, n] = 256·thread + register from its partition_C: the PTX ISA's figure
    owner = owner.cpu()
    for m in range(64):
        for col in range(n):
            t, r = divmod(int(owner[m, col]), 256)
            assert s1.ptx_owner(t, r) == (m, col)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_02_tma_gemm(n):
    s2 = step("02_tma")
    a, b = bf16(256, 512), bf16(2 * n, 512, seed=1)
    torch.testing.assert_close(s2.gemm(a, b, n), reference(a, b), atol=2e-2, rtol=1e-3)


def test_02_tma_fills_rows_past_the_tensor_with_zeros():
    """B's box reaches 5 rows past B's last row: TMA lands them as zeros (PTX ISA, "Out of Boundary Access":
    the tensor map's zero-fill mode, not OOB-NaN), so C's last 5 columns are exactly 0 — the fact step 6's
    padding columns rely on."""
    import cutlass.cute as cute

    s2, n = step("02_tma"), 64
    a, b = bf16(64, 128), bf16(n - 5, 128, seed=1)
    c = torch.full((64, n), float("nan"), device="cuda")
    args = [s2.course.to_cute(t, leading_dim=1) for t in (a, b, c)] + [s2.course.stream()]
    cute.compile(s2.TmaGemm(n), *args)(*args)
    torch.testing.assert_close(c[:, : n - 5], reference(a, b), atol=2e-2, rtol=1e-3)
    assert torch.equal(c[:, n - 5 :], torch.zeros(64, 5, device="cuda"))


def test_02_bad_k_is_refused():
    with pytest.raises(ValueError, match="K"):
        step("02_tma").gemm(bf16(64, 48), bf16(128, 48))


@pytest.mark.parametrize("n,stages", [(64, 2), (128, 4), (256, 3)])
def test_03_ring_gemm(n, stages):
    s3 = step("03_ring")
    a, b = bf16(256, 1024), bf16(2 * n, 1024, seed=1)  # 16 K steps: several laps of the ring
    torch.testing.assert_close(s3.gemm(a, b, n, stages), reference(a, b), atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("n", [128, 256])
def test_04_setmaxnreg_gemm(n):
    s4 = step("04_setmaxnreg")
    a, b = bf16(384, 1024), bf16(2 * n, 1024, seed=1)
    torch.testing.assert_close(s4.gemm(a, b, n), reference(a, b), atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("ctas,group", [(132, 8), (5, 2), (1, 3)])
def test_05_persistent_gemm(ctas, group):
    s5 = step("05_persistent")
    a, b = bf16(128 * 9, 512), bf16(256 * 5, 512, seed=1)  # 45 tiles: several per CTA, a short last group
    torch.testing.assert_close(s5.gemm(a, b, 256, 4, ctas, group), reference(a, b), atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("tokens", [1, 2, 7, 20, 64])
def test_06_swap_ab_linear(tokens):
    s6 = step("06_swap_ab")
    x, w = bf16(tokens, 1024), bf16(128 * 3, 1024, seed=1)
    torch.testing.assert_close(s6.linear_swap_ab(x, w), reference(x, w), atol=2e-2, rtol=1e-3)


def test_07_fp8_two_level():
    s7 = step("07_fp8")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 4096, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(256, 4096, device="cuda", generator=g).to(torch.float8_e4m3fn)
    ref = (a.float() @ b.float().T) * 0.5 * 0.25
    # two-level: the fp32 sum of exact fp8 products, near the fp32 reference even over K = 4096
    torch.testing.assert_close(s7.gemm(a, b, 0.5, 0.25), ref, atol=1e-2, rtol=1e-4)


@pytest.mark.parametrize("ctas", [132, 3])
def test_08_grouped_moe(ctas):
    s8 = step("08_grouped_moe")
    experts, tokens = 5, 700
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w = bf16(tokens, 512), bf16(experts, 512, 512, seed=1)
    expert_of_token = torch.randint(0, experts - 1, (tokens,), device="cuda", generator=g)  # expert 4 idle
    ref = torch.stack([x[t].float() @ w[int(e)].float().T for t, e in enumerate(expert_of_token.tolist())])
    torch.testing.assert_close(s8.moe_gemm(x, w, expert_of_token, ctas=ctas), ref, atol=2e-2, rtol=1e-3)

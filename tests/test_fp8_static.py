"""Static (calibrated) activation scales for fp8_tensor: ``a1_scale`` (x) and ``a2_scale`` (the
intermediate SiLU·up), on the CPU (Triton interpreter).

* the reference: ``quantize_activation_static`` is ``e4m3(clamp(a / s, ±448))`` — with the batch's
  own dynamic scale it is the dynamic quantization; values beyond 448·s saturate;
* the oracle with the calibrated scales of a batch is the dynamic oracle of that batch, bit for bit;
* triton_moe's quantize kernel with a static scale is the reference bit for bit, and the layer
  matches the static oracle (scales that saturate included), swap-AB on and off, top_k 1 and 2;
* six launches (the dynamic fp8_tensor call has eight: no amax of x, and GEMM1's epilogue quantizes the
  intermediate, triton_moe.plan.epilogue_quant), no torch kernel, no host read;
* bad arguments are named before any launch; bad values are flagged in the error word (device
  mode) or raised before the launch (sync mode); cute_moe applies the same checks (its static
  layer on the GPU: tests/test_cute_static.py).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_spec.oracle import calibrate_static_scales, oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.quant import FP8_MAX, quantize_activation, quantize_activation_static, static_scale_of
from moe_spec.validate import check, checks, validate_moe_args

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

SMALL = MoEShape("tiny", 8, 2, 160, 80, "test shape: K, I not multiples of the tiles")
TOL = 1e-2


def _inputs(T=11, seed=1, shape=SMALL):
    inp = make_inputs(shape, T, "fp8_tensor", seed=seed)
    a1, a2 = calibrate_static_scales(**inp.kwargs())
    return inp.kwargs(), a1, a2


def _config(swap_ab):
    from triton_moe import TritonConfig

    return TritonConfig(16, 64 if swap_ab else 32, 64, 1, 4, 2, swap_ab)


# --- the reference -----------------------------------------------------------------------------


def test_static_quantization_with_the_dynamic_scale_is_the_dynamic_one():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(7, 300, generator=g) * 5).bfloat16()
    q, s = quantize_activation(a, "fp8_tensor")
    for scale in (s, s.reshape(())):
        q_static = quantize_activation_static(a, scale)
        assert q_static.dtype == torch.float8_e4m3fn and torch.equal(q_static.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(static_scale_of(a.float().abs().max()), s)


def test_static_quantization_saturates_beyond_448_s():
    a = torch.tensor([[0.0, 1.0, -2.0, 28.0, 29.0, -1000.0, float("nan")]])
    s = torch.tensor([0.0625])  # a power of two: a / s is exact; 448·s = 28
    q = quantize_activation_static(a, s).float()
    assert q[0, :6].tolist() == [0.0, 16.0, -32.0, FP8_MAX, FP8_MAX, -FP8_MAX]  # 464 and 16000 saturate
    assert q[0, 6].isnan()  # a NaN stays a NaN, in its own value only


def test_oracle_with_calibrated_scales_is_the_dynamic_oracle():
    kw, a1, a2 = _inputs()
    assert a1.shape == a2.shape == (1,) and a1.dtype == torch.float32
    assert torch.equal(oracle(**kw, a1_scale=a1, a2_scale=a2), oracle(**kw))
    # smaller scales clip: another function, which the oracle computes
    clipped = oracle(**kw, a1_scale=a1 / 4, a2_scale=a2 / 8)
    assert rel_l2(clipped, oracle(**kw)) > 0.1


def test_static_scale_rows_do_not_depend_on_the_batch_in_the_oracle():
    """With static scales a token's row is a function of that token alone (the dynamic per-tensor
    scale is not: the batch's amax moves it)."""
    kw, a1, a2 = _inputs(T=9, seed=4)
    big = oracle(**kw, a1_scale=a1, a2_scale=a2)
    one = {**kw, "x": kw["x"][5:6], "topk_weights": kw["topk_weights"][5:6], "topk_ids": kw["topk_ids"][5:6]}
    assert rel_l2(oracle(**one, a1_scale=a1, a2_scale=a2)[0], big[5]) < 1e-12
    assert rel_l2(oracle(**one)[0], oracle(**kw)[5]) > 1e-6  # the dynamic scale differs


# --- triton_moe ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scale_shape", [(1,), ()], ids=["shape1", "shape0"])
def test_quantize_kernel_with_a_static_scale_is_the_reference(dtype, scale_shape):
    """Values compared, not bits: the interpreter's e4m3 cast turns −0 into +0. A scale below the
    amax makes values saturate; the kernel leaves the given scale as it was."""
    from triton_moe.moe import _quantize

    g = torch.Generator().manual_seed(7)
    a = (torch.randn(6, 300, generator=g) * 3).to(dtype)
    a[1, :200] *= 100
    for s in (torch.tensor([0.0123]), static_scale_of(a.float().abs().max())):
        s = s.reshape(scale_shape)
        given = s.clone()
        q, scale = _quantize(a, "fp8_tensor", scale=s, static_bit=32)
        assert scale is s and torch.equal(s, given)
        assert torch.equal(q.float(), quantize_activation_static(a, s).float())
    check()


@pytest.mark.parametrize("swap_ab", [False, True], ids=["noswap", "swap"])
@pytest.mark.parametrize("clip", [False, True], ids=["calibrated", "clipping"])
def test_matches_the_static_oracle(swap_ab, clip):
    from triton_moe import fused_moe

    kw, a1, a2 = _inputs()
    if clip:  # scales below the batch's amaxes: x and the intermediate saturate in places
        a1, a2 = a1 / 4, a2 / 8
    out = fused_moe(**kw, a1_scale=a1, a2_scale=a2, config=_config(swap_ab))
    assert out.dtype == torch.bfloat16 and out.shape == kw["x"].shape
    assert rel_l2(out, oracle(**kw, a1_scale=a1, a2_scale=a2)) <= TOL
    check()


def test_top_k_one_and_the_vllm_spelling():
    from triton_moe import fused_experts, fused_moe

    kw, a1, a2 = _inputs(T=7, seed=2, shape=MoEShape("one", 8, 1, 64, 48, "test"))
    out = fused_moe(**kw, a1_scale=a1.reshape(()), a2_scale=a2)
    assert rel_l2(out, oracle(**kw, a1_scale=a1, a2_scale=a2)) <= TOL
    vllm = fused_experts(
        kw["x"],
        kw["w1"],
        kw["w2"],
        kw["topk_weights"],
        kw["topk_ids"],
        use_fp8_w8a8=True,
        w1_scale=kw["w1_scale"],
        w2_scale=kw["w2_scale"],
        a1_scale=a1.reshape(()),
        a2_scale=a2,
    )
    assert torch.equal(vllm, out)


class _CountOps(TorchDispatchMode):
    """aten ops run inside the block (as tests/test_launches.py counts them)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


NO_LAUNCH = {
    "empty",
    "empty_strided",
    "new_empty",
    "view",
    "_unsafe_view",
    "reshape",
    "slice",
    "select",
    "alias",
    "as_strided",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "detach",
    "lift_fresh",
    "_reshape_alias",
}


@pytest.mark.parametrize(
    "top_k, static, expected",
    [
        (
            2,
            True,
            [
                "_count_kernel",
                "_place_kernel",
                "quantize_kernel",
                "moe_gemm_kernel",
                "quantize_kernel",
                "moe_gemm_kernel",
                "combine_kernel",
            ],
        ),
        (
            2,
            False,
            [
                "_count_kernel",
                "_place_kernel",
                "amax_kernel",
                "quantize_kernel",
                "moe_gemm_kernel",
                "quantize_kernel",
                "moe_gemm_kernel",
                "combine_kernel",
            ],
        ),
        (
            1,
            True,
            [
                "_count_kernel",
                "_place_kernel",
                "quantize_kernel",
                "moe_gemm_kernel",
                "quantize_kernel",
                "moe_gemm_kernel",
            ],
        ),
    ],
    ids=["static", "dynamic", "static-top1"],
)
def test_launches(top_k, static, expected):
    """Static scales: the amax kernel is not launched, and GEMM1's epilogue quantizes the intermediate
    (triton_moe.plan.epilogue_quant; the lists above are the separate path's) — 6 launches at top_k
    = 2, 5 at top_k = 1, against 8 and 7 with dynamic scales — and still no torch kernel and no host
    read."""
    from moe_spec.validate import MoEDims
    from triton_moe import fused_moe
    from triton_moe.jit import count_compilations
    from triton_moe.plan import plan

    shape = MoEShape("launches", 8, top_k, 128, 64, "test")
    kw = make_inputs(shape, 300, "fp8_tensor", seed=0).kwargs()
    if static:
        kw.update(a1_scale=torch.tensor([0.01]), a2_scale=torch.tensor([0.002]))
    p = plan(MoEDims(T=300, E=8, K=128, I=64, top_k=top_k), "fp8_tensor")
    if p.epilogue_quant(static):
        expected = expected[:4] + expected[5:]  # no quantize launch between the GEMMs
        assert static and len(expected) == 4 + top_k
    if p.x_quant_in_gemm1(static):  # a decode-size GEMM1 tile quantizes x in its A load
        expected = expected[:2] + expected[3:]
    with count_compilations(dry_run=True):
        fused_moe(**kw)  # warm: the error word, the workspace, the plan
    with count_compilations(dry_run=True) as counter, _CountOps() as ops:
        fused_moe(**kw)
    assert counter.launches == expected
    assert [op for op in ops.ops if op not in NO_LAUNCH] == [] and "_local_scalar_dense" not in ops.ops


# --- bad input -------------------------------------------------------------------------------------

ONE = torch.tensor([0.01])
BAD = [
    # (id, quant, a1_scale, a2_scale, exception, argument named)
    ("a1 without a2", "fp8_tensor", ONE, None, ValueError, "a2_scale"),
    ("a2 without a1", "fp8_tensor", None, ONE, ValueError, "a1_scale"),
    ("bf16", None, ONE, ONE, ValueError, "a1_scale"),
    ("fp8_channel", "fp8_channel", ONE, ONE, ValueError, "a1_scale"),
    ("fp8_block, a2 only", "fp8_block", None, ONE, ValueError, "a2_scale"),
    ("not a tensor", "fp8_tensor", 0.01, ONE, TypeError, "a1_scale"),
    ("bf16 scale", "fp8_tensor", ONE, ONE.bfloat16(), TypeError, "a2_scale"),
    ("two elements", "fp8_tensor", torch.ones(2), ONE, ValueError, "a1_scale"),
    ("shape [1, 1]", "fp8_tensor", ONE, ONE.reshape(1, 1), ValueError, "a2_scale"),
    ("per expert [E]", "fp8_tensor", torch.ones(8), ONE, ValueError, "a1_scale"),
    ("meta", "fp8_tensor", torch.empty(1, device="meta"), ONE, ValueError, "a1_scale"),
]


@pytest.mark.parametrize("quant, a1, a2, exc, name", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
@pytest.mark.parametrize("backend", ["triton_moe", "cute_moe"])
def test_bad_static_scale_is_named_before_any_launch(backend, quant, a1, a2, exc, name):
    from triton_moe.jit import count_compilations

    kw = make_inputs(SMALL, 3, quant, seed=0).kwargs()
    with pytest.raises(exc, match=f"^{name}:"):
        validate_moe_args(**kw, a1_scale=a1, a2_scale=a2)
    if backend == "triton_moe":
        from triton_moe import fused_moe
    else:
        from cute_moe import fused_moe
    with count_compilations(dry_run=True) as counter, pytest.raises(exc, match=f"^{name}:"):
        fused_moe(**kw, a1_scale=a1, a2_scale=a2)
    assert counter.launches == []


def test_cute_moe_takes_them_through_fused_experts_with_the_same_checks():
    """vLLM's call shape carries the static scales to cute_moe as to triton_moe: a lone one is
    refused naming the missing one (the layer itself runs in tests/test_cute_static.py, GPU)."""
    from cute_moe import fused_experts

    kw, a1, _ = _inputs(T=2)
    with pytest.raises(ValueError, match="^a2_scale:"):
        fused_experts(
            kw["x"],
            kw["w1"],
            kw["w2"],
            kw["topk_weights"],
            kw["topk_ids"],
            use_fp8_w8a8=True,
            w1_scale=kw["w1_scale"],
            w2_scale=kw["w2_scale"],
            a1_scale=a1,
        )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy divides by the bad scale
@pytest.mark.parametrize("which", ["a1_scale", "a2_scale"])
@pytest.mark.parametrize("value", [0.0, -0.01, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_bad_static_scale_value_is_flagged_on_the_device_and_raised_in_sync_mode(which, value):
    from triton_moe import fused_moe

    kw, a1, a2 = _inputs(T=4)
    scales = {"a1_scale": a1, "a2_scale": a2}
    scales[which] = torch.tensor([value])
    check()
    fused_moe(**kw, **scales)  # device mode: no raise, no sync
    with pytest.raises(ValueError, match=f"^{which}: expected a finite, positive static activation scale"):
        check()
    check()  # cleared
    with checks("sync"), pytest.raises(ValueError, match=f"^{which}: expected a finite, positive"):
        fused_moe(**kw, **scales)
    with pytest.raises(ValueError, match=f"^{which}:"):
        oracle(**kw, **scales)  # the oracle reads the data on the host


def test_good_static_scales_set_no_bit():
    from triton_moe import fused_moe

    kw, a1, a2 = _inputs(T=4)
    check()
    fused_moe(**kw, a1_scale=a1, a2_scale=a2)
    check()  # raises if a bit was set


# --- compiled for Hopper on the CPU (Triton's compiler + its bundled ptxas, in a subprocess) --------

SM90_SCRIPT = r"""
import json
from triton_moe.sm90 import compile_sm90
from triton_moe.kernels import moe_gemm_kernel
from triton_moe.kernels_rows import quantize_kernel

out = {}
for dtype in ("bf16", "fp32"):  # x, the intermediate
    sig = {"a_ptr": f"*{dtype}", "amax_ptr": "*i32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "zero_ptr": "*fp32",
           "num_rows": "i32", "K": "i32", "num_amax": "i32", "zero_count": "i32"}
    r = compile_sm90(quantize_kernel, sig, dict(QUANT=1, AMAX_GIVEN=False, GROUPS=8, INTERPRETER=False, STATIC_BIT=32),
                     num_warps=4, num_stages=1)
    out[f"quantize {dtype}"] = dict(spills=r["spill_bytes"], atomic_or=r["ttgir"].count("tt.atomic_rmw or"))
for static in (False, True):
    ptrs = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*fp32", "sorted_ids_ptr": "*i32",
            "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32", "topk_ids_ptr": "*i32", "error_ptr": "*i32"}
    sig = {n: ptrs.get(n, "*fp32") for n in moe_gemm_kernel.arg_names if n.endswith("_ptr")}
    sig.update(num_pairs="i32", N="i32", K="i32", E="i32")
    cex = dict(A_ROW_DIV=2, FUSE_SILU=True, MUL_ROUTED_WEIGHT=False, QUANT=1, FP8_IMPRECISE_ACC=0, SWAP_AB=False,
               INTERPRETER=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)  # the prefill tile
    if static:
        del sig["out_amax_ptr"]
        cex["out_amax_ptr"] = None
    r = compile_sm90(moe_gemm_kernel, sig, cex, num_warps=8, num_stages=3,
                     divisible_by_16=[n for n in sig if n != "num_pairs"])
    out[f"gemm1 static={static}"] = dict(spills=r["spill_bytes"], atomic_max=r["ttgir"].count("tt.atomic_rmw max"))
print(json.dumps(out))
"""


def test_static_scale_kernels_compile_for_sm90():
    """The static-scale quantize kernel (a scale read and checked, the error word's atomic OR) and
    GEMM1 without its amax pointer compile for Hopper, spilling at most a word; GEMM1's atomic max of the
    intermediate is
    gone from the static variant and present in the dynamic one."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SM90_SCRIPT], capture_output=True, text=True, env=env)
    if run.returncode and "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["quantize bf16"]["spills"] == r["quantize fp32"]["spills"] == r["gemm1 static=False"]["spills"] == 0, r
    # GEMM1's prefill tile holds two 128×128 fp32 accumulators in 8 warps; with the 64-bit row and
    # expert offsets, ptxas spills 4 bytes of the static variant (outside the K loop's operands)
    assert r["gemm1 static=True"]["spills"] <= 8, r
    assert r["quantize bf16"]["atomic_or"] == r["quantize fp32"]["atomic_or"] == 1, r
    assert r["gemm1 static=True"]["atomic_max"] == 0 < r["gemm1 static=False"]["atomic_max"], r

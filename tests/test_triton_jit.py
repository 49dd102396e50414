"""No recompilation when the batch changes: every launch of a sweep T = 1 … 8192 maps to the
specialization keys seen in the warm-up, for each (dtype, config) variant.

The keys are computed by Triton's own argument binder (see :mod:`triton_moe.jit`), i.e. the cache
key a GPU launch would look up. The CPU sweep records keys without running kernels
(``dry_run``), so it covers large T in seconds; a short real sweep checks that dry and real runs
record the same keys. The control test shows the counter catches a kernel without
``do_not_specialize``. (Checked by hand once: dropping ``do_not_specialize`` from
``moe_gemm_kernel`` makes ``test_sweep_does_not_recompile`` fail: two new moe_gemm_kernel keys.)
"""

import pytest
import torch
import triton
import triton.language as tl

from moe_spec.problem import MoEShape, make_inputs
from moe_spec.validate import MoEDims
from triton_moe import TritonConfig, fused_moe
from triton_moe.jit import count_compilations, launch, specialization_key
from triton_moe.plan import plan

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

SHAPE = MoEShape("sweep", 8, 2, 64, 48, "test")
SWEEP = [
    1,
    2,
    3,
    7,
    8,
    15,
    16,
    17,
    31,
    32,
    33,
    48,
    63,
    64,
    65,
    100,
    127,
    128,
    129,
    255,
    256,
    257,
    500,
    511,
    512,
    1000,
    1023,
    1024,
    1025,
    2047,
    2048,
    3001,
    4095,
    4096,
    4097,
    8191,
    8192,
]
VARIANTS = [
    (q, cfg)
    for q in (None, "fp8_tensor", "fp8_channel", "fp8_block")
    for cfg in (TritonConfig(16, 64, 64, swap_ab=True), TritonConfig(64, 64, 64, 8, swap_ab=False))
] + [
    ("fp8_tensor", TritonConfig(64, 64, 256, 8, swap_ab=False)),  # promoted inside the dot
    ("fp8_block", TritonConfig(16, 128, 64, swap_ab=True)),  # GEMM1 quantizes the intermediate
]


@pytest.mark.parametrize(
    "quant, config",
    VARIANTS,
    ids=lambda v: (
        str(v) if not isinstance(v, TritonConfig) else f"M{v.BLOCK_M}K{v.BLOCK_K}{'swap' if v.swap_ab else ''}"
    ),
)
def test_sweep_does_not_recompile(quant, config):
    with count_compilations(dry_run=True) as counter:
        fused_moe(**make_inputs(SHAPE, 5, quant, seed=0).kwargs(), config=config)  # warm-up
        warm = counter.total()
        counter.mark()
        for T in SWEEP:
            fused_moe(**make_inputs(SHAPE, T, quant, seed=T).kwargs(), config=config)
    # align ×2, GEMM1, GEMM2, combine (+ quantize ×2, + amax for fp8_tensor; one quantize less where
    # GEMM1's epilogue quantizes the intermediate: triton_moe.plan.epilogue_quant; one less again where
    # GEMM1 quantizes x in its A load: triton_moe.plan.x_quant_in_gemm1)
    p = plan(
        MoEDims(T=5, E=SHAPE.num_experts, K=SHAPE.hidden, I=SHAPE.intermediate, top_k=SHAPE.top_k), quant, config=config
    )
    assert warm == {None: 5, "fp8_tensor": 8}.get(quant, 7) - p.epilogue_quant() - p.x_quant_in_gemm1()
    assert counter.new_keys == {}, f"recompilations: {counter.new_keys}"


def test_real_launches_record_the_dry_run_keys():
    cfg = TritonConfig(16, 64, 64, swap_ab=True)
    keys = []
    for dry in (True, False):
        with count_compilations(dry_run=dry) as counter:
            for T in (1, 16, 17):
                fused_moe(**make_inputs(SHAPE, T, "fp8_block", seed=T).kwargs(), config=cfg)
        keys.append(dict(counter.keys))
    assert keys[0] == keys[1]
    # one binary per kernel, two for the GEMM (GEMM1 and GEMM2 are different constexpr variants)
    # and for quantize_kernel (x: bf16, amax found in-kernel; intermediate: fp32, amax given)
    assert {k: len(v) for k, v in keys[1].items()} == {
        "_count_kernel": 1,
        "_place_kernel": 1,
        "quantize_kernel": 2,
        "moe_gemm_kernel": 2,
        "combine_kernel": 1,
    }


@triton.jit
def _specializing_kernel(x_ptr, n):
    tl.store(x_ptr + tl.program_id(0), n)


def test_counter_sees_specialization():
    """Control: an int argument WITHOUT do_not_specialize gets a new key at 1 and at multiples of 16."""
    x = torch.zeros(1, dtype=torch.int32)
    keys = {specialization_key(_specializing_kernel, (x, n), {}) for n in (1, 16, 17, 32)}
    assert len(keys) == 3  # ==1, %16==0, other
    with count_compilations(dry_run=True) as counter:
        for n in (2, 16, 1):
            launch(_specializing_kernel, (1,), x, n)
    assert counter.total() == 3

"""triton_moe's plan names the tensor-core instruction each GEMM compiles to: the rule in
config.mma_instruction (implied by the tile and the dtype) against the PTX Triton's compiler
produces for sm_90a on the CPU. Runs in a subprocess: the test session imports the interpreted
kernels (``TRITON_INTERPRET=1``)."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, re, sys
from triton_moe.config import TritonConfig, mma_instruction
from triton_moe.sm90 import build_sm90
from triton_moe.kernels import QUANT_MODE, moe_gemm_kernel

def ptx_instructions(cfg, quant, fuse_silu):
    op = "*bf16" if quant is None else "*fp8e4nv"
    ptrs = {"a_ptr": op, "w_ptr": op, "out_ptr": "*fp32" if quant and fuse_silu else "*bf16",
            "sorted_ids_ptr": "*i32", "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32",
        "topk_ids_ptr": "*i32", "error_ptr": "*i32"}
    names = moe_gemm_kernel.arg_names
    sig = {n: ptrs.get(n, "*fp32") for n in names if n.endswith("_ptr")}
    sig.update(num_pairs="i32", N="i32", K="i32", E="i32")
    cex = dict(A_ROW_DIV=1, FUSE_SILU=fuse_silu, MUL_ROUTED_WEIGHT=not fuse_silu, QUANT=QUANT_MODE[quant],
               FP8_IMPRECISE_ACC=0, SWAP_AB=cfg.swap_ab, INTERPRETER=False, BLOCK_M=cfg.BLOCK_M,
               BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, SPLIT_K=cfg.split_k)
    ptx = build_sm90(moe_gemm_kernel, sig, cex, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     divisible_by_16=[n for n in sig if n != "num_pairs"]).asm["ptx"]
    return sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)\.\S+?(?=[\s;])", ptx)))

out = []
for fields, quant, fuse_silu in json.loads(sys.argv[1]):
    cfg = TritonConfig(*fields).resolved()
    out.append([ptx_instructions(cfg, quant, fuse_silu), mma_instruction(cfg, quant)])
print(json.dumps(out))
"""

CASES = [  # (TritonConfig fields, quant, GEMM1?) — the heuristic's tiles, and the rule's corners
    ((16, 64, 64, 1, 4, 4), None, True),  # swap-AB decode tile: tokens are WGMMA's N
    ((32, 64, 64, 1, 8, 4), None, False),  # swap-AB, 8 warps: two warpgroups split N
    ((64, 128, 64, 8, 8, 4), None, False),  # M = 64 with 8 warps: N split in two
    ((128, 128, 64, 8, 8, 3), None, True),  # prefill: two warpgroups along M
    ((16, 32, 64, 1, 4, 4), None, False),  # no swap (BLOCK_N < 64), M = 16: mma.sync
    ((16, 32, 128, 1, 4, 4), "fp8_tensor", False),  # ... FP8 through fp16 mma.sync
    ((128, 128, 128, 8, 8, 3), "fp8_tensor", True),  # FP8 WGMMA: K = 32
]


def test_mma_instruction_is_what_triton_compiles():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for case, (compiled, planned) in zip(CASES, results):
        assert compiled == [planned], (case, compiled, planned)


def test_only_a_gemm2_of_few_k_steps_reads_its_routing_before_the_loop():
    """EARLY_ROUTING: GEMM2 with at most EARLY_ROUTING_MAX_K_STEPS steps of BLOCK_K (DeepSeek-V3 TP8's
    I = 256); a longer GEMM2 (Qwen3-30B-A3B's 768) and GEMM1 read them in the epilogue."""
    from triton_moe.config import EARLY_ROUTING_MAX_K_STEPS, TritonConfig
    from triton_moe.moe import _gemm_constants

    cfg = TritonConfig(128, 128, 64, 8, 8, 3)
    assert _gemm_constants(cfg, None, False, 1, 64 * EARLY_ROUTING_MAX_K_STEPS)["EARLY_ROUTING"] is True
    assert _gemm_constants(cfg, None, False, 1, 64 * EARLY_ROUTING_MAX_K_STEPS + 1)["EARLY_ROUTING"] is False
    assert _gemm_constants(cfg, None, False, 1, 768)["EARLY_ROUTING"] is False
    assert _gemm_constants(cfg, None, True, 8, 256)["EARLY_ROUTING"] is False

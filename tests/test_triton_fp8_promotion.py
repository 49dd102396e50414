"""What Triton 3.6 makes of the two FP8 promotion variants (notes/triton_moe.md, "FP8 promotion").

Compiled for sm_90a on the CPU (Triton's compiler, its bundled ptxas and cuobjdump; no GPU), GEMM2
of ``moe_gemm_kernel``, fp8_tensor, 128×128×128, 8 warps, 3 stages:

* ``FP8_IMPRECISE_ACC = 0`` (``acc += tl.dot(a, w)``): TTGIR has a dot on a zero accumulator with
  the default ``maxNumImpreciseAcc = 2**30``, a wait with ``pendings = 0``, then ``arith.addf``;
  the PTX's loop waits for 0 groups before its fp32 adds.
* ``FP8_IMPRECISE_ACC = 128`` (``tl.dot(a, w, acc, max_num_imprecise_acc=128)``): TTGIR has a dot
  that accumulates into ``acc`` with ``maxNumImpreciseAcc = 128`` and a wait with ``pendings = 1``;
  the PTX adds the partial sums *before* its ``wait_group 1`` — reading WGMMA registers before a
  wait — and ptxas injects the wait itself (message C7517).
* The SASS of both: ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` then the FADDs, every K step.
* An explicit ``max_num_imprecise_acc`` larger than the dot's K is a ValueError.

Runs in a subprocess because the test session imports the interpreted kernels
(``TRITON_INTERPRET=1``).
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton_moe.sm90 import build_sm90
from triton_moe.kernels import moe_gemm_kernel

names = moe_gemm_kernel.arg_names
ptrs = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*bf16",
        "sorted_ids_ptr": "*i32", "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32",
        "topk_ids_ptr": "*i32", "error_ptr": "*i32"}
sig = {n: ptrs.get(n, "*fp32") for n in names if n.endswith("_ptr")}
sig.update(num_pairs="i32", N="i32", K="i32", E="i32")
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_gemm2(imprecise, block_k=128):
    cex = dict(A_ROW_DIV=1, FUSE_SILU=False, MUL_ROUTED_WEIGHT=True, QUANT=1, FP8_IMPRECISE_ACC=imprecise,
               SWAP_AB=False, INTERPRETER=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8)
    return build_sm90(moe_gemm_kernel, sig, cex, num_warps=8, num_stages=3,
                      divisible_by_16=[n for n in sig if n != "num_pairs"])


def loop_events(ptx):
    # the K loop: from the inner-loop header label to the branch back to it
    header = re.search(r"^(\$L__BB\d+_\d+):\s*// =>This Inner Loop Header", ptx, re.M)
    body = ptx[header.end():ptx.index("bra \t" + header.group(1)) if ("bra \t" + header.group(1)) in ptx
               else ptx.index(header.group(1) + ";", header.end())]
    events = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        for key in ("wgmma.mma_async", "wgmma.commit_group", "add.f32"):
            if line.startswith(key):
                events.append(key)
        m = re.match(r"wgmma\.wait_group\.sync\.aligned (\d+)", line)
        if m:
            events.append("wait " + m.group(1))
    return [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]


out = {}
for imprecise in (0, 128):
    c = compile_gemm2(imprecise)
    ttgir, ptx = c.asm["ttgir"], c.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        open(path, "w").write(ptx)
        cubin = os.path.join(d, "k.cubin")
        ptxas = subprocess.run([os.path.join(bindir, "ptxas"), "--gpu-name", "sm_90a", path, "-o", cubin],
                               capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
    ins = [re.sub(r"\s+", " ", m.group(1)).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    waits = [i for i, s in enumerate(ins) if s.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    out[imprecise] = {
        "max_num_imprecise_acc": [int(v) for v in re.findall(r"maxNumImpreciseAcc = (\d+)", ttgir)],
        "pendings": [int(v) for v in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)],
        "addf_after_dot": bool(re.search(r"warp_group_dot_wait[^\n]*\n\s*%\S+ = arith\.addf", ttgir)),
        "ptx_loop": loop_events(ptx),
        "ptxas_injects_wait": "C7517" in ptxas.stderr,
        "sass_wait0_then_fadd": bool(ins) and any(any(s.startswith("FADD") for s in ins[i + 1:i + 4]) for i in waits),
        "sass_first_mma_zero_acc": any(s.startswith("QGMMA") and ", RZ" in s for s in ins),
        "have_sass": bool(ins),
    }
try:
    compile_gemm2(256)
    out["too_large"] = None
except Exception as e:  # Triton wraps the ValueError of tl.dot in its CompilationError: walk the causes
    chain = []
    while e is not None:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    out["too_large"] = chain
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def facts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env)
    if run.returncode and "No such file" in run.stderr and ("ptxas" in run.stderr or "cuobjdump" in run.stderr):
        pytest.skip("Triton's bundled ptxas / cuobjdump is missing")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_ttgir_of_the_two_variants_differs(facts):
    add, acc = facts["0"], facts["128"]
    assert add["max_num_imprecise_acc"] == [2**30] and add["pendings"] == [0] and add["addf_after_dot"]
    assert acc["max_num_imprecise_acc"] == [128] and acc["pendings"] == [1, 0] and not acc["addf_after_dot"]


def test_ptx_of_the_two_variants_orders_wait_and_add_differently(facts):
    assert facts["0"]["ptx_loop"] == ["wgmma.mma_async", "wgmma.commit_group", "wait 0", "add.f32"]
    assert facts["128"]["ptx_loop"] == ["wgmma.mma_async", "add.f32", "wgmma.commit_group", "wait 1"]


def test_ptxas_makes_them_the_same(facts):
    assert not facts["0"]["ptxas_injects_wait"] and facts["128"]["ptxas_injects_wait"]
    for v in ("0", "128"):
        if not facts[v]["have_sass"]:
            pytest.skip("cuobjdump printed no SASS")
        assert facts[v]["sass_wait0_then_fadd"] and facts[v]["sass_first_mma_zero_acc"], facts[v]


def test_explicit_imprecise_acc_above_k_is_refused(facts):
    assert facts["too_large"], "compiled with max_num_imprecise_acc = 256 > BLOCK_K = 128"
    assert any(
        c.startswith("ValueError") and "max_num_imprecise_acc (256) must be <= K (128)" in c for c in facts["too_large"]
    ), facts["too_large"]

"""``triton_moe.jit.Bound``: a launch whose grid and constexprs are bound once per plan and shape.

On the CPU, against the stand-in sm_90 driver of :mod:`triton_moe.lab.hostcost` (real
``JITFunction``\\ s, Triton's own ``run``, a launcher that records its arguments): a bound launch
repeated with the same argument classes goes straight to the compiled kernel with the arguments
``run`` passes; a changed class compiles through ``run``; a compile counter sees every bound launch;
``forget_fast`` drops its entries. In a process as on a GPU, ``fused_moe`` called repeatedly at the
same shape (bf16, FP8, static scales, split-K) launches exactly what it launches through ``run``.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from triton_moe import jit
from triton_moe.jit import Bound, count_compilations, launch
from triton_moe.lab.hostcost import stand_in_driver


def _body(x_ptr, y_ptr, n, m, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * m, mask=i < n)


def _kernel():
    return JITFunction(_body, do_not_specialize=["n"])


@pytest.fixture
def driver():
    if torch.cuda.is_available():
        pytest.skip("the stand-in driver is for a machine without a GPU")
    with stand_in_driver(stream=11) as compiled:
        yield compiled


def _record(compiled):
    for k in compiled:
        k.record = True
        k.launches.clear()


def test_a_repeated_bound_launch_is_runs_launch(driver, monkeypatch):
    k = _kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    bound = Bound(k, (2,), BLOCK=32)
    bound(x, y, 5, 3)  # compiles through run
    bound(x, y, 5, 3)  # the kernel's direct path; the bound launch keeps its entry
    assert len(driver) == 1 and len(bound._hits) == 1
    _record(driver)
    jit.FAST_LAUNCH = False
    try:
        bound(x, y, 7, 3)  # through run
    finally:
        jit.FAST_LAUNCH = True
    driver.driver.stream = 12

    def no_lookup(*a, **kw):
        raise AssertionError("a bound hit must not go through the kernel's direct path")

    monkeypatch.setattr(jit, "_launch_fast", no_lookup)
    bound(x, y, 7, 3)  # the bound entry
    assert len(driver) == 1
    (grid_run, stream_run, _, args_run), (grid_b, stream_b, hooks_b, args_b) = driver[0].launches
    assert grid_run == grid_b == (2, 1, 1) and (stream_run, stream_b) == (11, 12)
    assert len(args_b) == len(args_run) == 5 and all(a is b for a, b in zip(args_b, args_run))
    assert hooks_b == (None, None, None)


@pytest.mark.parametrize("change", ["dtype", "alignment", "m_one", "m_div16", "n_i64"])
def test_a_changed_class_compiles_through_run(driver, change):
    k = _kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    bound = Bound(k, (2,), BLOCK=32)
    args = [x, y, 5, 3]
    bound(*args)
    bound(*args)
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "alignment":
        args[0] = x[1:]
    elif change == "m_one":
        args[3] = 1
    elif change == "m_div16":
        args[3] = 32
    else:
        args[2] = 2**31
    bound(*args)
    bound(*args)
    assert len(driver) == 2, "the changed call must compile a second binary"
    new, old = driver[1], driver[0]
    assert (new.signature, new.constexprs, new.attrs) != (old.signature, old.constexprs, old.attrs)
    _record(driver)
    bound(x, y, 9, 3)  # the first specialization, still known: its binary
    assert len(driver) == 2 and len(driver[0].launches) == 1 and not driver[1].launches


def test_a_counter_sees_every_bound_launch(driver):
    k = _kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    bound = Bound(k, (2,), BLOCK=32)
    bound(x, y, 5, 3)
    _record(driver)
    with count_compilations(dry_run=True) as dry:
        bound(x, y, 5, 3)
        launch(k, (2,), x, y, 5, 3, BLOCK=32)
    assert dry.launches == ["_body", "_body"] and len(dry.keys["_body"]) == 1  # one key: bound = unbound
    assert not driver[0].launches  # dry run: nothing launched
    with count_compilations() as counter:
        bound(x, y, 6, 3)
    assert counter.launches == ["_body"] and len(driver[0].launches) == 1
    assert Bound(k, (0,), BLOCK=32)(x, y, 5, 3) is None and len(driver[0].launches) == 1  # no programs


def test_forget_fast_drops_the_bound_entries(driver, monkeypatch):
    k = _kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    bound = Bound(k, (2,), BLOCK=32)
    bound(x, y, 5, 3)
    bound(x, y, 5, 3)
    assert bound._hits
    jit.forget_fast()
    seen = []
    fast = jit._launch_fast
    monkeypatch.setattr(jit, "_launch_fast", lambda *a: seen.append(1) or fast(*a))
    bound(x, y, 5, 3)
    assert seen == [1]  # looked up again, not launched from the forgotten entry


SCRIPT = r"""
import json, torch
from moe_spec.problem import MoEShape, make_inputs
from triton_moe import jit
from triton_moe.lab.hostcost import stand_in_driver
from triton_moe.config import TritonConfig
from triton_moe.moe import fused_moe

def shape_of(a):
    return (str(a.dtype), tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a

shape = MoEShape("t", 16, 4, 64, 32, "test")
cases = {"bf16": (None, TritonConfig(16, 64, 64, swap_ab=True), False),
         "fp8_tensor": ("fp8_tensor", TritonConfig(16, 64, 64, swap_ab=True), False),
         "static": ("fp8_tensor", TritonConfig(16, 64, 64), True),
         "split_k": (None, TritonConfig(16, 32, 64, split_k=2), False),
         "fp8_block 128-wide": ("fp8_block", TritonConfig(16, 128, 64, swap_ab=True), False)}
out = {}
with stand_in_driver() as compiled:
    for name, (quant, cfg, static) in cases.items():
        def call(T):
            kw = make_inputs(shape, T, quant, seed=T).kwargs()
            if static:
                kw.update(a1_scale=torch.tensor([0.05]), a2_scale=torch.tensor([0.02]))
            fused_moe(**kw, config=cfg)
        for T in (3, 400):
            call(T)
        calls = {}
        for fast in (False, True):
            jit.FAST_LAUNCH = fast
            for k in compiled:
                k.record, k.launches[:] = True, []
            for T in (5, 5, 5, 64, 64):  # repeated shapes: the bound launches' own entries
                call(T)
            calls[fast] = [[(k.name, g, s, [shape_of(a) for a in args]) for g, s, _, args in k.launches]
                           for k in compiled]
        out[name] = dict(same=calls[False] == calls[True], launches=sum(map(len, calls[True])))
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in driver is for a machine without a GPU")
def test_fused_moe_repeated_shapes_launch_what_run_launches():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # static fp8_tensor and fp8_block with a 128-wide GEMM1 tile: 7 launches with the intermediate's own
    # quantize_kernel, one less where GEMM1's epilogue quantizes it (the rule's owner says where)
    from moe_spec.validate import MoEDims
    from triton_moe.config import TritonConfig
    from triton_moe.plan import plan

    dims = MoEDims(T=5, E=16, K=64, I=32, top_k=4)
    # (and static fp8_tensor's x in GEMM1's A load: triton_moe.plan.x_quant_in_gemm1)
    p_static = plan(dims, "fp8_tensor", config=TritonConfig(16, 64, 64))
    static = 7 - p_static.epilogue_quant(True) - p_static.x_quant_in_gemm1(True)
    p_block = plan(dims, "fp8_block", config=TritonConfig(16, 128, 64, swap_ab=True))
    block = 7 - p_block.epilogue_quant() - p_block.x_quant_in_gemm1()
    assert p_static.epilogue_quant(True) and p_block.epilogue_quant()  # the cases this test is about
    for name, per_call in (
        ("bf16", 5),
        ("fp8_tensor", 8),
        ("static", static),
        ("split_k", 5),
        ("fp8_block 128-wide", block),
    ):
        assert out[name]["same"], name
        assert out[name]["launches"] == 5 * per_call, (name, out[name])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in driver is for a machine without a GPU")
def test_the_eager_study_measures_the_host_cost_on_a_cpu():
    """``python -m compare.studies.eager --host`` (no GPU): one row per T, its launches the plan's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ["-m", "compare.studies.eager", "--host", "--shape", "qwen3-30b-a3b", "--tokens", "1", "--quant", "bf16"]
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in res.stdout.splitlines() if line.startswith("| triton_moe")]
    assert len(rows) == 1, res.stdout
    backend, shape, quant, T, us, launches = (c.strip() for c in rows[0])
    assert (shape, quant, T, launches) == ("qwen3-30b-a3b", "bf16", "1", "5") and float(us) > 0

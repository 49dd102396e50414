"""The direct launch path of ``triton_moe.jit`` (a seen specialization skips ``JITFunction.run``).

On the CPU the kernels are real ``JITFunction``\\ s run against the stand-in sm_90 driver of
:mod:`triton_moe.lab.hostcost`: Triton's own ``run`` binds, keys, "compiles" (a counted stand-in) and
launches into a launcher that records its arguments. The checks: a repeated specialization
launches the kernel ``run`` compiled, with the arguments ``run`` would pass, on the current
stream; a changed dtype, pointer alignment, integer class or constexpr goes through ``run`` and
compiles; equal fast keys always mean equal Triton keys. The GPU test compares outputs with the
path on and off and captures a CUDA graph with it.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from triton_moe import jit
from triton_moe.jit import count_compilations, fast_key, launch, specialization_key
from triton_moe.lab.hostcost import stand_in_driver

GLOBAL_SCALE = tl.constexpr(3)


def _body(x_ptr, y_ptr, n, m, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * m * GLOBAL_SCALE, mask=i < n)


def _kernel():
    """A fresh JITFunction (nothing compiled yet), n in do_not_specialize, m specialized."""
    return JITFunction(_body, do_not_specialize=["n"])


def _launch(k, *args, **kw):
    launch(k, (2,), *args, **kw)


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in driver is for a machine without a GPU")


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


def test_repeat_launches_the_compiled_kernel_with_runs_arguments(driver):
    k = _kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    _launch(k, x, y, 5, 3, BLOCK=32)
    assert len(driver) == 1
    _record(driver)
    jit.FAST_LAUNCH = False
    try:
        _launch(k, x, y, 7, 3, BLOCK=32)  # through run
    finally:
        jit.FAST_LAUNCH = True
    driver.driver.stream = 12
    _launch(k, x, y, 7, 3, BLOCK=32)  # direct
    assert len(driver) == 1  # no compilation
    (grid_run, stream_run, hooks_run, args_run), (grid_fast, stream_fast, hooks_fast, args_fast) = driver[0].launches
    assert grid_run == grid_fast == (2, 1, 1)
    assert (stream_run, stream_fast) == (11, 12)  # each takes the stream current at its launch
    assert len(args_run) == len(args_fast) == 5
    assert all(a is b for a, b in zip(args_run, (x, y, 7, 3, 32)))  # every parameter, constexprs included
    assert all(a is b for a, b in zip(args_fast, args_run))
    assert hooks_fast == (None, None, None)  # run passes its empty hook chains, the direct path None
    assert hooks_run[1] is knobs.runtime.launch_enter_hook and not hooks_run[1].calls


def test_a_cuda_launcher_is_entered_with_the_arguments_its_call_passes(driver):
    """With Triton's CudaLauncher (no scratch memory) the direct path calls its C launch function
    itself: with what ``CudaLauncher.__call__`` passes it when ``run`` launches."""
    from triton.backends.nvidia.driver import CudaLauncher

    calls = []
    launcher = object.__new__(CudaLauncher)  # the class's own __call__, a recording C entry point
    launcher.launch = lambda *a: calls.append(a)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, True
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    k = _kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    _launch(k, x, y, 5, 3, BLOCK=32)  # compiles the stand-in
    driver[0]._run = launcher
    jit.forget_fast(k)
    jit.FAST_LAUNCH = False
    try:
        _launch(k, x, y, 7, 3, BLOCK=32)  # run → CudaLauncher.__call__ → launch
    finally:
        jit.FAST_LAUNCH = True
    _launch(k, x, y, 7, 3, BLOCK=32)  # run again: the direct path keeps the kernel
    _launch(k, x, y, 7, 3, BLOCK=32)  # direct → launch
    assert len(calls) == 3
    via_run, direct = calls[1], calls[2]
    assert via_run[:9] == (2, 1, 1, 11, driver[0].function, False, True, None, None)
    assert direct[:10] == via_run[:10]  # grid, stream, function, cooperative, PDL, scratch, metadata
    assert direct[10:13] == (None, None, None) and via_run[11] is knobs.runtime.launch_enter_hook
    assert all(a is b for a, b in zip(direct[13:], via_run[13:])) and len(direct) == len(via_run) == 18
    # a launcher that allocates scratch memory is called (its __call__ allocates), never bypassed
    import triton
    from triton.runtime import _allocation

    launcher.global_scratch_size = 256
    jit.forget_fast(k)
    previous = _allocation._allocator.get()
    triton.set_allocator(lambda size, align, stream: ("scratch", size))
    try:
        for _ in range(3):  # run, then twice the direct path
            _launch(k, x, y, 7, 3, BLOCK=32)
    finally:
        triton.set_allocator(previous)
    assert [c[7] for c in calls[3:]] == [("scratch", 512)] * 3
    assert [c[11] is None for c in calls[3:]] == [False, True, True]  # run's hook chain, then the direct path


@pytest.mark.parametrize("change", ["dtype", "alignment", "m_one", "m_div16", "constexpr", "n_i64", "options"])
def test_a_changed_specialization_goes_through_run_and_compiles(driver, change):
    k = _kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    args, kw = [x, y, 5, 3], dict(BLOCK=32)
    _launch(k, *args, **kw)
    _launch(k, *args, **kw)
    assert len(driver) == 1
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "alignment":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "m_one":
        args[3] = 1
    elif change == "m_div16":
        args[3] = 32
    elif change == "constexpr":
        kw["BLOCK"] = 64
    elif change == "n_i64":
        args[2] = 2**31
    else:
        kw["num_warps"] = 8
    with count_compilations() as counter:
        _launch(k, *args, **kw)
        _launch(k, *args, **kw)  # the second time: direct, nothing new
    assert len(driver) == 2, "the changed call must compile a second binary"
    assert counter.launches == ["_body", "_body"] and len(counter.keys["_body"]) == 1
    new, old = driver[1], driver[0]
    assert (new.signature, new.constexprs, new.attrs, new.options) != (
        old.signature,
        old.constexprs,
        old.attrs,
        old.options,
    )
    _launch(k, x, y, 9, 3, BLOCK=32)  # the first specialization is still known
    assert len(driver) == 2


def test_equal_fast_keys_mean_equal_triton_keys(driver):
    """Over many argument combinations: the fast key is a refinement of Triton's key."""
    k = _kernel()
    base = torch.zeros(256)
    ptrs = [base, base[1:], base[4:], base.half(), base.to(torch.int32)]
    ints = [0, 1, 2, 15, 16, 17, 32, 2**31 - 1, 2**31, 2**31 + 16, 2**63 - 16, 2**63, -1, -16, -(2**31) - 1]
    triton_key_of = {}
    for xp in ptrs:
        for n in ints:
            for m in ints:
                for block in (16, 32):
                    args, kw = (xp, base, n, m), dict(BLOCK=block)
                    fk = fast_key(k, args, kw)
                    tk = specialization_key(k, args, kw)
                    assert triton_key_of.setdefault(fk, tk) == tk, (args, kw)
    assert len(set(triton_key_of.values())) > 20


def test_a_launch_hook_or_a_changed_global_goes_through_run(driver):
    k = _kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    _launch(k, x, y, 5, 3, BLOCK=32)
    _record(driver)
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _launch(k, x, y, 5, 3, BLOCK=32)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert driver[0].launches[-1][2][1] is knobs.runtime.launch_enter_hook  # run's launch, with its hooks
    # what Triton's code generator records while compiling (the stand-in compiles nothing)
    k.used_global_vals[("GLOBAL_SCALE", id(globals()))] = (GLOBAL_SCALE, globals())
    _launch(k, x, y, 5, 3, BLOCK=32)
    saved = GLOBAL_SCALE
    globals()["GLOBAL_SCALE"] = tl.constexpr(4)
    try:
        with pytest.raises(RuntimeError, match="GLOBAL_SCALE"):  # run's check, not a stale binary
            _launch(k, x, y, 5, 3, BLOCK=32)
        globals()["GLOBAL_SCALE"] = tl.constexpr(saved.value)  # an equal value in a new object: unchanged
        _launch(k, x, y, 5, 3, BLOCK=32)
        _launch(k, x, y, 5, 3, BLOCK=32)
        assert driver[0].launches[-1][2][1] is None  # the direct path again, no hooks
        globals()["GLOBAL_SCALE"] = tl.constexpr(5)  # changed after the new object was seen equal
        with pytest.raises(RuntimeError, match="GLOBAL_SCALE"):
            _launch(k, x, y, 5, 3, BLOCK=32)
    finally:
        globals()["GLOBAL_SCALE"] = saved


SCRIPT = r"""
import json, sys, torch
from moe_spec.problem import MoEShape, make_inputs
from triton_moe import jit
from triton_moe.lab.hostcost import stand_in_driver
from triton_moe.config import TritonConfig
from triton_moe.moe import fused_moe

def shape_of(a):
    return (str(a.dtype), tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a

shape = MoEShape("t", 16, 4, 64, 32, "test")
cfg = TritonConfig(16, 64, 64, swap_ab=True)
out = {}
with stand_in_driver() as compiled:
    for quant in (None, "fp8_tensor"):
        before = len(compiled)
        for T in (3, 400):  # the warm-up: both chunk widths of the alignment
            fused_moe(**make_inputs(shape, T, quant, seed=0).kwargs(), config=cfg)
        warm = len(compiled)
        calls = {}
        for fast in (False, True):
            jit.FAST_LAUNCH = fast
            for k in compiled:
                k.record, k.launches[:] = True, []
            for T in (1, 5, 17, 64, 300):
                fused_moe(**make_inputs(shape, T, quant, seed=T).kwargs(), config=cfg)
            calls[fast] = [[(k.name, g, s, [shape_of(a) for a in args]) for g, s, _, args in k.launches]
                           for k in compiled]
        out[str(quant)] = dict(warm=warm - before, after=len(compiled) - warm, same=calls[False] == calls[True],
                               launches=sum(map(len, calls[True])))
print(json.dumps(out))
"""


@CPU_ONLY
def test_fused_moe_direct_path_launches_what_run_launches():
    """A process as on a GPU (JITFunction kernels, stand-in driver): after a warm-up at T = 3 and 400,
    five more batch sizes compile nothing, and the direct path's launches equal ``run``'s."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for quant, launches in (("None", 5), ("fp8_tensor", 8)):
        r = out[quant]
        assert r["warm"] >= 5 and r["after"] == 0, r  # fp8 adds 5 kernels to the 5 of bf16
        assert r["same"], quant
        assert r["launches"] == 5 * launches, r


@pytest.mark.gpu
def test_direct_path_on_the_gpu_same_output_and_graph_capture():
    from moe_spec.problem import MoEShape, make_inputs
    from triton_moe import fused_moe

    shape = MoEShape("t", 16, 4, 256, 128, "test")
    for quant in (None, "fp8_tensor"):
        kw = make_inputs(shape, 7, quant, seed=1).to("cuda").kwargs()
        jit.FAST_LAUNCH = False
        try:
            ref = fused_moe(**kw)
        finally:
            jit.FAST_LAUNCH = True
        fused_moe(**kw)
        assert torch.equal(fused_moe(**kw), ref)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            side = fused_moe(**kw)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(side, ref)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(**kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)

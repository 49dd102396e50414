"""cute_moe's host path: every kernel compiled with the DSL's TVM-FFI calling convention and called
with torch tensors (:mod:`cute_moe.runtime`), the plan and the bound launches cached per call
signature (``cute_moe.moe._call_of``).

On the CPU the kernels compile (``CUTE_DSL_ARCH=sm_90a``) but cannot launch, so the layer's GPU path
runs on CPU tensors with each compiled function standing behind a recorder: every launch's
arguments are then held against the signature the compiled function states (its TVM-FFI arity
error spells it: ``__call__(x: Tensor([n0, n1], bfloat16), …)``) — the count, each tensor's rank
and dtype, an extent two tensors share, a pointer or a scalar where the kernel takes an address or
an ``Int32``, None where it was compiled without an operand. On the GPU: an eager call launches
through the TVM-FFI functions and gives, bit for bit, what a CUDA-graph replay of the same call and
the public step functions (the DSL's own call path) give.
"""

import dataclasses
import importlib
import re

import pytest
import torch

from moe_spec.problem import MoEShape, make_inputs

#: Qwen3-30B-A3B's E and top_k, small K and I (the host path does not depend on them).
SMALL = MoEShape("host", 128, 8, 256, 128, "host path")
FP8 = ("fp8_tensor", "fp8_channel", "fp8_block")
SIGNATURE = re.compile(r"`__call__\((.*)\)`", re.S)


def _params(fn) -> list[tuple[str, str]]:
    """(name, type) of each parameter a compiled TVM-FFI function takes, as its arity error states them."""
    from cute_moe.runtime import ffi_function

    with pytest.raises(TypeError, match="Expects") as err:
        ffi_function(fn)()
    text = SIGNATURE.search(str(err.value)).group(1)
    # split on the commas between parameters, not those inside Tensor([...], dtype)
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "[(") - (ch in "])")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [tuple(s.strip() for s in p.split(":", 1)) for p in parts if p.strip()]


TENSOR = re.compile(r"Tensor\(\[(.*)\], (\w+)\)")


def _mismatches(fn, args: tuple) -> list[str]:
    """What in ``args`` does not fit the signature of ``fn`` (empty: all of it fits)."""
    params = _params(fn)
    if len(params) != len(args):
        return [f"{len(args)} arguments for {len(params)} parameters: {params}"]
    bad, extents = [], {}
    for (name, kind), arg in zip(params, args):
        m = TENSOR.fullmatch(kind)
        if m:
            dims = [d.strip() for d in m.group(1).split(",")]
            if not isinstance(arg, torch.Tensor):
                bad.append(f"{name}: a {type(arg).__name__} for {kind}")
            elif arg.dim() != len(dims) or str(arg.dtype).removeprefix("torch.") != m.group(2):
                bad.append(f"{name}: {arg.dtype} {list(arg.shape)} for {kind}")
            else:
                for d, n in zip(dims, arg.shape):
                    if d.isdigit() and int(d) != n:
                        bad.append(f"{name}: extent {n} for the static {d}")
                    elif not d.isdigit() and extents.setdefault(d, (n, name))[0] != n:
                        bad.append(f"{name}: extent {d} = {n}, {extents[d][1]} has {extents[d][0]}")
        elif kind == "DataPointer" or kind.startswith("int"):
            if type(arg) is not int:
                bad.append(f"{name}: a {type(arg).__name__} for {kind}")
        elif kind == "None":
            if arg is not None:
                bad.append(f"{name}: a {type(arg).__name__} where the function was compiled with None")
        else:
            bad.append(f"{name}: unexpected parameter kind {kind}")
    return bad


class _Recorder:
    """Stands for a compiled kernel: records the arguments of each launch, launches nothing."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __call__(self, *args):
        self.calls.append((self.fn, args))


@pytest.fixture
def recorded_layer(monkeypatch):
    """``cute_moe.moe.fused_moe``'s GPU path on CPU tensors, each compiled kernel (compiled for real)
    behind a :class:`_Recorder`; yields (fused_moe, the launches' (compiled function, arguments))."""
    from cute_moe import moe

    calls: list = []
    monkeypatch.setattr(importlib.import_module("cute_moe.plan"), "ONE_LAUNCH", False)  # the grouped pipeline
    monkeypatch.setattr(moe, "ffi_function", lambda fn: _Recorder(fn, calls))
    monkeypatch.setattr(moe, "check_runs_on", lambda *a: None)
    monkeypatch.setattr(moe, "surface_errors", lambda *a: None)
    moe.forget_calls()
    yield moe.fused_moe, calls
    moe.forget_calls()


def test_every_kernel_compiles_with_the_tvm_ffi_convention():
    """The compile options always carry ``--enable-tvm-ffi`` (with the PTX kept, too), and every kernel
    family compiles to a function whose bare TVM-FFI function a call takes (no Python wrapper)."""
    import tvm_ffi

    from cute_moe import cache
    from cute_moe.alignops import compile_align_kernels
    from cute_moe.quantops import compile_quant_kernels
    from cute_moe.rowops import compile_row_kernels, compile_unfused_kernels
    from cute_moe.runtime import ffi_function

    assert cache.ptx_options(False) == "--enable-tvm-ffi"
    assert cache.ptx_options(True).startswith("--enable-tvm-ffi --keep-ptx --dump-dir ")
    kernels = {
        **compile_row_kernels(132),
        **compile_align_kernels(torch.int64),
        **compile_quant_kernels("fp8_tensor", 132),
        **compile_unfused_kernels("fp8_tensor", 132),
    }
    assert {"gather", "silu_mul", "combine", "count", "place", "x_amax", "x_quantize", "a_quantize"} <= set(kernels)
    assert {"weighted_combine", "scale_f32", "scale_bf16"} <= set(kernels)
    for name, fn in kernels.items():
        assert isinstance(ffi_function(fn), tvm_ffi.Function), name
        assert _params(fn), name  # it states its signature


@pytest.mark.parametrize("switches", ["plan", "off"])
@pytest.mark.parametrize("quant, T", [(None, 1), (None, 300), ("fp8_tensor", 1), ("fp8_tensor", 64)])
def test_each_launch_of_a_call_fits_its_compiled_signature(recorded_layer, monkeypatch, quant, T, switches):
    """Every launch of a warm call (T = 300: 2400 pairs, the count kernel too) passes arguments that
    fit what its kernel was compiled for, and a second call binds nothing anew — with the plan's switches,
    and with x quantized on its own and the swap-AB intermediate's amax launched ("off")."""
    from cute_moe import moe

    if switches == "off":
        plan = importlib.import_module("cute_moe.plan")
        monkeypatch.setattr(plan, "GATHER_QUANT", False)
        monkeypatch.setattr(plan, "SWAP_AB_EPILOGUE_AMAX", False)
        moe.forget_calls()
    fused_moe, calls = recorded_layer
    kw = make_inputs(SMALL, T, quant, seed=0).kwargs()
    fused_moe(**kw)
    first = [fn for fn, _ in calls]
    calls.clear()
    fused_moe(**kw)
    assert [fn for fn, _ in calls] == first  # the same compiled functions, launched in the same order
    counted = T * SMALL.top_k > 2048  # more than one chunk of pairs: the count kernel first
    assert len(_params(calls[0][0])) == (4 if counted else 23)  # count / place
    # fp8_tensor: place, x's amax, its quantize and gather (or one gathering quantize: plan.gather_quant), GEMM1,
    # the intermediate's amax (none where GEMM1's epilogue takes it), its quantize, GEMM2, combine
    import cute_moe
    from moe_spec.validate import MoEDims

    if quant is not None:
        dims = MoEDims(T=T, E=SMALL.num_experts, K=SMALL.hidden, I=SMALL.intermediate, top_k=SMALL.top_k)
        p = cute_moe.plan(dims, quant)
        fp8 = 9 - (1 if p.gather_quant else 0) - (1 if p.gemm1.epilogue_quant == "amax" else 0)
    assert len(calls) == (4 if quant is None else fp8) + counted
    bad = [f"launch {i}: {why}" for i, (fn, args) in enumerate(calls) for why in _mismatches(fn, args)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("quant, static", [(q, False) for q in FP8] + [("fp8_tensor", True)])
@pytest.mark.parametrize("T", [1, 300])
def test_x_quantized_in_the_gather_fits_its_compiled_signature(recorded_layer, monkeypatch, quant, static, T):
    """With ``cute_moe.plan.GATHER_QUANT`` every launch of a call — the gathering quantize (static scales:
    its static twin) among them — passes arguments that fit what its kernel was compiled for."""
    from cute_moe import moe
    from cute_moe.quantops import compile_gather_quantize

    fused_moe, calls = recorded_layer
    monkeypatch.setattr(importlib.import_module("cute_moe.plan"), "GATHER_QUANT", True)
    monkeypatch.setattr(importlib.import_module("cute_moe.plan"), "GATHER_QUANT_NORMAL_TOP_K", None)
    moe.forget_calls()
    kw = make_inputs(SMALL, T, quant, seed=0).kwargs()
    if static:
        kw.update(a1_scale=torch.tensor(0.01), a2_scale=torch.tensor(0.02))
    fused_moe(**kw)
    assert compile_gather_quantize(quant, 132, static=static) in [fn for fn, _ in calls]
    bad = [f"launch {i}: {why}" for i, (fn, args) in enumerate(calls) for why in _mismatches(fn, args)]
    assert not bad, "\n".join(bad)


def test_a_mismatched_argument_is_caught_by_the_signature_check(recorded_layer):
    """The check above can fail: a GEMM launch given K-mismatched operands, or a missing operand."""
    fused_moe, calls = recorded_layer
    fused_moe(**make_inputs(SMALL, 4, None, seed=0).kwargs())
    fn, args = next((fn, args) for fn, args in calls if len(args) == 11)  # a GEMM: 11 parameters
    assert not _mismatches(fn, args)
    x = args[0]
    assert _mismatches(fn, (x[:, : x.shape[1] // 2],) + args[1:])  # K of x no longer K of w
    assert _mismatches(fn, args[:-1])
    assert _mismatches(fn, args[:6] + (args[5],) + args[7:])  # a tensor where the kernel has no x_scale


# ---- GPU -------------------------------------------------------------------------------------------


def _by_steps(kw: dict, quant) -> torch.Tensor:
    """The fused layer through the public step functions (each kernel through the DSL's own call)."""
    from cute_moe import moe
    from cute_moe.moe_fp8 import quantize_intermediate, quantize_tokens, sorted_token_scales
    from cute_moe.plan import plan
    from moe_spec.quant import FP8_DTYPE
    from moe_spec.validate import validate_moe_args

    names = ("x", "w1", "w2", "topk_weights", "topk_ids", "quant", "w1_scale", "w2_scale")
    dims = validate_moe_args(**{k: kw.get(k) for k in names})
    p = plan(dims, quant)
    p = dataclasses.replace(p, gemm1=p.gemm1.replace(epilogue_quant=None))  # the steps quantize after GEMM1
    x, ids = kw["x"], kw["topk_ids"]
    rows = moe.sort_rows(ids, kw["topk_weights"], dims.E, p.align_tile, (p.gemm1.tokens_tile, p.gemm2.tokens_tile))
    if quant is None:
        h = moe.grouped_gemm(x if p.gemm1.gather_rows else moe.gather_rows(x, rows), kw["w1"], rows, p.gemm1)
        a = h if p.gemm1.gated else moe.silu_mul(h, rows)
        y = moe.grouped_gemm(a, kw["w2"], rows, p.gemm2, row_scale=rows.weight_of_row)
        return moe.combine(y, rows, dims.T, dims.top_k)
    xq, x_scale = quantize_tokens(x, quant)
    x_sorted = moe.gather_rows(xq.view(torch.bfloat16), rows).view(FP8_DTYPE)
    x_scale = sorted_token_scales(x_scale, rows.token_of_row, quant)
    h = moe.grouped_gemm(x_sorted, kw["w1"], rows, p.gemm1, x_scale=x_scale, w_scale=kw["w1_scale"])
    aq, a_scale = quantize_intermediate(h, rows, quant, **({"gated": True} if p.gemm1.gated else {}))
    y = moe.grouped_gemm(
        aq, kw["w2"], rows, p.gemm2, row_scale=rows.weight_of_row, x_scale=a_scale, w_scale=kw["w2_scale"]
    )
    return moe.combine(y, rows, dims.T, dims.top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=["bf16", "fp8_tensor"])
def test_gpu_eager_call_launches_through_tvm_ffi_bit_for_bit(quant, T, monkeypatch):
    """Qwen3-30B-A3B: an eager call launches every kernel through a bare TVM-FFI function, and its output
    equals, bit for bit, a CUDA-graph replay of the same call and the public step functions' result."""
    import tvm_ffi

    from cute_moe import moe
    from moe_spec.problem import get_shape

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run the GPU lane on the H200: python3 -m pytest -m gpu)")
    monkeypatch.setattr(importlib.import_module("cute_moe.plan"), "ONE_LAUNCH", False)  # the grouped pipeline
    moe.forget_calls()  # (the one launch's own: tests/test_cute_one_launch.py)
    kw = make_inputs(get_shape("qwen3-30b-a3b"), T, quant, seed=0).to("cuda").kwargs()
    eager = moe.fused_moe(**kw)
    dims = moe.validate_moe_args(
        **{k: kw.get(k) for k in ("x", "w1", "w2", "topk_weights", "topk_ids", "quant", "w1_scale", "w2_scale")}
    )
    call = moe._call_of(dims, quant, None, None, "fused", kw["x"].device, kw["topk_ids"].dtype, False)
    assert call.launches and all(isinstance(f, tvm_ffi.Function) for f in call.launches.values())
    launched: list = []
    bound = call.launches
    call.launches = {n: (lambda f, n=n: lambda *a: (launched.append(n), f(*a))[1])(f) for n, f in bound.items()}
    try:
        again = moe.fused_moe(**kw)
    finally:
        call.launches = bound
    assert launched and set(launched) <= set(bound), launched
    assert torch.equal(again, eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe.fused_moe(**kw)  # warm on the capture stream: its workspace
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.fused_moe(**kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert torch.equal(_by_steps(kw, quant), eager)

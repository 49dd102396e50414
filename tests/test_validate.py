"""Every bad input of the contract is rejected with the right exception and names its argument.

These exercise moe_spec.validate directly; each backend's tests check that its fused_moe calls it
before launching anything. The data checks (ids, routing weights, scales) raise here in the
"sync" check mode; in the default "device" mode validate_moe_args reads no data, and
guard_routing / the kernels flag the data in the device's error word, which check() raises.
"""

import os
import subprocess
import sys

import pytest
import torch

from moe_spec.contract import make_fused_experts, quant_from_vllm
from moe_spec.problem import MoEShape, get_shape, make_inputs
from moe_spec.validate import (
    BAD_ID,
    BAD_WEIGHT,
    DATA_CHECKS,
    INT32_MAX,
    REPEATED_ID,
    check,
    check_mode,
    checks,
    guard_routing,
    validate_moe_args,
)

SHAPE = MoEShape("small", 4, 2, 64, 48, "test")


def _kw(quant=None, T=5):
    return make_inputs(SHAPE, T, quant, seed=0).kwargs()


def _set(**changes):
    def mutate(kw):
        kw.update(changes)
        return kw

    return mutate


def _edit(name, fn):
    def mutate(kw):
        kw[name] = fn(kw[name])
        return kw

    return mutate


CASES = [
    # (id, quant, mutation, exception, argument named in the message)
    ("x not a tensor", None, _set(x=[[1.0]]), TypeError, "x"),
    ("x float32", None, _edit("x", lambda t: t.float()), TypeError, "x"),
    ("x 3-D", None, _edit("x", lambda t: t[None]), ValueError, "x"),
    ("x non-contiguous", None, _edit("x", lambda t: torch.cat([t, t], 1)[:, ::2]), ValueError, "x"),
    ("w1 fp8 under bf16", None, _edit("w1", lambda t: t.to(torch.float8_e4m3fn)), TypeError, "w1"),
    ("w1 bf16 under fp8", "fp8_tensor", _edit("w1", lambda t: t.to(torch.bfloat16)), TypeError, "w1"),
    ("w1 wrong K", None, _edit("w1", lambda t: t[:, :, :32].contiguous()), ValueError, "w1"),
    ("w1 odd 2I", None, _edit("w1", lambda t: t[:, :95].contiguous()), ValueError, "w1"),
    ("w2 wrong I", None, _edit("w2", lambda t: t[:, :, :40].contiguous()), ValueError, "w2"),
    ("w2 wrong E", None, _edit("w2", lambda t: t[:3].contiguous()), ValueError, "w2"),
    (
        "w2 transposed view",
        None,
        _edit("w2", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        ValueError,
        "w2",
    ),
    ("topk_weights bf16", None, _edit("topk_weights", lambda t: t.bfloat16()), TypeError, "topk_weights"),
    ("topk_weights wrong T", None, _edit("topk_weights", lambda t: t[:3]), ValueError, "topk_weights"),
    (
        "topk_weights NaN",
        None,
        _edit("topk_weights", lambda t: t.index_fill(0, torch.tensor([1]), float("nan"))),
        ValueError,
        "topk_weights",
    ),
    (
        "top_k > E",
        None,
        lambda kw: {**kw, "topk_weights": torch.ones(5, 5), "topk_ids": torch.zeros(5, 5, dtype=torch.int32)},
        ValueError,
        "topk_weights",
    ),
    ("topk_ids float", None, _edit("topk_ids", lambda t: t.float()), TypeError, "topk_ids"),
    ("topk_ids wrong k", None, _edit("topk_ids", lambda t: t[:, :1].contiguous()), ValueError, "topk_ids"),
    (
        "topk_ids out of range",
        None,
        _edit("topk_ids", lambda t: t.index_fill(0, torch.tensor([2]), 4)),
        ValueError,
        "topk_ids",
    ),
    (
        "topk_ids one element = E",
        None,
        _edit(
            "topk_ids", lambda t: t.index_put((torch.tensor([3]), torch.tensor([1])), torch.tensor(4, dtype=t.dtype))
        ),
        ValueError,
        "topk_ids",
    ),
    (
        "topk_ids negative",
        None,
        _edit("topk_ids", lambda t: t.index_fill(0, torch.tensor([0]), -1)),
        ValueError,
        "topk_ids",
    ),
    (
        "topk_ids duplicate",
        None,
        _edit("topk_ids", lambda t: t[:, :1].expand(-1, 2).contiguous()),
        ValueError,
        "topk_ids",
    ),
    ("quant unknown", None, _set(quant="int4"), ValueError, "quant"),
    ("scale missing", "fp8_channel", _set(w1_scale=None), ValueError, "w1_scale"),
    ("scale given to bf16", None, _set(w2_scale=torch.ones(4)), ValueError, "w2_scale"),
    ("scale wrong shape", "fp8_channel", _edit("w1_scale", lambda t: t[:, :10].contiguous()), ValueError, "w1_scale"),
    ("scale block shape", "fp8_block", _edit("w2_scale", lambda t: t[:, :, :0]), ValueError, "w2_scale"),
    ("scale float64", "fp8_tensor", _edit("w2_scale", lambda t: t.double()), TypeError, "w2_scale"),
    (
        "scale inf",
        "fp8_tensor",
        _edit("w1_scale", lambda t: t.index_fill(0, torch.tensor([1]), float("inf"))),
        ValueError,
        "w1_scale",
    ),
    ("scale zero", "fp8_block", _edit("w2_scale", lambda t: t * 0), ValueError, "w2_scale"),
    (
        "channel scale transposed view",
        "fp8_channel",
        _edit("w1_scale", lambda t: t.t().contiguous().t()),
        ValueError,
        "w1_scale",
    ),
    (
        "block scale strided view",
        "fp8_block",
        _edit("w2_scale", lambda t: torch.cat([t, t], 2)[:, :, ::2]),
        ValueError,
        "w2_scale",
    ),
    ("topk_ids on meta", None, _edit("topk_ids", lambda t: t.to("meta")), ValueError, "topk_ids"),
    ("x on meta", None, _edit("x", lambda t: t.to("meta")), ValueError, "x"),
    ("w2 on meta", "fp8_tensor", _edit("w2", lambda t: t.to("meta")), ValueError, "w2"),
    ("w1_scale on meta", "fp8_block", _edit("w1_scale", lambda t: t.to("meta")), ValueError, "w1_scale"),
    (
        "everything on meta",
        "fp8_channel",
        lambda kw: {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
        ValueError,
        "x",
    ),
]


#: The cases whose fault is in the data (the checks that read device memory).
DATA_CASES = {
    "topk_weights NaN",
    "topk_ids out of range",
    "topk_ids one element = E",
    "topk_ids negative",
    "topk_ids duplicate",
    "scale inf",
    "scale zero",
}
assert DATA_CASES <= {c[0] for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(case):
    """In the "sync" mode every fault, data included, raises before anything runs."""
    _, quant, mutate, exc, name = case
    kw = mutate(_kw(quant))
    with checks("sync"), pytest.raises(exc) as info:
        validate_moe_args(**kw)
    assert str(info.value).startswith(f"{name}:"), str(info.value)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_device_mode_raises_for_metadata_and_reads_no_data(case, monkeypatch):
    """The default mode: faults in the metadata raise as in "sync"; faults in the data pass
    validate_moe_args, which reads no value (a read would be a device→host sync on a GPU)."""
    _, quant, mutate, exc, name = case
    kw = mutate(_kw(quant))
    assert check_mode() == "device"

    def no_read(self, *args):
        raise AssertionError("validate_moe_args read a tensor's data")

    for method in ("item", "__bool__", "__int__", "__float__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, no_read)
    if case[0] in DATA_CASES:
        assert validate_moe_args(**kw).E == SHAPE.num_experts
    else:
        with pytest.raises(exc) as info:
            validate_moe_args(**kw)
        assert str(info.value).startswith(f"{name}:"), str(info.value)


def test_an_id_equal_to_e_in_one_element_gets_the_range_message():
    """One id = E (not a whole row, which would also repeat an expert): the range check names it."""
    kw = _kw()
    kw["topk_ids"][3, 1] = SHAPE.num_experts
    assert kw["topk_ids"][3, 0] != SHAPE.num_experts  # the row has no repeat
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E=4\), got values in \[0, 4\]"):
        validate_moe_args(**kw, data_checks="sync")


def test_the_verdict_cache_keys_on_strides_and_options():
    """A cached verdict is a function of dtypes, shapes, strides, devices and options: a call that
    differs in any of them is checked again."""
    kw = _kw("fp8_block")
    assert validate_moe_args(**kw).T == 5 and validate_moe_args(**kw).T == 5  # the second from the cache
    with pytest.raises(ValueError, match="^x: expected a contiguous"):
        validate_moe_args(**{**kw, "x": torch.cat([kw["x"], kw["x"]], 1)[:, ::2]})
    with pytest.raises(ValueError, match="^w1: at most 3 experts"):
        validate_moe_args(**kw, max_experts=3)
    with pytest.raises(TypeError, match="^w1: expected dtype bfloat16"):
        validate_moe_args(**{**kw, "quant": None, "w1_scale": None, "w2_scale": None})
    with pytest.raises(ValueError, match="^data_checks: expected one of"):
        validate_moe_args(**kw, data_checks="later")


# --- the device's error word, and the data checks in torch ops ---------------------------------------


ROUTING_FAULTS = {  # name: (mutation of (ids, weights), bit, argument named by check())
    "id = E": (
        lambda i, w: (i.index_put((torch.tensor([2]), torch.tensor([0])), torch.tensor(4, dtype=i.dtype)), w),
        BAD_ID,
        "topk_ids",
    ),
    "id < 0": (
        lambda i, w: (i.index_put((torch.tensor([4]), torch.tensor([1])), torch.tensor(-3, dtype=i.dtype)), w),
        BAD_ID,
        "topk_ids",
    ),
    "repeated": (lambda i, w: (torch.cat([i[:, :1], i[:, :1]], 1), w), REPEATED_ID, "topk_ids"),
    "weight NaN": (lambda i, w: (i, w.index_fill(0, torch.tensor([1]), float("nan"))), BAD_WEIGHT, "topk_weights"),
    "weight -inf": (lambda i, w: (i, w.index_fill(0, torch.tensor([3]), -float("inf"))), BAD_WEIGHT, "topk_weights"),
}


@pytest.mark.parametrize("fault", list(ROUTING_FAULTS))
def test_guard_routing_flags_each_fault_and_check_names_it(fault, word):
    mutate, bit, name = ROUTING_FAULTS[fault]
    kw = _kw()
    ids, weights = mutate(kw["topk_ids"], kw["topk_weights"])
    safe_ids, safe_weights = guard_routing(ids, weights, SHAPE.num_experts, word)
    assert int(word) == bit
    assert bool(((safe_ids >= 0) & (safe_ids < SHAPE.num_experts)).all()) and safe_ids.dtype == ids.dtype
    bad = (ids < 0) | (ids >= SHAPE.num_experts)
    assert torch.equal(safe_weights.isnan(), bad | weights.isnan())  # a bad id's pair weighs NaN
    assert torch.equal(safe_ids[~bad], ids[~bad])
    with pytest.raises(ValueError) as info:
        check("cpu")
    assert str(info.value).startswith(f"{name}: ") and int(word) == 0, str(info.value)
    check("cpu")  # cleared: nothing to raise


def test_guard_routing_passes_good_routing_and_check_raises_nothing(word):
    kw = _kw()
    ids, weights = guard_routing(kw["topk_ids"], kw["topk_weights"], SHAPE.num_experts, word)
    assert int(word) == 0 and torch.equal(ids, kw["topk_ids"]) and torch.equal(weights, kw["topk_weights"])
    check("cpu")
    check()


def test_check_names_the_first_failed_argument_and_lists_the_rest(word):
    word.fill_(BAD_WEIGHT | DATA_CHECKS[-1].bit | REPEATED_ID)
    with pytest.raises(ValueError) as info:
        check()
    msg = str(info.value)
    assert msg.startswith("topk_ids: expected distinct ids in each token's row"), msg
    assert "also failed: topk_weights" in msg and DATA_CHECKS[-1].argument in msg


def test_check_mode_comes_from_the_environment():
    """MOE_CHECK in any case; a value that names no mode fails the first call that needs the mode,
    naming MOE_CHECK, never an import (MOE_CHECK=SYNC once made every import fail)."""
    code = (
        "from moe_spec.validate import check_mode\n"
        "try:\n    print(check_mode())\nexcept ValueError as e:\n    print('refused', e)"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    run = lambda mode: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env={**env, "MOE_CHECK": mode}, capture_output=True, text=True
    )
    assert [run(m).stdout.strip() for m in ("sync", "device", "SYNC", " Device ")] == ["sync", "device"] * 2
    bad = run("eager")
    assert bad.returncode == 0 and bad.stderr == "", bad.stderr
    assert bad.stdout.startswith("refused MOE_CHECK: expected one of ('device', 'sync') (any case), got 'eager'")


def test_a_bad_moe_check_fails_the_call_not_the_import():
    code = (
        "import torch\nfrom moe_spec.problem import MoEShape, make_inputs\n"
        "from moe_spec.validate import checks, validate_moe_args\n"
        "kw = make_inputs(MoEShape('s', 4, 2, 64, 48, ''), 3).kwargs()\n"
        "with checks('sync'):\n    validate_moe_args(**kw)\n"
        "validate_moe_args(**kw)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "MOE_CHECK": "synch",
    }
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1].startswith(
        "ValueError: MOE_CHECK: expected one of ('device', 'sync') (any case), got 'synch'"
    ), run.stderr
    help_ = subprocess.run(
        [sys.executable, "-m", "compare", "--help"], env=env, capture_output=True, text=True, cwd=env["PYTHONPATH"]
    )
    assert help_.returncode == 0 and "Traceback" not in help_.stderr, help_.stderr


def test_meta_tensors_are_refused_before_any_value_is_read(monkeypatch):
    """Meta tensors have shapes but no data: refused by name, before a check reads a value."""

    def no_item(self):
        raise AssertionError("a value was read")

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    monkeypatch.setattr(torch.Tensor, "__bool__", no_item)
    monkeypatch.setattr(torch.Tensor, "__int__", no_item)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _kw("fp8_block").items()}
    with pytest.raises(ValueError, match="^x: expected a tensor with data, got a meta tensor"):
        validate_moe_args(**meta)


def test_a_backend_expert_limit_names_w1():
    with pytest.raises(ValueError, match="^w1: at most 3 experts"):
        validate_moe_args(**_kw(), max_experts=3)
    assert validate_moe_args(**_kw(), max_experts=4).E == 4


def test_unknown_quant_lists_the_registry():
    with pytest.raises(ValueError) as info:
        validate_moe_args(**{**_kw(), "quant": "fp4"})
    assert str(info.value) == "quant: expected one of None, 'fp8_tensor', 'fp8_channel', 'fp8_block', got 'fp4'"


@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_channel", "fp8_block"])
def test_good_input_passes_and_reports_dims(quant):
    d = validate_moe_args(**_kw(quant))
    assert (d.T, d.E, d.K, d.I, d.top_k) == (5, 4, 64, 48, 2)


def test_zero_tokens_is_valid():
    d = validate_moe_args(**_kw(None, T=0))
    assert d.T == 0 and d.K == 64


def test_int32_offset_overflow_is_rejected_before_allocation():
    """A problem whose activation copies overflow int32, built from meta tensors (no memory): W1
    and W2 as a whole may pass 2³¹ (64-bit expert offsets), T·top_k·max(K, 2I) may not."""
    E, I, K, T, top_k = 256, 2048, 7168, 40000, 8
    assert T * top_k * K > INT32_MAX
    meta = dict(device="meta")
    kw = dict(
        x=torch.empty(T, K, dtype=torch.bfloat16, **meta),
        w1=torch.empty(E, 2 * I, K, dtype=torch.bfloat16, **meta),
        w2=torch.empty(E, K, I, dtype=torch.bfloat16, **meta),
        topk_weights=torch.empty(T, top_k, **meta),
        topk_ids=torch.empty(T, top_k, dtype=torch.int32, **meta),
    )
    with pytest.raises(ValueError, match=r"^x: .*int32"):
        validate_moe_args(**kw)


def test_vllm_flags_map_to_formats():
    assert quant_from_vllm() is None
    assert quant_from_vllm(True) == "fp8_tensor"
    assert quant_from_vllm(True, per_channel_quant=True) == "fp8_channel"
    assert quant_from_vllm(True, block_shape=[128, 128]) == "fp8_block"
    with pytest.raises(ValueError, match=r"^block_shape: .*\[\[128, 128\]\]"):
        quant_from_vllm(True, block_shape=[64, 64])
    with pytest.raises(ValueError, match="^per_channel_quant/block_shape:"):
        quant_from_vllm(False, per_channel_quant=True)


def test_fused_experts_adapter_forwards_and_rejects():
    seen = {}

    def fake_fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        seen.update(quant=quant, w1_scale=w1_scale)
        return x + 1

    fused_experts = make_fused_experts(fake_fused_moe)
    kw = _kw("fp8_channel")
    x = kw["x"].clone()
    out = fused_experts(
        x,
        kw["w1"],
        kw["w2"],
        kw["topk_weights"],
        kw["topk_ids"],
        use_fp8_w8a8=True,
        per_channel_quant=True,
        w1_scale=kw["w1_scale"][..., None],
        w2_scale=kw["w2_scale"][..., None],
        inplace=True,
    )
    assert out is x and seen["quant"] == "fp8_channel" and seen["w1_scale"].shape == (4, 96)
    with pytest.raises(ValueError, match="^activation:"):
        fused_experts(x, kw["w1"], kw["w2"], kw["topk_weights"], kw["topk_ids"], activation="gelu")


def test_fused_experts_adapter_forwards_static_scales_only_when_given():
    """a1_scale / a2_scale reach the backend (which validates them) when given, and only then, so a
    backend without the option is called as before."""
    seen = {}

    def fake_fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None, **opts):
        validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale, **opts)
        seen.update(opts)
        return x

    fused_experts = make_fused_experts(fake_fused_moe)
    kw = _kw("fp8_tensor")
    args = (kw["x"], kw["w1"], kw["w2"], kw["topk_weights"], kw["topk_ids"])
    fused_experts(*args, use_fp8_w8a8=True, w1_scale=kw["w1_scale"], w2_scale=kw["w2_scale"])
    assert seen == {}
    a1, a2 = torch.tensor(0.5), torch.ones(1)
    fused_experts(*args, use_fp8_w8a8=True, w1_scale=kw["w1_scale"], w2_scale=kw["w2_scale"], a1_scale=a1, a2_scale=a2)
    assert seen["a1_scale"] is a1 and seen["a2_scale"] is a2
    with pytest.raises(ValueError, match="^a1_scale: static activation scales need quant='fp8_tensor'"):
        bf16 = _kw(None)
        fused_experts(
            bf16["x"],
            bf16["w1"],
            bf16["w2"],
            bf16["topk_weights"],
            bf16["topk_ids"],
            a1_scale=torch.ones(1),
            a2_scale=torch.ones(1),
        )
    with pytest.raises(ValueError, match="^a2_scale: required when a1_scale is given"):
        fused_experts(*args, use_fp8_w8a8=True, w1_scale=kw["w1_scale"], w2_scale=kw["w2_scale"], a1_scale=a1)


@pytest.mark.parametrize(
    "quant, vllm_shape",
    [("fp8_tensor", (4, 1, 1)), ("fp8_tensor", (4,)), ("fp8_channel", (4, 96, 1)), ("fp8_block", (4, 1, 1))],
)
def test_fused_experts_takes_vllm_scale_shapes(quant, vllm_shape):
    """vLLM keeps singleton dims in its scales; the adapter hands the contract's shape on."""
    seen = {}

    def fake_fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        seen.update(w1_scale=w1_scale, w2_scale=w2_scale)
        return x

    kw = _kw(quant)
    flags = dict(
        use_fp8_w8a8=True,
        per_channel_quant=quant == "fp8_channel",
        block_shape=[128, 128] if quant == "fp8_block" else None,
    )
    make_fused_experts(fake_fused_moe)(
        kw["x"],
        kw["w1"],
        kw["w2"],
        kw["topk_weights"],
        kw["topk_ids"],
        w1_scale=kw["w1_scale"].reshape(vllm_shape),
        w2_scale=kw["w2_scale"],
        **flags,
    )
    assert seen["w1_scale"].shape == kw["w1_scale"].shape and seen["w2_scale"] is kw["w2_scale"]


def test_get_shape_errors():
    assert get_shape("Qwen3-30B-A3B").num_experts == 128
    with pytest.raises(ValueError, match="^shape:"):
        get_shape("llama-moe")
    with pytest.raises(ValueError, match="^tp:"):
        get_shape("mixtral-8x7b:tp3")
    with pytest.raises(ValueError, match="^shape:"):
        get_shape("mixtral-8x7b:x8")

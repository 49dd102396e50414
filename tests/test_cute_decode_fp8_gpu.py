"""GPU lane for the one-launch CuTe decode kernel under FP8 (``cute_moe.decode.decode_fused_moe(quant=...)``,
:mod:`cute_moe.decode_quant`): each format against the fp64 W8A8 oracle and the grouped FP8 pipeline
(``cute_moe.fused_moe`` with the one launch off) — close, and bit for bit, since both quantize x and h with
the same arithmetic and promote every 128-deep K step the same way — reruns bit for bit with the counters
and the amax word back at zero, static scales (a bad one flagged), a bad id as the contract says, and batch
invariance where the format has it (static scales, per-token and per-group scales).

Run on the device: ``source .ci/on-device && python3 -m pytest -m gpu tests/test_cute_decode_fp8_gpu.py``.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from moe_spec.oracle import oracle, rel_l2  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 1e-2  # rel-L2 against the fp64 oracle on the kernel's own quantized inputs (notes/numerics.md)
GROUPED_TOL = 2e-3  # against the grouped FP8 pipeline: the same arithmetic
STATIC = 1 / 64  # a static a1_scale / a2_scale: x ~ N(0, 1) and h stay well inside ±448·s
FORMATS = ["fp8_tensor", "fp8_tensor_static", "fp8_channel", "fp8_block"]
SPECS = ["qwen3-30b-a3b", "deepseek-v3:tp8", "mixtral-8x7b"]


@pytest.fixture(scope="module")
def shapes():
    from moe_spec.problem import draw_weights, get_shape

    cache = {}

    def get(spec):
        if spec not in cache:
            cache.clear()  # one shape's weights on the card at a time
            s = get_shape(spec)
            cache[spec] = (s, *draw_weights(s, 1, device="cuda"))
        return cache[spec]

    return get


def _inputs(shapes, spec, T, fmt, seed=0):
    from moe_spec.problem import make_inputs

    quant = fmt.removesuffix("_static")
    s, w1, w2 = shapes(spec)
    inp = make_inputs(s, T, quant, seed=seed, device="cuda", weights_bf16=(w1, w2))
    kw = inp.to("cuda").kwargs()
    if fmt.endswith("_static"):
        kw |= {n: torch.full((1,), STATIC, device="cuda") for n in ("a1_scale", "a2_scale")}
    return kw


def _decode(**kw):
    from cute_moe.decode import decode_fused_moe

    return decode_fused_moe(**kw)


@pytest.fixture
def grouped(monkeypatch):
    """``cute_moe.fused_moe`` on the grouped pipeline (the one launch off: ``cute_moe.plan.ONE_LAUNCH``)."""
    import importlib

    import cute_moe
    import cute_moe.moe as moe

    monkeypatch.setattr(importlib.import_module("cute_moe.plan"), "ONE_LAUNCH", False)
    moe.forget_calls()
    yield cute_moe.fused_moe
    moe.forget_calls()


def _clear_word():
    from moe_spec.validate import check, poll

    torch.cuda.synchronize()
    for clear in (check, poll):
        try:
            clear("cuda")
        except ValueError:
            pass


@pytest.fixture(autouse=True)
def clean_word():
    _clear_word()
    yield
    _clear_word()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("T", [1, 8])
def test_against_the_oracle_and_the_grouped_pipeline(shapes, spec, T, fmt, grouped):
    kw = _inputs(shapes, spec, T, fmt)
    out = _decode(**kw)
    assert out.shape == (T, kw["x"].shape[1]) and out.dtype == torch.bfloat16
    assert rel_l2(out, oracle(**kw)) < TOL
    assert rel_l2(out, grouped(**kw).double()) < GROUPED_TOL


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spec", SPECS)
def test_bits_of_the_grouped_pipeline(shapes, spec, fmt, grouped):
    kw = _inputs(shapes, spec, 4, fmt, seed=2)
    assert torch.equal(_decode(**kw), grouped(**kw))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reruns_are_bitwise_equal_and_the_counters_reset(shapes, fmt):
    from cute_moe.decode import decode_workspace

    spec = "qwen3-30b-a3b"
    kw = _inputs(shapes, spec, 8, fmt, seed=3)
    first = _decode(**kw)
    top_k = kw["topk_ids"].shape[1]
    K, I = kw["x"].shape[1], kw["w2"].shape[2]  # noqa: E741
    quant = fmt.removesuffix("_static")
    for T in (1, 8, 2):
        _decode(**_inputs(shapes, spec, T, fmt, seed=4))
        torch.cuda.synchronize()
        ws = decode_workspace(T, top_k, K, I, kw["x"].device, quant)
        assert int(ws["counters"].abs().sum()) == 0  # the last CTA out zeroed every counter
        assert float(ws["amax"][0]) == 0.0  # and the amax word
    assert torch.equal(first, _decode(**kw))


@pytest.mark.parametrize("fmt", ["fp8_tensor_static", "fp8_channel", "fp8_block"])
def test_batch_invariance(shapes, fmt):
    """With static, per-token or per-group scales a token's output alone is its output in the batch."""
    kw = _inputs(shapes, "deepseek-v3:tp8", 8, fmt, seed=5)
    whole = _decode(**kw)
    for t in (0, 7):
        alone = {**kw, "x": kw["x"][t : t + 1], "topk_weights": kw["topk_weights"][t : t + 1]}
        alone["topk_ids"] = kw["topk_ids"][t : t + 1]
        assert torch.equal(_decode(**alone)[0], whole[t])


def test_a_bad_static_scale_is_flagged(shapes):
    from moe_spec.validate import check

    kw = _inputs(shapes, "qwen3-30b-a3b", 1, "fp8_tensor_static")
    kw["a1_scale"] = torch.full((1,), float("nan"), device="cuda")
    _decode(**kw)
    torch.cuda.synchronize()
    with pytest.raises(ValueError) as err:
        check("cuda")
    assert "a1_scale" in str(err.value)


@pytest.mark.parametrize("fmt", ["fp8_tensor", "fp8_block"])
def test_a_bad_id_gives_its_token_nan(shapes, fmt):
    from moe_spec.validate import check

    kw = _inputs(shapes, "qwen3-30b-a3b", 2, fmt, seed=6)
    kw["topk_ids"] = kw["topk_ids"].clone()
    kw["topk_ids"][1, 0] = 10_000
    out = _decode(**kw)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    with pytest.raises(ValueError, match="topk_ids"):
        check("cuda")


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_moe_takes_it_when_the_plan_lists_the_format(shapes, fmt, grouped, monkeypatch):
    """With the format in ``cute_moe.plan.ONE_LAUNCH_FORMATS`` ``cute_moe.fused_moe`` runs the FP8 one launch
    (its binding, grid and scales): the grouped pipeline's bits, and again on a second call."""
    import importlib

    import cute_moe
    import cute_moe.moe as moe

    kw = _inputs(shapes, "qwen3-30b-a3b", 1, fmt, seed=7)
    want = grouped(**kw)  # the one launch off (the fixture)
    plan = importlib.import_module("cute_moe.plan")
    monkeypatch.setattr(plan, "ONE_LAUNCH", True)
    monkeypatch.setattr(plan, "ONE_LAUNCH_FORMATS", (None, fmt.removesuffix("_static")))
    moe.forget_calls()
    from moe_spec.validate import MoEDims

    E, K, I = kw["w2"].shape  # noqa: E741
    dims = MoEDims(T=1, E=E, K=K, I=I, top_k=kw["topk_ids"].shape[1])
    assert cute_moe.plan(dims, kw["quant"], static=fmt.endswith("_static")).path == "decode"
    assert torch.equal(cute_moe.fused_moe(**kw), want) and torch.equal(cute_moe.fused_moe(**kw), want)

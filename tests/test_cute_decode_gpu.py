"""GPU lane for the one-launch CuTe decode kernel (``cute_moe.decode.decode_fused_moe``): against the
fp64 oracle and the grouped pipeline (``cute_moe.fused_moe``), reruns bit for bit with the counters back
at zero, a bad id as the contract says, batch invariance, and the workspace reused across T.

Run on the device: ``source .ci/on-device && python3 -m pytest -m gpu tests/test_cute_decode_gpu.py``.
Written before any GPU ran the kernel (notes/decode.md, "The CuTe DSL kernel").
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")

from moe_spec.oracle import oracle, rel_l2  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 5e-3  # rel-L2 against the fp64 oracle (bf16 operands, fp32 accumulation), as tests/test_cute_gpu.py
GROUPED_TOL = 1e-3  # against the grouped pipeline: the same arithmetic, at most a few bf16 roundings apart
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


def _inputs(shapes, spec, T, seed=0, skew=0.0):
    from moe_spec.problem import make_inputs

    s, w1, w2 = shapes(spec)
    inp = make_inputs(s, T, seed=seed, device="cuda", skew=skew, weights_bf16=(w1, w2))
    return dict(x=inp.x, w1=inp.w1, w2=inp.w2, topk_weights=inp.topk_weights, topk_ids=inp.topk_ids)


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
    """The device's error word and its host copy cleared (``check`` clears both, ``poll`` a stale copy)."""
    from moe_spec.validate import check, poll

    torch.cuda.synchronize()  # copies of the word in flight land first
    for clear in (check, poll):
        try:
            clear("cuda")
        except ValueError:
            pass


@pytest.fixture(autouse=True)
def clean_word():
    """Every test starts and ends with the error word clear (a set bit would make the next call raise)."""
    _clear_word()
    yield
    _clear_word()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("T", [1, 2, 8])
def test_against_the_oracle(shapes, spec, T):
    kw = _inputs(shapes, spec, T)
    out = _decode(**kw)
    ref = oracle(**kw)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert rel_l2(out, ref) < TOL


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("T", [1, 8])
def test_against_the_grouped_pipeline(shapes, spec, T, grouped):
    """Same functions, same K order (64-wide stages of four m64nNk16 WGMMAs into one fp32 chain), the
    same three roundings: close, and expected bit for bit (the next test)."""
    kw = _inputs(shapes, spec, T, seed=1)
    assert rel_l2(_decode(**kw), grouped(**kw).double()) < GROUPED_TOL


@pytest.mark.parametrize("spec", SPECS)
def test_bits_of_the_grouped_pipeline(shapes, spec, grouped):
    kw = _inputs(shapes, spec, 4, seed=2)
    assert torch.equal(_decode(**kw), grouped(**kw))


@pytest.mark.parametrize("spec", SPECS)
def test_reruns_are_bitwise_equal_and_the_counters_reset(shapes, spec):
    from cute_moe.decode import decode_workspace

    kw = _inputs(shapes, spec, 8, seed=3)
    first = _decode(**kw)
    top_k = kw["topk_ids"].shape[1]
    K, I = kw["x"].shape[1], kw["w2"].shape[2]
    for T in (1, 8, 2):  # other sizes in between share the workspace (one pair bucket up to 8 pairs)
        other = _inputs(shapes, spec, T, seed=4)
        _decode(**other)
        torch.cuda.synchronize()
        ws = decode_workspace(T, top_k, K, I, kw["x"].device)
        assert int(ws["counters"].abs().sum()) == 0  # the last CTA out zeroed every counter
    again = _decode(**kw)
    assert torch.equal(first, again)


@pytest.mark.parametrize("spec", SPECS)
def test_int64_ids_give_the_int32_bits(shapes, spec):
    kw = _inputs(shapes, spec, 2, seed=5)
    a = _decode(**kw)
    b = _decode(**{**kw, "topk_ids": kw["topk_ids"].to(torch.int64)})
    assert torch.equal(a, b)


@pytest.mark.parametrize("spec", SPECS)
def test_batch_invariance(shapes, spec):
    """A token's row alone (T = 1) is the bits of its row in a batch: every value it sees is computed
    from its own row in a fixed order, whichever chunk of its expert's pairs it lands in."""
    T = 8 if spec != "mixtral-8x7b" else 32  # Mixtral: 64 pairs on 8 experts, chunks past the first
    kw = _inputs(shapes, spec, T, seed=6, skew=2.0 if spec == "mixtral-8x7b" else 0.0)
    batch = _decode(**kw)
    for t in (0, 3, T - 1):
        one = {**kw, "x": kw["x"][t : t + 1], "topk_weights": kw["topk_weights"][t : t + 1]}
        one["topk_ids"] = kw["topk_ids"][t : t + 1]
        assert torch.equal(_decode(**one)[0], batch[t]), t


def test_an_expert_with_more_pairs_than_a_chunk(shapes):
    """Mixtral, 32 tokens on a skewed router: some expert holds more than 16 pairs (two chunks)."""
    kw = _inputs(shapes, "mixtral-8x7b", 32, seed=7, skew=4.0)
    assert int(torch.bincount(kw["topk_ids"].flatten().long()).max()) > 16
    assert rel_l2(_decode(**kw), oracle(**kw)) < TOL


@pytest.mark.parametrize("spec", SPECS)
def test_a_bad_id_gives_a_nan_row_and_the_flag(shapes, spec):
    """moe_spec.contract: an id outside [0, E) is computed clamped, its routing weight replaced by NaN:
    its token's row is NaN, the other rows unchanged; BAD_ID in the error word, named by check()."""
    from moe_spec.validate import BAD_ID, check, error_word

    kw = _inputs(shapes, spec, 4, seed=8)
    clean = _decode(**kw)
    torch.cuda.synchronize()
    assert int(error_word("cuda").item()) == 0
    E = kw["w1"].shape[0]
    kw["topk_ids"] = kw["topk_ids"].clone()
    kw["topk_ids"][2, 1] = E
    out = _decode(**kw)
    torch.cuda.synchronize()
    assert bool(out[2].isnan().all())
    rest = torch.arange(4, device="cuda") != 2
    assert torch.equal(out[rest], clean[rest])
    assert int(error_word("cuda").item()) == BAD_ID
    with pytest.raises(ValueError, match=r"^topk_ids: "):
        check("cuda")


def test_repeated_ids_and_a_bad_weight_set_their_bits(shapes):
    from moe_spec.validate import BAD_WEIGHT, REPEATED_ID, error_word

    kw = _inputs(shapes, "qwen3-30b-a3b", 2, seed=9)
    kw["topk_ids"] = kw["topk_ids"].clone()
    kw["topk_ids"][1, 3] = kw["topk_ids"][1, 0]  # the same expert twice in row 1: computed twice, summed
    out = _decode(**kw)
    torch.cuda.synchronize()
    assert int(error_word("cuda").item()) == REPEATED_ID
    # the oracle refuses a repeated id: sum it over two halves of the slots, each free of repeats
    halves = ([0, 4, 5, 6], [3, 1, 2, 7])
    part = lambda cols: oracle(  # noqa: E731
        **{**kw, "topk_ids": kw["topk_ids"][:, cols], "topk_weights": kw["topk_weights"][:, cols]}
    )
    assert rel_l2(out, part(halves[0]) + part(halves[1])) < TOL
    _clear_word()
    kw["topk_weights"] = kw["topk_weights"].clone()
    kw["topk_weights"][0, 0] = float("inf")
    out = _decode(**kw)
    torch.cuda.synchronize()
    assert int(error_word("cuda").item()) & BAD_WEIGHT
    assert not bool(out[0].isfinite().all()) and bool(out[1].isfinite().all())


def test_the_sizes_compile_once(shapes):
    """Every T and shape runs the one binary of its ids dtype: no compile after the first call."""
    import cute_moe

    _decode(**_inputs(shapes, "deepseek-v3:tp8", 1))
    before = cute_moe.compile_count()
    for spec in SPECS:
        for T in (1, 3, 8):
            _decode(**_inputs(shapes, spec, T, seed=T))
    assert cute_moe.compile_count() == before


def _halve(monkeypatch):
    """The kernel compiled with A tiles halved where they are fewer than the CTAs (``HALF_TASKS``)."""
    import cute_moe.decode as dd
    import cute_moe.decode_parts as dp

    monkeypatch.setattr(dp, "HALF_TASKS", True)
    dd._kernel.cache_clear()


def _small_layer(T, E, top_k, K, I, ids, seed):  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * I, K, device="cuda", generator=g) / K**0.5).bfloat16()
    w2 = (torch.randn(E, K, I, device="cuda", generator=g) / I**0.5).bfloat16()
    w = torch.rand(T, top_k, device="cuda", generator=g)
    ids = torch.tensor(ids, dtype=torch.int32, device="cuda").view(T, top_k)
    return dict(x=x, w1=w1, w2=w2, topk_weights=w / w.sum(1, keepdim=True), topk_ids=ids)


def test_halved_tiles_give_the_bits_of_whole_tiles(shapes, monkeypatch):
    """Gate and up as two tasks, the second to arrive finishing the chunk: each sum is the whole tile's
    WGMMA sequence, so out has the same bits — at DeepSeek-V3 TP8 T = 1 (32 tiles, 64 halves) and on a small
    layer whose expert holds 32 or 64 pairs (two or four chunks, each exchanged); and the halved binary where
    it does not halve (Qwen3-30B-A3B T = 1: 96 tiles). Reruns equal, the arrival words and counters back at
    zero."""
    import cute_moe.decode as dd
    import cute_moe.decode_parts as dp

    cases = [_inputs(shapes, "deepseek-v3:tp8", 1, seed=seed) for seed in (10, 11, 12)]
    cases += [_small_layer(32, 8, 2, 1024, 128, [0 if j % 2 == 0 else 1 + j % 7 for j in range(64)], seed=11)]
    cases += [_small_layer(64, 8, 1, 1024, 128, [0] * 64, seed=12)]
    cases += [_inputs(shapes, "qwen3-30b-a3b", 1, seed=13)]
    whole = [_decode(**kw) for kw in cases]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    halved = []
    for kw in cases:
        T, top_k = kw["topk_ids"].shape
        E, K, I = kw["w1"].shape[0], kw["x"].shape[1], kw["w2"].shape[2]  # noqa: E741
        leaders = dp.leader_tables(kw["topk_ids"].flatten().tolist(), E)["n_leaders"]
        halved.append(4 * leaders * (I // dp.H_TILE) <= dp.grid_size(T, top_k, E, K, I, sms))
    if halved != [True] * 5 + [False]:
        pytest.skip(f"{sms} SMs: the cases do not halve as on a 132-SM H100 / H200 ({halved})")
    _halve(monkeypatch)
    try:
        for kw, want in zip(cases, whole):
            T, top_k = kw["topk_ids"].shape
            ws = dd.new_workspace(T, top_k, kw["x"].shape[1], kw["w2"].shape[2], kw["x"].device)
            got = dd.decode_fused_moe(**kw, workspace=ws)
            again = dd.decode_fused_moe(**kw, workspace=ws)
            torch.cuda.synchronize()
            assert torch.equal(got, want) and torch.equal(again, want)
            assert int(ws["arrive"].abs().sum()) == 0 and int(ws["counters"].abs().sum()) == 0
    finally:
        dd._kernel.cache_clear()

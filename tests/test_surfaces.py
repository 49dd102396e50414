"""Every surface of the backends holds the edges like ``fused_moe`` does.

The surfaces: each backend's ``fused_moe``, its vLLM spelling ``fused_experts``, its ``warmup``, the
transformers experts forward (``compare.hf_experts``) and the sharded layers (``compare.distributed``).
One check of the layer's sizes (``moe_spec.validate.check_sizes``) decides for all of them, so they
refuse the same layers with the same words, each naming its own argument — before anything is
allocated (the huge layers here are expanded views of one element: allocating one would fail).
Then one test per defect the issue lists, each written against the words of the issue, and the
default mode's error path: a failed data check is raised by a later call, without a sync.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from moe_spec.oracle import oracle_breakdown, rel_l2, rel_l2_terms
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.quant import get_format
from moe_spec.validate import CALL_NAMES, WARMUP_NAMES, check, check_sizes, error_word, poll

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = MoEShape("small", 4, 2, 64, 32, "test")


def _huge(*shape, dtype=torch.bfloat16):
    """A tensor of ``shape`` that owns one element (an expanded view): sizes of any magnitude, no memory."""
    return torch.zeros(1, dtype=dtype).expand(*shape)


def _refusal(fn):
    """``(exception type, message)`` of ``fn()``, or None when it returns."""
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return None


# --- one size check, every surface ------------------------------------------------------------------------

#: (E, K, I, top_k, T): each refused by one rule of check_sizes, and one layer that passes it
SIZES = {
    "E over the expert limit": (1025, 64, 32, 2, 3),
    "K: one expert over int32": (4, 10**9, 32, 2, 3),
    "I: one expert over int32": (4, 64, 10**9, 2, 3),
    "K and I: one expert over int32": (4, 2**20, 2**11, 2, 3),
    "T: the sorted copies over int32": (4, 64, 32, 2, 10**9),
    "T = 10^12": (4, 64, 32, 2, 10**12),
    "top_k > E": (4, 64, 32, 5, 3),
    "valid": (4, 64, 32, 2, 3),
}


def _backend(name):
    import importlib

    return importlib.import_module(name)


def _limits(backend):
    return _backend(backend).fused_moe.limits


def _call_refusal(backend, E, K, I, top_k, T, spelling="fused_moe"):  # noqa: E741
    mod = _backend(backend)
    x, w1, w2 = _huge(T, K), _huge(E, 2 * I, K), _huge(E, K, I)
    w, ids = _huge(T, top_k, dtype=torch.float32), _huge(T, top_k, dtype=torch.int32)
    return _refusal(lambda: getattr(mod, spelling)(x, w1, w2, w, ids))


def _rule(message: str) -> str:
    return message.partition(": ")[2]


@pytest.mark.parametrize("backend", ["triton_moe", "cute_moe"])
@pytest.mark.parametrize("case", list(SIZES))
def test_every_surface_refuses_the_sizes_fused_moe_refuses(backend, case):
    """fused_moe, fused_experts and the warm-up (dry run) refuse exactly what check_sizes refuses,
    with the same words after their own argument's name."""
    E, K, I, top_k, T = SIZES[case]  # noqa: E741
    limits = _limits(backend)
    verdict = _refusal(lambda: check_sizes(E, K, I, top_k, T, limits=limits))
    for spelling in ("fused_moe", "fused_experts"):
        got = _call_refusal(backend, E, K, I, top_k, T, spelling)
        if verdict is None:  # the sizes pass: what refuses these expanded views is their strides
            assert got is not None and "contiguous" in got[1], got
        elif spelling == "fused_experts" and verdict[1].startswith("x: "):  # vLLM's name of x
            assert got == (verdict[0], "hidden_states: " + _rule(verdict[1])), got
        else:
            assert got == verdict, (spelling, got, verdict)
    warm = _backend(backend).warmup
    verdict = _refusal(lambda: check_sizes(E, K, I, top_k, T, limits=limits, names=WARMUP_NAMES, min_tokens=1))
    got = _refusal(lambda: warm(E, K, I, top_k, None, max_tokens=T, device="cpu", dry_run=True))
    if verdict is None:
        assert got is None, got
    else:
        assert got[0] is verdict[0] and _rule(got[1]) == _rule(verdict[1]), (got, verdict)
        assert got[1].split(": ")[0] in set(dataclasses.asdict(WARMUP_NAMES).values()) | {"K", "I"}


def test_warmup_refuses_before_it_allocates():
    """Issue 36 item 3: triton_moe.warmup(4, 10**9, 32, 2, device="cpu") asked for 512 GB before it
    checked the int32 limit that fused_moe names; item 4: cute_moe.warmup(1025, …) reported plans."""
    import cute_moe
    import triton_moe

    cases = [
        (triton_moe.warmup, (4, 10**9, 32, 2), "K: one expert's matrix holds 2I·K"),
        (triton_moe.warmup, (4, 64, 10**9, 2), "I: one expert's matrix holds 2I·K"),
        (triton_moe.warmup, (4, 2**20, 2**11, 2), "K: one expert's matrix holds 2I·K"),
        (cute_moe.warmup, (1025, 64, 32, 2), "E: at most 1024 experts (E) are supported by cute_moe"),
        (cute_moe.warmup, (10**9, 64, 32, 2), "E: at most 1024 experts"),
        (cute_moe.warmup, (4, 10**9, 32, 2), "K: one expert's matrix holds 2I·K"),
        (cute_moe.warmup, (4, 64, 10**9, 2), "I: one expert's matrix holds 2I·K"),
    ]
    for warm, sizes, words in cases:
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            warm(*sizes, device="cpu", dry_run=True)
        assert str(info.value).startswith(words), str(info.value)
        assert time.monotonic() - start < 5


@pytest.mark.parametrize("max_tokens", [10**9, 10**12])
def test_warmup_max_tokens_fused_moe_refuses(max_tokens):
    """Issue 36 item 5: both warm-ups accepted max_tokens = 10⁹ and 10¹² and reported coverage of T up to
    there, which fused_moe refuses (its activation copies would pass int32)."""
    import cute_moe
    import triton_moe

    for warm in (cute_moe.warmup, triton_moe.warmup):
        with pytest.raises(ValueError, match=r"^max_tokens: the sorted activation copies hold T·top_k·max\(K, 2I\)"):
            warm(8, 64, 32, 2, max_tokens=max_tokens, device="cpu", dry_run=True)
    assert _call_refusal("triton_moe", 8, 64, 32, 2, max_tokens)[1].startswith("x: the sorted activation copies")


def test_cute_moe_refuses_an_empty_batch_where_it_refuses_one_token():
    """Issue 36 item 6: T = 0 on CPU tensors returned a (0, K) tensor while T = 1 was refused."""
    import cute_moe

    msgs = []
    for T in (1, 0):
        with pytest.raises(ValueError) as info:
            cute_moe.fused_moe(**make_inputs(SMALL, T).kwargs())
        msgs.append(str(info.value))
    assert msgs[0] == msgs[1] and msgs[0].startswith("x: cute_moe runs on a CUDA device, got a tensor on cpu")


def test_fused_experts_block_shape_must_be_two_ints():
    """Issue 36 item 8: block_shape=128 gave TypeError: 'int' object is not iterable, in both backends."""
    import cute_moe
    import triton_moe

    inp = make_inputs(MoEShape("b", 4, 2, 128, 128, ""), 3, "fp8_block")
    for fused_experts in (triton_moe.fused_experts, cute_moe.fused_experts):
        for bad in (128, [128], [128, "128"], (128, 0)):
            with pytest.raises(TypeError, match=r"^block_shape: expected None or \[rows, cols\]"):
                fused_experts(
                    inp.x,
                    inp.w1,
                    inp.w2,
                    inp.topk_weights,
                    inp.topk_ids,
                    use_fp8_w8a8=True,
                    block_shape=bad,
                    w1_scale=inp.w1_scale,
                    w2_scale=inp.w2_scale,
                )


# --- the unclear errors, each named --------------------------------------------------------


@pytest.mark.parametrize("device, error", [("foo", ValueError), (None, TypeError), ("cuda:7", ValueError)])
def test_warmup_device_is_named(device, error):
    import cute_moe
    import triton_moe

    for warm in (cute_moe.warmup, triton_moe.warmup):
        with pytest.raises(error, match="^device: "):
            warm(4, 64, 32, 2, device=device, dry_run=True)


def test_warmup_ids_dtypes_and_unknown_options_are_named():
    import cute_moe
    import triton_moe

    with pytest.raises(TypeError, match=r"^ids_dtypes: expected a non-empty tuple of dtypes"):
        triton_moe.warmup(4, 64, 32, 2, device="cpu", dry_run=True, ids_dtypes=torch.int32)
    for warm, allowed in ((cute_moe.warmup, "swap_ab, configs, fusion"), (triton_moe.warmup, "config, swap_ab")):
        with pytest.raises(TypeError, match=rf"^foo: not an option of \w+\.warmup, .*\({allowed}\)"):
            warm(4, 64, 32, 2, device="cpu", dry_run=True, foo=1)
    assert triton_moe.warmup(4, 64, 32, 2, device="cpu", dry_run=True, ids_dtypes=(torch.int32,)).plans


def test_fused_experts_inplace_on_a_tensor_that_requires_grad_is_refused_before_any_launch():
    import triton_moe
    from triton_moe.jit import count_compilations

    inp = make_inputs(SMALL, 3)
    x = inp.x.clone().requires_grad_(True)
    with count_compilations(dry_run=True) as counter, pytest.raises(ValueError, match="^hidden_states: inplace=True"):
        triton_moe.fused_experts(x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, inplace=True)
    assert counter.launches == []
    with torch.no_grad():
        assert triton_moe.fused_experts(x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, inplace=True) is x


def test_fused_experts_names_hidden_states():
    import triton_moe

    inp = make_inputs(SMALL, 3)
    with pytest.raises(TypeError, match="^hidden_states: expected dtype bfloat16"):
        triton_moe.fused_experts(inp.x.float(), inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)


# --- the transformers forward ------------------------------------------------------------


@pytest.fixture
def hx():
    return pytest.importorskip("compare.hf_experts", reason="transformers (the hf extra) is not installed")


def _mixtral_experts(E=4, H=64, I=32, top_k=2, weights=None):  # noqa: E741
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(
        hidden_size=H, num_experts_per_tok=top_k, hidden_act="silu", num_local_experts=E, intermediate_size=I
    )
    with torch.device("meta"):
        module = MixtralExperts(config)
    if weights is None:
        inp = make_inputs(MoEShape("hf", E, top_k, H, I, ""), 1)
        weights = inp.w1, inp.w2
    module.gate_up_proj = torch.nn.Parameter(weights[0], requires_grad=False)
    module.down_proj = torch.nn.Parameter(weights[1], requires_grad=False)
    return module


@pytest.mark.parametrize("shape", [(0, 64), (1, 0, 64), (2, 0, 64)])
def test_hf_forward_takes_an_empty_batch(shape, hx):
    """Issue 36 item 7: an empty batch failed: cannot reshape tensor of 0 elements into shape [0, -1]."""
    experts = _mixtral_experts()
    with torch.no_grad():
        out = hx._FORWARDS["triton_moe"](
            experts, torch.zeros(*shape, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
        )
    assert out.shape == shape and out.dtype == torch.bfloat16


def test_hf_forward_blames_hidden_states_of_the_wrong_width(hx):
    """Issue 36 item 9: a hidden_states width that does not match the model was blamed on w1."""
    experts = _mixtral_experts()
    with (
        torch.no_grad(),
        pytest.raises(
            ValueError,
            match=r"^hidden_states: expected \[\.\.\., H\] with the model's "
            r"hidden size H = 64",
        ),
    ):
        hx._FORWARDS["triton_moe"](
            experts, torch.zeros(3, 48, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)
        )


def test_hf_register_names_its_argument(hx):
    """Issue 36 item 9: hx.register(None) raised a bare TypeError."""
    for bad in (None, 3):
        with pytest.raises(TypeError, match="^implementations: expected a name or a tuple of names"):
            hx.register(bad)


@pytest.mark.parametrize("case", list(SIZES))
def test_hf_forward_refuses_the_sizes_fused_moe_refuses(case, hx):
    """The forward runs the one size check with its own names, before it converts or copies anything."""
    E, K, I, top_k, T = SIZES[case]  # noqa: E741
    experts = _mixtral_experts(E, K, I, min(top_k, E), weights=(_huge(E, 2 * I, K), _huge(E, K, I)))
    verdict = _refusal(lambda: check_sizes(E, K, I, top_k, T, limits=_limits("triton_moe"), names=hx.HF_NAMES))
    with torch.no_grad():
        got = _refusal(
            lambda: hx._FORWARDS["triton_moe"](
                experts, _huge(T, K), _huge(T, top_k, dtype=torch.long), _huge(T, top_k, dtype=torch.float32)
            )
        )
    if verdict is None:
        assert got is not None and "contiguous" in got[1], got
    else:
        assert got == verdict


# --- a w1 blamed as w1; the CPU without the interpreter ------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton_moe", "cute_moe"])
def test_a_w1_with_i_rows_is_blamed_on_w1(backend):
    """Defect 4: w1 of shape [E, I, K] was reported as 'w2: expected shape (4, 128, 32), got (4, 128, 64)'."""
    inp = make_inputs(MoEShape("d4", 4, 2, 128, 64, ""), 3)
    kw = {**inp.kwargs(), "w1": inp.w1[:, :64].contiguous()}
    with pytest.raises(ValueError, match=r"^w1: expected shape \[E, 2I, K\] = \(4, 128, 128\)"):
        _backend(backend).fused_moe(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal: this machine has a GPU")
def test_the_python_api_on_a_cpu_without_the_interpreter_says_what_to_do():
    """Defect 5: without TRITON_INTERPRET=1 a CPU call ended in Triton's '0 active drivers' traceback."""
    code = (
        "from moe_spec.problem import MoEShape, make_inputs\nimport triton_moe\n"
        "inp = make_inputs(MoEShape('s', 4, 2, 64, 32, ''), 3)\n"
        "for T in (3, 0):\n"
        "    try:\n        triton_moe.fused_moe(**make_inputs(MoEShape('s', 4, 2, 64, 32, ''), T).kwargs())\n"
        "    except ValueError as e:\n        print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", code], env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120
    )
    lines = run.stdout.strip().splitlines()
    want = (
        "x: triton_moe runs on a CUDA device, got a tensor on cpu; on a CPU, set TRITON_INTERPRET=1 before "
        "Python imports triton"
    )
    assert run.returncode == 0 and len(lines) == 2 and all(line.startswith(want) for line in lines), run
    assert "active drivers" not in run.stdout + run.stderr


# --- the error under cancellation ---------------------------------------------------------------


def test_k1_cancellation_is_judged_against_the_terms():
    """K = 1: the two experts' terms (and GEMM2's products over I) cancel for some seeds, so the
    output's own rel L2 misses the bound with no fault of the kernel; against the terms' magnitudes
    every seed is inside. A kernel that drops a term is still caught."""
    from triton_moe import fused_moe

    shape, tol = MoEShape("k1", 7, 2, 1, 173, "K = 1 cancellation"), get_format(None).tolerance
    plain, terms = [], []
    for seed in range(40):
        inp = make_inputs(shape, 1, None, seed=seed)
        out = fused_moe(**inp.kwargs())
        ref = oracle_breakdown(**inp.kwargs(), term_scales=True)
        plain.append(rel_l2(out, ref.out))
        terms.append(rel_l2_terms(out, ref))
        assert terms[-1] <= plain[-1] + 1e-12
    assert max(terms) <= tol, f"seed {terms.index(max(terms))}: {max(terms):.2e}"
    assert sum(e > tol for e in plain) >= 3  # the cancellation is there: the plain metric misses
    wrong = ref.pair_output[:, 0] * ref.topk_weights[:, 0, None].double()  # one expert's term only
    assert rel_l2_terms(wrong, ref) > tol


@pytest.mark.parametrize("shape", [SMALL, MoEShape("m", 16, 4, 256, 128, ""), MoEShape("q", 32, 8, 512, 256, "")])
def test_terms_metric_is_rel_l2_on_data_without_cancellation(shape):
    """Random data: the terms' root-sum-square is the output's size (within 5 %), so the contract's
    metric forgives nothing rel L2 would not; terms of one sign: it is rel L2 exactly."""
    inp = make_inputs(shape, 16, None, seed=3)
    ref = oracle_breakdown(**inp.kwargs(), term_scales=True)
    noisy = ref.out * (1 + 1e-3 * torch.randn(ref.out.shape, dtype=torch.float64))
    assert 0.95 * rel_l2(noisy, ref.out) <= rel_l2_terms(noisy, ref) <= rel_l2(noisy, ref.out)
    same_sign = make_inputs(shape, 3, None, seed=4)
    for t in (same_sign.w1, same_sign.w2, same_sign.x):
        t.abs_()
    ref = oracle_breakdown(**same_sign.kwargs(), term_scales=True)
    assert math.isclose(rel_l2_terms(ref.out * 1.01, ref), rel_l2(ref.out * 1.01, ref.out), rel_tol=1e-9)


# --- the default mode's error path ---------------------------------------------


@pytest.fixture
def clean_word():
    error_word("cpu").zero_()
    yield
    error_word("cpu").zero_()


@pytest.mark.parametrize("backend", ["triton_moe"])
def test_a_bad_id_is_raised_by_the_next_call_without_a_sync(backend, clean_word, monkeypatch):
    """Defect 3: in the default mode a bad id raised nothing; its row came back NaN and only check()
    or MOE_CHECK=sync told. Now the next call raises, naming topk_ids, before it launches anything
    — and reads no device value to decide (no .item(), no bool() of a tensor)."""
    from triton_moe.jit import count_compilations

    fused_moe = _backend(backend).fused_moe
    inp = make_inputs(SMALL, 4, seed=5)
    good = inp.kwargs()
    bad = {**good, "topk_ids": inp.topk_ids.clone()}
    bad["topk_ids"][1, 0] = 9
    out = fused_moe(**bad)
    assert bool(out[1].isnan().all())

    def no_read(self, *a):
        raise AssertionError("a device value was read")

    with monkeypatch.context() as m, count_compilations(dry_run=True) as counter:
        for name in ("item", "__bool__", "__int__"):
            m.setattr(torch.Tensor, name, no_read)
        with pytest.raises(AssertionError):  # the raise path syncs (check() reads the word): it got there
            fused_moe(**good)
    assert counter.launches == []
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E\)"):
        fused_moe(**good)
    assert int(error_word("cpu")) == 0
    fused_moe(**good)  # raised once, cleared: the next call runs
    fused_moe(**bad)
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E\)"):
        poll()  # an explicit check without a sync
    poll()
    check()


@pytest.mark.parametrize("which", ["a1_scale", "a2_scale", "w1_scale"])
@pytest.mark.parametrize("value", [0.0, -1.0, -0.0])
def test_a_zero_or_negative_scale_is_finite_flagged_and_raised_by_the_next_call(which, value, clean_word):
    """Item 13: the contract said bad data never comes out as a plausible number, but a scale of 0,
    −1 or −0.0 gives a finite output in the default mode. The contract now says exactly that, and
    the error reaches the caller: the next call raises it, naming the scale."""
    import moe_spec.contract as contract
    from triton_moe import fused_moe

    words = " ".join(contract.__doc__.split())
    assert "never comes out as a plausible number" not in words
    assert "zero, −0.0 and a negative scale come out finite" in words
    inp = make_inputs(SMALL, 3, "fp8_tensor", seed=6)
    kw = {**inp.kwargs(), "a1_scale": torch.tensor([0.05]), "a2_scale": torch.tensor([0.05])}
    if which == "w1_scale":
        kw["w1_scale"] = torch.full_like(inp.w1_scale, value)
    else:
        kw[which] = torch.tensor([value])
    out = fused_moe(**kw)
    assert bool(torch.isfinite(out).all())  # what the contract now says: finite, and flagged
    with pytest.raises(ValueError, match=f"^{which}: expected a? ?finite, positive"):
        fused_moe(**inp.kwargs())


@pytest.mark.gpu
def test_gpu_a_bad_id_is_raised_by_a_later_call_without_a_sync():
    """On a GPU: the failing call, a call that copies the word to pinned memory, then the raise — the
    calls in between wait for nothing (the test syncs only to make the timing deterministic)."""
    import triton_moe
    from moe_spec import validate

    inp = make_inputs(MoEShape("g", 8, 2, 256, 128, ""), 16, seed=7).to("cuda")
    good = inp.kwargs()
    bad = {**good, "topk_ids": inp.topk_ids.clone()}
    bad["topk_ids"][3, 1] = 8
    for fused_moe in (triton_moe.fused_moe, _backend("cute_moe").fused_moe):
        fused_moe(**good)
        check()
        fused_moe(**bad)
        torch.cuda.synchronize()
        time.sleep(2 * validate.COPY_INTERVAL_S)
        fused_moe(**good)  # copies the word (the bad call's bit) to pinned memory
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E\)"):
            fused_moe(**good)
        assert int(error_word("cuda")) == 0
        fused_moe(**good)


# --- the sharded layers ----------------------------------------------------------------------


def _uneven_experts(rank, world):
    """E = 3 split by hand as 1 + 2, with the peer check."""
    from compare.distributed import EPMoE

    inp = make_inputs(MoEShape("ep3", 3, 2, 64, 32, ""), 3, None)
    lo, E = [(0, 1), (1, 2)][rank]
    kw = {**inp.kwargs(), "w1": inp.w1[lo : lo + E].contiguous(), "w2": inp.w2[lo : lo + E].contiguous()}
    try:
        EPMoE("triton_moe")(**kw)
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _refuse_without_peer_check(rank, world, parallel):
    """Rank 1 passes float32 x, check_peers=False; both catch what they get and meet at a barrier."""
    import torch.distributed as dist

    from compare.distributed import EPMoE, TPMoE, shard_ep, shard_tp

    inp = make_inputs(SMALL, 3, None)
    kw = (shard_ep if parallel == "ep" else shard_tp)(inp, rank, world).kwargs()
    if rank == 1:
        kw["x"] = kw["x"].float()
    try:
        out = (EPMoE if parallel == "ep" else TPMoE)("triton_moe", check_peers=False)(**kw)
        result = ("nan rows", out.isnan().any(dim=1).tolist())
    except (TypeError, ValueError) as exc:
        result = ("refused", f"{type(exc).__name__}: {exc}")
    dist.barrier()
    return result


def _sharded_cases(rank, world):
    return [_uneven_experts(rank, world)] + [_refuse_without_peer_check(rank, world, p) for p in ("ep", "tp")]


def test_the_sharded_layers_blame_the_shard_and_never_leave_a_peer_waiting():
    """Item 10: experts split 1 + 2 blamed topk_ids ("expected global expert ids in [0, E=2)")
    instead of the shard; without the peer check a refusing rank left its peer waiting until the run's
    limit. Now: the shard is named on both ranks; the refusing rank takes part in the collectives with
    NaN, so its peer's rows that needed it come out NaN, and both reach the barrier."""
    from compare.launch import run_ranks

    start = time.monotonic()
    ranks = run_ranks(_sharded_cases, 2, backend="gloo", timeout_s=90)
    assert time.monotonic() - start < 80
    shard = ranks[0][0]
    assert shard == ranks[1][0] and shard.startswith("ValueError: w1: the ranks disagree on E: [1, 2]"), shard
    for i in (1, 2):  # EP, TP
        assert ranks[1][i] == ("refused", "TypeError: x: expected dtype bfloat16, got float32")
        assert ranks[0][i][0] == "nan rows" and any(ranks[0][i][1])
    assert ranks[0][2][1] == [True] * 3  # TP: every row of the sum had the refusing rank's part


def test_the_sharded_layers_run_the_size_check(tmp_path):
    """In a one-rank group: TP and EP refuse what fused_moe refuses, with its words."""
    import datetime

    import torch.distributed as dist

    from compare.distributed import EPMoE, TPMoE

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rv'}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        for case, (E, K, I, top_k, T) in SIZES.items():  # noqa: E741
            verdict = _refusal(lambda: check_sizes(E, K, I, top_k, T, limits=_limits("triton_moe"), names=CALL_NAMES))
            # weights of the huge layers are expanded views; small ones are real (EP checks them first)
            small = E * 3 * I * K <= 10**6
            weights = make_inputs(MoEShape("w", E, min(top_k, E), K, I, ""), 1) if small else None
            args = (
                _huge(T, K),
                weights.w1 if small else _huge(E, 2 * I, K),
                weights.w2 if small else _huge(E, K, I),
                _huge(T, top_k, dtype=torch.float32),
                _huge(T, top_k, dtype=torch.int32),
            )
            for layer in (TPMoE("triton_moe"), EPMoE("triton_moe")):
                got = _refusal(lambda: layer(*args))
                if verdict is None:  # refused for the views' strides, or (EP reads them) their zero ids
                    assert got is not None and ("contiguous" in got[1] or "appears twice" in got[1]), (case, got)
                else:
                    assert got == verdict, (case, type(layer).__name__, got, verdict)
    finally:
        dist.destroy_process_group()

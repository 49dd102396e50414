"""Our kernels as transformers experts implementations, checked inside real model architectures.

CPU (Triton interpreter): tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 models (2 layers, bf16,
sizes multiples of 16). Under ``experts_implementation="triton_moe"`` their logits must lie within
the bf16 tolerance of compare.metrics (relative L2) of the same model under ``"eager"``, must NOT be
bitwise equal to eager's (our kernel rounds differently: a silent fall-back to transformers' own
forward would be bitwise equal), the counter of completed ``fused_moe`` calls must rise by one per
MoE layer, and greedy generation (8 tokens on the CPU, 16 on the GPU) must follow eager's (below). The FP8 mapping is
checked against transformers' own dequantization and against the fp64 oracle. Refusals (GELU gate,
biases, static FP8 scales, other block shapes) are raised before any kernel runs. cute_moe cannot
launch on a CPU: its registration and its refusals are checked there.

GPU (``-m gpu``): the same checks on real layer shapes (one MoE layer, random weights) for both
backends, and the FP8 path of triton_moe.

Greedy generation at random init: the logits of a random model are nearly flat and bf16 (ties are
common), so two correct bf16 implementations can pick different tokens wherever eager's top-2 gap is
below their rounding difference. Seen here: at the Qwen3-30B-A3B layer shape (8 prompts, 16 tokens)
eager and transformers' own "grouped_mm" part ways on one row, at a step where eager's top-2 gap is
one bf16 ulp; the tiny DeepSeek-V3 model below matches eager on every row under transformers 5.24
but parts on one row under 5.17 (its random init differs), at a gap of 0.004. Token-for-token
identity is therefore not something a correct kernel can promise at random init, and no seed stays
chosen across transformers versions. What is checked instead, on CPU and GPU alike: the tokens equal
eager's up to the first step where they differ, and at every step up to and including that one
(same prefix on both sides) the two logit vectors agree within the bf16 tolerance — a kernel bug
moves the logits beyond it, a near-tie does not. How many rows stay identical for all the tokens is
printed (``-s``), with eager's top-2 gap where a row parts.
"""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

import compare.hf_experts as hx
from compare.metrics import bitwise_equal, tolerance_for
from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs, route

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

BF16_TOL = tolerance_for(None).rel_l2
NEW_TOKENS = 16
CPU_NEW_TOKENS = 8  # the interpreter costs a fused_moe call per step and MoE layer: the same check, half the steps
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hx.register()


# --- tiny models -----------------------------------------------------------------------------------

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    num_experts_per_tok=2,
)


def mixtral(**kw):
    return MixtralConfig(**{**COMMON, "intermediate_size": 32, "num_local_experts": 8, **kw})


def qwen3_moe(**kw):
    return Qwen3MoeConfig(
        **{
            **COMMON,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            **kw,
        }
    )


def deepseek_v3(**kw):
    return DeepseekV3Config(
        **{
            **COMMON,
            "moe_intermediate_size": 32,
            "intermediate_size": 64,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "n_group": 2,
            "topk_group": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "num_key_value_heads": 4,
            **kw,
        }
    )


def build(config, seed=0, device="cpu"):
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # always the tokens asked for
    model.generation_config.pad_token_id = 0
    return model.eval()


def moe_layers(model) -> int:
    return sum(1 for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor))


def prompts(model, batch=2, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(model.device)


@torch.no_grad()
def logits_under(model, implementation, ids):
    model.set_experts_implementation(implementation)
    before = hx.CALLS[implementation]
    out = model(ids).logits
    return out, hx.CALLS[implementation] - before


@torch.no_grad()
def greedy(model, implementation, ids, new_tokens=NEW_TOKENS):
    """(new tokens [B, new_tokens], the logits that chose them [B, new_tokens, V] in fp32)."""
    model.set_experts_implementation(implementation)
    out = model.generate(
        ids, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1).float()


def top2_gap(logits):
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def check_logits(model, implementation, ids):
    ref, _ = logits_under(model, "eager", ids)
    out, calls = logits_under(model, implementation, ids)
    assert calls == moe_layers(model), f"{implementation}: {calls} fused_moe calls for {moe_layers(model)} MoE layers"
    err = rel_l2(out, ref)
    assert err <= BF16_TOL, f"{implementation} vs eager: rel L2 {err:.2e} > {BF16_TOL:.0e}"
    assert not bitwise_equal(out, ref), f"{implementation}: logits bitwise equal to eager's (did it fall back?)"


def agrees_until_a_near_tie(model, implementation, ids, new_tokens=NEW_TOKENS):
    """Greedy tokens equal eager's up to the first step where they differ, and at every step up to
    and including that one (same prefix on both sides) the two logit vectors agree within the bf16
    tolerance: a divergence is then a near-tie that two correct roundings decide differently."""
    ref, ref_logits = greedy(model, "eager", ids, new_tokens)
    out, out_logits = greedy(model, implementation, ids, new_tokens)
    identical = 0
    for r in range(ids.shape[0]):
        differ = (out[r] != ref[r]).nonzero()
        last = int(differ[0]) if len(differ) else new_tokens - 1
        identical += not len(differ)
        for step in range(last + 1):
            err = rel_l2(out_logits[r, step], ref_logits[r, step])
            assert err <= BF16_TOL, (
                f"row {r}, step {step}: logits rel L2 {err:.2e} > {BF16_TOL:.0e} "
                f"(tokens {out[r].tolist()} vs eager {ref[r].tolist()})"
            )
        if len(differ):
            print(
                f"row {r} parts from eager at step {last}: eager's top-2 gap there is "
                f"{float(top2_gap(ref_logits[r, last])):.3g}"
            )
    print(f"{implementation}: {identical}/{ids.shape[0]} rows identical to eager for {new_tokens} tokens")
    return identical


# --- CPU: the three architectures -----------------------------------------------------------------------


@pytest.mark.parametrize("make", [mixtral, qwen3_moe, deepseek_v3], ids=lambda f: f.__name__)
def test_triton_moe_inside_the_model_matches_eager(make):
    model = build(make())
    ids = prompts(model)
    check_logits(model, "triton_moe", ids)
    before = hx.CALLS["triton_moe"]
    agrees_until_a_near_tie(model, "triton_moe", ids, CPU_NEW_TOKENS)
    assert hx.CALLS["triton_moe"] - before == CPU_NEW_TOKENS * moe_layers(model)  # prefill + 7 decode steps


def test_from_pretrained_takes_the_name(tmp_path):
    """The README's use: register(), then from_pretrained(..., experts_implementation="triton_moe")."""
    build(qwen3_moe(num_hidden_layers=1)).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, experts_implementation="triton_moe")
    assert model.config._experts_implementation == "triton_moe"
    before = hx.CALLS["triton_moe"]
    with torch.no_grad():
        model(prompts(model))
    assert hx.CALLS["triton_moe"] == before + 1


def test_register_is_explicit_and_idempotent():
    assert hx.register() == hx.IMPLEMENTATIONS and hx.register("triton_moe") == ("triton_moe",)
    assert all(hx.registered(name) for name in hx.IMPLEMENTATIONS)
    with pytest.raises(ValueError, match="^implementations: "):
        hx.register("flash_moe")


def test_experts_module_takes_3d_hidden_states_and_bf16_router_weights():
    model = build(qwen3_moe(num_hidden_layers=1))
    experts = model.model.layers[0].mlp.experts
    model.set_experts_implementation("triton_moe")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g).bfloat16()  # Qwen3-MoE's router hands over bf16 weights
    with torch.no_grad():
        out3, out2 = experts(x, ids, w), experts(x.reshape(6, 64), ids, w)
    assert out3.shape == x.shape and torch.equal(out3.reshape(6, 64), out2)


def test_autograd_is_refused():
    model = build(mixtral(num_hidden_layers=1))
    model.set_experts_implementation("triton_moe")
    with pytest.raises(ValueError, match="^hidden_states: autograd"):
        model(prompts(model))


# --- CPU: refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", hx.IMPLEMENTATIONS)
def test_a_gelu_gate_is_refused_before_any_launch(implementation):
    model = build(mixtral(hidden_act="gelu", num_hidden_layers=1))
    model.set_experts_implementation(implementation)
    before = hx.CALLS[implementation]
    with pytest.raises(
        ValueError,
        match=rf"^experts_implementation: '{implementation}' cannot run MixtralExperts "
        r"\(model_type 'mixtral'\): activation GELUActivation",
    ):
        with torch.no_grad():
            model(prompts(model))
    assert hx.CALLS[implementation] == before


def test_biases_are_refused():
    config = GptOssConfig(
        **{**COMMON, "intermediate_size": 32, "num_local_experts": 8, "layer_types": None, "sliding_window": 16}
    )
    model = build(config)
    model.set_experts_implementation("triton_moe")
    with pytest.raises(ValueError, match=r"cannot run GptOssExperts \(model_type 'gpt_oss'\):.*biases"):
        with torch.no_grad():
            model(prompts(model))


def test_no_gate_and_float32_weights_are_refused():
    from transformers.integrations.moe import use_experts_implementation
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class UpOnlyExperts(MixtralExperts):  # the flag NemotronH's experts carry
        pass

    use_experts_implementation(UpOnlyExperts, has_gate=False)
    with pytest.raises(ValueError, match=r"cannot run UpOnlyExperts \(model_type 'mixtral'\): no gate"):
        hx.contract_arguments(UpOnlyExperts(mixtral()), "triton_moe")
    with pytest.raises(ValueError, match=r"cannot run MixtralExperts .*: torch.float32 expert weights"):
        hx.contract_arguments(build(mixtral(num_hidden_layers=1)).float().model.layers[0].mlp.experts, "triton_moe")


def test_cute_moe_is_registered_and_refuses_the_cpu_before_launching():
    model = build(mixtral(num_hidden_layers=1))
    model.set_experts_implementation("cute_moe")
    with pytest.raises(ValueError, match="cute_moe runs on a CUDA device"):
        with torch.no_grad():
            model(prompts(model))
    assert hx.CALLS["cute_moe"] == 0


# --- CPU: FP8 ------------------------------------------------------------------------------------------

FP8_SIZES = dict(hidden_size=128, moe_intermediate_size=128)  # one 128×128 block per half


@pytest.mark.parametrize("scheme,quant", [("block", "fp8_block"), ("tensor", "fp8_channel")])
def test_fp8_experts_map_exactly_and_match_the_oracle(scheme, quant):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    model = build(qwen3_moe(num_hidden_layers=1, **FP8_SIZES))
    assert hx.quantize_experts(model, scheme) == 1
    experts = model.model.layers[0].mlp.experts
    args = hx.contract_arguments(experts, "triton_moe")
    assert args.quant == quant
    # our reading of the scales is transformers' own: the same dequantized weights, bit for bit
    from moe_spec.quant import dequantize_weight

    for q, s, ours, theirs in (
        (args.w1, args.w1_scale, experts.gate_up_proj, experts.gate_up_proj_scale_inv),
        (args.w2, args.w2_scale, experts.down_proj, experts.down_proj_scale_inv),
    ):
        assert q.data_ptr() == ours.data_ptr()  # no copy of the weights
        assert torch.equal(
            dequantize_weight(q, s, quant), Fp8Dequantize(None)._dequantize_one(ours, theirs, torch.float32)
        )
    inp = make_inputs(MoEShape("t", 8, 2, 128, 128, "test"), 10, None, seed=4)
    model.set_experts_implementation("triton_moe")
    with torch.no_grad():
        out = experts(inp.x, inp.topk_ids.long(), inp.topk_weights)
    ref = oracle(
        inp.x,
        args.w1,
        args.w2,
        inp.topk_weights,
        inp.topk_ids,
        quant=quant,
        w1_scale=args.w1_scale,
        w2_scale=args.w2_scale,
    )
    assert rel_l2(out, ref) <= tolerance_for(quant).rel_l2


def test_fp8_model_runs_through_the_fp8_registry():
    model = build(qwen3_moe(**FP8_SIZES))
    ids = prompts(model)
    ref, _ = logits_under(model, "eager", ids)
    hx.quantize_experts(model, "block")
    out, calls = logits_under(model, "triton_moe", ids)
    assert calls == 2
    assert rel_l2(out, ref) <= tolerance_for("fp8_block").quant_error  # what FP8 costs, not a kernel check


def test_fp8_refusals():
    model = build(qwen3_moe(num_hidden_layers=1, **FP8_SIZES))
    hx.quantize_experts(model, "block")
    experts = model.model.layers[0].mlp.experts
    experts.activation_scheme = "static"
    experts.block_size = (64, 64)
    with pytest.raises(
        ValueError, match=r"cannot run FP8ExpertsModule.*activation_scheme='static'.*block_size=\(64, 64\)"
    ):
        hx.contract_arguments(experts, "triton_moe")


def test_small_intermediate_block_scales_are_refused():
    # 2I = 64 <= 128: transformers allocates one block row per half ([E, 2, kb]); 128×128 blocks of the
    # concatenated weight would have one row — the two readings differ, so the mapping refuses
    from moe_spec.quant import quantize_weight

    model = build(qwen3_moe(num_hidden_layers=1, hidden_size=128, moe_intermediate_size=32))
    experts = model.model.layers[0].mlp.experts
    q1, s1 = quantize_weight(experts.gate_up_proj.detach(), "fp8_block")
    q2, s2 = quantize_weight(experts.down_proj.detach(), "fp8_block")
    fp8 = hx.fp8_experts(experts.config, q1, q2, s1.repeat(1, 2, 1), s2, (128, 128))
    with pytest.raises(
        ValueError,
        match=r"intermediate size 32, not a multiple of 128.*"
        r"gate_up_proj_scale_inv of shape \(8, 2, 1\)",
    ):
        hx.contract_arguments(fp8, "triton_moe")


# --- the harness hook --------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["grouped_mm", "triton_moe"])
def test_experts_fused_moe_is_contract_shaped(implementation):
    inp = make_inputs(MoEShape("t", 8, 2, 64, 32, "test"), 9, None, seed=5)
    fused_moe = hx.experts_fused_moe(implementation, "deepseek_v3")
    before = hx.CALLS["triton_moe"]
    out = fused_moe(**inp.kwargs())
    assert out.shape == inp.x.shape and out.dtype == torch.bfloat16
    assert rel_l2(out, oracle(**inp.kwargs())) <= BF16_TOL
    assert hx.CALLS["triton_moe"] - before == (implementation == "triton_moe")
    with pytest.raises(ValueError, match="^quant: 'fp8_tensor' has no transformers counterpart"):
        fp8 = make_inputs(MoEShape("t", 8, 2, 64, 32, "test"), 9, "fp8_tensor", seed=5)
        fused_moe(**fp8.kwargs())
    with pytest.raises(TypeError, match="^topk_weights: "):
        fused_moe(**{**inp.kwargs(), "topk_weights": inp.topk_weights.bfloat16()})


def test_the_project_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import moe_spec.contract, triton_moe, cute_moe, compare, compare.backends, compare.cli, compare.suite\n"
        "try:\n    import compare.hf_experts\nexcept ImportError as e:\n    print('refused:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "refused: compare.hf_experts needs transformers 5.x" in run.stdout


# --- GPU: real layer shapes ----------------------------------------------------------------------------

REAL = {  # one MoE layer of the real model, random weights; vocabulary cut to 4096
    "qwen3_30b_a3b": lambda: Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=2048,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    ),
    "mixtral_8x7b": lambda: MixtralConfig(
        vocab_size=4096,
        hidden_size=4096,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", hx.IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(REAL))
def test_gpu_real_layer_shapes(name, implementation):
    model = build(REAL[name](), seed=1, device="cuda")
    ids = prompts(model, batch=8, length=64, seed=1)
    check_logits(model, implementation, ids)
    agrees_until_a_near_tie(model, implementation, ids)


@pytest.mark.gpu
def test_gpu_fp8_block_real_layer_shape():
    model = build(REAL["qwen3_30b_a3b"](), seed=2, device="cuda")
    ids = prompts(model, batch=4, length=64, seed=2)
    ref, _ = logits_under(model, "eager", ids)
    hx.quantize_experts(model, "block")
    out, calls = logits_under(model, "triton_moe", ids)
    assert calls == 1 and rel_l2(out, ref) <= tolerance_for("fp8_block").quant_error
    experts = model.model.layers[0].mlp.experts
    args = hx.contract_arguments(experts, "triton_moe")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 2048, generator=g).bfloat16().cuda()
    weights, ids = (t.cuda() for t in route(torch.randn(256, 128, generator=g), 8))
    with torch.no_grad():
        got = experts(x, ids.long(), weights)
    ref = oracle(x, args.w1, args.w2, weights, ids, quant="fp8_block", w1_scale=args.w1_scale, w2_scale=args.w2_scale)
    assert rel_l2(got, ref) <= tolerance_for("fp8_block").rel_l2


# --- the benchmark, on a tiny model ------------------------------------------------------------------


def test_hf_bench_writes_its_rows_with_run_info(tmp_path):
    import json

    from compare.studies import hf_bench

    tiny = dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
    )
    res = hf_bench.main(
        [
            "--layers",
            "1",
            "--prefill",
            "1x16",
            "--decode-batch",
            "2",
            "--decode-steps",
            "1",
            "--decode-prompt",
            "8",
            "--reps",
            "1",
            "--implementations",
            "eager,triton_moe,cute_moe",
            "--out",
            str(tmp_path),
            "--commit",
            "abc1234",
            "--config",
            json.dumps(tiny),
            "--deadline-s",
            "1000",
        ]
    )
    rows = {(r["format"], r["implementation"]): r for r in res["rows"]}
    assert rows["bf16", "eager"]["status"] == "ok"
    ours = rows["bf16", "triton_moe"]
    assert ours["status"] == "ok" and ours["our_kernel_calls"] > 0 and ours["rel_l2_vs_eager_bf16"] <= BF16_TOL
    assert ours["decode_tokens_per_s"] > 0 and ours["prefill_ms"] > 0
    assert "cute_moe runs on a CUDA device" in rows["bf16", "cute_moe"]["status"]
    assert rows["fp8_block", "eager"]["status"].startswith("not available: ")  # transformers' FP8 needs its Hub kernel
    fp8 = rows["fp8_block", "triton_moe"]
    assert fp8["status"] == "ok" and fp8["rel_l2_vs_eager_bf16"] <= tolerance_for("fp8_block").quant_error
    md = next(tmp_path.glob("hf_bench_*.md")).read_text()
    saved = json.loads(next(tmp_path.glob("hf_bench_*.json")).read_text())
    for key in ("date", "device", "commit", "command"):
        assert saved[key] == res[key] and str(res[key]) in md
    assert saved["commit"] == "abc1234" and md.count("| bf16 |") == 3

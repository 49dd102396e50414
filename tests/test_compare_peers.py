"""The peer adapters (compare/peers/) against fakes of the peers, on the CPU.

Each fake is put into ``sys.modules`` under the peer's module names with the peer's signature. It
asserts the layouts it is handed and computes the layer the way the peer reads them (vLLM's flags or
quant config; TensorRT-LLM's [up; gate] w31 and its four FP8 scales; SonicMoE's interleaved (2I, K, E)
weights and flat routing), so an adapter that converts wrongly gives a wrong answer against the
fp64 oracle. Also: the 'not installed' rows, a declined format, a peer that needs a GPU on the CPU,
and conversions made once per input tensor.
"""

import dataclasses
import enum
import json
import sys
import types
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from compare import cli, userkernel
from compare.peers import PEERS, adapter
from moe_spec.oracle import oracle, rel_l2
from moe_spec.problem import MoEShape, make_inputs
from moe_spec.quant import FP8_BLOCK, FP8_DTYPE, FP8_MAX, fake_quantize_activation

SHAPE = MoEShape("tiny", num_experts=4, top_k=2, hidden=256, intermediate=128, source="test")
T = 5
BF16 = torch.bfloat16


def _install(monkeypatch, modules: dict) -> None:
    """Fake modules (dotted name -> attributes), their parent packages too."""
    for name, attrs in modules.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in modules and not isinstance(sys.modules.get(parent), types.ModuleType):
                monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)


def _problem(quant):
    return make_inputs(SHAPE, T, quant, seed=3)


def _run(name, quant, inputs=None):
    """(output, inputs) of the peer's adapted fused_moe on the tiny problem."""
    backend = userkernel.load_peer(name)
    assert backend.missing is None, backend.missing
    inputs = inputs or _problem(quant)
    return backend.fused_moe(**inputs.kwargs()), inputs


def _close_to_oracle(out, inputs) -> float:
    err = rel_l2(out, oracle(**inputs.kwargs()))
    assert err < 1e-2, err
    return err


# --- vLLM -----------------------------------------------------------------------------------------


def _vllm_quant(E, N, K, use_fp8, per_channel, block_shape, w_scale):
    """The contract's format back from vLLM's spelling, checking each scale's shape on the way."""
    if not use_fp8:
        assert w_scale is None
        return None
    if block_shape is not None:
        assert block_shape == [FP8_BLOCK, FP8_BLOCK] and not per_channel
        assert tuple(w_scale.shape) == (E, -(-N // FP8_BLOCK), -(-K // FP8_BLOCK))
        return "fp8_block"
    if per_channel:
        assert tuple(w_scale.shape) == (E, N, 1), "vLLM keeps per-channel scales as [E, N, 1]"
        return "fp8_channel"
    assert tuple(w_scale.shape) == (E,)
    return "fp8_tensor"


def _vllm_compute(hidden_states, w1, w2, topk_weights, topk_ids, quant, s1, s2):
    assert hidden_states.dtype == BF16 and topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    squeeze = (lambda s: s[..., 0]) if quant == "fp8_channel" else (lambda s: s)  # noqa: E731
    s1, s2 = (None if s is None else squeeze(s) for s in (s1, s2))
    return oracle(hidden_states, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=s1, w2_scale=s2).to(BF16)


def _fake_vllm(monkeypatch, calls, spelling):
    def fp8_w8a8_moe_quant_config(
        w1_scale,
        w2_scale,
        a1_scale=None,
        a2_scale=None,
        w1_bias=None,
        w2_bias=None,
        per_act_token_quant=False,
        per_out_ch_quant=False,
        block_shape=None,
    ):
        return types.SimpleNamespace(
            w1_scale=w1_scale,
            w2_scale=w2_scale,
            a1_scale=a1_scale,
            a2_scale=a2_scale,
            per_act_token_quant=per_act_token_quant,
            per_out_ch_quant=per_out_ch_quant,
            block_shape=block_shape,
        )

    def current(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        inplace=False,
        activation="silu",
        apply_router_weight_on_input=False,
        global_num_experts=-1,
        expert_map=None,
        quant_config=None,
        allow_deep_gemm=False,
    ):
        assert not inplace and quant_config is None or (quant_config.a1_scale is None and quant_config.a2_scale is None)
        calls.append(quant_config)
        E, N, K = w1.shape
        if quant_config is None:
            return _vllm_compute(hidden_states, w1, w2, topk_weights, topk_ids, None, None, None)
        assert quant_config.per_act_token_quant == quant_config.per_out_ch_quant  # per-token x with per-channel w
        quant = _vllm_quant(
            E, N, K, True, quant_config.per_out_ch_quant, quant_config.block_shape, quant_config.w1_scale
        )
        return _vllm_compute(
            hidden_states, w1, w2, topk_weights, topk_ids, quant, quant_config.w1_scale, quant_config.w2_scale
        )

    def flags(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        inplace=False,
        activation="silu",
        apply_router_weight_on_input=False,
        use_fp8_w8a8=False,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=False,
        global_num_experts=-1,
        expert_map=None,
        w1_scale=None,
        w2_scale=None,
        w1_zp=None,
        w2_zp=None,
        a1_scale=None,
        a2_scale=None,
        block_shape=None,
    ):
        assert not inplace and a1_scale is None and a2_scale is None
        calls.append(use_fp8_w8a8)
        E, N, K = w1.shape
        quant = _vllm_quant(E, N, K, use_fp8_w8a8, per_channel_quant, block_shape, w1_scale)
        return _vllm_compute(hidden_states, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale)

    _install(
        monkeypatch,
        {
            "vllm.model_executor.layers.fused_moe": {"fused_experts": current if spelling == "quant_config" else flags},
            "vllm.model_executor.layers.fused_moe.config": {"fp8_w8a8_moe_quant_config": fp8_w8a8_moe_quant_config},
        },
    )


@pytest.mark.parametrize("spelling", ["quant_config", "flags"])
@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_channel", "fp8_block"])
def test_vllm_adapter(quant, spelling, monkeypatch):
    calls = []
    _fake_vllm(monkeypatch, calls, spelling)
    out, inputs = _run("vllm", quant)
    _close_to_oracle(out, inputs)
    assert len(calls) == 1
    note = userkernel.load_peer("vllm").converted(quant)
    assert ("quant_config" in note) == (spelling == "quant_config")
    assert ("[E, N] → [E, N, 1]" in note) == (quant == "fp8_channel")


# --- SGLang ---------------------------------------------------------------------------------------


class _StandardTopKOutput(NamedTuple):
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


@dataclasses.dataclass
class _MoeRunnerConfig:  # the fields of SGLang's MoeRunnerConfig that fused_experts reads, and a few more
    num_experts: int = None
    num_local_experts: int = None
    hidden_size: int = None
    intermediate_size_per_partition: int = None
    top_k: int = None
    params_dtype: torch.dtype = None
    activation: str = "silu"
    is_gated: bool = True
    apply_router_weight_on_input: bool = False
    inplace: bool = True
    no_combine: bool = False
    routed_scaling_factor: float = None
    gemm1_alpha: float = None
    gemm1_clamp_limit: float = None
    gate_up_interleaved: bool = True


def _fake_sglang(monkeypatch, calls, api):
    def current(
        hidden_states,
        w1,
        w2,
        topk_output,
        moe_runner_config,
        b1=None,
        b2=None,
        use_fp8_w8a8=False,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=False,
        w1_scale=None,
        w2_scale=None,
        w1_zp=None,
        w2_zp=None,
        a1_scale=None,
        a2_scale=None,
        block_shape=None,
    ):
        assert isinstance(topk_output, _StandardTopKOutput) and isinstance(moe_runner_config, _MoeRunnerConfig)
        c = moe_runner_config
        assert not c.inplace and c.activation == "silu" and not c.gate_up_interleaved and not c.no_combine
        assert (c.num_experts, c.num_local_experts, c.hidden_size, c.intermediate_size_per_partition, c.top_k) == (
            SHAPE.num_experts,
            SHAPE.num_experts,
            SHAPE.hidden,
            SHAPE.intermediate,
            SHAPE.top_k,
        )
        calls.append(c)
        topk_weights, topk_ids, _ = topk_output
        E, N, K = w1.shape
        quant = _vllm_quant(E, N, K, use_fp8_w8a8, per_channel_quant, block_shape, w1_scale)
        return _vllm_compute(hidden_states, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale)

    def earlier(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        inplace=False,
        activation="silu",
        use_fp8_w8a8=False,
        per_channel_quant=False,
        w1_scale=None,
        w2_scale=None,
        block_shape=None,
    ):
        assert not inplace
        calls.append(None)
        E, N, K = w1.shape
        quant = _vllm_quant(E, N, K, use_fp8_w8a8, per_channel_quant, block_shape, w1_scale)
        return _vllm_compute(hidden_states, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale)

    _install(
        monkeypatch,
        {
            "sglang.srt.layers.moe.fused_moe_triton.fused_moe": {
                "fused_experts": current if api == "current" else earlier
            },
            "sglang.srt.layers.moe.topk": {"StandardTopKOutput": _StandardTopKOutput},
            "sglang.srt.layers.moe.moe_runner": {"MoeRunnerConfig": _MoeRunnerConfig},
        },
    )


@pytest.mark.parametrize("api", ["current", "earlier"])
@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_channel", "fp8_block"])
def test_sglang_adapter(quant, api, monkeypatch):
    calls = []
    _fake_sglang(monkeypatch, calls, api)
    out, inputs = _run("sglang", quant)
    _close_to_oracle(out, inputs)
    assert len(calls) == 1


# --- FlashInfer -----------------------------------------------------------------------------------


def _e4m3(v):
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()


def _blocks(scale, rows, cols):
    """[E, ⌈rows/128⌉, ⌈cols/128⌉] block scales expanded to [E, rows, cols]."""
    return scale.repeat_interleave(FP8_BLOCK, 1)[:, :rows].repeat_interleave(FP8_BLOCK, 2)[:, :, :cols]


def _fake_flashinfer(monkeypatch, calls):
    """cutlass_fused_moe as TensorRT-LLM defines it: w31 = [up; gate], SwiGLU = SiLU(gate)·up, the four FP8
    per-tensor scales, or DeepSeek block scales with the activations quantized inside."""

    def cutlass_fused_moe(
        input,
        token_selected_experts,
        token_final_scales,
        fc1_expert_weights,
        fc2_expert_weights,
        output_dtype,
        quant_scales,
        fc1_expert_biases=None,
        fc2_expert_biases=None,
        input_sf=None,
        swiglu_alpha=None,
        swiglu_beta=None,
        swiglu_limit=None,
        tp_size=1,
        tp_rank=0,
        ep_size=1,
        ep_rank=0,
        cluster_size=1,
        cluster_rank=0,
        output=None,
        enable_alltoall=False,
        use_deepseek_fp8_block_scale=False,
        use_w4_group_scaling=False,
        use_mxfp8_act_scaling=False,
        min_latency_mode=False,
        tune_max_num_tokens=8192,
        enable_pdl=None,
        use_fused_finalize=True,
    ):
        assert token_selected_experts.dtype == torch.int32 and token_final_scales.dtype == torch.float32
        assert output_dtype == BF16 and output.dtype == BF16 and output.shape == input.shape
        calls.append(dict(fc1=fc1_expert_weights, quant_scales=quant_scales, block=use_deepseek_fp8_block_scale))
        E, N, K = fc1_expert_weights.shape
        I = N // 2  # noqa: E741
        w31, w2 = fc1_expert_weights.float(), fc2_expert_weights.float()
        x = input.float()
        fc1_scale = fc2_scale = torch.ones(E)
        if quant_scales is None:
            assert input.dtype == BF16 and fc1_expert_weights.dtype == BF16
        elif use_deepseek_fp8_block_scale:
            assert input.dtype == BF16 and len(quant_scales) == 2
            w31, w2 = w31 * _blocks(quant_scales[0], N, K), w2 * _blocks(quant_scales[1], K, I)
            x = fake_quantize_activation(input, "fp8_block", torch.float32)
        else:
            assert input.dtype == FP8_DTYPE and len(quant_scales) == 4
            fc1_dequant, fc2_quant, fc2_dequant, fc1_input_dequant = quant_scales
            assert fc1_dequant.shape == (E,) and fc2_dequant.shape == (E,)
            assert fc2_quant.dim() == 0 and fc1_input_dequant.dim() == 0
            fc1_scale, fc2_scale = fc1_dequant, fc2_dequant
        out = torch.zeros(input.shape, dtype=torch.float32)
        for t in range(input.shape[0]):
            for j in range(token_selected_experts.shape[1]):
                e = int(token_selected_experts[t, j])
                h = (x[t] @ w31[e].T) * fc1_scale[e]
                up, gate = h[:I], h[I:]
                a = F.silu(gate) * up
                if quant_scales is not None and use_deepseek_fp8_block_scale:
                    a = fake_quantize_activation(a[None], "fp8_block", torch.float32)[0]
                elif quant_scales is not None:
                    a = _e4m3(a * fc2_quant)
                out[t] += token_final_scales[t, j] * (a @ w2[e].T) * fc2_scale[e]
        output.copy_(out.to(BF16))
        return [output]

    _install(monkeypatch, {"flashinfer.fused_moe": {"cutlass_fused_moe": cutlass_fused_moe}})


@pytest.mark.parametrize("quant", [None, "fp8_tensor", "fp8_block"])
def test_flashinfer_adapter(quant, monkeypatch):
    calls, made = [], []
    _fake_flashinfer(monkeypatch, calls)
    module = adapter("flashinfer")
    real = module.up_gate
    monkeypatch.setattr(module, "up_gate", lambda w1: made.append(1) or real(w1))
    backend = userkernel.load_peer("flashinfer")
    inputs = _problem(quant)
    out = backend.fused_moe(**inputs.kwargs())
    _close_to_oracle(out, inputs)
    I = SHAPE.intermediate  # noqa: E741
    w31 = calls[0]["fc1"]
    assert torch.equal(w31[:, :I], inputs.w1[:, I:]) and torch.equal(w31[:, I:], inputs.w1[:, :I])  # [up; gate]
    again = backend.fused_moe(**inputs.kwargs())
    assert torch.equal(again, out)
    assert len(made) == 1 and calls[1]["fc1"].data_ptr() == w31.data_ptr()  # converted once, outside the second call
    if quant == "fp8_block":
        half = I // FP8_BLOCK
        s31 = calls[0]["quant_scales"][0]
        assert torch.equal(s31[:, :half], inputs.w1_scale[:, half:]) and calls[0]["block"]
    assert "w31 [up; gate]" in backend.converted(quant)


def test_flashinfer_declines_per_channel_through_the_probe(monkeypatch):
    calls = []
    _fake_flashinfer(monkeypatch, calls)
    backend = userkernel.load_peer("flashinfer")
    inputs = _problem("fp8_channel")
    from compare.numerics import _tokens, unavailable

    with pytest.raises(NotImplementedError, match="not fp8_channel"):
        backend.fused_moe(**_tokens(inputs, slice(0, 0)).kwargs())
    assert unavailable(backend, inputs, "cuda").startswith(
        "not implemented: flashinfer's adapter maps bf16, fp8_tensor, fp8_block, not fp8_channel"
    )
    assert not calls


# --- SonicMoE -------------------------------------------------------------------------------------


class _ActivationType(enum.Enum):
    SWIGLU = "swiglu"
    GEGLU = "geglu"


def _fake_sonicmoe(monkeypatch, calls):
    def moe_general_routing_inputs(
        x,
        router_scores,
        token_indices,
        expert_indices,
        w1,
        b1,
        w2,
        b2,
        E,
        stream_id,
        activation_type,
        is_inference_mode_enabled=False,
        concat_layout=False,
    ):
        twoI, K, E1 = w1.shape
        K2, I, E2 = w2.shape
        assert (E1, E2, K2, twoI) == (E, E, K, 2 * I) and b1 is None and b2 is None
        assert max(w1.stride()) == w1.stride(2) and w1.stride(1) == 1  # stride order (2, 0, 1)
        assert max(w2.stride()) == w2.stride(2) and w2.stride(1) == 1
        assert activation_type is _ActivationType.SWIGLU and is_inference_mode_enabled and not concat_layout
        assert token_indices.dtype == expert_indices.dtype == torch.int32 and router_scores.dtype == torch.float32
        assert bool((token_indices[1:] >= token_indices[:-1]).all()), "token indices sorted ascending"
        calls.append(w1)
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t, e, s in zip(token_indices.tolist(), expert_indices.tolist(), router_scores.tolist()):
            h = x[t].float() @ w1[:, :, e].float().T
            a = h[1::2] * F.silu(h[0::2])  # interleaved rows: gate even, up odd
            out[t] += s * (a @ w2[:, :, e].float().T)
        return out.to(BF16), torch.bincount(expert_indices, minlength=E)

    _install(
        monkeypatch,
        {
            "sonicmoe": {"moe_general_routing_inputs": moe_general_routing_inputs},
            "sonicmoe.enums": {"ActivationType": _ActivationType},
        },
    )


def test_sonicmoe_adapter(monkeypatch):
    calls = []
    _fake_sonicmoe(monkeypatch, calls)
    out, inputs = _run("sonicmoe", None)
    _close_to_oracle(out, inputs)
    gate_rows = calls[0][0::2].permute(2, 0, 1)  # back to [E, I, K]
    assert torch.equal(gate_rows, inputs.w1[:, : SHAPE.intermediate])
    with pytest.raises(NotImplementedError, match="not fp8_tensor"):
        userkernel.load_peer("sonicmoe").fused_moe(**_problem("fp8_tensor").kwargs())


# --- every peer -----------------------------------------------------------------------------------


def test_an_empty_batch_does_not_call_the_peer(monkeypatch):
    calls = []
    _fake_vllm(monkeypatch, calls, "quant_config")
    inputs = _problem(None)
    from compare.numerics import _tokens

    out = userkernel.load_peer("vllm").fused_moe(**_tokens(inputs, slice(0, 0)).kwargs())
    assert out.shape == (0, SHAPE.hidden) and out.dtype == BF16 and not calls


@pytest.mark.parametrize("name", PEERS)
def test_not_installed(name, monkeypatch):
    monkeypatch.setitem(sys.modules, adapter(name).PEER.entry.split(".")[0].split(":")[0], None)
    backend = userkernel.load_peer(name)
    assert backend.fused_moe is None and backend.missing.startswith("not installed: ")
    assert f"pip install {adapter(name).PEER.package}" in backend.missing


def test_peers_in_a_cpu_run(monkeypatch, tmp_path):
    """Not installed: a row saying so for each peer; installed (a fake) on a CPU: 'runs on a CUDA GPU',
    with the declined format 'not implemented' on every machine. The run exits 0."""
    for name in ("vllm", "sglang", "sonicmoe"):
        monkeypatch.setitem(sys.modules, name, None)
    _fake_flashinfer(monkeypatch, [])
    monkeypatch.setattr(userkernel, "_loaded", {})
    out = tmp_path / "out"
    code = cli.main(
        [
            "--backends",
            ",".join(PEERS),
            "--shapes",
            "mixtral-8x7b",
            "--tokens",
            "2",
            "--quant",
            "bf16,fp8_channel",
            "--no-jit",
            "--no-plots",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = {(r["backend"], r["quant"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    for name in ("vllm", "sglang", "sonicmoe"):
        assert rows[(name, "bf16")]["status"].startswith("not available: not installed: ")
    assert rows[("flashinfer", "bf16")]["status"] == "not available: flashinfer runs on a CUDA GPU"
    assert rows[("flashinfer", "fp8_channel")]["status"].startswith("not implemented: ")
    assert rows[("flashinfer", "bf16")]["config"] == "-"

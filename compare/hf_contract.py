"""What of a transformers experts module the backend contract can express: its weights as the contract's arguments.

:func:`contract_arguments` turns a transformers (5.x) experts module — ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, or transformers' ``FP8Experts`` with its block or per-tensor scales — into
the arguments of the contract (:mod:`moe_spec.contract`), without copying the weights, or raises a
ValueError naming the experts class, the model type and every feature the contract cannot express.
:mod:`compare.hf_experts` registers the forward that calls it; ``notes/transformers.md`` says why
each feature is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from transformers.activations import SiLUActivation
    from transformers.integrations import moe as hf_moe
    from transformers.integrations.finegrained_fp8 import FP8Experts
except ImportError as exc:  # the module is optional; the rest of the project never imports it
    raise ImportError(
        f"compare.hf_contract needs transformers 5.x (the project's `hf` extra: pip install -e '.[hf]'): {exc}"
    ) from exc

from moe_spec.quant import FP8_BLOCK, FP8_DTYPE

_UE8M0 = getattr(torch, "float8_e8m0fnu", None)  # DeepSeek-V4-style power-of-two scales


@dataclass(frozen=True)
class ContractArguments:
    """The weights of one experts module as the contract's arguments (no copy of w1 / w2)."""

    w1: torch.Tensor
    w2: torch.Tensor
    quant: str | None = None
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


# --- what the contract can express ---------------------------------------------------------------


def _structure_problems(module) -> list[str]:
    """Flags of ``@use_experts_implementation`` and module state the contract has no place for."""
    cls = type(module).__name__
    flags = {
        "has_gate": (True, "no gate (has_gate=False: act(up) experts); the kernels compute SiLU(gate)·up"),
        "has_bias": (False, "biases on gate_up_proj / down_proj (has_bias=True); the contract has none"),
        "is_concatenated": (
            True,
            "interleaved gate/up rows (is_concatenated=False); the contract wants all gate rows, then all up rows",
        ),
        "is_transposed": (
            False,
            "transposed weights (is_transposed=True: gate_up_proj [E, H, 2I]); the contract wants [E, 2I, H]",
        ),
        "has_post_expert_norm": (False, "a norm after each expert (has_post_expert_norm=True)"),
        "_is_expert_parallel": (
            False,
            "expert parallelism (ids >= num_experts mark experts of other "
            "ranks; the contract wants every id in [0, E))",
        ),
    }
    problems = [why for attr, (ok, why) in flags.items() if bool(getattr(module, attr, ok)) != ok]
    # the decorator installs transformers' default gate, act_fn(gate) * up, where a class has none
    if not isinstance(module, FP8Experts) and type(module)._apply_gate is not hf_moe._default_apply_gate:
        problems.append(f"its own gate function ({cls}._apply_gate), not SiLU(gate)·up")
    act = getattr(module, "act_fn", None)
    if not isinstance(act, (SiLUActivation, torch.nn.SiLU)):
        name = getattr(module.config, "hidden_act", None)
        problems.append(
            f"activation {type(act).__name__} (config.hidden_act={name!r}); the kernels compute SiLU(gate)·up"
        )
    return problems


def _fp8_scale(s: torch.Tensor, name: str, problems: list) -> torch.Tensor | None:
    """An FP8Experts scale as the contract's fp32 (UE8M0 powers of two widen exactly)."""
    if s.dtype == torch.float32 or (_UE8M0 is not None and s.dtype == _UE8M0):
        return s.detach().float().contiguous()
    problems.append(f"{name} stored as {s.dtype}; the contract takes float32 (or exact UE8M0) scales")
    return None


def _fp8_arguments(module, problems: list) -> ContractArguments | None:
    """``FP8Experts`` (transformers' finegrained FP8) → fp8_block or fp8_channel arguments."""
    for attr in ("gate_softcap", "up_softcap", "swiglu_alpha", "limit"):
        if getattr(module, attr, None) is not None:
            problems.append(
                f"a modified gate ({attr}={getattr(module, attr)}); the kernels compute plain SiLU(gate)·up"
            )
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        problems.append(
            "static activation scales (activation_scheme='static'); the kernels quantize activations dynamically"
        )
    w1, w2 = module.gate_up_proj.detach(), module.down_proj.detach()
    if w1.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        problems.append(
            f"expert weights stored as {w1.dtype} (FP4-packed or other); the contract's FP8 formats are float8_e4m3fn"
        )
        return None
    s1 = _fp8_scale(module.gate_up_proj_scale_inv, "gate_up_proj_scale_inv", problems)
    s2 = _fp8_scale(module.down_proj_scale_inv, "down_proj_scale_inv", problems)
    if s1 is None or s2 is None:
        return None
    E, two_i, H = w1.shape
    block = module.block_size
    if block is None:  # per tensor: one scale per projection (gate and up were two projections)
        s1, s2 = s1.reshape(E, -1), s2.reshape(E, -1)
        if s1.shape[1] not in (1, 2) or s2.shape[1] != 1:
            problems.append(
                f"per-tensor scales of shapes {tuple(module.gate_up_proj_scale_inv.shape)} / "
                f"{tuple(module.down_proj_scale_inv.shape)}; expected [E, 1 or 2, 1] / [E, 1, 1]"
            )
            return None
        return ContractArguments(
            w1, w2, "fp8_channel", s1.repeat_interleave(two_i // s1.shape[1], dim=1), s2.expand(E, H).contiguous()
        )
    if tuple(block) != (FP8_BLOCK, FP8_BLOCK):
        problems.append(
            f"block_size={tuple(block)}; the contract's fp8_block format uses {FP8_BLOCK}×{FP8_BLOCK} weight blocks"
        )
        return None
    if (two_i // 2) % FP8_BLOCK:
        problems.append(
            f"intermediate size {two_i // 2}, not a multiple of {FP8_BLOCK}: gate and up are quantized "
            "as two projections, whose 128-row blocks do not line up with those of gate_up_proj"
        )
    for name, s, n_out, k_in in (("gate_up_proj_scale_inv", s1, two_i, H), ("down_proj_scale_inv", s2, H, two_i // 2)):
        want = (E, -(-n_out // FP8_BLOCK), -(-k_in // FP8_BLOCK))
        if tuple(s.shape) != want:  # e.g. 2I <= 128: transformers keeps one block row per half
            problems.append(
                f"{name} of shape {tuple(s.shape)}; 128×128 blocks of a [{E}, {n_out}, {k_in}] "
                f"weight have scales {want}"
            )
    return ContractArguments(w1, w2, "fp8_block", s1, s2)


def _refuse(module, problems: list, who: str) -> None:
    if problems:
        model_type = getattr(module.config, "model_type", "?")
        raise ValueError(
            f"{who} cannot run {type(module).__name__} (model_type {model_type!r}): " + "; ".join(problems)
        )


def contract_arguments(module, implementation: str) -> ContractArguments:
    """The contract's weight arguments for a transformers experts module, or a ValueError that
    names the module's class, the model type and every feature the contract cannot express."""
    who = f"experts_implementation: {implementation!r}"
    problems = _structure_problems(module)
    if not getattr(module, "has_gate", True):
        _refuse(module, problems, who)  # no gate_up_proj to read (its weight is up_proj)
    if isinstance(module, FP8Experts):
        args = _fp8_arguments(module, problems)
    else:
        w1, w2 = module.gate_up_proj.detach(), module.down_proj.detach()
        args = ContractArguments(w1, w2)
        if w1.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
            problems.append(
                f"{w1.dtype} expert weights; the kernels take bfloat16 (load the model with dtype=torch.bfloat16)"
            )
    _refuse(module, problems, who)
    return args

"""Our kernels inside transformers models: ``experts_implementation="triton_moe"`` or ``"cute_moe"``.

transformers (5.x) keeps the routed experts of a MoE model (Mixtral, Qwen3-MoE, DeepSeek-V3 and
most others) in one module with 3-D weights — ``gate_up_proj [E, 2I, H]`` (gate rows, then up
rows) and ``down_proj [E, H, I]``, the layout of this project's contract — and sends that module's
forward through a registry: ``ALL_EXPERTS_FUNCTIONS`` (``transformers.integrations.moe``), or
``ALL_FP8_EXPERTS_FUNCTIONS`` (``transformers.integrations.finegrained_fp8``) for the ``FP8Experts``
module of an FP8 checkpoint. :func:`register` adds both backends to both registries; then::

    import compare.hf_experts; compare.hf_experts.register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="triton_moe")

(or ``model.set_experts_implementation("triton_moe")`` on a loaded model). Registration must come
first: ``from_pretrained`` rejects a name that no registry holds.

What the registry hands over, and what the contract (:mod:`moe_spec.contract`) receives:

====================================  ===============================================================
experts forward                       ``fused_moe``
====================================  ===============================================================
hidden_states [N, H] or [B, S, H]     ``x`` [T, H] bf16 (a view); the output takes the input's shape
top_k_index [N, k] int64              ``topk_ids`` as is
top_k_weights [N, k], router's dtype  ``topk_weights`` converted to float32 (Qwen3-MoE's are bf16)
gate_up_proj, down_proj (bf16)        ``w1``, ``w2`` — the parameters themselves, no copy
FP8Experts, 128×128 blocks            ``quant="fp8_block"``; ``*_scale_inv`` (fp32, or UE8M0 widened
                                      exactly to fp32) are the block scales: a weight reads q · s
FP8Experts, per tensor (no blocks)    ``quant="fp8_channel"``: the one scale of the gate half, of the
                                      up half and of down_proj repeated over their rows (exact)
====================================  ===============================================================

Whatever the contract cannot express is refused — :func:`compare.hf_contract.contract_arguments`,
before any kernel runs — with a ValueError that names the experts class, the model type and every such feature:
an activation other than SiLU, biases, no gate, interleaved or transposed weights, a norm after
each expert, a model-specific gate, expert parallelism, non-bf16 weights, static FP8 activation
scales, FP4 weights, other block shapes. ``notes/transformers.md`` says why for each.

:data:`CALLS` counts completed backend calls per implementation: a test that sees it rise knows the
model ran our kernel and did not fall back to transformers' own forward.

``torch.compile(model, fullgraph=True)`` traces the forward without a graph break: the backend's
``fused_moe`` is a torch operator while a tracer is at work (``torch.ops.triton_moe.fused_moe``,
``torch.ops.cute_moe.fused_moe``: :mod:`moe_spec.ops`), the package is looked up in ``sys.modules``
(:func:`register` imports it) and the eager-only count is left out of the trace.

:func:`experts_fused_moe` goes the other way: a transformers experts module (with any registered
implementation) as a callable with the contract's signature, for the harness's tables.
"""

from __future__ import annotations

import collections
import importlib
import math
import sys
from collections.abc import Callable

import torch

try:
    from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.integrations import finegrained_fp8
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts, FP8ExpertsInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, use_experts_implementation
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
except ImportError as exc:  # the module is optional; the rest of the project never imports it
    raise ImportError(
        f"compare.hf_experts needs transformers 5.x (the project's `hf` extra: pip install -e '.[hf]'): {exc}"
    ) from exc

from compare.hf_contract import ContractArguments, _refuse, _structure_problems, contract_arguments  # noqa: F401
from moe_spec.quant import FP8_BLOCK
from moe_spec.validate import SizeNames, check_runs_on, check_sizes, validate_moe_args

#: The names :func:`register` adds to transformers' experts registries.
IMPLEMENTATIONS = ("triton_moe", "cute_moe")

#: Completed ``fused_moe`` calls per implementation, counted by the registered forwards when they
#: run eagerly (a torch.compile'd forward is not counted: its graph holds the backend's op instead).
CALLS: collections.Counter = collections.Counter()

# --- the registered forwards ----------------------------------------------------------------------


def _backend_fused_moe(implementation: str) -> Callable:
    """``fused_moe`` of the backend package itself (``triton_moe`` or ``cute_moe``), not through the
    harness's backend table: the table loads this module, so this module does not load the table.
    An imported package is found in ``sys.modules``, which torch.compile traces (an import it cannot:
    :func:`register` imports the packages it registers)."""
    module = sys.modules.get(implementation)
    if module is not None and hasattr(module, "fused_moe"):
        return module.fused_moe
    try:
        return importlib.import_module(implementation).fused_moe
    except Exception as exc:  # noqa: BLE001 - any import failure is this call's error, said plainly
        raise RuntimeError(
            f"experts_implementation: {implementation!r} is not available here: "
            f"import {implementation} failed: {type(exc).__name__}: {exc}"
        ) from exc


#: How the forward names a size it refuses (moe_spec.validate.check_sizes): its own arguments and
#: the module's weights, not the contract's names.
HF_NAMES = SizeNames(
    E="gate_up_proj",
    K="hidden_states",
    I="down_proj",
    top_k="top_k_weights",
    T="hidden_states",
    device="hidden_states",
    matrix="gate_up_proj",
)
#: The contract's argument names → the forward's, for a refusal raised inside ``fused_moe``.
_HF_ARGUMENT = {
    "x": "hidden_states",
    "topk_ids": "top_k_index",
    "topk_weights": "top_k_weights",
    "w1": "gate_up_proj",
    "w2": "down_proj",
}


def _routing_shape(hidden_states, top_k_index, top_k_weights, H: int) -> tuple[int, int]:
    """(T, top_k): one routing row of top_k entries per token of ``hidden_states`` [..., H]."""
    if hidden_states.dim() < 1 or hidden_states.shape[-1] != H:
        raise ValueError(
            f"hidden_states: expected [..., H] with the model's hidden size H = {H} "
            f"(gate_up_proj.shape[2]), got shape {tuple(hidden_states.shape)}"
        )
    T = math.prod(hidden_states.shape[:-1])
    for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1 or t.numel() != T * t.shape[-1] or (t.dim() == 1 and T != 1):
            raise ValueError(
                f"{name}: expected [T={T}, top_k] (a row per token of hidden_states), got shape {tuple(t.shape)}"
            )
    if top_k_weights.shape[-1] != top_k_index.shape[-1]:
        raise ValueError(
            f"top_k_weights: expected top_k = {top_k_index.shape[-1]} weights a row (as top_k_index), "
            f"got shape {tuple(top_k_weights.shape)}"
        )
    return T, top_k_index.shape[-1]


def _make_forward(implementation: str) -> Callable:
    label = f"{implementation} experts (compare.hf_experts)"

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # under torch.profiler (hf_bench --profile-steps) an eager call is one named range, so a profile
        # says what our experts cost the host; never traced (a compiled graph shows the op itself)
        if not torch.compiler.is_compiling() and torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(label):
                return run(self, hidden_states, top_k_index, top_k_weights)
        return run(self, hidden_states, top_k_index, top_k_weights)

    def run(self, hidden_states, top_k_index, top_k_weights):
        args = contract_arguments(self, implementation)
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dtype != torch.bfloat16:
            got = hidden_states.dtype if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            raise TypeError(f"hidden_states: expected bfloat16 (the kernels' activations), got {got}")
        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.gate_up_proj.requires_grad):
            raise ValueError(
                "hidden_states: autograd is recording, but the kernels have no backward; run "
                "inference under torch.no_grad() or torch.inference_mode() (generate() does)"
            )
        fused_moe = _backend_fused_moe(implementation)
        # the one size check of every surface, naming this forward's arguments, before anything is
        # allocated; then the device the backend runs on — the empty batch included
        E, two_i, H = args.w1.shape
        T, top_k = _routing_shape(hidden_states, top_k_index, top_k_weights, H)
        limits = getattr(fused_moe, "limits", None)
        check_sizes(E, H, two_i // 2, top_k, T, limits=limits, names=HF_NAMES)
        check_runs_on(hidden_states.device, limits, "hidden_states")
        x = hidden_states.reshape(T, H)
        try:
            out = fused_moe(
                x.contiguous(),
                args.w1,
                args.w2,
                top_k_weights.reshape(T, top_k).to(torch.float32).contiguous(),
                top_k_index.reshape(T, top_k).contiguous(),
                quant=args.quant,
                w1_scale=args.w1_scale,
                w2_scale=args.w2_scale,
            )
        except (TypeError, ValueError) as exc:  # the contract's names → this forward's
            name, sep, rest = str(exc).partition(": ")
            if sep and name in _HF_ARGUMENT:
                raise type(exc)(f"{_HF_ARGUMENT[name]}: {rest}") from None
            raise
        if not torch.compiler.is_compiling():  # traced, the count would be a guard: a recompile per call
            CALLS[implementation] += 1
        return out.view(hidden_states.shape)

    forward.__name__ = forward.__qualname__ = f"{implementation}_experts_forward"
    forward.__doc__ = f"transformers experts forward through {implementation}.fused_moe (see compare.hf_experts)."
    return forward


_FORWARDS = {name: _make_forward(name) for name in IMPLEMENTATIONS}


def register(implementations=IMPLEMENTATIONS) -> tuple:
    """Add our implementations to transformers' experts registries (bf16 and FP8), and import their
    packages (a package that does not import here is reported by the forward when it runs).
    Idempotent: a second call registers the same functions again."""
    if isinstance(implementations, str):
        names = (implementations,)
    elif isinstance(implementations, (tuple, list)):
        names = tuple(implementations)
    else:
        raise TypeError(
            f"implementations: expected a name or a tuple of names from {IMPLEMENTATIONS}, got {implementations!r}"
        )
    unknown = [n for n in names if n not in _FORWARDS]
    if unknown:
        raise ValueError(f"implementations: expected names from {IMPLEMENTATIONS}, got {unknown}")
    for name in names:
        ExpertsInterface.register(name, _FORWARDS[name])
        FP8ExpertsInterface.register(name, _FORWARDS[name])
        try:  # imported now, so that a torch.compile'd forward finds it (module docstring)
            _backend_fused_moe(name)
        except RuntimeError:
            pass  # not importable here: the forward raises this when it is called
    return names


def registered(implementation: str) -> bool:
    """Whether both registries hold our forward under ``implementation``."""
    fn = _FORWARDS.get(implementation)
    return fn is not None and all(
        registry.get(implementation) is fn for registry in (ALL_EXPERTS_FUNCTIONS, ALL_FP8_EXPERTS_FUNCTIONS)
    )


# --- transformers' FP8 experts, built from a bf16 model -----------------------------------------------


class FP8ExpertsModule(FP8Experts):
    """transformers' ``FP8Experts`` storage (what its FP8 quantizer installs) with the registry
    dispatch of ``@use_experts_implementation``; a subclass, so transformers' class stays as it was."""


use_experts_implementation(FP8ExpertsModule, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def fp8_experts(config, w1, w2, w1_scale, w2_scale, block_size) -> FP8ExpertsModule:
    """An ``FP8ExpertsModule`` holding the given quantized weights and scales (no copy)."""
    with torch.device("meta"):
        module = FP8ExpertsModule(config, block_size=block_size)
    module.gate_up_proj, module.down_proj = _frozen(w1), _frozen(w2)
    module.gate_up_proj_scale_inv, module.down_proj_scale_inv = _frozen(w1_scale), _frozen(w2_scale)
    return module


def quantize_experts(model, scheme: str = "block") -> int:
    """Replace every bf16 experts module of ``model`` by transformers' FP8 experts module, quantized
    with this project's rule (:func:`moe_spec.quant.quantize_weight`), in one of the two layouts of
    transformers' finegrained FP8: ``"block"`` (128×128 blocks, DeepSeek-V3 checkpoints) or
    ``"tensor"`` (``block_size=None``: one scale per projection — gate, up, down). Returns the number
    of modules replaced. The model's other layers stay bf16."""
    from moe_spec.quant import quantize_weight

    if scheme not in ("block", "tensor"):
        raise ValueError(f"scheme: expected 'block' or 'tensor', got {scheme!r}")
    replaced = 0
    for name, module in list(model.named_modules()):
        if (
            isinstance(module, FP8Experts)
            or not isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            or module.gate_up_proj.dim() != 3
        ):
            continue
        _refuse(module, _structure_problems(module), f"model: quantize_experts(scheme={scheme!r})")
        w1, w2 = module.gate_up_proj.detach(), module.down_proj.detach()
        if scheme == "block":
            (q1, s1), (q2, s2) = quantize_weight(w1, "fp8_block"), quantize_weight(w2, "fp8_block")
            block = (FP8_BLOCK, FP8_BLOCK)
        else:
            gate, up = w1.chunk(2, dim=1)
            (qg, sg), (qu, su) = quantize_weight(gate, "fp8_tensor"), quantize_weight(up, "fp8_tensor")
            q1, s1 = torch.cat([qg, qu], dim=1), torch.stack([sg, su], dim=1)[..., None]
            q2, s2 = quantize_weight(w2, "fp8_tensor")
            s2, block = s2[:, None, None], None
        model.set_submodule(name, fp8_experts(module.config, q1, q2, s1, s2, block))
        replaced += 1
    return replaced


# --- the other way round: a transformers experts module as a contract-shaped callable ----------------

#: model type → (config class, experts class, config names of E and I)
_MODELS = {
    "mixtral": (MixtralConfig, MixtralExperts, "num_local_experts", "intermediate_size"),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeExperts, "num_experts", "moe_intermediate_size"),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3Experts, "n_routed_experts", "moe_intermediate_size"),
    "olmoe": (OlmoeConfig, OlmoeExperts, "num_experts", "intermediate_size"),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeExperts, "num_experts", "moe_intermediate_size"),
}


#: catalog name (moe_spec.problem.CATALOG) → the model type whose experts module that model has
CATALOG_MODEL_TYPES = {
    "mixtral-8x7b": "mixtral",
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen3-235b-a22b": "qwen3_moe",
    "deepseek-v3": "deepseek_v3",
    "mixtral-8x22b": "mixtral",
    "olmoe-1b-7b": "olmoe",
    "qwen1.5-moe-a2.7b": "qwen2_moe",
}
#: the experts class the harness's hf backends run for every shape: the contract's arguments carry no
#: model name, and the experts classes of the catalog's models compute the same function
HARNESS_MODEL_TYPE = "mixtral"
#: the formats with a transformers counterpart (the ``quant`` of :func:`experts_fused_moe`)
QUANTS = (None, "fp8_block")


def model_type_of(shape) -> str:
    """The transformers model type of a catalog shape (a ``MoEShape`` or a label such as
    "deepseek-v3:tp8"): the experts class that model has."""
    from moe_spec.problem import get_shape

    name = get_shape(shape).name if isinstance(shape, str) else shape.name
    if name not in CATALOG_MODEL_TYPES:
        raise ValueError(f"shape: {name!r} has no transformers model type here; known: {sorted(CATALOG_MODEL_TYPES)}")
    return CATALOG_MODEL_TYPES[name]


def no_counterpart(quant) -> str:
    """The refusal of a format transformers' experts modules have no counterpart for."""
    return (
        f"quant: {quant!r} has no transformers counterpart (its FP8 experts store 128×128 blocks, or "
        "per-tensor weights whose activations its Hub kernel quantizes); use None or 'fp8_block'"
    )


def experts_module_name(model_type: str, quant) -> str:
    """The experts class :func:`experts_fused_moe` runs for ``model_type`` and ``quant``."""
    if quant is None:
        return _MODELS[model_type][1].__name__
    return f"FP8Experts ({_MODELS[model_type][0].__name__}, {FP8_BLOCK}×{FP8_BLOCK} blocks)"


def own_forward(implementation: str, quant) -> str:
    """What transformers' own implementation ``"grouped_mm"`` runs."""
    if implementation != "grouped_mm":
        return ""
    return "torch._grouped_mm" if quant is None else "Hub kernel kernels-community/finegrained-fp8 (matmul_grouped)"


def cannot_run(implementation: str, quant) -> str | None:
    """Why transformers' own FP8 forward cannot run here, or None. Its ``grouped_mm`` for FP8Experts
    loads a Hub kernel at its first call (the ``kernels`` package, and a download); where that fails,
    the row says so instead of crashing."""
    if quant != "fp8_block" or implementation in IMPLEMENTATIONS:
        return None
    load = getattr(finegrained_fp8, "_load_finegrained_fp8_kernel", None)
    if load is None:
        return None  # a transformers without this loader: the call itself tells
    if implementation not in _HUB_REFUSALS:  # one attempt per process (a failed download can be slow)
        try:
            load()
            _HUB_REFUSALS[implementation] = None
        except Exception as exc:  # noqa: BLE001 - any failure to load is the reason
            first = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
            _HUB_REFUSALS[implementation] = (
                f"transformers' FP8 {implementation} needs its Hub kernel "
                "(kernels-community/finegrained-fp8), which does not load here: "
                f"{type(exc).__name__}: {first}"
            )
    return _HUB_REFUSALS[implementation]


_HUB_REFUSALS: dict = {}  # implementation -> cannot_run's answer for fp8_block


def experts_fused_moe(implementation: str, model_type: str = "mixtral", compile: Callable | None = None) -> Callable:
    """``fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None)``
    running transformers' experts module of ``model_type`` with ``experts_implementation =
    implementation`` ("eager", "grouped_mm", "batched_mm", "triton_moe", … — any registered name).

    bf16 goes through the model's own experts class; ``quant="fp8_block"`` through transformers'
    FP8 experts module with 128×128 blocks (the only FP8 layout both sides share: transformers' FP8
    storage has no per-row weight scales, and its per-tensor layout quantizes activations in its Hub
    kernel, not per tensor). The weights are wrapped, not copied.
    ``topk_ids`` go in as int64 and ``topk_weights`` as float32, as the models hand them over.
    ``compile``: applied once to each experts module made (e.g. ``torch.compile(..., fullgraph=True)``),
    whose forward then runs compiled, as in a compiled model; the weights are still assigned per call.
    """
    if model_type not in _MODELS:
        raise ValueError(f"model_type: expected one of {sorted(_MODELS)}, got {model_type!r}")
    if not isinstance(implementation, str):
        raise TypeError(f"implementation: expected a registered experts implementation name, got {implementation!r}")
    config_cls, experts_cls, e_name, i_name = _MODELS[model_type]
    modules: dict = {}

    def fused_moe(x, w1, w2, topk_weights, topk_ids, *, quant=None, w1_scale=None, w2_scale=None):
        d = validate_moe_args(x, w1, w2, topk_weights, topk_ids, quant=quant, w1_scale=w1_scale, w2_scale=w2_scale)
        if quant not in QUANTS:
            raise ValueError(no_counterpart(quant))
        key = (d.E, d.K, d.I, d.top_k, quant)
        if key not in modules:
            config = config_cls(
                hidden_size=d.K, num_experts_per_tok=d.top_k, hidden_act="silu", **{e_name: d.E, i_name: d.I}
            )
            config._experts_implementation = implementation
            with torch.device("meta"):
                module = experts_cls(config) if quant is None else FP8ExpertsModule(config, block_size=(FP8_BLOCK,) * 2)
            modules[key] = (module, module if compile is None else compile(module))
        module, forward = modules[key]
        module.gate_up_proj, module.down_proj = _frozen(w1), _frozen(w2)
        if quant is not None:
            module.gate_up_proj_scale_inv, module.down_proj_scale_inv = _frozen(w1_scale), _frozen(w2_scale)
        with torch.no_grad():
            return forward(x, topk_ids.long(), topk_weights)

    fused_moe.__name__ = f"hf_{implementation}_fused_moe"
    fused_moe.__doc__ = (
        f"The contract through transformers' {experts_cls.__name__} with experts_implementation={implementation!r}."
    )
    return fused_moe

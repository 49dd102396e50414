"""The MoE problem, defined once for both backends.

An MoE layer routes each token ``t`` to ``top_k`` of ``E`` experts. Expert ``e`` is a gated MLP::

    h      = x[t] · W1[e]ᵀ                 W1[e] : [2I, K]  (gate rows 0..I-1, then up rows I..2I-1)
    a      = SiLU(h[:I]) · h[I:]           a     : [I]
    y_e(t) = a · W2[e]ᵀ                    W2[e] : [K, I]

    out[t] = Σ_j  topk_weights[t, j] · y_{topk_ids[t, j]}(t)

The tensor conventions are vLLM's ``fused_experts``:

==============  ====================  ==========================================================
argument        shape                 dtype
==============  ====================  ==========================================================
x               [T, K]                bfloat16
w1              [E, 2I, K]            bfloat16, or float8_e4m3fn when ``quant`` is an fp8 format
w2              [E, K, I]             same as w1
topk_weights    [T, top_k]            float32
topk_ids        [T, top_k]            int32 or int64, each in [0, E), no repeats within a row
==============  ====================  ==========================================================

Both operands of every GEMM are K-major (row-major with the reduction dimension contiguous), the
natural ``nn.Linear`` layout; this is also what FP8 WGMMA requires on Hopper.

This module holds the catalog of real model shapes, softmax
top-k routing, and :func:`make_inputs`, which builds a complete random problem (optionally
quantized, see :mod:`moe_spec.quant`). Both backends and every test read it from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_spec.quant import get_format, quantize_weight


@dataclass(frozen=True)
class MoEShape:
    """The sizes of one MoE layer. ``intermediate`` is already divided by the tensor-parallel degree."""

    name: str
    num_experts: int  # E
    top_k: int
    hidden: int  # K
    intermediate: int  # I (per TP rank)
    source: str
    tp: int = 1

    @property
    def label(self) -> str:
        return self.name if self.tp == 1 else f"{self.name}:tp{self.tp}"

    def with_tp(self, degree: int) -> MoEShape:
        """This layer as one rank of a ``degree``-way tensor-parallel split (I is sharded)."""
        if degree < 1 or (self.intermediate * self.tp) % degree:
            raise ValueError(
                f"tp: {degree} does not divide the intermediate size {self.intermediate * self.tp} of {self.name}"
            )
        return dataclasses.replace(self, intermediate=self.intermediate * self.tp // degree, tp=degree)

    def weight_elements(self) -> int:
        """Elements of one expert's W1 and W2 together: 2I·K + K·I."""
        return 3 * self.intermediate * self.hidden

    def flops(self, tokens: int) -> int:
        """Multiply-add FLOPs of the expert computation for ``tokens`` tokens (both GEMMs)."""
        return 2 * tokens * self.top_k * self.weight_elements()


#: Real model shapes, from each model's published ``config.json`` (Hugging Face model cards).
CATALOG: dict[str, MoEShape] = {
    s.name: s
    for s in (
        MoEShape(
            "mixtral-8x7b",
            8,
            2,
            4096,
            14336,
            "mistralai/Mixtral-8x7B-v0.1 config.json: num_local_experts 8, num_experts_per_tok 2, "
            "hidden_size 4096, intermediate_size 14336",
        ),
        MoEShape(
            "qwen3-30b-a3b",
            128,
            8,
            2048,
            768,
            "Qwen/Qwen3-30B-A3B config.json: num_experts 128, num_experts_per_tok 8, "
            "hidden_size 2048, moe_intermediate_size 768",
        ),
        MoEShape(
            "qwen3-235b-a22b",
            128,
            8,
            4096,
            1536,
            "Qwen/Qwen3-235B-A22B config.json: num_experts 128, num_experts_per_tok 8, "
            "hidden_size 4096, moe_intermediate_size 1536",
        ),
        MoEShape(
            "deepseek-v3",
            256,
            8,
            7168,
            2048,
            "deepseek-ai/DeepSeek-V3 config.json: n_routed_experts 256, num_experts_per_tok 8, "
            "hidden_size 7168, moe_intermediate_size 2048 (routed experts only)",
        ),
        # outside compare's default three, each unlike them: a wider intermediate, many small experts,
        # an expert count that is not a power of two
        MoEShape(
            "mixtral-8x22b",
            8,
            2,
            6144,
            16384,
            "mistral-community/Mixtral-8x22B-v0.1 config.json: num_local_experts 8, num_experts_per_tok 2, "
            "hidden_size 6144, intermediate_size 16384",
        ),
        MoEShape(
            "olmoe-1b-7b",
            64,
            8,
            2048,
            1024,
            "allenai/OLMoE-1B-7B-0924 config.json: num_experts 64, num_experts_per_tok 8, "
            "hidden_size 2048, intermediate_size 1024",
        ),
        MoEShape(
            "qwen1.5-moe-a2.7b",
            60,
            4,
            2048,
            1408,
            "Qwen/Qwen1.5-MoE-A2.7B config.json: num_experts 60, num_experts_per_tok 4, "
            "hidden_size 2048, moe_intermediate_size 1408 (routed experts only; its shared expert is a dense MLP)",
        ),
    )
}


def get_shape(spec: str) -> MoEShape:
    """Look up ``"name"`` or ``"name:tpN"`` (e.g. ``"deepseek-v3:tp8"``) in :data:`CATALOG`."""
    name, _, tp = spec.strip().lower().partition(":")
    if name not in CATALOG:
        raise ValueError(f"shape: unknown shape {spec!r}; known: {', '.join(CATALOG)} (optionally ':tpN')")
    shape = CATALOG[name]
    if tp:
        if not (tp.startswith("tp") and tp[2:].isdigit()):
            raise ValueError(f"shape: bad tensor-parallel suffix in {spec!r}; expected ':tpN', e.g. ':tp8'")
        shape = shape.with_tp(int(tp[2:]))
    return shape


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """Softmax top-k routing: ``(topk_weights float32 [T, k], topk_ids int32 [T, k])``.

    The softmax is taken over all E experts in fp32; with ``renormalize`` the k chosen weights are
    rescaled to sum to one (Mixtral, Qwen3), without it they keep their softmax mass.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: expected a [T, E] tensor, got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k: expected 1 <= top_k <= E = {logits.shape[1]}, got {top_k}")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.float().contiguous(), ids.to(torch.int32).contiguous()


@dataclass
class MoEInputs:
    """A complete problem: the arguments of the backend contract ``fused_moe(**inputs.kwargs())``."""

    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    quant: str | None = None
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    def kwargs(self) -> dict:
        return dict(
            x=self.x,
            w1=self.w1,
            w2=self.w2,
            topk_weights=self.topk_weights,
            topk_ids=self.topk_ids,
            quant=self.quant,
            w1_scale=self.w1_scale,
            w2_scale=self.w2_scale,
        )

    def to(self, device) -> MoEInputs:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return MoEInputs(
            move(self.x),
            move(self.w1),
            move(self.w2),
            move(self.topk_weights),
            move(self.topk_ids),
            self.quant,
            move(self.w1_scale),
            move(self.w2_scale),
        )


def draw_weights(shape: MoEShape, seed_or_generator=0, device="cpu"):
    """bf16 expert weights ``(w1 [E, 2I, K], w2 [E, K, I])`` drawn N(0, 1/fan_in), so activations stay
    O(1) through both GEMMs. Drawn in fp32 on ``device`` with a generator there (fast on a GPU for
    the catalog shapes; a given seed gives the same values on a given kind of device), then cast.
    :func:`make_inputs`, the compare suite and both benchmarks draw their weights here."""
    gen = seed_or_generator
    if not isinstance(gen, torch.Generator):
        gen = torch.Generator(device=device).manual_seed(int(seed_or_generator))
    E, K, I = shape.num_experts, shape.hidden, shape.intermediate
    w1 = (torch.randn(E, 2 * I, K, generator=gen, device=gen.device) * K**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, K, I, generator=gen, device=gen.device) * I**-0.5).to(torch.bfloat16)
    return w1, w2


def make_inputs(
    shape: MoEShape,
    T: int,
    quant: str | None = None,
    *,
    seed: int = 0,
    device="cpu",
    skew: float = 0.0,
    renormalize: bool = True,
    weights_bf16: tuple | None = None,
) -> MoEInputs:
    """A random problem of ``T`` tokens for ``shape``, quantized to ``quant``.

    Weights are drawn N(0, 1/fan_in) so activations stay O(1) through both GEMMs; x ~ N(0, 1).
    ``skew`` > 0 biases the router towards low-numbered experts (``skew`` = 4 sends almost every
    token to the first few), to exercise uneven expert loads. ``weights_bf16`` lets a caller reuse
    one (w1, w2) pair across token counts. Quantization goes through :mod:`moe_spec.quant`.
    """
    fmt = get_format(quant)
    E, K = shape.num_experts, shape.hidden
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w1, w2 = draw_weights(shape, gen) if weights_bf16 is None else weights_bf16
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=gen)
    if skew:
        logits = logits - skew * torch.arange(E, dtype=torch.float32) / max(E - 1, 1) * E**0.5
    topk_weights, topk_ids = route(logits, shape.top_k, renormalize)
    w1_scale = w2_scale = None
    if fmt.quantized:
        w1, w1_scale = quantize_weight(w1, quant)
        w2, w2_scale = quantize_weight(w2, quant)
    return MoEInputs(x, w1, w2, topk_weights, topk_ids, quant, w1_scale, w2_scale).to(device)

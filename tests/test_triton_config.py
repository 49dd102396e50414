"""triton_moe.config: the swap-AB rule, the heuristic, tuned-table lookup, shipped tables load."""

import json

import pytest

from triton_moe import config as C
from triton_moe.config import TritonConfig


def test_swap_rule():
    assert C.choose_swap_ab(16, 64) and C.choose_swap_ab(32, 128)
    assert not C.choose_swap_ab(64, 64) and not C.choose_swap_ab(16, 32)
    assert TritonConfig(16, 64, 64).resolved().swap_ab is True
    assert TritonConfig(16, 64, 64, swap_ab=False).resolved().swap_ab is False  # forced off stays off


@pytest.mark.parametrize("T, bm", [(1, 16), (8, 16), (64, 16), (128, 32), (256, 64), (4096, 128)])
def test_heuristic_is_deterministic_in_tokens_per_expert(T, bm):
    # Mixtral-like: E = 8, top_k = 2 → T/4 pairs per expert
    cfg = C.default_config(T, 8, 2, None)
    assert cfg.BLOCK_M == bm and cfg == C.default_config(T, 8, 2, None)
    assert cfg.swap_ab == (bm < 64)
    cfg.check(None)
    C.default_config(T, 8, 2, "fp8_block").check("fp8_block")


def test_table_lookup_nearest(tmp_path, monkeypatch):
    table = {"1": TritonConfig(16, 64, 128, swap_ab=True).as_dict(),
             "64": TritonConfig(64, 64, 128).as_dict(),
             "1024": TritonConfig(128, 128, 64, 8, 8, 3).as_dict()}
    monkeypatch.setattr(C, "CONFIG_DIR", tmp_path)
    path = C.table_path(8, 14336, 4096, None, "Fake GPU")
    path.write_text(json.dumps({"configs": table}))
    C.load_table.cache_clear()
    assert C.get_config(3, 8, 2, 14336, 4096, None, "Fake GPU").BLOCK_M == 16
    assert C.get_config(500, 8, 2, 14336, 4096, None, "Fake GPU").BLOCK_M == 64   # |500−64| < |500−1024|
    assert C.get_config(600, 8, 2, 14336, 4096, None, "Fake GPU").BLOCK_M == 128
    # no table for this dtype: the heuristic
    assert C.get_config(600, 8, 2, 14336, 4096, "fp8_tensor", "Fake GPU") == C.default_config(600, 8, 2, "fp8_tensor")
    C.load_table.cache_clear()


#: The tuned tables the package ships (measured on the H200; see notes/triton_moe.md).
SHIPPED = [("mixtral-8x7b", None), ("mixtral-8x7b", "fp8_tensor"), ("qwen3-30b-a3b", None),
           ("deepseek-v3:tp8", None), ("deepseek-v3:tp8", "fp8_tensor")]


@pytest.mark.parametrize("spec, quant", SHIPPED, ids=lambda v: v or "bf16")
def test_shipped_h200_table_exists_loads_and_is_used(spec, quant):
    from moe_spec.problem import get_shape

    s = get_shape(spec)
    path = C.table_path(s.num_experts, s.intermediate, s.hidden, quant, "NVIDIA H200")
    assert path.exists(), f"missing shipped table {path.name}"
    table = C.load_table(str(path))
    assert sorted(table) == [1, 8, 32, 128, 1024, 4096], path.name
    body = json.loads(path.read_text())
    assert (body["shape"], body["dtype"]) == (spec, quant or "bf16")  # the layer, hence the top_k, it was tuned for
    for T, cfg in table.items():
        cfg.resolved().check(quant)
        assert C.get_config(T, s.num_experts, s.top_k, s.intermediate, s.hidden, quant, "NVIDIA H200") == cfg.resolved()


def test_no_stray_tables():
    from moe_spec.problem import get_shape

    names = {C.table_path(get_shape(spec).num_experts, get_shape(spec).intermediate, get_shape(spec).hidden,
                          quant, "NVIDIA H200").name for spec, quant in SHIPPED}
    assert {p.name for p in C.CONFIG_DIR.glob("*.json")} == names


@pytest.mark.parametrize("T", [1, 8, 32, 128, 1024, 4096])
@pytest.mark.parametrize("spec", ["mixtral-8x7b", "deepseek-v3:tp8"])
@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
def test_autotune_candidates_leave_swap_to_the_rule(spec, quant, T):
    from moe_spec.problem import get_shape
    from triton_moe.autotune import candidates

    s = get_shape(spec)
    cands = candidates(T, s.num_experts, s.top_k, quant)
    assert cands and all(c.swap_ab is None for c in cands)
    assert cands[0].resolved() == C.default_config(T, s.num_experts, s.top_k, quant)  # the heuristic first
    assert len(set(cands)) == len(cands)
    for c in cands:
        assert c.resolved().swap_ab == C.choose_swap_ab(c.BLOCK_M, c.BLOCK_N)
        c.check(quant)

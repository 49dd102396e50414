"""triton_moe.config (construction checks, the swap-AB rule) and triton_moe.heuristic (the default
rule, tuned-table lookup, the shipped tables)."""

import dataclasses
import json

import pytest

from triton_moe import config as C
from triton_moe import heuristic as H
from triton_moe.config import Gemm2Tile, TritonConfig


def test_swap_rule():
    assert C.choose_swap_ab(16, 64) and C.choose_swap_ab(32, 128)
    assert not C.choose_swap_ab(64, 64) and not C.choose_swap_ab(16, 32)
    assert TritonConfig(16, 64, 64).resolved().swap_ab is True
    assert TritonConfig(16, 64, 64, swap_ab=False).resolved().swap_ab is False  # forced off stays off


@pytest.mark.parametrize(
    "T, bm, swap", [(1, 16, True), (8, 16, True), (64, 16, True), (128, 32, True), (256, 64, False), (4096, 128, False)]
)
def test_heuristic_is_deterministic_in_tokens_per_expert(T, bm, swap):
    # Mixtral-like: E = 8, top_k = 2 → T/4 pairs per expert
    cfg = H.default_config(T, 8, 2, None)
    assert cfg.BLOCK_M == bm and cfg == H.default_config(T, 8, 2, None)
    assert cfg.swap_ab is swap
    cfg.check(None)
    H.default_config(T, 8, 2, "fp8_block").check("fp8_block")


def test_table_lookup_nearest(tmp_path, monkeypatch):
    table = {
        "1": TritonConfig(16, 64, 128, swap_ab=True).as_dict(),
        "64": TritonConfig(64, 64, 128).as_dict(),
        "1024": TritonConfig(128, 128, 64, 8, 8, 3).as_dict(),
    }
    monkeypatch.setattr(H, "CONFIG_DIR", tmp_path)
    path = H.table_path(8, 14336, 4096, None, "Fake GPU")
    path.write_text(json.dumps({"configs": table}))
    H.load_table.cache_clear()
    assert H.get_config(3, 8, 2, 14336, 4096, None, "Fake GPU").BLOCK_M == 16
    assert H.get_config(500, 8, 2, 14336, 4096, None, "Fake GPU").BLOCK_M == 64  # |500−64| < |500−1024|
    assert H.get_config(600, 8, 2, 14336, 4096, None, "Fake GPU").BLOCK_M == 128
    # no table for this dtype: the heuristic
    assert H.get_config(600, 8, 2, 14336, 4096, "fp8_tensor", "Fake GPU") == H.default_config(600, 8, 2, "fp8_tensor")
    H.load_table.cache_clear()


#: The tuned tables the package ships (measured on the H200; see notes/triton_moe.md).
SHIPPED = [
    (spec, quant)
    for spec in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3:tp8")
    for quant in (None, "fp8_tensor", "fp8_channel", "fp8_block")
]


@pytest.mark.parametrize("spec, quant", SHIPPED, ids=lambda v: v or "bf16")
def test_shipped_h200_table_exists_loads_and_is_used(spec, quant):
    from moe_spec.problem import get_shape

    s = get_shape(spec)
    path = H.table_path(s.num_experts, s.intermediate, s.hidden, quant, "NVIDIA H200")
    assert path.exists(), f"missing shipped table {path.name}"
    table = H.load_table(str(path))
    assert sorted(table) == [1, 8, 32, 128, 1024, 4096], path.name
    body = json.loads(path.read_text())
    assert (body["shape"], body["dtype"]) == (spec, quant or "bf16")  # the layer, hence the top_k, it was tuned for
    if "command" in body:  # written by the autotuner: rerunnable at its commit, with every candidate measured
        autotune = ("python -m triton_moe.lab.autotune ", "python -m triton_moe.autotune ")  # the latter: before lab/
        assert body["command"].startswith(autotune) and body["commit"], path.name
        assert all(str(T) in body["candidates_us"] for T in table), path.name
    for T, cfg in table.items():
        cfg.resolved().check(quant)
        assert H.get_config(T, s.num_experts, s.top_k, s.intermediate, s.hidden, quant, "NVIDIA H200") == cfg.resolved()


def test_no_stray_tables():
    from moe_spec.problem import get_shape

    names = {
        H.table_path(
            get_shape(spec).num_experts, get_shape(spec).intermediate, get_shape(spec).hidden, quant, "NVIDIA H200"
        ).name
        for spec, quant in SHIPPED
    }
    assert {p.name for p in H.CONFIG_DIR.glob("*.json")} == names


@pytest.mark.parametrize("T", [1, 8, 32, 128, 1024, 4096])
@pytest.mark.parametrize("spec", ["mixtral-8x7b", "deepseek-v3:tp8"])
@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
def test_autotune_candidates_leave_swap_to_the_rule(spec, quant, T):
    from moe_spec.problem import get_shape
    from triton_moe.lab.autotune import candidates

    s = get_shape(spec)
    cands = candidates(T, s.num_experts, s.top_k, quant)
    assert cands and all(c.swap_ab is None for c in cands)
    assert cands[0].resolved() == H.default_config(T, s.num_experts, s.top_k, quant)  # the heuristic first
    assert len(set(cands)) == len(cands)
    for c in cands:
        assert c.resolved().swap_ab == C.choose_swap_ab(c.BLOCK_M, c.BLOCK_N)
        c.check(quant)


BAD_CONFIGS = [
    (dict(BLOCK_M=16.0), TypeError, r"^BLOCK_M: expected an int, got 16\.0"),
    (dict(BLOCK_M=True), TypeError, r"^BLOCK_M: expected an int"),
    (dict(BLOCK_M=8), ValueError, r"^BLOCK_M=8: must be a power of two >= 16"),
    (dict(BLOCK_N=48), ValueError, r"^BLOCK_N=48: must be a power of two >= 16"),
    (dict(BLOCK_K="64"), TypeError, r"^BLOCK_K: expected an int"),
    (dict(BLOCK_K=0), ValueError, r"^BLOCK_K=0: must be a power of two"),
    (dict(GROUP_M=2.5), TypeError, r"^GROUP_M: expected an int"),
    (dict(GROUP_M=0), ValueError, r"^GROUP_M=0: must be >= 1"),
    (dict(num_warps=3), ValueError, r"^num_warps=3: must be one of 1, 2, 4, 8, 16"),
    (dict(num_warps=None), TypeError, r"^num_warps: expected an int"),
    (dict(num_stages=2.5), TypeError, r"^num_stages: expected an int"),
    (dict(num_stages=0), ValueError, r"^num_stages=0: must be >= 1"),
    (dict(swap_ab="no"), TypeError, r"^swap_ab: expected True, False or None, got 'no'"),
    (dict(swap_ab=0), TypeError, r"^swap_ab: expected True, False or None, got 0"),
    (dict(persistent_tma=1), TypeError, r"^persistent_tma: expected True or False, got 1"),
    (dict(persistent_tma=True, swap_ab=True), ValueError, r"^persistent_tma=True: .* non-swap-AB path"),
    (dict(tma_flatten=None), TypeError, r"^tma_flatten: expected True or False"),
    (dict(tma_flatten=True), ValueError, r"^tma_flatten=True: .* needs persistent_tma=True"),
    (dict(split_k=2.0), TypeError, r"^split_k: expected an int, got 2\.0"),
    (dict(split_k=0), ValueError, r"^split_k=0: must be >= 1"),
    (dict(split_k=2, persistent_tma=True, swap_ab=False), ValueError, r"^split_k=2: the persistent TMA kernel"),
    (dict(gemm2={"BLOCK_N": 128, "BLOCK_K": 64}), TypeError, r"^gemm2: expected a triton_moe.config.Gemm2Tile or None"),
    (dict(gemm2=(128, 64)), TypeError, r"^gemm2: expected"),
]


@pytest.mark.parametrize("bad, error, match", BAD_CONFIGS, ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_a_bad_field_is_named_on_construction(bad, error, match):
    """Type first, then value; the message starts with the field name (before any launch: a bad
    config cannot exist to be passed)."""
    with pytest.raises(error, match=match):
        TritonConfig(**{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, **bad})


def test_every_field_is_checked():
    checked = {name for bad, _, _ in BAD_CONFIGS for name in bad}
    assert checked == {f.name for f in dataclasses.fields(TritonConfig)}


@pytest.mark.parametrize(
    "config, quant, match",
    [
        (TritonConfig(16, 64, 256, swap_ab=True), "fp8_block", "^config: fp8_block needs BLOCK_K to divide 128"),
        (TritonConfig(16, 64, 16), "fp8_tensor", "^config: FP8 needs BLOCK_K >= 32"),
        (TritonConfig(128, 256, 128, num_stages=6), None, "^config: .* exceed the 232448-byte shared memory"),
    ],
)
def test_what_depends_on_the_format_is_checked_against_it(config, quant, match):
    with pytest.raises(ValueError, match=match):
        config.check(quant)
    assert not config.fits(quant)


@pytest.mark.parametrize("quant", [None, "fp8_tensor"], ids=lambda q: q or "bf16")
def test_heuristic_buckets_start_where_the_rule_changes(quant):
    """rule_starts is the first T of each heuristic bucket: the config changes there and nowhere else."""
    E, top_k = 8, 2
    starts = H.rule_starts(E, top_k, 14336, 4096, quant, device_name="No Such GPU")
    changes = [
        T for T in range(2, 2000) if H.default_config(T, E, top_k, quant) != H.default_config(T - 1, E, top_k, quant)
    ]
    assert starts == [1] + changes


def test_table_buckets_start_at_the_midpoints(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "CONFIG_DIR", tmp_path)
    table = {
        "1": TritonConfig(16, 64, 64),
        "8": TritonConfig(16, 128, 64),
        "32": TritonConfig(32, 64, 64),
        "1024": TritonConfig(128, 128, 64, 8, 8, 3),
    }
    H.table_path(8, 512, 256, None, "Fake GPU").write_text(
        json.dumps({"configs": {t: c.as_dict() for t, c in table.items()}})
    )
    H.load_table.cache_clear()
    starts = H.rule_starts(8, 2, 512, 256, None, device_name="Fake GPU")
    assert starts == [1, 5, 21, 529]  # 4.5 → 5, 20 → 21 (a tie goes to 8), 528 → 529 (a tie goes to 32)
    picks = [H.get_config(T, 8, 2, 512, 256, None, "Fake GPU") for T in (4, 5, 20, 21, 528, 529)]
    assert [c.BLOCK_N for c in picks[:2]] == [64, 128] and [c.BLOCK_M for c in picks[2:]] == [16, 32, 32, 128]
    H.load_table.cache_clear()


def test_tile_label_names_the_tile_fields():
    assert TritonConfig(128, 64, 32, 8, 4, 3).tile_label() == "128x64x32/g8w4s3"


# ---- GEMM2's own tile (TritonConfig.gemm2) ---------------------------------------------------------------

BAD_GEMM2 = [
    (dict(BLOCK_N=48), ValueError, r"^gemm2\.BLOCK_N=48: must be a power of two >= 16"),
    (dict(BLOCK_N=256.0), TypeError, r"^gemm2\.BLOCK_N: expected an int"),
    (dict(BLOCK_K=8), ValueError, r"^gemm2\.BLOCK_K=8: must be a power of two >= 16"),
    (dict(GROUP_M=0), ValueError, r"^gemm2\.GROUP_M=0: must be >= 1"),
    (dict(num_warps=6), ValueError, r"^gemm2\.num_warps=6: must be one of"),
    (dict(num_stages=0), ValueError, r"^gemm2\.num_stages=0: must be >= 1"),
    (dict(swap_ab="yes"), TypeError, r"^gemm2\.swap_ab: expected True, False or None"),
    (dict(persistent_tma="no"), TypeError, r"^gemm2\.persistent_tma: expected True or False"),
    (dict(persistent_tma=True, BLOCK_N=512), ValueError, r"^gemm2\.persistent_tma=True: a TMA box"),
    (dict(tma_flatten=True), ValueError, r"^gemm2\.tma_flatten=True: .* needs persistent_tma=True"),
]


@pytest.mark.parametrize("bad, error, match", BAD_GEMM2, ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_a_bad_gemm2_field_is_named_on_construction(bad, error, match):
    with pytest.raises(error, match=match):
        Gemm2Tile(**{"BLOCK_N": 128, "BLOCK_K": 64, **bad})


def test_every_gemm2_field_is_checked_and_blocks_m_and_split_k_are_not_its_own():
    checked = {name for bad, _, _ in BAD_GEMM2 for name in bad}
    fields = {f.name for f in dataclasses.fields(Gemm2Tile)}
    assert checked == fields
    # every field of the config but the alignment tile, the split and the override itself, declared once
    assert fields == {f.name for f in dataclasses.fields(TritonConfig)} - {"BLOCK_M", "split_k", "gemm2"}
    assert [f.name for f in dataclasses.fields(TritonConfig)] == ["BLOCK_M", *C.TILE_FIELDS, "split_k", "gemm2"]
    assert TritonConfig(16, 64, 128, 2, 8, 5, True) == TritonConfig(
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=2, num_warps=8, num_stages=5, swap_ab=True
    )
    assert not isinstance(TritonConfig(16, 64, 64), Gemm2Tile)  # a config is not GEMM2's tile


def test_gemm2_config_keeps_block_m_and_drops_the_split():
    cfg = TritonConfig(128, 128, 64, 8, 8, 3, split_k=2, gemm2=Gemm2Tile(256, 128, 4, 8, 2, persistent_tma=True))
    g2 = cfg.gemm2_config()
    assert g2 == TritonConfig(128, 256, 128, 4, 8, 2, persistent_tma=True)  # split_k 1, no gemm2
    assert cfg.gemm1_config() == TritonConfig(128, 128, 64, 8, 8, 3, split_k=2)
    # without an override GEMM2 runs GEMM1's tile, unsplit
    plain = TritonConfig(16, 64, 64, split_k=4)
    assert plain.gemm2_config() == TritonConfig(16, 64, 64) and plain.gemm1_config() is plain


def test_gemm2_swap_ab_follows_the_rule_on_its_own_tile():
    cfg = TritonConfig(16, 32, 64, gemm2=Gemm2Tile(64, 64)).resolved()
    assert (cfg.swap_ab, cfg.gemm2.swap_ab) == (False, True)  # BLOCK_N 32 < 64 <= 64
    assert cfg.resolved() is cfg
    forced = TritonConfig(16, 32, 64, gemm2=Gemm2Tile(64, 64)).replace_both(swap_ab=False).resolved()
    assert (forced.swap_ab, forced.gemm2.swap_ab) == (False, False)
    with pytest.raises(ValueError, match=r"^config\.gemm2: persistent_tma is the non-swap-AB path, but BLOCK_M=16"):
        TritonConfig(16, 32, 64, swap_ab=False, gemm2=Gemm2Tile(64, 64, persistent_tma=True)).resolved()


@pytest.mark.parametrize(
    "config, quant, match",
    [
        (
            TritonConfig(16, 64, 64, gemm2=Gemm2Tile(64, 256)),
            "fp8_block",
            r"^config\.gemm2: fp8_block needs BLOCK_K to divide 128",
        ),
        (TritonConfig(16, 64, 64, gemm2=Gemm2Tile(64, 16)), "fp8_tensor", r"^config\.gemm2: FP8 needs BLOCK_K >= 32"),
        (
            TritonConfig(128, 128, 64, gemm2=Gemm2Tile(256, 128, num_stages=3)),
            None,
            r"^config\.gemm2: 294912 bytes of pipelined tiles exceed",
        ),
    ],
)
def test_what_depends_on_the_format_is_checked_for_gemm2_too(config, quant, match):
    with pytest.raises(ValueError, match=match):
        config.check(quant)
    assert not config.fits(quant)


def test_gemm2_shared_memory_counts_one_weight_tile():
    """GEMM1 stages a gate and an up weight tile, GEMM2 one (the sm_90a binaries agree:
    tests/test_triton_gemm2.py): 128×256×64 bf16 with 4 stages fits GEMM2, not GEMM1."""
    g2 = TritonConfig(128, 128, 64, 8, 8, 3, gemm2=Gemm2Tile(256, 64, 8, 8, 4))
    assert g2.gemm2_config().smem_bytes(None, gemm=2) == (128 * 64 + 256 * 64) * 2 * 4 == 196608
    assert g2.fits(None) and not TritonConfig(128, 256, 64, 8, 8, 4).fits(None)


def test_a_table_entry_with_gemm2_round_trips(tmp_path, monkeypatch):
    cfg = TritonConfig(128, 128, 64, 8, 8, 3, gemm2=Gemm2Tile(256, 64, 8, 8, 4))
    assert TritonConfig.from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg
    assert TritonConfig.from_dict(TritonConfig(16, 64, 64).as_dict()) == TritonConfig(16, 64, 64)  # "gemm2": null
    monkeypatch.setattr(H, "CONFIG_DIR", tmp_path)
    old = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}  # an entry written before gemm2 existed
    H.table_path(8, 512, 256, None, "Fake GPU").write_text(json.dumps({"configs": {"1": old, "4096": cfg.as_dict()}}))
    H.load_table.cache_clear()
    got = H.get_config(4000, 8, 2, 512, 256, None, "Fake GPU")
    assert got == cfg.resolved() and got.gemm2 == Gemm2Tile(256, 64, 8, 8, 4, swap_ab=False)
    assert H.get_config(1, 8, 2, 512, 256, None, "Fake GPU") == TritonConfig(16, 64, 64).resolved()
    H.load_table.cache_clear()


@pytest.mark.parametrize(
    "entry, match",
    [
        (
            {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "fp8_imprecise_acc": 128},
            r"^fp8_imprecise_acc: not a field of "
            r"TritonConfig \(its fields: BLOCK_M, ",
        ),
        (
            {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "gemm2": {"BLOCK_N": 64, "BLOCK_K": 64, "split_k": 2}},
            r"^gemm2\.split_k: not a field of Gemm2Tile",
        ),
    ],
)
def test_a_table_entry_with_an_unknown_key_is_named(entry, match):
    with pytest.raises(ValueError, match=match):
        TritonConfig.from_dict(entry)


def test_fp8_promotes_at_least_every_128_of_k():
    """The kernels' promotion rule (triton_moe.kernels.fp8_imprecise_acc) gives every shipped table entry the
    FP8_IMPRECISE_ACC it was tuned and checked with: 128 for the FP8 entries with BLOCK_K > 128, 0 for all others."""
    from moe_spec.problem import get_shape
    from triton_moe import moe
    from triton_moe.kernels import fp8_imprecise_acc

    assert [fp8_imprecise_acc(bk, "fp8_tensor") for bk in (32, 64, 128, 256, 512)] == [0, 0, 0, 128, 128]
    assert fp8_imprecise_acc(256, "fp8_channel") == 128 and fp8_imprecise_acc(256, None) == 0
    deep = []
    for spec, quant in SHIPPED:
        s = get_shape(spec)
        for T, cfg in H.load_table(
            str(H.table_path(s.num_experts, s.intermediate, s.hidden, quant, "NVIDIA H200"))
        ).items():
            cfg = cfg.resolved()
            for g, k in ((cfg.gemm1_config(), s.hidden), (cfg.gemm2_config(), s.intermediate)):
                n = moe._gemm_constants(g, quant, g is cfg.gemm1_config(), s.top_k, k)["FP8_IMPRECISE_ACC"]
                assert n == (128 if quant and g.BLOCK_K > 128 else 0), (spec, quant, T, g)
                deep += [(spec, quant, T)] * (n > 0)
    assert list(dict.fromkeys(deep)) == [
        ("mixtral-8x7b", "fp8_channel", 1),
        ("deepseek-v3:tp8", "fp8_tensor", 1),
        ("deepseek-v3:tp8", "fp8_channel", 1),
    ]  # the three entries written with fp8_imprecise_acc=128


def test_the_plan_names_each_gemm():
    import triton_moe
    from moe_spec.validate import MoEDims

    d = MoEDims(T=4096, E=256, K=7168, I=256, top_k=8)
    p = triton_moe.plan(d, None, config=TritonConfig(128, 128, 64, 8, 8, 3, gemm2=Gemm2Tile(256, 64, 8, 8, 4)))
    assert (p.gemm1.BLOCK_N, p.gemm2.BLOCK_N, p.align_tile) == (128, 256, 128)
    assert p.mma == (
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
    )
    assert p.describe() == "BM128 BN128 BK64 w8 s3 wgmma m64n128k16; G2 BN256 BK64 w8 s4 wgmma m64n256k16"
    assert p.config.tile_label() == "128x128x64/g8w8s3 G2 256x64/g8w8s4"
    # swap_ab forced per call: both GEMMs
    q = triton_moe.plan(d, None, config=TritonConfig(16, 32, 64, gemm2=Gemm2Tile(64, 64)), swap_ab=True)
    assert q.swap_ab == (True, True)
    assert triton_moe.plan(d, None, config=TritonConfig(16, 32, 64, gemm2=Gemm2Tile(64, 64))).swap_ab == (False, True)

"""The course's exercises: course/exercises.md is what course/exercises.py computes from the steps
today, and every answer agrees with a second, independent source."""

import importlib.util
import sys
from pathlib import Path

import pytest

COURSE = Path(__file__).resolve().parents[1] / "course"


def step(name: str):
    if str(COURSE) not in sys.path:
        sys.path.insert(0, str(COURSE))
    if "_common" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_common", COURSE / "_common.py")
        sys.modules["_common"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["_common"])
    return sys.modules["_common"].load(name)


@pytest.fixture(scope="module")
def answers():
    return step("exercises").answers()


def test_exercises_md_is_current(answers):
    md = (COURSE / "exercises.md").read_text()
    assert md == step("exercises").render(answers), "stale: run python course/exercises.py"


def test_descriptor(answers):
    d = answers["descriptor"]
    f = d["fields"]
    rebuilt = (
        (f["start address"] // 16)
        | (f["leading dimension byte offset"] // 16) << 16
        | (f["stride dimension byte offset"] // 16) << 32
        | f["base offset"] << 49
        | f["swizzle mode"] << 62
    )
    assert rebuilt == d["value"]
    assert f["swizzle"] == "128-byte" and f["stride dimension byte offset"] == 8 * 128 and f["base offset"] == 0
    assert d["k_steps"] == [2, 4, 6]  # K16 slices 1, 2, 3 of a stage: 32 bytes apart, in 16-byte units


def test_owner(answers):
    o = answers["owner"]
    s1 = step("01_wgmma")
    assert s1.ptx_owner(o["thread"], o["register"]) == (o["m"], o["n"])  # the PTX ISA's figure
    assert (o["derived_thread"], o["derived_register"]) == (o["thread"], o["register"])


def test_stages(answers):
    s = answers["stages"]
    import re

    ptx = step("04_setmaxnreg").ptx(256, 4)  # the expect_tx of a 128 × 256 × 64 stage
    assert str(s["stage_bytes"]) in re.findall(r"mov\.b32\s+%r\d+, (\d+);", ptx)
    assert s["stages"] * s["stage_bytes"] + 1024 <= s["capacity"] < (s["stages"] + 1) * s["stage_bytes"] + 1024


def test_parity_against_a_phase_count(answers):
    """Count completed phases directly: full[s] completes one phase per load of slot s; empty[s]
    one per release. A wait on parity P returns when the phase of parity P it names is complete."""
    s3 = step("03_ring")
    stages = 4
    for k in range(24):
        slot, parity = s3.ring_position(k, stages)
        uses_before = sum(1 for j in range(k) if j % stages == slot)
        assert parity == uses_before % 2  # the consumer waits for full's phase number uses_before
        needed = uses_before - 1  # the producer needs the release of the slot's previous use (phase uses_before − 1)
        assert parity ^ 1 == needed % 2  # for the first lap, −1: "the phase before", parity 1
    p = answers["parity"]
    assert (p["slot"], p["consumer"], p["producer"]) == (1, 0, 1)


def test_registers(answers):
    r = answers["registers"]
    assert r["ok"]["fits"] and not r["greedy"]["fits"] and r["three"]["fits"]
    for b in r.values():
        assert b["pool"] <= 65536 and b["launch"] % 8 == 0


def test_swap(answers):
    """Against the production rule's own words (cute_moe.plan: swap while tokens per expert ≤ WGMMA's M;
    swapped token tiles are the powers of two 8 … 64) and against choose_config, which plans the layer."""
    from cute_moe.plan import choose_config
    from moe_spec.hopper import WGMMA_M

    sw = answers["swap"]
    for t, c in sw.items():
        assert c["swap"] == (t <= WGMMA_M) == choose_config(t, 4096, 4096).swap_ab
        assert c["swapped_tile"] == min(WGMMA_M, max(8, 1 << (t - 1).bit_length()))
        assert c["normal_tile"] == (WGMMA_M if t <= WGMMA_M else 2 * WGMMA_M)
        assert c["swapped_padding"] == -t % c["swapped_tile"] and c["normal_padding"] == -t % c["normal_tile"]
    assert sw[4]["swapped_token_cols"] == 8 and sw[4]["normal_padding"] == 60 and sw[96]["normal_token_rows"] == 128

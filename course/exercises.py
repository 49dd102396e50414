"""The exercises of the course, their worked answers computed from the steps' own code and PTX.

``python course/exercises.py`` rewrites course/exercises.md; tests/test_course_exercises.py
checks that the file equals :func:`render` (so an answer cannot go stale when a step changes)
and checks each answer against a second source (the PTX ISA's formula, the ring's definition).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import _common as course

FIELDS = (  # PTX ISA, "Matrix Descriptor Format" (wgmma): name, first bit, width, unit
    ("start address", 0, 14, "16 B"),
    ("leading dimension byte offset", 16, 14, "16 B"),
    ("stride dimension byte offset", 32, 14, "16 B"),
    ("base offset", 49, 3, ""),
    ("swizzle mode", 62, 2, ""),
)
SWIZZLE = {0: "none", 1: "128-byte", 2: "64-byte", 3: "32-byte"}


def decode_descriptor(desc: int) -> dict:
    """The bit fields of a 64-bit wgmma matrix descriptor (offsets in bytes where they are offsets)."""
    out = {}
    for name, lo, width, unit in FIELDS:
        v = (desc >> lo) & ((1 << width) - 1)
        out[name] = v * 16 if unit else v
    out["swizzle"] = SWIZZLE[out["swizzle mode"]]
    return out


def descriptor_in_ptx(ptx: str) -> tuple[int, list[int]]:
    """The constant part of the A operand's descriptor in a step's PTX (``or.b64 …, CONST``) and the
    increments ORed into its start address for the K slices of one stage."""
    m = re.search(
        r"or\.b64\s+%rd\d+, %rd\d+, (\d+);\s*mov\.b64\s+\{(%r\d+), %r\d+\}, %rd\d+;\s*add\.s32\s+(%r\d+), "
        r"%r\d+, \2;(.*?)wgmma",
        ptx,
        re.S,
    )
    steps = sorted(int(s) for s in re.findall(rf"or\.b32\s+%r\d+, {re.escape(m.group(3))}, (\d+);", m.group(4)))
    return int(m.group(1)), steps


def answers() -> dict:
    s1, s3, s4, s6 = (course.load(n) for n in ("01_wgmma", "03_ring", "04_setmaxnreg", "06_swap_ab"))
    desc, k_steps = descriptor_in_ptx(s4.ptx(256, 4))
    m, n = 37, 21
    owner = s1.owner_map(64)[(m, n)]  # read from the tiled MMA; the text derives it from the PTX ISA's figure
    lane = 4 * (m % 16 % 8) + n % 8 // 2
    from cutlass.memory import get_smem_capacity_in_bytes

    capacity = get_smem_capacity_in_bytes("sm_90")
    stage = (128 + 256) * s3.TILE_K * 2
    barriers = 1024  # the mbarrier array, rounded up to the 1024-byte alignment of the first ring buffer
    producer_k9, consumer_k9 = s3.ring_position(9, 4)[1] ^ 1, s3.ring_position(9, 4)[1]
    return {
        "descriptor": {"value": desc, "fields": decode_descriptor(desc), "k_steps": k_steps},
        "owner": {
            "m": m,
            "n": n,
            "N": 64,
            "thread": owner[0],
            "register": owner[1],
            "derived_lane": lane,
            "derived_thread": 32 * (m // 16) + lane,
            "derived_register": 4 * (n // 8) + 2 * (m % 16 // 8) + n % 2,
        },
        "stages": {
            "capacity": capacity,
            "barriers": barriers,
            "stage_bytes": stage,
            "stages": (capacity - barriers) // stage,
        },
        "parity": {
            "k": 9,
            "stages": 4,
            "slot": s3.ring_position(9, 4)[0],
            "consumer": consumer_k9,
            "producer": producer_k9,
        },
        "registers": {
            "ok": s4.register_budget(40, 232, 2),
            "greedy": s4.register_budget(40, 240, 2),
            "three": s4.register_budget(24, 160, 3),
        },
        "swap": {t: s6.swap_ab_choice(t) for t in (4, 64, 96)},
    }


def render(a: dict | None = None) -> str:
    a = a or answers()
    d, o, st, p, r, sw = (a[k] for k in ("descriptor", "owner", "stages", "parity", "registers", "swap"))
    f = d["fields"]
    ok, greedy, three = r["ok"], r["greedy"], r["three"]
    lines = [
        "# Exercises, with worked answers",
        "",
        "Every number below is computed by `course/exercises.py` from the steps' code and their PTX",
        "(`python course/exercises.py` rewrites this file; `tests/test_course_exercises.py` fails when it is stale).",
        "",
        "## 1. Decode a matrix descriptor (step 4)",
        "",
        f"Step 4's PTX builds the A descriptor by ORing the constant `{d['value']:#018x}` into the start",
        'address. Decode it with the PTX ISA\'s "Matrix Descriptor Format" (bits 0–13 start address,',
        "16–29 leading-dimension byte offset, 32–45 stride-dimension byte offset, all three in units of",
        "16 bytes; 49–51 base offset; 62–63 swizzle mode: 0 none, 1 128-byte, 2 64-byte, 3 32-byte).",
        "",
        f"**Answer.** Swizzle mode {f['swizzle mode']} = {f['swizzle']}; stride byte offset",
        f"{f['stride dimension byte offset']} bytes (from one 8-row group of core matrices to the next along M:",
        f"8 rows × 128 bytes); leading byte offset field {f['leading dimension byte offset'] // 16}: for a"
        " K-major swizzled",
        'layout the ISA does not use it ("assumed to be 1"), since one WGMMA\'s K16 slice, 32 bytes, lies inside',
        "one 128-byte swizzled row;",
        f"base offset {f['base offset']} (the buffer is 1024-byte aligned); start address",
        f"{f['start address']}: it is ORed in at run time. The first WGMMA of a stage takes that address; the other",
        f"three OR {d['k_steps']} into the start address field: steps of {d['k_steps'][0] * 16} bytes = 16 bf16, "
        "one K16 slice each.",
        "",
        "## 2. Who owns accumulator element (m, n)? (step 1)",
        "",
        f"For N = {o['N']}, which thread of the warpgroup and which of its registers hold C[{o['m']}, {o['n']}]?",
        "",
        f"**Answer.** Thread {o['thread']}, register d[{o['register']}]. Rows: warp = m / 16 = {o['m'] // 16};",
        f"inside the warp's 16 rows, m mod 16 = {o['m'] % 16}, so lane / 4 = {o['m'] % 16 % 8}"
        " and the register is in the",
        f"{'second' if o['m'] % 16 >= 8 else 'first'} pair of its group ((r / 2) mod 2 = {o['m'] % 16 // 8}). Columns:",
        f"n / 8 = {o['n'] // 8} is the register group (r / 4), n mod 8 = {o['n'] % 8} = 2·(lane mod 4) + (r mod 2),",
        f"so lane mod 4 = {o['n'] % 8 // 2} and r mod 2 = {o['n'] % 2}. Lane = 4·{o['m'] % 16 % 8} + {o['n'] % 8 // 2}"
        f" = {o['derived_lane']}, thread = 32·{o['m'] // 16} + {o['derived_lane']} = {o['derived_thread']};",
        f"r = 4·{o['n'] // 8} + 2·{o['m'] % 16 // 8} + {o['n'] % 2} = {o['derived_register']}.",
        "",
        "## 3. Fit stages to the shared-memory budget (steps 3–5)",
        "",
        f"A 128 × 256 tile with 64 of K per stage (bf16): how many stages fit in {st['capacity']:,} bytes",
        '(`cutlass.memory.get_smem_capacity_in_bytes("sm_90")`), with 1 KB for the barriers?',
        "",
        f"**Answer.** One stage is (128 + 256) · 64 · 2 = {st['stage_bytes']:,} bytes;",
        f"({st['capacity']:,} − 1,024) / {st['stage_bytes']:,} → **{st['stages']} stages**."
        " (The production kernel also",
        "keeps its epilogue's staging buffers in shared memory and budgets them first.)",
        "",
        "## 4. Which parity does each side wait on? (step 3)",
        "",
        f"With {p['stages']} stages, K step k = {p['k']}: which slot, and which parity do the consumer"
        " (on full[s]) and the",
        "producer (on empty[s]) wait for?",
        "",
        f"**Answer.** Slot {p['k']} mod {p['stages']} = {p['slot']}, "
        f"lap {p['k']} / {p['stages']} = {p['k'] // p['stages']}. "
        f"The consumer waits full[{p['slot']}] with parity {p['consumer']}:",
        f"the barrier completed phase 0 (k = {p['slot']}) and phase 1 (k = {p['slot'] + p['stages']});"
        f" k = {p['k']}'s load",
        f"completes phase 2, parity 0. The producer waits empty[{p['slot']}] with parity {p['producer']}: it needs",
        f"the release of k = {p['k'] - p['stages']}, the consumers' second release of that slot, which completes",
        "empty's phase 1.",
        "",
        "## 5. Budget registers under setmaxnreg (step 4)",
        "",
        "A producer and two consumer warpgroups (384 threads). The producer drops to 40. Can the consumers ask",
        "for 232? For 240? And with three consumer warpgroups (512 threads), a producer at 24, consumers at 160?",
        "",
        f"**Answer.** The pool is what the CTA was launched with: at most {ok['launch']} registers per thread",
        f"for {ok['threads']} threads = {ok['pool']:,}. 40 · 128 + 232 · 256 = {ok['after']:,}: fits.",
        f"40 · 128 + 240 · 256 = {greedy['after']:,} > {greedy['pool']:,}: the second `setmaxnreg.inc` would",
        "block forever (it waits until the pool has the registers). With 512 threads the launch gets at most",
        f"{three['launch']} per thread, a pool of {three['pool']:,}; 24 · 128 + 160 · 384 = {three['after']:,}: "
        + ("fits." if three["fits"] else "does not fit."),
        "",
        "## 6. Swap-AB or not? (step 6)",
        "",
        "An expert receives 4, 64 or 96 tokens. Swap?",
        "",
    ]
    for t, c in sw.items():
        verdict = "swap" if c["swap"] else "do not swap"
        lines.append(
            f"* **{t} tokens: {verdict}.** Normal path: tiles of {c['normal_tile']} rows cover "
            f"{c['normal_token_rows']}, {c['normal_padding']} of them padding; swapped: tiles of N = "
            f"{c['swapped_tile']} cover {c['swapped_token_cols']} columns, {c['swapped_padding']} padding."
        )
    lines += [
        "",
        "Step 6 asks cute_moe's own path rule (`cute_moe.plan.path_rule`): swap while the mean tokens per expert",
        f"is at most `SWAP_AB_MAX_TOKENS_PER_EXPERT` = {sw[4]['threshold']}, WGMMA's M. Below it the normal path's "
        "smallest tile,",
        "one warpgroup's 64 rows, is mostly padding, while the swapped tile shrinks to 8, 16 or 32 columns; decode",
        "is bound by the weight bytes, which both paths stream once per token tile. At 96 both paths pad 32",
        "tokens, but the normal path's one 128-token tile reads each weight stage once for all 96 tokens where",
        "the swapped path's two 64-column tiles read it twice, and its output needs no transpose. On the H200",
        "swap-AB measured faster at 1 to 64 tokens per expert and slower at 128 and 256 (cute_moe/plan.py).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    out = Path(__file__).with_name("exercises.md")
    out.write_text(render())
    print(f"wrote {out}", file=sys.stderr)

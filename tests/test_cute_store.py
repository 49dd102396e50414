"""Which threads issue the TMA traffic of the compiled grouped GEMM (CPU: PTX only, no GPU).

``cp.async.bulk.tensor`` is a per-thread instruction: every thread that executes it starts its own
copy, and ``cp.async.bulk.commit_group`` / ``wait_group`` count the *executing thread's* bulk
async-groups.  So a TMA store must be issued by exactly one thread of the CTA, and that same thread
must commit and wait for it.  These tests read the PTX that ``cute_moe.compile_ptx`` produces on the
CPU, follow the control flow once per thread id of the CTA, and count the threads that can reach
each instruction.

The walk evaluates every branch whose predicate is computed from ``%tid.x`` alone (``mov``,
integer arithmetic, ``shfl.sync.idx`` broadcasts from lane 0, ``setp``, ``elect.sync``, whose
leader is taken to be lane 0); a branch on anything else (loop counters, values loaded from
memory) is followed both ways.  That over-approximates the threads that reach an instruction,
never under-approximates it.
"""

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cute_moe = pytest.importorskip("cute_moe")

from cute_moe.plan import choose_config  # noqa: E402

# Mixtral GEMM1 (N_out = 2·14336, K = 4096): the configs the path rule picks at 2 and 500 tokens
# per expert — swap-AB 128 weights × 8 tokens, and the normal 128 × 256 tile.
CONFIGS = {"swap_ab": choose_config(2, 28672, 4096), "normal": choose_config(500, 28672, 4096)}

STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")
LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global")
COMMIT = re.compile(r"cp\.async\.bulk\.commit_group")
WAIT = re.compile(r"cp\.async\.bulk\.wait_group")
STMATRIX = re.compile(r"stmatrix\.sync\.aligned")


class Unknown(Exception):
    """A value that depends on more than the thread id."""


def _int(tok: str) -> int:
    return int(tok, 16) if tok.lower().startswith(("0x", "-0x")) else int(tok)


class Ptx:
    """The kernel body as instructions, labels and single-definition registers."""

    def __init__(self, text: str):
        body = text[text.index(".entry") :]
        body = body[body.index("{") + 1 :]
        self.lines: list[str] = []
        self.labels: dict[str, list[int]] = {}  # inline-asm blocks reuse local label names
        for raw in body.splitlines():
            line = raw.split("//")[0].strip()
            if not line or line.startswith(".") or line in ("{", "}"):
                continue
            if line.endswith(":"):
                self.labels.setdefault(line[:-1], []).append(len(self.lines))
                continue
            self.lines.append(line.rstrip(";").strip())
        self._reach: dict[int, set[int]] = {}
        self.defs: dict[str, list[int]] = {}
        for i, line in enumerate(self.lines):
            for reg in self._dests(line):
                self.defs.setdefault(reg, []).append(i)

    @staticmethod
    def _split(line: str):
        guard = None
        if line.startswith("@"):
            guard, line = line.split(None, 1)
        op, *rest = line.split(None, 1)
        args = [a.strip() for a in rest[0].split(",")] if rest else []
        return guard, op, args

    def _dests(self, line: str) -> list[str]:
        _, op, args = self._split(line)
        if not args or op.startswith(("st", "bra", "bar", "cp.", "mbarrier", "wgmma", "fence", "ret")):
            return []
        return [r for r in args[0].split("|") if r.startswith("%")]

    # ---- evaluation of thread-id-only values ------------------------------------------------
    def value(self, reg: str, tid: int, cache: dict):
        key = (reg, tid)
        if key in cache:
            if cache[key] is Unknown:
                raise Unknown(reg)
            return cache[key]
        try:
            v = self._eval(reg, tid, cache)
        except Unknown:
            cache[key] = Unknown
            raise
        cache[key] = v
        return v

    def _operand(self, tok: str, tid: int, cache: dict):
        if tok == "%tid.x":
            return tid
        if tok == "%laneid":
            return tid % 32
        if tok.startswith("%"):
            return self.value(tok, tid, cache)
        try:
            return _int(tok)
        except ValueError:
            raise Unknown(tok) from None

    def _eval(self, reg: str, tid: int, cache: dict):
        where = self.defs.get(reg, [])
        if len(where) != 1:
            raise Unknown(reg)
        _, op, args = self._split(self.lines[where[0]])
        name = op.split(".")[0]
        if name == "elect":  # elect.sync %r|%p, -1: one leader per warp (modelled as lane 0)
            return tid % 32 == 0 if reg == args[0].split("|")[-1] else 0
        if name == "shfl" and ".idx" in op and args[3:] == ["31", "-1"]:
            src_tid = tid - tid % 32 + self._operand(args[2], tid, cache)  # the source lane's value
            return self._operand(args[1], src_tid, cache)
        if name == "mov" or name == "cvt":
            return self._operand(args[1], tid, cache)
        if name == "not" and op.endswith(".pred"):
            return not self._operand(args[1], tid, cache)
        if name == "setp":
            a, b = (self._operand(x, tid, cache) for x in args[1:3])
            cmp = op.split(".")[1]
            return {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[cmp]
        binary = {
            "add": lambda a, b: a + b,
            "sub": lambda a, b: a - b,
            "mul": lambda a, b: a * b,
            "shl": lambda a, b: a << b,
            "shr": lambda a, b: a >> b,
            "and": lambda a, b: a & b,
            "or": lambda a, b: a | b,
            "xor": lambda a, b: a ^ b,
        }
        if name in binary and len(args) == 3:
            a, b = (self._operand(x, tid, cache) for x in args[1:3])
            if name == "shr" and ".u32" in op:
                a &= 0xFFFFFFFF
            return binary[name](a, b)
        raise Unknown(reg)

    # ---- control flow, one thread at a time ----------------------------------------------------
    def reachable(self, tid: int) -> set[int]:
        """Instruction indices thread ``tid`` can execute (unknown branches go both ways)."""
        if tid not in self._reach:
            self._reach[tid] = self._walk(tid)
        return self._reach[tid]

    def _walk(self, tid: int) -> set[int]:
        cache: dict = {}
        seen: set[int] = set()
        todo = [0]
        while todo:
            i = todo.pop()
            while i < len(self.lines) and i not in seen:
                seen.add(i)
                guard, op, args = self._split(self.lines[i])
                if op.startswith("ret"):
                    break
                if op.startswith("bra"):
                    target = min(self.labels[args[0]], key=lambda at: abs(at - i))  # the local one
                    if guard is None:
                        i = target
                        continue
                    negate = guard.startswith("@!")
                    try:
                        taken = bool(self.value(guard.lstrip("@!"), tid, cache)) != negate
                        if taken:
                            i = target
                            continue
                    except Unknown:
                        todo.append(target)
                i += 1
        return seen


def _threads_reaching(ptx: Ptx, threads: int, pattern) -> dict[int, set[int]]:
    """{instruction index: set of thread ids that can reach it} for every line matching pattern."""
    sites = [i for i, line in enumerate(ptx.lines) if pattern.search(line)]
    assert sites, f"no {pattern.pattern} in the PTX"
    out = {i: set() for i in sites}
    for tid in range(threads):
        seen = ptx.reachable(tid)
        for i in sites:
            if i in seen:
                out[i].add(tid)
    return out


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def compiled(request):
    cfg = CONFIGS[request.param]
    return cfg, Ptx(cute_moe.compile_ptx(cfg))


def test_one_thread_issues_every_tma_store(compiled):
    cfg, ptx = compiled
    stores = _threads_reaching(ptx, cfg.threads, STORE)
    issuers = set().union(*stores.values())
    assert len(issuers) == 1, f"{len(issuers)} threads issue TMA stores: {sorted(issuers)[:40]}"
    assert min(issuers) >= 128, "the store thread is a consumer (warpgroups 1…n)"


def test_the_store_thread_commits_and_waits_for_its_own_groups(compiled):
    cfg, ptx = compiled
    stores = _threads_reaching(ptx, cfg.threads, STORE)
    issuer = set().union(*stores.values())
    for pattern in (COMMIT, WAIT):
        for line, threads in _threads_reaching(ptx, cfg.threads, pattern).items():
            assert threads == issuer, f"{ptx.lines[line]!r} runs on threads {sorted(threads)[:40]}, stores on {issuer}"


def test_the_walk_sees_the_loads_elected_and_stmatrix_on_every_consumer(compiled):
    # The same walk on instructions whose issuers are known: one producer thread issues each TMA
    # load (the DSL elects a lane), every consumer thread executes stmatrix.
    cfg, ptx = compiled
    loads = set().union(*_threads_reaching(ptx, cfg.threads, LOAD).values())
    assert loads == {0}
    consumers = set(range(128, cfg.threads))
    assert all(t == consumers for t in _threads_reaching(ptx, cfg.threads, STMATRIX).values())


EXPECT_TX = re.compile(r"mbarrier\.arrive\.expect_tx")
ARRIVE = re.compile(r"^mbarrier\.arrive\.shared")
SETMAXNREG_DEC = re.compile(r"setmaxnreg\.dec")
SETMAXNREG_INC = re.compile(r"setmaxnreg\.inc")


def test_ring_and_register_roles(compiled):
    # What notes/hopper.md says each thread does: thread 0 (the producer's elected lane) announces
    # each stage's bytes on the full barrier; lane 0 of every consumer warp arrives once on a slot's
    # empty barrier (its init count is the number of consumer warps); setmaxnreg runs warpgroup-wide.
    cfg, ptx = compiled
    for threads in _threads_reaching(ptx, cfg.threads, EXPECT_TX).values():
        assert threads == {0}
    consumer_warp_leaders = set(range(128, cfg.threads, 32))
    for threads in _threads_reaching(ptx, cfg.threads, ARRIVE).values():
        assert threads == consumer_warp_leaders
    assert all(t == set(range(128)) for t in _threads_reaching(ptx, cfg.threads, SETMAXNREG_DEC).values())
    assert all(t == set(range(128, cfg.threads)) for t in _threads_reaching(ptx, cfg.threads, SETMAXNREG_INC).values())
    counts = [ptx.value(ptx._split(line)[2][1], 0, {}) for line in ptx.lines if line.startswith("mbarrier.init")]
    full, empty = counts[: cfg.stages], counts[cfg.stages :]  # the ring's full barriers first, then its empty ones
    assert full == [1] * cfg.stages and empty == [4 * cfg.consumer_warpgroups] * cfg.stages, counts

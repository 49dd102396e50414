"""Every ``python -m`` entry point of the four packages, on the CPU: no argument, ``--help``, a bad option.

The entry points are found, not listed: every module of moe_spec, cute_moe, triton_moe and compare with
an ``if __name__ == "__main__"`` guard, and every package's ``__main__.py``. Each runs in a subprocess of
its own (TRITON_INTERPRET=1, no GPU visible), two at a time, three ways — through ``runpy``, as
``python -m`` runs a module, the imports paid once — each within 60 s:

* ``--help``: exit 0, the usage on stdout;
* ``--bogus-option``: exit 2 and one line on stderr, ``python -m <module>: error: …`` (moe_spec.cli);
* no argument: exit 0 (a CPU form, which says it is reduced where it is) or 2 with that one line (an
  option is required, or the tool needs a CUDA GPU and says so).

No run may print a traceback. The working directory is a temporary one, so a tool that writes its
default output does not touch the checkout. ``python -m compare`` with no argument is the main job
(README), minutes on a CPU: it is held to its first 60 s — no traceback, its progress on stderr — and
then stopped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moe_spec", "cute_moe", "triton_moe", "compare")
LIMIT_S = 60
#: Entry points whose no-argument run is a whole job by design, and what it shows in its first minute.
LONG_JOBS = {"compare": re.compile(r"\[\d+/\d+ done\]")}


def entry_points() -> list[str]:
    """Modules (``python -m`` names) with a ``__main__`` guard, and packages with a ``__main__.py``."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if path.name == "__main__.py":
                found.append(module.removesuffix(".__main__"))
            elif re.search(r"^if __name__ == [\"']__main__[\"']", path.read_text(), re.M):
                found.append(module)
    return found


#: The three runs of one entry point, in one process (the imports are paid once): ``--help``,
#: ``--bogus-option``, then no argument, each through ``runpy`` as ``python -m`` runs it, between
#: marker lines on both streams that carry its exit status and its seconds.
DRIVER = r"""
import runpy, sys, time, traceback
module = sys.argv[1]
for args in (["--help"], ["--bogus-option"], []):
    tag = "|".join(args)
    for stream in (sys.stdout, sys.stderr):
        print(f"@@@start {tag}", file=stream, flush=True)
    sys.argv, start, code = [module, *args], time.monotonic(), 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:  # SystemExit("message"): what Python prints, and status 1
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        print(f"@@@end {tag} {code} {time.monotonic() - start:.1f}", file=stream, flush=True)
"""


def _split(text: str) -> dict:
    """{args tag: (text, exit status or None (still running), seconds or None)} from the driver's markers."""
    parts, tag, lines = {}, None, []
    for line in text.splitlines():
        if line.startswith("@@@start "):
            tag, lines = line[len("@@@start ") :], []
            parts[tag] = ("", None, None)
        elif line.startswith("@@@end ") and tag is not None:
            _, rest = line.split(" ", 1)
            code, seconds = rest.rsplit(" ", 2)[-2:]
            parts[tag] = ("\n".join(lines), int(code), float(seconds))
            tag = None
        elif tag is not None:
            lines.append(line)
            parts[tag] = ("\n".join(lines), None, None)
    return parts


def _run(module: str, tmp: Path) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TRITON_INTERPRET": "1",
        "CUTE_DSL_ARCH": "sm_90a",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONWARNINGS": "ignore",
    }
    text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
    try:
        # a long job's first minute is all the test reads of it (its help and bad option take seconds)
        r = subprocess.run(
            [sys.executable, "-c", DRIVER, module],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=LIMIT_S + 20 if module in LONG_JOBS else 2 * LIMIT_S,
        )
        out, err = r.stdout, r.stderr
    except subprocess.TimeoutExpired as exc:
        out, err = text(exc.stdout), text(exc.stderr)
    outs, errs = _split(out), _split(err)
    runs = []
    for args in (["--help"], ["--bogus-option"], []):
        tag = "|".join(args)
        o, code, seconds = outs.get(tag, ("", None, None))
        e = errs.get(tag, ("", None, None))[0]
        runs.append(dict(module=module, args=args, rc=code, out=o, err=e, timed_out=code is None or seconds > LIMIT_S))
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("entry_points")
    with ThreadPoolExecutor(2) as pool:
        return [run for per_module in pool.map(lambda m: _run(m, work), entry_points()) for run in per_module]


def test_the_entry_points_are_found():
    found = entry_points()
    for module in (
        "compare",
        "compare.status",
        "compare.studies.eager",
        "compare.studies.hf_bench",
        "triton_moe.lab.autotune",
        "triton_moe.lab.hostcost",
        "cute_moe.lab.explore",
    ):
        assert module in found, module
    assert len(found) == len(set(found)) >= 20


def _one_error_line(run) -> str | None:
    """What is wrong with a refusal: it must be one line on stderr, ``python -m <module>: error: …``."""
    lines = [line for line in run["err"].splitlines() if line.strip()]
    if len(lines) != 1 or not lines[0].startswith(f"python -m {run['module']}: error: "):
        return f"expected one line 'python -m {run['module']}: error: …', got {lines[:6]}"
    return None


def test_no_traceback_and_no_run_past_the_limit(runs):
    problems = []
    for r in runs:
        what = f"python -m {r['module']} {' '.join(r['args'])}".strip()
        if "Traceback (most recent call last)" in r["out"] + r["err"]:
            problems.append(f"{what}: traceback: {(r['err'] or r['out']).strip().splitlines()[-1][:160]}")
        elif r["timed_out"]:
            long_job = LONG_JOBS.get(r["module"]) if not r["args"] else None
            if long_job is None or not long_job.search(r["err"] + r["out"]):
                problems.append(f"{what}: still running after {LIMIT_S} s")
    assert not problems, "\n".join(problems)


def test_help_exits_0(runs):
    bad = [f"{r['module']}: exit {r['rc']}" for r in runs if r["args"] == ["--help"] and r["rc"] != 0]
    assert not bad, bad
    assert all("usage: python -m " in r["out"] for r in runs if r["args"] == ["--help"])


def test_a_bad_option_is_one_line_and_exit_2(runs):
    bad = []
    for r in runs:
        if r["args"] == ["--bogus-option"]:
            why = _one_error_line(r) if r["rc"] == 2 else f"exit {r['rc']}"
            if why:
                bad.append(f"{r['module']}: {why}")
    assert not bad, "\n".join(bad)


def test_no_argument_runs_its_cpu_form_or_says_why_not(runs):
    bad = []
    for r in runs:
        if r["args"] or (r["timed_out"] and r["module"] in LONG_JOBS):
            continue
        if r["rc"] == 2:
            why = _one_error_line(r)
        elif r["rc"] == 0:
            why = None
        else:
            why = f"exit {r['rc']}: {r['err'].strip().splitlines()[-1:]}"
        if why:
            bad.append(f"{r['module']}: {why}")
    assert not bad, "\n".join(bad)

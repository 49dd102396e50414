"""Repository invariants: CI runs the README's test command; the backends never import each other."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## The two commands.*?```bash\n(.*?)```", text, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    main_job, tests = _readme_commands()
    assert "python -m compare" in main_job and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [line.strip() for line in ci], f"{tests!r} not run verbatim by .ci/run"


def _imports(package):
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_backends_never_import_each_other():
    assert (ROOT / "cute_moe").is_dir() and (ROOT / "triton_moe").is_dir()
    assert "triton_moe" not in _imports("cute_moe")
    assert "cute_moe" not in _imports("triton_moe")


def test_shared_leaf_modules_import_no_backend():
    for leaf in ("problem", "quant", "validate", "oracle", "contract", "timing"):
        tree = ast.parse((ROOT / "compare" / f"{leaf}.py").read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.split(".")[0] in ("cute_moe", "triton_moe") for m in mods), leaf

"""Repository invariants: CI runs the README's test command; the import graph keeps its layers (the
backends never import each other, the product never imports the lab), has no cycle and stays shallow;
product modules stay under the line limit."""

import ast
import pathlib
import re

import pytest

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


#: The three layers, lowest first. A module may import its own layer's package or a lower layer,
#: never a higher one; the two backends share a layer and never import each other.
LAYERS = ({"moe_spec"}, {"cute_moe", "triton_moe"}, {"compare"})
#: Package parts that hold the lab (benchmarks, studies, figures, explorers): no product module imports them.
LAB_PARTS = {"lab", "studies"}
MAX_LINES = 450  # product modules only: the lab's scripts are exempt
#: The most modules one import chain may pass through inside a backend's product.
MAX_CHAIN = 6
BACKENDS = ("cute_moe", "triton_moe")


def _modules():
    mods = {}
    for layer in LAYERS:
        for pkg in layer:
            for path in sorted((ROOT / pkg).rglob("*.py")):
                name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                mods[name.removesuffix(".__init__")] = path
    return mods


def _imported_names(mod: str, is_pkg: bool, source: str, known) -> set:
    """The dotted names ``source`` imports: import statements (``from a import b`` counts as a.b when that
    is a module) and the string literals of ``importlib.import_module("…")`` and ``__import__("…")``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = mod.split(".")[: len(mod.split(".")) - node.level + is_pkg]
                base = ".".join(parts + ([base] if base else []))
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            arg = node.args[0] if node.args else None
            if func in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
    return names


def _graph_of(sources: dict) -> dict:
    """module -> the modules of ``sources`` it imports; ``sources`` maps a module to (is_pkg, source)."""

    def owner(name):
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name

    return {
        mod: {owner(n) for n in _imported_names(mod, is_pkg, text, sources)} - {"", mod}
        for mod, (is_pkg, text) in sources.items()
    }


def _import_graph():
    """module -> the project modules it imports."""
    return _graph_of({m: (p.name == "__init__.py", p.read_text()) for m, p in _modules().items()})


def _layer(mod):
    return next(i for i, layer in enumerate(LAYERS) if mod.split(".")[0] in layer)


def _is_lab(mod: str) -> bool:
    return bool(LAB_PARTS & set(mod.split(".")[1:]))


def _product_imports_of_the_lab(graph) -> list:
    return [f"{m} -> {d}" for m, deps in sorted(graph.items()) if not _is_lab(m) for d in sorted(deps) if _is_lab(d)]


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _longest_chain(graph, among) -> list:
    """The longest import chain (a list of modules, importer first) that stays inside ``among``; an edge
    back into the chain (a cycle, which its own test reports) ends the chain there."""
    memo = {}

    def chain(m, on_path):
        if m in memo:
            return memo[m]
        best = [m]
        for d in sorted(graph.get(m, ())):
            if d in among and d not in on_path:
                c = [m] + chain(d, on_path | {d})
                if len(c) > len(best):
                    best = c
        memo[m] = best
        return best

    return max((chain(m, {m}) for m in sorted(among)), key=len, default=[])


def _product_of(graph, backend: str) -> set:
    """A backend's product modules: all but its lab, its package facade (``__init__``) and ``__main__``."""
    return {
        m
        for m in graph
        if m.split(".")[0] == backend and m != backend and not _is_lab(m) and not m.endswith(".__main__")
    }


def test_no_import_points_up_a_layer_and_backends_never_import_each_other():
    graph = _import_graph()
    assert {m.split(".")[0] for m in graph} == set().union(*LAYERS)
    bad = [
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if _layer(d) > _layer(m) or (_layer(d) == _layer(m) == 1 and d.split(".")[0] != m.split(".")[0])
    ]
    assert not bad, bad


def test_the_product_never_imports_the_lab():
    bad = _product_imports_of_the_lab(_import_graph())
    assert not bad, bad


def test_the_lab_rule_finds_a_product_module_importing_the_lab():
    graph = {
        "p.kernel": {"p.lab.bench"},
        "p.lab.bench": {"p.kernel"},
        "q.studies.profile": {"q.suite"},
        "q.suite": {"q.studies.stall"},
        "q.studies.stall": set(),
        "q.lab": set(),
        "q.cli": {"q.lab"},
    }
    assert _product_imports_of_the_lab(graph) == [
        "p.kernel -> p.lab.bench",
        "q.cli -> q.lab",
        "q.suite -> q.studies.stall",
    ]


def test_the_import_graph_has_no_cycle():
    assert not _cycles(_import_graph())


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_reader_reads_importlib_and_dunder_import_literals():
    sources = {
        "p": (True, ""),
        "p.a": (False, "import importlib\ndef f():\n    return importlib.import_module('p.b').g\n"),
        "p.b": (False, "def g():\n    return __import__('p.c')\n"),
        "p.c": (False, "from importlib import import_module\nimport_module('p.a')\n"),
        "p.d": (False, "import importlib\nname = 'p.a'\nimportlib.import_module(name)\n"),
    }
    graph = _graph_of(sources)
    assert graph == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": set()}
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_the_import_reader_resolves_relative_imports():
    sources = {
        "p": (True, "from .x import y\n"),
        "p.x": (True, "from . import y\nfrom .y import Thing\n"),
        "p.x.y": (False, "from ..z import *\n"),
        "p.z": (False, ""),
    }
    assert _graph_of(sources) == {"p": {"p.x.y"}, "p.x": {"p.x.y"}, "p.x.y": {"p.z"}, "p.z": set()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_longest_import_chain_in_a_backends_product_is_short(backend):
    graph = _import_graph()
    chain = _longest_chain(graph, _product_of(graph, backend))
    assert len(chain) <= MAX_CHAIN, (
        f"{backend}'s product imports {len(chain)} modules deep (at most {MAX_CHAIN}): " + " -> ".join(chain)
    )


def test_the_chain_finder_finds_the_longest_chain():
    graph = {"a": {"b", "x"}, "b": {"c"}, "c": {"d", "a"}, "d": {"lab"}, "x": set(), "lab": {"a"}}
    assert _longest_chain(graph, {"a", "b", "c", "d", "x"}) == ["a", "b", "c", "d"]
    assert len(_longest_chain(graph, {"a", "b", "c", "d", "x", "lab"})) == 5
    assert _longest_chain({}, set()) == []


def test_the_product_splits_its_backends_from_their_labs():
    graph = {"k": set(), "k.gemm": set(), "k.lab.bench": set(), "k.lab": set(), "k.__main__": set(), "j.plan": set()}
    assert _product_of(graph, "k") == {"k.gemm"}


def _over_the_line_limit(modules) -> dict:
    """product module -> its line count, for those over :data:`MAX_LINES`; the lab is exempt."""
    counts = {m: len(path.read_text().splitlines()) for m, path in modules.items() if not _is_lab(m)}
    return {m: n for m, n in counts.items() if n > MAX_LINES}


def test_no_product_module_is_over_the_line_limit():
    long = _over_the_line_limit(_modules())
    assert not long, long


def test_the_line_limit_binds_the_product_and_exempts_the_lab(tmp_path):
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n" * MAX_LINES)
    mods = {"p.kernel": long, "p.ok": short, "p.lab.bench": long, "p.studies.x": long}
    assert _over_the_line_limit(mods) == {"p.kernel": MAX_LINES + 1}

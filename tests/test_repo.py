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


#: The three layers, lowest first. A module may import its own layer's package or a lower layer,
#: never a higher one; the two backends share a layer and never import each other.
LAYERS = ({"moe_spec"}, {"cute_moe", "triton_moe"}, {"compare"})
MAX_LINES = 450


def _modules():
    mods = {}
    for layer in LAYERS:
        for pkg in layer:
            for path in sorted((ROOT / pkg).rglob("*.py")):
                name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                mods[name.removesuffix(".__init__")] = path
    return mods


def _import_graph():
    """module -> the project modules it imports (``from a import b`` counts as a.b when that is a module)."""
    mods = _modules()

    def owner(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in mods.items():
        deps = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".")[: len(mod.split(".")) - node.level + is_pkg]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            deps |= {owner(n) for n in names} - {"", mod}
        graph[mod] = deps
    return graph


def _layer(mod):
    return next(i for i, layer in enumerate(LAYERS) if mod.split(".")[0] in layer)


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
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
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_points_up_a_layer_and_backends_never_import_each_other():
    graph = _import_graph()
    assert {m.split(".")[0] for m in graph} == set().union(*LAYERS)
    bad = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
           if _layer(d) > _layer(m) or (_layer(d) == _layer(m) == 1 and d.split(".")[0] != m.split(".")[0])]
    assert not bad, bad


def test_the_import_graph_has_no_cycle():
    assert not _cycles(_import_graph())


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long

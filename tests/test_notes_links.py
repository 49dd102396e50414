"""Every relative link in notes/*.md and README.md points at a file that exists, and every #anchor at
a heading of its target (GitHub's heading slugs); the notes index is one table per section."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "notes").glob("*.md")) + [ROOT / "README.md"]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
    found, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return found


def links(path: pathlib.Path) -> list:
    return [m.group(1) for m in LINK.finditer(_prose(path.read_text()))]


def broken(path: pathlib.Path) -> list:
    """The links of ``path`` that point nowhere, each with the reason."""
    bad = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: — not ours to resolve
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file) if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n\n## Section (two), `code`\n\n## Section (two), `code`\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#section-two-code) [ok](a.md#section-two-code-1) [gone](missing.md) "
        "[bad](a.md#nope) [self](#top) `[code](not-a-link.md)` [web](https://example.com/x.md)\n\n"
        "```\n[fenced](also-not-a-link.md)\n```\n\n# Top\n"
    )
    assert broken(page) == ["missing.md: no such file", "a.md#nope: no heading with that anchor"]


def test_the_notes_index_is_one_table_per_section():
    # a blank line inside a markdown table ends it: the rows after it render without a header
    sections = re.split(r"^## ", (ROOT / "notes" / "README.md").read_text(), flags=re.M)
    for section in sections:
        lines = section.splitlines()
        table = [i for i, line in enumerate(lines) if line.startswith("|")]
        if table:
            assert table == list(range(table[0], table[-1] + 1)), "a table of notes/README.md is split"
            assert re.match(r"\|(\s*-+\s*\|)+$", lines[table[0] + 1]), "the table's second line is not its rule"


def test_the_index_lists_every_page_and_every_result():
    index = (ROOT / "notes" / "README.md").read_text()
    for page in (ROOT / "notes").glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, page.name
    for result in (ROOT / "notes" / "results").glob("*.md"):
        assert f"](results/{result.name})" in index, result.name


OWN = ("cute_moe", "triton_moe", "compare", "moe_spec", "tests", "notes", "course", ".ci")


def missing_names(page: pathlib.Path) -> list:
    """The repository files and ``python -m`` modules a page names in code spans that do not exist:
    a path under one of the project's folders, a bare ``name.py`` (some file of that name), a module."""
    text = page.read_text()
    files = {p.name for top in OWN for p in (ROOT / top).rglob("*.py")}
    bad, own_path = [], re.compile(r"(?<![\w./])((?:" + "|".join(map(re.escape, OWN)) + r")/[\w./=,-]*\w)")
    for span in re.findall(r"`([^`\n]+)`", text):
        for path in own_path.findall(span):
            if "*" not in path and "<" not in span and not (ROOT / path).exists():  # not a pattern
                bad.append(path)
        if re.fullmatch(r"\w+\.py", span) and span not in files:
            bad.append(span)
        for module in re.findall(r"python3? -m ((?:cute_moe|triton_moe|compare|moe_spec)[\w.]*)", span):
            base = ROOT.joinpath(*module.split("."))
            if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
                bad.append(f"python -m {module}")
    return bad


#: The pages that teach today's code (the log is history, and the results index keeps each command
#: as it was run).
CURRENT = [p for p in PAGES if p.name != "log.md" and p != ROOT / "notes" / "README.md"]


@pytest.mark.parametrize("page", CURRENT, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_and_modules_exist(page):
    assert missing_names(page) == []


def test_the_name_checker_finds_a_moved_file(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "`cute_moe/gemm.py` `cute_moe/nowhere.py` `gemm.py` `nowhere.py` "
        "`python -m compare` `python -m cute_moe.nowhere --x` `examples/elsewhere.py`\n"
    )
    assert missing_names(page) == ["cute_moe/nowhere.py", "nowhere.py", "python -m cute_moe.nowhere"]

"""The docs a new user reads first (README.md, docs/**/*.md): every relative link and every
file named in the text exists, every ``#anchor`` into a Markdown file names one of its headings,
and no table is cut in two by a blank line (issue 31, "the first hour"). Reads files only."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: [text](target "title"): the target
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: a Markdown file named in plain text or code: docs/deploy.md, ../usage.md, reference/x.md
NAMED = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)*[\w][\w./-]*\.md)\b")
ROW = re.compile(r"^\s*\|")
SEPARATOR = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence:
            out.append((n, line))
    return out


@cache
def _anchors(path: Path) -> frozenset[str]:
    return frozenset(_slug(line.lstrip("#")) for _, line in _prose(path)
                     if line.startswith("#"))


def link_problems(doc: Path) -> list[str]:
    """Broken relative links, anchors and named .md files of one document."""
    text, rel = doc.read_text(), doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    problems = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-zA-Z][a-zA-Z+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            problems.append(f"{rel}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{rel}: link to {target}: no heading with that anchor")
    for m in NAMED.finditer(LINK.sub("", text)):
        name = m.group(1)
        if not ((doc.parent / name).exists() or (ROOT / name).exists()):
            problems.append(f"{rel}: names {name}, which exists neither next to it nor at the "
                            "repository root")
    return problems


def table_problems(doc: Path) -> list[str]:
    """Tables cut in two: rows after a blank line that follows a row, with no header of their
    own (Markdown then shows them as a paragraph of pipes)."""
    lines = _prose(doc)
    problems = []
    for i in range(2, len(lines)):
        (n, line), (_, blank), (_, before) = lines[i], lines[i - 1], lines[i - 2]
        after = lines[i + 1][1] if i + 1 < len(lines) else ""
        if ROW.match(line) and not blank.strip() and ROW.match(before) \
                and not SEPARATOR.match(after):
            problems.append(f"{doc.name}:{n}: a table row after a blank line, with no header: "
                            "the blank line splits the table")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_named_files_exist(doc: Path) -> None:
    assert link_problems(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_table_is_split_by_a_blank_line(doc: Path) -> None:
    assert table_problems(doc) == []


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading, `with` code\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md#a-heading-with-code) [web](https://example.com/x.md)\n"
                   "[gone](missing.md) [bad anchor](there.md#nope)\n"
                   "```\npip install x   # see reference/cpu-recipes.md\n```\n"
                   "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n\n"
                   "| c |\n|---|\n| 5 |\n")
    assert link_problems(doc) == [
        f"{doc}: link to missing.md: no such file",
        f"{doc}: link to there.md#nope: no heading with that anchor",
        f"{doc}: names reference/cpu-recipes.md, which exists neither next to it nor at the "
        "repository root"]
    assert table_problems(doc) == [
        "doc.md:10: a table row after a blank line, with no header: the blank line splits "
        "the table"]

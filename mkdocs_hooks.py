"""mkdocs hooks for the docs site (mkdocs.yml: ``hooks``). Build: ``mkdocs build --strict``.

- The home page is the repository's README.md, generated as ``index.md`` at build time (no copy
  to keep in step): its links into ``docs/`` become site links.
- A link from a page to a file outside ``docs/`` (``../kvbridge/x.py``, ``../README.md``) cannot
  be a site page; it becomes a link to that file in the repository (``repo_url``), or plain code
  naming the path when no ``repo_url`` is set. Links inside ``docs/`` stay, and ``--strict``
  fails on any that do not resolve.
- Heading anchors are GitHub's (``pymdownx.slugs``), so the ``#anchor`` links that GitHub and
  ``tests/unit/test_docs.py`` check are the ones the site has.

Not part of the kvbridge package; imported by mkdocs only.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

#: [text](target "title"): text, target, the rest
LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)((?:\s+\"[^\"]*\")?)\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z+.-]*:")
ROOT = Path(__file__).resolve().parent


def on_config(config: Any) -> Any:
    from pymdownx.slugs import slugify

    config.mdx_configs.setdefault("toc", {}).setdefault("slugify", slugify(case="lower"))
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    if files.get_file_from_path("index.md") is None:
        files.append(File.generated(config, "index.md", content=_readme(config)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Links that leave docs/ point at the repository instead."""
    src = page.file.src_uri
    if src == "index.md" and page.file.generated_by:
        return markdown  # the README: rewritten in _readme already
    return _outside_links(markdown, posixpath.dirname(src), config)


def _readme(config: Any) -> str:
    # README's links are relative to the repository root: those outside docs/ first
    text = _outside_links((ROOT / "README.md").read_text(), "..", config)

    def sub(m: re.Match[str]) -> str:
        label, target, title = m.groups()
        path, hash_, anchor = target.partition("#")
        if SCHEME.match(target) or not path or not path.startswith("docs/"):
            return m.group(0)
        return f"{label}({path[len('docs/'):]}{hash_}{anchor}{title})"

    return LINK.sub(sub, text)  # docs/x.md -> x.md


def _outside_links(markdown: str, page_dir: str, config: Any) -> str:
    """Rewrite links whose target, relative to ``docs/<page_dir>``, lies outside docs/."""
    repo_url = (config.get("repo_url") or "").rstrip("/")
    branch = (config.get("extra") or {}).get("source_branch", "main")

    def sub(m: re.Match[str]) -> str:
        label, target, title = m.groups()
        path, hash_, anchor = target.partition("#")
        if SCHEME.match(target) or not path or target.startswith("/"):
            return m.group(0)
        in_repo = posixpath.normpath(posixpath.join("docs", page_dir, path))
        if in_repo == "docs" or in_repo.startswith("docs/"):
            return m.group(0)
        if in_repo.startswith("../"):
            return m.group(0)  # outside the repository: leave it to --strict to report
        if repo_url:
            kind = "tree" if (ROOT / in_repo).is_dir() else "blob"
            return f"{label}({repo_url}/{kind}/{branch}/{in_repo}{hash_}{anchor}{title})"
        text = label[1:-1] if label.startswith("[") else label[2:-1]
        return f"{text} (`{in_repo}`)"

    out, fence = [], False
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fence = not fence
        out.append(line if fence else LINK.sub(sub, line))
    return "".join(out)

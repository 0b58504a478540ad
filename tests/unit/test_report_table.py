"""kvbridge.tools.report.table: the one table printer, and its wrapped last column."""

from __future__ import annotations

import pytest

from kvbridge.tools.report import table

_LONG = ("offload tier 'lmcache' cannot load: No module named 'lmcache' — install: pip install "
         "--no-deps lmcache==0.5.6 sortedcontainers aiofile, after the CPU torch "
         "(docs/backends/lmcache.md)")


def test_without_width_nothing_wraps() -> None:
    lines = table(["check", "detail"], [("tier lmcache", _LONG)])
    assert len(lines) == 3 and lines[2].endswith("(docs/backends/lmcache.md)")
    assert table(["a", "b"], [("x", _LONG)], width=0) == table(["a", "b"], [("x", _LONG)])


@pytest.mark.parametrize("width", [60, 100])
def test_the_last_column_wraps_within_width_with_every_word_kept(width: int) -> None:
    rows = [("tier lmcache", "warn", _LONG), ("python", "ok", "Python 3.12")]
    lines = table(["check", "status", "detail"], rows, width=width)
    assert max(len(line) for line in lines) <= width
    assert lines[0].split() == ["check", "status", "detail"] and set(lines[1]) <= {"-", " "}
    indent = lines[0].index("detail")
    detail = [line[indent:] for line in lines[2:-1]]
    assert " ".join(detail).split() == _LONG.split()  # continuation lines hold the rest
    assert all(not line[:indent].strip() for line in lines[3:-1])  # under the detail column
    assert lines[-1].split() == ["python", "ok", "Python", "3.12"]


def test_narrow_width_keeps_20_characters_for_the_last_column() -> None:
    lines = table(["a-wide-first-column", "detail"], [("x", "word " * 20)], width=10)
    assert all(len(line) <= 21 + 20 for line in lines) and len(lines) > 3
    cut = table(["a", "b"], [("x", "y" * 50)], width=25)  # one word longer than the room
    assert [len(line) for line in cut[2:]] == [25, 25, 9]

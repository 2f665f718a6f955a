"""A figure shown on two pages is the same on both, and a table copied from a committed result is that
result. The docs include results' tables (`--8<-- "benchmarks/results/X.md"`); the README, which GitHub
renders without includes, copies some, and each copy is checked here:

- a table of a page (README.md, docs/) whose header row is a header row of a table in
  benchmarks/results/*.md holds only rows of that result's tables under that header, cell for cell;
- two pages' tables under the same header row give the same cells for the same row label (first
  cell): no page keeps an older run's figure of a row another page shows anew.

The figures quoted in prose are checked where they are quoted, by the tests of their results
(tests/benchmarks/, tests/invact/)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def tables(text: str) -> list[tuple[str, list[str]]]:
    """(header row, body rows) of each Markdown table outside code fences, rows as written (stripped)."""
    found, lines = [], _FENCE.sub("", text).splitlines()
    i = 0
    while i < len(lines) - 1:
        header, rule = lines[i].strip(), lines[i + 1].strip()
        if header.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", rule):
            body, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                body.append(lines[i].strip())
                i += 1
            found.append((header, body))
        else:
            i += 1
    return found


def _label(row: str) -> str:
    return row.strip("|").split("|")[0].strip()


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _source_rows() -> dict[str, dict[str, set[str]]]:
    """header row -> {result file -> its rows under that header}."""
    rows: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in RESULTS:
        for header, body in tables(path.read_text()):
            rows[header][_rel(path)].update(body)
    return rows


def test_tables_are_found_as_pages_write_them():
    text = "x\n| a | b |\n|---|---|\n| 1 | 2 |\n\n```text\n| c |\n|---|\n| 3 |\n```\n| d |\n|:-:|\n"
    assert tables(text) == [("| a | b |", ["| 1 | 2 |"]), ("| d |", [])]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_a_table_copied_from_a_result_is_the_result(page):
    sources = _source_rows()
    wrong = []
    for header, body in tables(page.read_text()):
        if header not in sources:
            continue
        known = set().union(*sources[header].values())
        wrong += [(row, sorted(sources[header])) for row in body if row not in known]
    assert not wrong, f"{_rel(page)}: rows that no result under their header holds: {wrong}"


def test_pages_show_a_rows_figures_alike():
    shown: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)  # (header, label) -> {page: row}
    for page in PAGES:
        for header, body in tables(page.read_text()):
            for row in body:
                shown[header, _label(row)].setdefault(_rel(page), row)
    differ = {key: rows for key, rows in shown.items() if len(set(rows.values())) > 1}
    assert not differ, f"the same row differs between pages: {differ}"

"""The docs' links hold: every relative link in README.md and docs/*.md names a file that
exists, every file under docs/benchmarks/ is linked from one of those pages, and
docs/benchmarks.md stays a results page (the full notebook of runs is in git).

Text only: no network, no model.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCHMARKS = DOCS / "benchmarks"
RESULTS_PAGE = DOCS / "benchmarks.md"
MAX_RESULTS_LINES = 600

# [text](target) and ![alt](target), with an optional "title"; link text may hold code.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _targets(page: Path) -> list[str]:
    """The relative targets of a page's links, anchors stripped, outside code."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    targets = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def _linked() -> set[Path]:
    return {(page.parent / t).resolve() for page in _pages() for t in _targets(page)}


def test_link_pattern_reads_the_forms_the_docs_use() -> None:
    text = "[a](x.md#y) ![plot](b/c.png) [`j`](b/d.json) [w](https://e.org) [h](#top)"
    found = [m.group(1) for m in LINK.finditer(text)]
    assert found == ["x.md#y", "b/c.png", "b/d.json", "https://e.org", "#top"]


def test_every_relative_link_names_an_existing_file() -> None:
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in _pages()
        for target in _targets(page)
        if not (page.parent / target).exists()
    ]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_every_benchmark_file_is_linked_from_a_page() -> None:
    files = sorted(p for p in BENCHMARKS.rglob("*") if p.is_file())
    assert files, f"{BENCHMARKS} holds no files"
    linked = _linked()
    orphans = [str(p.relative_to(ROOT)) for p in files if p.resolve() not in linked]
    assert not orphans, (
        "files under docs/benchmarks/ no page links (link them from docs/benchmarks.md or "
        "delete them; their history stays in git):\n" + "\n".join(orphans))


def test_results_page_stays_short() -> None:
    lines = RESULTS_PAGE.read_text(encoding="utf-8").count("\n")
    assert lines < MAX_RESULTS_LINES, (
        f"docs/benchmarks.md has {lines} lines: keep the latest result per benchmark and "
        "machine there, and the history in git")

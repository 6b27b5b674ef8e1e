"""Every relative link in the README and docs/ resolves: the file exists, and an ``#anchor`` names a
heading of that page (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, a repeated
heading numbered -1, -2, ...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def slugs(text: str) -> set[str]:
    """The anchors of a page's headings (none from inside code blocks)."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCED.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        repeats = counts.get(slug, 0)
        counts[slug] = repeats + 1
        found.add(slug if repeats == 0 else f"{slug}-{repeats}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest.read_text()):
            broken.append(f"{target}: no such heading in {dest.name}")
    assert broken == []

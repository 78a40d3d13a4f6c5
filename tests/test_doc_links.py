"""Every relative link in the README and docs/ points at a file that exists, and every #anchor
at a heading of that file (GitHub's slugs), so moving text between the guides and the design
cannot leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    dead = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        missing = not path.exists()
        if missing or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            dead.append(target)
    assert not dead, f"{doc.relative_to(ROOT)}: dead links {dead}"


def test_slug_follows_github():
    assert slug("Processes: front end ↔ engine core ↔ TP workers") == (
        "processes-front-end--engine-core--tp-workers"
    )
    assert slug("Shadow mode: the kernels checked inside the engine") == (
        "shadow-mode-the-kernels-checked-inside-the-engine"
    )

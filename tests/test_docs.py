"""The docs a newcomer reads: README.md (short, the quick start near the top, a map of docs/)
and docs/*.md. Every relative link resolves: to a file or folder inside the repository and,
with an anchor into a Markdown file, to one of its headings (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 300
QUICK_START_BY_LINE = 60

#: [text](target) outside code; an image's ![alt](target) too. Targets have no spaces here.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are code)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"`", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in md.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(md: Path, root: Path = REPO) -> list[str]:
    bad = []
    for target in LINK.findall(prose(md.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        try:
            dest.relative_to(root)
        except ValueError:
            bad.append(f"{target}: outside the repository")
            continue
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return bad


@pytest.mark.parametrize("md", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(md):
    assert broken_links(md) == []


def test_readme_is_short_with_the_quick_start_near_the_top():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, len(lines)
    heads = [i for i, line in enumerate(lines, 1) if re.match(r"^#{1,3}\s+Quick start\b", line)]
    assert heads and heads[0] <= QUICK_START_BY_LINE, heads


def test_readme_maps_every_doc():
    text = README.read_text()
    assert DOCS, "docs/ is empty"
    missing = [p.name for p in DOCS if f"](docs/{p.name})" not in text]
    assert missing == []


def test_the_checker_catches_what_it_should(tmp_path):
    """A missing file, a missing anchor and a link out of the root are each caught; code,
    external links, folders and good anchors are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Two words\n")
    md = tmp_path / "docs" / "a.md"
    md.write_text("# Top\n\n## A `b`: c\n\n[ok](#a-b-c) [ok](#top) [web](https://x.y/z)\n"
                  "`[code](nowhere.md)` [ok](b.md#two-words) [ok](../docs/)\n"
                  "```\n[code](nowhere.md)\n```\n"
                  "[bad](b.md#three) [bad](missing.md) [bad](#gone) [bad](../../x.md)\n")
    bad = broken_links(md, root=tmp_path)
    assert [b.split(": ")[0] for b in bad] == ["b.md#three", "missing.md", "#gone", "../../x.md"]
    assert "outside the repository" in bad[-1]

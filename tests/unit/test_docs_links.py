"""Every relative link and `#anchor` in the README and docs/*.md leads somewhere: the file exists,
and the anchor is the GitHub slug of a heading in the target file."""

import re
from pathlib import Path

import pytest

from tests.support import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The Markdown outside fenced code blocks, where links and headings are what they seem."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces to hyphens
    (github-slugger, which github.com uses: keeps letters, digits, `_` and `-`)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; repeated headings get `-1`, `-2`, … as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    """The targets of a page's inline links and images, outside code."""
    return LINK.findall(CODE_SPAN.sub("", prose(page.read_text())))


def test_slugs_follow_github():
    assert slug("Pipeline stages over `mx.distributed` (issue 16)") == "pipeline-stages-over-mxdistributed-issue-16"
    assert slug("Where a decode step's time goes") == "where-a-decode-steps-time-goes"
    assert slug("Long prompts: chunks on a staging cache") == "long-prompts-chunks-on-a-staging-cache"
    assert slug("stepserve against mlx_lm.server") == "stepserve-against-mlx_lmserver"


def broken_links(page: Path) -> list[str]:
    """Each relative link of a page whose file is missing, or whose anchor names no heading there."""
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading {anchor!r} in {dest.name}")
    return broken


def test_links_and_headings_in_code_do_not_count_and_broken_ones_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Part `one`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Two words\n\n```md\n# Not a heading\n[in code](nowhere.md)\n```\n"
        "[a](#two-words) [b](other.md#part-one) `[c](d.md)` [d](https://example.com/x.md)\n"
        "[e](#title-1) [f](missing.md) [g](other.md#two-words)\n"
    )
    assert anchors(page) == {"title", "two-words"}
    assert links(page) == [
        "#two-words",
        "other.md#part-one",
        "https://example.com/x.md",
        "#title-1",
        "missing.md",
        "other.md#two-words",
    ]
    assert broken_links(page) == [
        "#title-1: no heading 'title-1' in page.md",
        "missing.md: no such file",
        "other.md#two-words: no heading 'two-words' in other.md",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: " + "; ".join(broken_links(page))

"""Every relative link in README.md and docs/*.md reaches something: its file or folder exists,
and its `#anchor` names a heading of the Markdown file it points to, by GitHub's rule (the
heading's text lowercased, punctuation but `-` and `_` dropped, spaces made `-`, a repeated
heading numbered `-1`, `-2`, ...). Links inside code are not links; web addresses are not
checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[`~]*[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$", re.M)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def _without_code(text: str) -> str:
    """`text` with fenced blocks and code spans blanked, lines kept where they were."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text."""
    text = _INLINE_LINK.sub(r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown document's headings (those inside code blocks are not headings)."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    seen: dict[str, int] = {}
    found: set[str] = set()
    for match in _HEADING.finditer(text):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(doc: Path) -> list[str]:
    """Each relative link of `doc` that reaches nothing, with its line."""
    text = doc.read_text()
    prose = _without_code(text)
    broken = []
    for match in _LINK.finditer(prose):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        path, _, anchor = target.partition("#")
        where = doc.parent / path if path else doc
        line = prose.count("\n", 0, match.start()) + 1
        if not where.exists():
            broken.append(f"{doc.name}:{line}: {target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where.read_text()):
            broken.append(f"{doc.name}:{line}: {target}: no heading #{anchor} in {where.name}")
    return broken


def test_a_heading_anchor_follows_githubs_rule():
    assert slug("Stop on SIGTERM (bench/stop_on_sigterm.py)") == "stop-on-sigterm-benchstop_on_sigtermpy"
    assert slug("Users' code: the task path, A/B") == "users-code-the-task-path-ab"
    assert slug("Fault benchmark (hybridtrain bench faults --aggregate-at-sites)") == (
        "fault-benchmark-hybridtrain-bench-faults---aggregate-at-sites"
    )
    assert slug("The trainer (`trainer/`)") == "the-trainer-trainer"
    assert slug("See [the API](api.md) · now") == "see-the-api--now"


def test_a_repeated_heading_is_numbered_and_a_heading_in_code_is_not_one():
    text = "# Setup\n\n## Setup\n\n```sh\n# not a heading\n```\n"
    assert anchors(text) == {"setup", "setup-1"}


def test_a_missing_file_or_heading_is_reported_and_code_and_web_links_are_not(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other\n\n## Its part\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md#its-part) [self](#doc) [web](https://example.com/x#y)\n"
        "`[code](nowhere.md)`\n\n[gone](gone.md) [stale](other.md#old-part) [self](#nope)\n"
    )
    assert broken_links(doc) == [
        "doc.md:6: gone.md: no such file",
        "doc.md:6: other.md#old-part: no heading #old-part in other.md",
        "doc.md:6: #nope: no heading #nope in doc.md",
    ]


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_of_the_docs_reaches_its_file_and_heading(doc: str):
    assert broken_links(ROOT / doc) == []

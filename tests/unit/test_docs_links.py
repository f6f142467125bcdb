"""The documents' links land: every relative Markdown link names a file of the checkout, and every
``#anchor`` names a heading of its target, spelled as GitHub spells heading anchors.

Also the splits of the long documents: ``docs/policies.md`` is the reference and holds no dated
study; ``docs/policy-studies.md`` holds the studies ("### Part N: title (date)", appended at its end)
and its table of contents lists every one of them, in order. ``docs/benchmark-history.md`` holds
issue #16's rounds (a new one right before "Older figures", its last section) and lists them all.
``docs/loadtest.md`` is the reference with the current headline first; ``docs/loadtest-history.md``
holds the headlines it replaced and the dated studies, oldest first, and lists them all.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SKIPPED_DIRS = {"node_modules", "__pycache__", "build", "dist", "out", "loadtest-results", "_proto"}
"""Folders of generated or third-party files, never the repository's own documents."""

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_PART = re.compile(r"^### Part (\d+): .+ \((\d{4}-\d{2}-\d{2})\)$", re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, every character but letters, digits, ``_``,
    ``-`` and spaces dropped (backticks, ``$``, ``:``, ``(``, ``×``, ``–`` …), spaces become ``-``."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in "_- ")
    return kept.replace(" ", "-")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of the text outside fenced code blocks (CommonMark: a fence closes
    only on a line of the same character, at least as long, with nothing after it)."""
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if not fence:
            if match:
                fence = match.group(1)
            else:
                yield number, line
        elif match and match.group(1).startswith(fence) and not match.group(2).strip():
            fence = ""


def anchors(text: str) -> set[str]:
    """Every heading anchor of a document, repeated headings numbered ``-1``, ``-2`` as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, target)`` of each inline link outside code (fenced or inline), images too."""
    for number, line in prose_lines(text):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            yield number, match.group("target")


def broken_links(relpath: str, text: str, root: Path = ROOT) -> list[str]:
    """The links of ``relpath`` (repository-relative) whose file or anchor is missing."""
    found = []
    folder = (root / relpath).parent
    for number, target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:  # a heading of this document
            if anchor not in anchors(text):
                found.append(f"{relpath}:{number}: {target} (no such heading)")
            continue
        destination = (folder / path).resolve()
        if not destination.exists():
            found.append(f"{relpath}:{number}: {target} (no such file)")
            continue
        if anchor and destination.suffix == ".md" and anchor not in anchors(destination.read_text("utf-8")):
            found.append(f"{relpath}:{number}: {target} (no such heading)")
    return found


def markdown_files(root: Path = ROOT) -> list[Path]:
    return sorted(
        path
        for path in root.rglob("*.md")
        if not any(part.startswith(".") or part in SKIPPED_DIRS for part in path.relative_to(root).parts[:-1])
    )


def test_every_relative_link_and_anchor_of_the_documents_lands() -> None:
    files = markdown_files()
    assert ROOT / "docs" / "policies.md" in files
    found = [
        finding
        for path in files
        for finding in broken_links(path.relative_to(ROOT).as_posix(), path.read_text("utf-8"))
    ]
    assert not found, "\n".join(found)


def swallowed_headings(text: str) -> list[int]:
    """Lines that look like section headings (``##`` or deeper) inside a fenced code block: the mark
    of a fence left open, which turns the sections after it into code."""
    prose = {number for number, _ in prose_lines(text)}
    return [
        number
        for number, line in enumerate(text.splitlines(), 1)
        if number not in prose and re.match(r"^#{2,6} \S", line)
    ]


def test_no_document_leaves_a_code_block_open() -> None:
    found = {
        path.relative_to(ROOT).as_posix(): lines
        for path in markdown_files()
        if (lines := swallowed_headings(path.read_text("utf-8")))
    }
    assert not found, found
    assert swallowed_headings("## A\n```bash\nx\n\n## B\n```\n## C\n") == [5]


def test_slugs_follow_githubs_rule() -> None:
    assert (
        slug("Part 24: the default becomes `$RC` (2026-11-29)") == "part-24-the-default-becomes-rc-2026-11-29"
    )
    assert (
        slug("Part 5: `overlap_credit` 2 as the default? (2026-11-28)")
        == "part-5-overlap_credit-2-as-the-default-2026-11-28"
    )
    assert (
        slug("Shared contexts bigger than one replica: the guard")
        == "shared-contexts-bigger-than-one-replica-the-guard"
    )
    assert slug("`agent` × 3 – a b") == "agent--3--a-b"  # dropped characters leave their spaces
    assert slug("What-if: replaying recent traffic") == "what-if-replaying-recent-traffic"


def test_the_checker_finds_missing_files_and_headings(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Part 1: x (2026-01-01)\n\n## Same\n\n## Same\n")
    text = "\n".join(
        [
            "[ok](b.md) [ok](b.md#part-1-x-2026-01-01) [ok](b.md#same-1) [ok](#a) [web](https://x/y#z)",
            "# A",
            "[gone](c.md) [no heading](b.md#part-2) [third](b.md#same-2) [here](#b)",
            "`[in code](c.md)`",
            "```bash",
            "[in a fence](c.md)",
            "```bash",
            "[still in the fence: an info string does not close it](c.md)",
            "```",
            "[after the fence](d.md)",
        ]
    )
    found = broken_links("docs/a.md", text, root=tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == [
        "c.md (no such file)",
        "b.md#part-2 (no such heading)",
        "b.md#same-2 (no such heading)",
        "#b (no such heading)",
        "d.md (no such file)",
    ]
    assert all(f.startswith("docs/a.md:3: ") for f in found[:-1]) and found[-1].startswith("docs/a.md:10: ")


def test_policies_md_is_the_reference_and_the_studies_have_their_own_file() -> None:
    """A dated study goes at the end of docs/policy-studies.md, with a line in its table of contents;
    docs/policies.md keeps no "### Part N" section (move one there, and fix the links)."""
    reference = (DOCS / "policies.md").read_text("utf-8")
    assert not _PART.findall(reference), (
        "a dated study in docs/policies.md: move it to docs/policy-studies.md"
    )
    studies = (DOCS / "policy-studies.md").read_text("utf-8")
    parts = [int(n) for n, _ in _PART.findall(studies)]
    assert parts == sorted(parts) and len(parts) == len(set(parts)), parts
    assert parts[0] == 4 and len(parts) >= 26, parts
    contents = studies.split("\n## ", 2)[1]  # the first "##" section: the table of contents
    listed = [int(n) for n in re.findall(r"^\| \[Part (\d+)\]\(#part-\d+-", contents, re.MULTILINE)]
    assert listed == parts, (listed, parts)
    last_section = [line for _, line in prose_lines(studies) if re.match(r"#{1,3} ", line)][-1]
    assert last_section.startswith(f"### Part {parts[-1]}: "), "new studies are appended at the end"


def test_the_benchmark_history_lists_every_round_and_ends_with_the_older_figures() -> None:
    """A new round of docs/benchmark-history.md goes right before "Older figures", with a line in the
    contents; docs/benchmarks.md keeps the commands and the latest figures."""
    history = (DOCS / "benchmark-history.md").read_text("utf-8")
    sections = [line[4:] for _, line in prose_lines(history) if line.startswith("### ")]
    assert sections[-1].startswith("Older figures (2026-11-22"), sections[-1]
    contents = history.split("\n## ", 2)[1]
    listed = re.findall(r"^\| \[(.+?)\]\(#([^)]+)\) \| \S.* \|$", contents, re.MULTILINE)
    assert [title for title, _ in listed] == sections
    assert [anchor for _, anchor in listed] == [slug(s) for s in sections]
    reference = (DOCS / "benchmarks.md").read_text("utf-8")
    assert not any(line.startswith("### Cheaper requests") for _, line in prose_lines(reference))


_STALE = re.compile(
    r"(?<![\w-])(?:policies\.md\W{0,4}(?:Parts? \d|Against the oracle)|benchmarks\.md\W{0,4}[Rr]ound \d"
    r"|loadtest\.md\W{0,4}(?:\d{4}-\d\d-\d\d|Headline(?!\")|Figures|Earlier figures|After the policy-input"
    r"|The other workloads|Confirmation on the emulated|Agreement|Where the fleet|The followers|Lost entries"
    r"|Receipts and the no-events|Two fleet-only))"
)
"""A study named in the file it left: docs/policies.md's Parts, docs/benchmarks.md's rounds and
docs/loadtest.md's dated sections (its superseded headlines and studies, by name or by date) moved."""


def stale_references(text: str) -> list[int]:
    return [number for number, line in enumerate(text.splitlines(), 1) if _STALE.search(line)]


def test_studies_and_rounds_are_named_where_they_are() -> None:
    suffixes = {".py", ".md", ".js", ".proto", ".yaml", ".yml"}
    found = {
        path.relative_to(ROOT).as_posix(): lines
        for path in sorted(ROOT.rglob("*"))
        if path.suffix in suffixes
        and path.is_file()
        and path != Path(__file__).resolve()
        and not any(
            part.startswith(".") or part in SKIPPED_DIRS for part in path.relative_to(ROOT).parts[:-1]
        )
        and (lines := stale_references(path.read_text("utf-8", errors="replace")))
    }
    assert not found, (
        f"write docs/policy-studies.md, docs/benchmark-history.md or docs/loadtest-history.md: {found}"
    )
    assert stale_references('see docs/policies.md "Part 24"\nround 8 (docs/benchmarks.md, round 8)') == [1, 2]
    assert not stale_references('docs/policy-studies.md "Part 24"; docs/benchmark-history.md, round 8')
    moved = [
        '(docs/loadtest.md, "Where the fleet and the simulator part")',
        "docs/loadtest.md, 2026-11-29, items 5-6",
        'docs/loadtest.md "Headline: capacity at the SLO"',
        '(`docs/loadtest.md`, "Agreement re-measured")',
    ]
    assert stale_references("\n".join(moved)) == [1, 2, 3, 4]
    assert not stale_references(
        'docs/loadtest.md "Headline"; docs/loadtest.md, "The client\'s send lag"; '
        'docs/loadtest-history.md, "Where the fleet and the simulator part", 2026-11-29'
    )


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def headings(text: str) -> list[tuple[int, str]]:
    """``(level, title)`` of each ``##`` to ``######`` heading outside code."""
    found = []
    for _, line in prose_lines(text):
        match = _HEADING.match(line)
        if match and len(match.group(1)) >= 2:
            found.append((len(match.group(1)), match.group(2)))
    return found


def test_loadtest_md_is_the_reference_with_the_current_headline_first() -> None:
    """docs/loadtest.md opens, after its intro, with "## Headline" (and its fixed-rate second table,
    issue #20); it has no other headline and no dated section: a headline a newer one replaces, and
    any dated study, go to docs/loadtest-history.md. The headline is at least as new as every section
    there."""
    reference = (DOCS / "loadtest.md").read_text("utf-8")
    found = headings(reference)
    assert found[0] == (2, "Headline"), found[:2]
    assert found[1] == (3, "Fixed-rate ratios (second table)"), found[:2]
    assert [title for _, title in found if "headline" in title.lower()] == ["Headline"]
    assert not [title for _, title in found if _DATE.search(title)], "a dated section in docs/loadtest.md"
    headline = reference.split("\n## Headline\n", 1)[1].split("\n## ", 1)[0]
    second_table = headline.split("\n### Fixed-rate ratios (second table)\n", 1)[1]
    assert "\n| workload" in second_table, "the fixed-rate ratios' table"
    assert "](loadtest-history.md#figures-of-the-current-code-" in second_table, "the link to its runs"
    history = (DOCS / "loadtest-history.md").read_text("utf-8")
    history_dates = [date for _, title in headings(history) for date in _DATE.findall(title)]
    dated = _DATE.search(headline.split("\n### ", 1)[0])
    assert dated and all(dated.group() >= date for date in history_dates), (dated, history_dates)
    assert not {title for _, title in found} & {title for _, title in headings(history)}


_CONTENTS_ROW = re.compile(
    r"^\| (?P<sub>↳ )?\[(?P<title>.+?)\]\(#(?P<anchor>[^)]+)\) "
    r"\| (?P<date>\d{4}-\d{2}-\d{2}) \| \S.* \| \S.* \|$",
    re.MULTILINE,
)


def test_the_loadtest_history_lists_every_section_oldest_first() -> None:
    """Every "##" section of docs/loadtest-history.md is dated in its heading and has a row in the
    contents, in order, oldest first; so has every dated deeper section (a follow-up kept under its
    section), marked "↳". Each row gives the heading's date, what it measured and what superseded it."""
    history = (DOCS / "loadtest-history.md").read_text("utf-8")
    found = headings(history)
    assert found[0] == (2, "Contents"), found[0]
    expected = [(level > 2, title) for level, title in found[1:] if level == 2 or _DATE.search(title)]
    contents = history.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    rows = list(_CONTENTS_ROW.finditer(contents))
    assert [(bool(row["sub"]), row["title"]) for row in rows] == expected
    assert [row["anchor"] for row in rows] == [slug(title) for _, title in expected]
    for row in rows:
        assert _DATE.findall(row["title"])[0] == row["date"], row["title"]
    top = [row["date"] for row in rows if not row["sub"]]
    assert top == sorted(top), "sections are oldest first; a new one goes at the end"
    assert len(top) >= 10

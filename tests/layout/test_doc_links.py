"""Every relative link of README.md and docs/**/*.md leads somewhere: the file (or folder) exists,
and an ``#anchor`` names a heading of the file it points into, slugged as GitHub slugs headings."""
from __future__ import annotations

import re
from pathlib import Path

from tests.layout.imports import REPO_ROOT

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code spans blanked unless ``keep_code``
    (a heading's code is part of its anchor)."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line if keep_code else re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text (links' text, no code marks or emphasis),
    lower case, punctuation dropped (word characters, spaces and hyphens stay), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(), keep_code=True):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(files: list[Path]) -> list[str]:
    broken = []
    for path in files:
        for number, line in prose_lines(path.read_text()):
            for target in LINK.findall(line):
                if EXTERNAL.match(target):
                    continue
                where = f"{path.relative_to(REPO_ROOT)}:{number}: {target}"
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                if not linked.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and linked.is_file() and anchor not in anchors(linked):
                    broken.append(f"{where} (no such heading)")
    return broken


def test_every_relative_link_leads_to_a_file_and_heading():
    assert broken_links(markdown_files()) == []


def test_the_checker_sees_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    import tests.layout.test_doc_links as checker

    monkeypatch.setattr(checker, "REPO_ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "jobs.md").write_text(
        "# The jobs\n\n## `freescale export` / `freescale/jobs/export.py` (the work)\n\n## Again\n\n## Again\n"
        "```\n## not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/jobs.md#freescale-export--freescalejobsexportpy-the-work) [ok](docs/jobs.md#again-1) "
        "[ok](#readme) [web](https://example.com/x.md) `[code](missing.md)`\n\n# Readme\n\n"
        "[gone](docs/missing.md) [stale](docs/jobs.md#freescale-export--jobsexportpy-the-work) "
        "[fenced](docs/jobs.md#not-a-heading) [self](#nowhere)\n")
    assert [line.split(": ", 1)[1] for line in broken_links(markdown_files())] == [
        "docs/missing.md (no such file)",
        "docs/jobs.md#freescale-export--jobsexportpy-the-work (no such heading)",
        "docs/jobs.md#not-a-heading (no such heading)",
        "#nowhere (no such heading)",
    ]

"""Every relative link in the repository's Markdown reaches a file of the checkout, and every `#anchor`
a heading of the file it names (GitHub's heading ids), so a reference page that moves a table to
`benchmarks/results/` cannot leave a reader at a dead link.
"""
from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a Markdown text outside its code fences (and not the fences)."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def heading_ids(text: str) -> set[str]:
    """GitHub's ids for a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens,
    the n-th repeat of an id suffixed `-n`; headings inside code fences are not headings."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        title = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def _markdown() -> list[str]:
    """The checkout's Markdown files (none outside a git checkout: the parametrized test is then skipped
    as an empty parameter set; this runs while pytest collects, where a skip would be an error)."""
    out = subprocess.run(["git", "ls-files", "--", "*.md"], cwd=ROOT, capture_output=True, text=True)
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()] if out.returncode == 0 else []


def dead_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of one Markdown file whose file (inside `root`) or heading does not exist."""
    dead = []
    ids: dict[Path, set[str]] = {}  # each linked file's headings, read once
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists() or root not in linked.parents and linked != root:
                dead.append(f"{number}: {target} (no such file)")
                continue
            if anchor and linked.suffix == ".md":
                if linked not in ids:
                    ids[linked] = heading_ids(linked.read_text(encoding="utf-8"))
                if anchor not in ids[linked]:
                    dead.append(f"{number}: {target} (no such heading)")
    return dead


def test_heading_ids_follow_github():
    text = ("# vLLM 0.33.0\n## Calibration → serving agreement\n## Tensor parallel (TP=2)\n"
            "```\n# not one\n```\n# vLLM 0.33.0\n")
    assert heading_ids(text) == {"vllm-0330", "calibration--serving-agreement", "tensor-parallel-tp2", "vllm-0330-1"}


def test_a_dead_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Here\n", encoding="utf-8")
    page.write_text("[a](other.md#here) [b](other.md#gone) [c](missing.md) [d](https://x.org/y)\n", encoding="utf-8")
    assert dead_links(page, tmp_path) == ["1: other.md#gone (no such heading)", "1: missing.md (no such file)"]


@pytest.mark.parametrize("name", _markdown())
def test_links_reach_their_target(name):
    assert not dead_links(ROOT / name), name

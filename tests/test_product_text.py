"""Product code speaks of the product: no work-session diary, no paths outside the repository.

Results are identified by date, device and commit, never by numbered work sessions, device loans
or carried files; the design is cited as docs/design.md, not as a file outside the checkout.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = {
    "a numbered work session": re.compile(r"\bsessions?\b(?!\")", re.IGNORECASE),
    "a device loan": re.compile(r"\blease[sd]?\b", re.IGNORECASE),
    "carried files": re.compile(r"devcarry|\.devmodel|\bcarr(y|ied|ies|ying)\b", re.IGNORECASE),
    "a numbered run": re.compile(r"\w_s\d+\b"),
    "a path outside the repository": re.compile(r"\.\./shared"),
    "the design outside the repository": re.compile(r"\bDESIGN §"),
}
CHECKED = ("*.py", "*.sh", "*.md", "*.yaml", "*.ipynb", "Makefile", "pyproject.toml")


def _files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", *CHECKED], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file() and f != "tests/test_product_text.py"]


@pytest.mark.parametrize("what", PATTERNS)
def test_no_diary_words(what):
    pattern = PATTERNS[what]
    hits = [f"{f}:{i}" for f in _files()
            for i, line in enumerate((ROOT / f).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if pattern.search(line.replace('scope="session"', ""))]
    assert not hits, f"{what}: " + ", ".join(hits)

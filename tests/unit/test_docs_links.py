"""The README stays short, and every relative link in it and in docs/ leads somewhere: to a file
that exists and, where the link names a heading (`page.md#heading`), to a heading of that page."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))
MAX_README_BYTES = 15_000

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE = re.compile(r"^```.*?^```|`[^`\n]*`", flags=re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.MULTILINE)


def _relative_links(page: Path) -> list[str]:
    """Link targets outside code, without web addresses and mail links."""
    text = _CODE.sub("", page.read_text())
    return [target for target in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(heading) for heading in _HEADING.findall(_CODE.sub("", page.read_text()))}


def test_the_readme_is_at_most_15000_bytes():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; move detail to docs/ (at most {MAX_README_BYTES})"


def test_the_readme_starts_with_the_two_commands():
    """Its first code block, after a paragraph saying what fsdp2nb is and the picture."""
    text = README.read_text()
    first_block = re.search(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert first_block.group(1) == "bash"
    assert [line.split()[:2] for line in first_block.group(2).splitlines()] == [["make", "demo"], ["make", "test"]]
    before = text[:first_block.start()]
    assert "](docs/dashboard.png)" in before and len(before.splitlines()) <= 12


def test_the_pages_have_links():
    assert len(_relative_links(README)) >= 5


@pytest.mark.parametrize(
    ("page", "target"),
    [(page, target) for page in PAGES for target in _relative_links(page)],
    ids=[f"{page.name}->{target}" for page in PAGES for target in _relative_links(page)],
)
def test_relative_link_resolves(page: Path, target: str):
    path, _, fragment = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
    if fragment and linked.suffix == ".md":
        assert fragment in _anchors(linked), f"{page.relative_to(ROOT)} links to {target}: no such heading"


def test_anchor_follows_github():
    assert _anchor("Pool, cells and set-up") == "pool-cells-and-set-up"
    assert _anchor("Measured on one H200 (`scripts/gpu_check.sh`)") == "measured-on-one-h200-scriptsgpu_checksh"

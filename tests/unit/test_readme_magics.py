"""Every `%%fsdp2` / `%fsdp2` line in the code blocks of the README and docs/ is one the magic
accepts: parsed by the extension's own argument parsers, as the magic parses it, without starting
a pool."""

import re
from pathlib import Path

import pytest

from fsdp2nb.frontend.magic_options import COMMANDS, cell_parser, line_parsers, split_magic_line

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))
_MAGIC_LINE = re.compile(r"^\s*(?:[\w, ]+=\s*)?(%%?fsdp2)\b(.*)$")


def _code_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


def readme_magic_lines(pages: tuple[Path, ...] = PAGES) -> list[tuple[str, str, str]]:
    """(the line as written, magic, the text after it) for each magic line in a code block."""
    found = []
    for block in (block for page in pages for block in _code_blocks(page.read_text())):
        for line in block.splitlines():
            match = _MAGIC_LINE.match(line)
            if match:
                found.append((line, match.group(1), match.group(2).strip()))
    return found


def test_the_readme_has_magic_examples():
    assert sum(magic == "%%fsdp2" for _, magic, _ in readme_magic_lines((README,))) >= 3


@pytest.mark.parametrize(("line", "magic", "arguments"), readme_magic_lines(),
                         ids=[line.strip() for line, _, _ in readme_magic_lines()])
def test_readme_magic_line_is_accepted(line, magic, arguments):
    words = split_magic_line(arguments)
    if magic == "%%fsdp2":
        cell_parser().parse_args(words)  # raises UsageError for what the magic would refuse
        return
    assert words and words[0] in COMMANDS, f"{line!r}: %fsdp2 takes one of {COMMANDS}"
    line_parsers()[words[0]].parse_args(words[1:])


def test_a_comment_after_the_options_is_not_an_argument():
    options = cell_parser().parse_args(split_magic_line("--cpu 2   # or --gpus 4"))
    assert options.cpu == 2 and options.gpus is None
    assert split_magic_line("pull x --rank 1 # from rank 1") == ["pull", "x", "--rank", "1"]
    assert split_magic_line("push '#tag'") == ["push", "#tag"]

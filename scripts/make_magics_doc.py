"""Write docs/magics.md, every `%%fsdp2` option and `%fsdp2` command, from the magics' own parsers.

    python scripts/make_magics_doc.py          # rewrite docs/magics.md
    python scripts/make_magics_doc.py --check  # exit 1 when docs/magics.md differs from the parsers

tests/unit/test_magics_doc.py runs the check, so a changed option shows up here or fails the test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp2nb.frontend.magic_options import COMMANDS, cell_parser, line_parsers

PAGE = Path(__file__).resolve().parent.parent / "docs" / "magics.md"
HEADER = """# The magics, option by option

Every option of `%%fsdp2` and every `%fsdp2` command with its arguments, as the magics parse them.
This page is written from the parsers by `scripts/make_magics_doc.py` (do not edit it by hand);
`tests/unit/test_magics_doc.py` fails when it differs from them. [Usage](usage.md) says what each
command does in full; `%fsdp2?` in a notebook shows examples.
"""


def _spelling(action: argparse.Action) -> str:
    """How an argument is written: `--gpus N|I,J,..`, `--bg`, `[NAME]`, `NAME...`."""
    if action.choices is not None:
        value = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        value = action.metavar or action.dest.upper()
    if action.nargs == "+":
        value = f"{value}..."
    elif action.nargs == "*":
        value = f"[{value}...]"
    if not action.option_strings:
        return f"[{value}]" if action.nargs == "?" else str(value)
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    return f"{flags} [{value}]" if action.nargs == "?" else f"{flags} {value}"


def _table_cell(text: str) -> str:
    """A pipe inside a table cell, code spans included, must be escaped or it splits the cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _meaning(action: argparse.Action) -> str:
    text = action.help or ""
    if action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0 and "default" not in text:
        text += f" (default: `{action.default}`)"
    return text


def _section(title: str, parser: argparse.ArgumentParser) -> str:
    rows = [f"| `{_table_cell(_spelling(action))}` | {_table_cell(_meaning(action))} |" for action in parser._actions
            if not isinstance(action, argparse._HelpAction)]
    table = "\n".join(["| argument | meaning |", "|---|---|", *rows]) if rows else "No arguments."
    description = f"{parser.description}\n\n" if parser.description else ""
    return f"## `{title}`\n\n{description}{table}\n"


def magics_page() -> str:
    """The page, from the parsers the magics use."""
    parsers = line_parsers()
    sections = [_section("%%fsdp2", cell_parser()), *(_section(f"%fsdp2 {name}", parsers[name]) for name in COMMANDS)]
    return "\n".join([HEADER, *sections])


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--check", action="store_true", help="exit 1 when the page differs, write nothing")
    if options.parse_args().check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != magics_page():
            print(f"{PAGE} differs from the parsers: run python scripts/make_magics_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(magics_page())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/magics.md is the magics' parsers written out: every `%%fsdp2` option and `%fsdp2` command,
so an option added, renamed or dropped in frontend/magic_options.py fails here until the page is
written again (`python scripts/make_magics_doc.py`)."""

from pathlib import Path

from fsdp2nb.frontend.magic_options import COMMANDS, cell_parser
from scripts.make_magics_doc import PAGE, magics_page


def test_the_page_equals_what_the_parsers_say():
    assert PAGE.read_text() == magics_page(), "docs/magics.md is stale: run python scripts/make_magics_doc.py"


def test_the_page_names_every_command_and_cell_option():
    page = PAGE.read_text()
    assert all(f"## `%fsdp2 {command}`" in page for command in COMMANDS)
    options = [flag for action in cell_parser()._actions for flag in action.option_strings if flag.startswith("--")]
    cell_section = page.split("## `%fsdp2 ", 1)[0]
    assert options and all(f"`{option}" in cell_section for option in options)


def test_the_page_is_linked_from_usage():
    assert "(magics.md)" in (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()

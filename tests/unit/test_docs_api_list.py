"""docs/architecture.md's entry for fsdp2nb/__init__.py names every public name (`__all__`), so a
name added to the API is added to the page that lists it."""

import re
from pathlib import Path

import fsdp2nb

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_architecture_page_lists_every_public_name():
    text = ARCHITECTURE.read_text()
    entry = text.split("- `__init__.py`:", 1)[1].split("\n- `", 1)[0]
    listed = set(re.findall(r"\w+", entry))
    missing = sorted(set(fsdp2nb.__all__) - listed)
    assert not missing, f"docs/architecture.md's __init__.py entry leaves out {missing}"

"""The README and docs/ name only fsdp2nb functions that exist: every `fsdp2nb.NAME` resolves, and a
name that looks like a variant of a public one (`export_hf_model` beside `export_hf`) is defined
somewhere in the package."""

import re
from pathlib import Path

import fsdp2nb

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_SPAN = re.compile(r"`([^`\n]+)`")
_SNAKE = re.compile(r"\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b")


def _spans() -> list[tuple[str, str]]:
    return [(page.name, span) for page in PAGES for span in _SPAN.findall(page.read_text())]


def test_every_fsdp2nb_name_in_the_docs_exists():
    named = {(page, name) for page, span in _spans() for name in re.findall(r"\bfsdp2nb\.([A-Za-z_]\w*)", span)}
    modules = {path.stem for path in (ROOT / "fsdp2nb").iterdir()}  # fsdp2nb.examples, fsdp2nb.log ...
    missing = sorted((page, name) for page, name in named if name not in modules and not hasattr(fsdp2nb, name))
    assert not missing, f"the docs name fsdp2nb attributes that do not exist: {missing}"


def test_no_variant_of_a_public_function_name_is_made_up():
    source_words = set(re.findall(r"\w+", " ".join(path.read_text() for path in (ROOT / "fsdp2nb").rglob("*.py"))))
    public = [name for name in fsdp2nb.__all__ if name.islower() and "_" in name]
    made_up = sorted({(page, word) for page, span in _spans() for word in _SNAKE.findall(span)
                      if word not in source_words and any(word.startswith(f"{name}_") for name in public)})
    assert not made_up, f"the docs name functions fsdp2nb does not define: {made_up}"

"""A cell's source as the ranks run it: IPython's input transformations, applied once in the kernel.

`%%fsdp2` cells may use IPython syntax (`%time`, `!ls`, `x?`); the kernel transforms each cell
once and checks that it parses, so a syntax error is reported before any rank runs it. Plain
Python, the usual case, skips the transformations and a cell run again unchanged skips the parse.
"""

from __future__ import annotations

import ast
import functools

from IPython.core.getipython import get_ipython

from fsdp2nb.frontend.errors import CellSyntaxError


def transform_and_check(code: str) -> str:
    """IPython's input transformations, once for all ranks; a cell that does not parse raises
    CellSyntaxError here, before any rank sees it."""
    shell = get_ipython()
    if shell is None or is_plain_python(shell, code):
        source = code if code.endswith("\n") else code + "\n"
    else:
        source = shell.transform_cell(code)
    _check_syntax(source)
    return source


@functools.lru_cache(maxsize=64)  # a failure raises, so only sources that parsed are kept
def _check_syntax(source: str) -> None:
    """Raise CellSyntaxError if `source` does not parse. A cell run again unchanged was parsed
    before, and parsing is a visible part of an empty cell's cost when the parser is out of the
    CPU's caches."""
    try:
        ast.parse(source, "<fsdp2 cell>")
    except SyntaxError as error:
        raise CellSyntaxError(error) from None


def is_plain_python(shell, code: str) -> bool:  # an IPython shell
    """Whether IPython's input transformations would leave `code` as it is, so they can be
    skipped (a visible part of an empty cell's cost): none of the characters its syntax uses
    (`%`, `!`, `?`), no leading blank line, indent or prompt, and only IPython's own transformers."""
    if not code or code[0].isspace() or code.startswith((">>>", "...", "In [")):
        return False
    if "%" in code or "!" in code or "?" in code:
        return False
    manager = shell.input_transformer_manager
    counts = (len(manager.cleanup_transforms), len(manager.line_transforms), len(manager.token_transformers))
    return not shell.input_transformers_post and counts == _default_transformer_counts()


@functools.cache
def _default_transformer_counts() -> tuple[int, int, int]:
    from IPython.core.inputtransformer2 import TransformerManager

    manager = TransformerManager()
    return len(manager.cleanup_transforms), len(manager.line_transforms), len(manager.token_transformers)


def notebook_execution_count() -> int | None:
    """The number the notebook shows for the running cell (`In [N]`), if known."""
    shell = get_ipython()
    # The running cell's result carries its number; the shell's own counter is already one
    # ahead while a cell runs (IPython 9 advances it first).
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    count = getattr(running, "execution_count", None)
    return count if isinstance(count, int) else None

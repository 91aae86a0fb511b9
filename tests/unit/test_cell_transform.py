"""The kernel skips IPython's input transformations only where they would change nothing."""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell

from fsdp2nb.frontend.cell_transform import is_plain_python

CELLS = [
    "x = 1",
    "x = 1\nx",
    "for i in range(3):\n    print(i)\n",
    "\n\nx = 1",  # leading blank lines: IPython drops them
    "    x = 1",  # leading indent: IPython removes it
    ">>> x = 1",  # a pasted prompt: IPython strips it
    "In [1]: x = 1",
    "%time x = 1",
    "!ls",
    "y = !ls",
    "x?",
    "'100%' if x != 3 else None",
    "%%timeit\nx = 1",
    "s = 'a' # comment with a ? in it",
]


@pytest.fixture(scope="module")
def shell():
    return InteractiveShell.instance()


@pytest.mark.parametrize("code", CELLS)
def test_skipping_the_transform_gives_what_it_would(shell, code):
    if is_plain_python(shell, code):
        assert shell.transform_cell(code) == (code if code.endswith("\n") else code + "\n")


def test_plain_cells_take_the_short_way(shell):
    assert is_plain_python(shell, "x = 1\nx")
    assert not is_plain_python(shell, "%time x = 1")
    assert not is_plain_python(shell, "\nx = 1")


def test_a_registered_transformer_disables_the_short_way(shell):
    def upper(lines: list[str]) -> list[str]:
        return [line.upper() for line in lines]

    shell.input_transformers_cleanup.append(upper)
    try:
        assert not is_plain_python(shell, "x = 1")
    finally:
        shell.input_transformers_cleanup.remove(upper)


def test_ranks_name_cells_as_ipython_does_when_a_cell_runs_again():
    from IPython.core.compilerop import CachingCompiler

    from fsdp2nb.worker.shell import _RankCompiler

    ours, ipython = _RankCompiler(), CachingCompiler()
    for code, number in [("pass\n", 3), ("pass\n", 4), ("x = 1\n", 5), ("pass\n", 12), ("pass\n", 0)]:
        assert ours.get_code_name(code, code, number) == ipython.get_code_name(code, code, number)

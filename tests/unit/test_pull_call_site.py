"""How `%fsdp2 pull` tells a statement (define the names) from a value (return it), in a real
IPython shell: the cell source is transformed and run as a notebook cell would be."""

import pytest
from IPython.core.interactiveshell import InteractiveShell

from fsdp2nb.frontend.magics import magic_result_is_discarded


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    seen: list[bool] = []

    def probe(line: str) -> tuple[int, int]:
        seen.append(magic_result_is_discarded())
        return 1, 2

    shell.register_magic_function(probe, "line", "probe")
    shell.seen = seen
    yield shell
    InteractiveShell.clear_instance()  # later tests expect no shell


@pytest.mark.parametrize(("cell", "discarded"), [
    ("%probe x", True),                                  # the last line: its value would be shown
    ("%probe x\nafter = 1", True),                       # a statement inside the cell
    ("if True:\n    %probe x", True),
    ("def f():\n    %probe x\nf()", True),
    ("y = %probe x", False),
    ("y = %probe x\nafter = 1", False),
    ("a, b = %probe x", False),
    ("def f():\n    y = %probe x\n    return y\nf()", False),
    ("print(get_ipython().run_line_magic('probe', 'x'))", False),
])
def test_statement_or_value(shell, cell, discarded):
    shell.seen.clear()
    result = shell.run_cell(cell, store_history=False)
    assert result.success, result.error_in_exec
    assert shell.seen == [discarded]


def test_called_without_run_line_magic_the_value_counts_as_used():
    assert magic_result_is_discarded() is False

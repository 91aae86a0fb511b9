"""nbclient runs a notebook with `--bg` cells to the same result as its blocking version: the
same outputs in every other cell, and a failing run stops the notebook with the same error."""

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests.support.kernel_client import WITHOUT_GPUS

_TRAIN = "import time\nfor step in range(3):\n    x += step\n    time.sleep(0.1)\n"


def _notebook(bg: bool, train: str) -> nbformat.NotebookNode:
    line = "%%fsdp2 --bg" if bg else "%%fsdp2"
    cells = ["%load_ext fsdp2nb",
             "%%fsdp2 --cpu 2 --no-dashboard\nx = rank * 100",
             f"{line}\n{train}",
             "y = 5\nprint('kernel side', y)",
             "%%fsdp2\nprint('x is', x)",
             "values = %fsdp2 pull x --all --value\nprint(values)"]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])


def _execute(notebook: nbformat.NotebookNode) -> CellExecutionError | None:
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=False)
    try:
        client.execute()  # the kernel inherits this process's environment (WITHOUT_GPUS set)
    except CellExecutionError as error:
        return error
    return None


def _outputs(notebook: nbformat.NotebookNode, skip: int) -> list[list[tuple]]:
    """Each cell's outputs but for cell `skip` (the background cell's value is its handle), the
    line a cell queued behind the run says while it waits (there only if it had to wait), and the
    pool start's report of processes an earlier kernel left (there only if one did)."""
    return [[(o.output_type, o.get("name"), o.get("text"), o.get("ename")) for o in cell.outputs
             if not (o.get("text") or "").startswith(_CIRCUMSTANTIAL)]
            for index, cell in enumerate(notebook.cells) if index != skip]


_CIRCUMSTANTIAL = ("waiting for In[", "ended orphaned fsdp2nb process")


@pytest.mark.parametrize("train", [_TRAIN, _TRAIN + "raise ValueError('diverged')"], ids=["ok", "fails"])
def test_nbclient_gives_the_same_result_with_background_cells(train, monkeypatch):
    for name, value in WITHOUT_GPUS.items():
        monkeypatch.setenv(name, value)
    blocking, background = _notebook(False, train), _notebook(True, train)
    blocking_error, background_error = _execute(blocking), _execute(background)
    if "raise" not in train:
        assert blocking_error is None and background_error is None
        assert _outputs(background, skip=2) == _outputs(blocking, skip=2)
        assert "[0] x is 3\n" in background.cells[4].outputs[-1].text
        return
    assert blocking_error.ename == background_error.ename == "RankError"
    assert "diverged" in str(blocking_error) and "diverged" in str(background_error)
    # Sequence stops at the run in one, at the next cell that needs the ranks in the other:
    # nothing after it ran in either.
    assert background.cells[5].outputs == [] and blocking.cells[5].outputs == []
    assert not any("x is" in (o.get("text") or "") for o in background.cells[4].outputs)

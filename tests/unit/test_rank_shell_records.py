"""What a rank's IPython shell keeps per cell: a long day of cells must not grow it without bound,
and a traceback must still show the lines of code that lives on (a function an early cell defined).

The rank shell is a process-wide singleton (IPython's `instance()`), so each test runs it in a
fresh interpreter, as a rank does, and reads back what it holds as JSON.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp2nb.worker.shell import _MAX_COMPILED_CELLS, _RankCompiler

REPO = Path(__file__).resolve().parents[2]

A_DAY_OF_CELLS = """
import json, linecache, sys
from fsdp2nb.worker.shell import make_shell, run_cell

shell = make_shell({}, lambda kind, data, metadata: None)
errors = []

def cell(number, source):
    error = run_cell(shell, source, source, execution_count=number)
    if error is not None:
        errors.append((number, error.ename, "\\n".join(error.traceback)))

cell(1, "def fails_later():\\n    raise ValueError('raised where the first cell put it')")
for number in range(2, NUM_CELLS + 2):
    kind = number % 4
    if kind == 0:
        cell(number, "pass")  # the same source each time
    elif kind == 1:
        cell(number, f"value = {number}\\nvalue")  # a value shown: IPython records it
    elif kind == 2:
        cell(number, f"squares = [i * i for i in range({number % 7})]")  # nested code (3.11)
    else:
        cell(number, f"if True:\\n    raise RuntimeError('cell {number}')")
cell(NUM_CELLS + 2, "fails_later()")

def cells_in_linecache():
    return [name for name in linecache.cache if name.startswith("<ipython-input-")]
import gc
gc.collect()  # a raising cell's traceback sits in reference cycles, freed by the collector as on a busy rank
print(json.dumps({
    "cells_in_linecache": len(cells_in_linecache()),
    "cells_that_ran_in_linecache": len([name for name in cells_in_linecache() if "raise" not in linecache.getline(name, 2)]),
    "outputs_recorded": sum(len(outputs) for outputs in shell.history_manager.outputs.values()),
    "last_error": errors[-1],
    "num_errors": len(errors),
}))
"""

NUM_CELLS = 400


@pytest.fixture(scope="module")
def a_day() -> dict:
    """What the rank shell held after NUM_CELLS cells (and the last cell's error)."""
    script = A_DAY_OF_CELLS.replace("NUM_CELLS", str(NUM_CELLS))
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_rank_keeps_the_source_of_only_recent_cells_and_code_that_lives(a_day):
    assert a_day["num_errors"] == NUM_CELLS // 4 + 1  # every raising cell failed, and the last call
    # The recent cells, cell 1 (its function lives), the cells in the compiled-cell cache (their
    # code objects live there): a bound set by the compiler, not by the 400 cells run. A cell
    # that raised keeps its source for as long as IPython's traceback formatting (the
    # `executing` package's cache) keeps its code: not the rank's to drop.
    bound = _RankCompiler.KEPT_RECENT_CELLS + 1 + _MAX_COMPILED_CELLS
    assert a_day["cells_that_ran_in_linecache"] <= bound, a_day


def test_a_rank_records_no_shown_value_per_cell(a_day):
    assert a_day["outputs_recorded"] == 0


def test_a_function_from_the_first_cell_still_shows_its_source_after_hundreds_of_cells(a_day):
    number, ename, coloured = a_day["last_error"]
    traceback = re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    assert (number, ename) == (NUM_CELLS + 2, "ValueError")
    assert "raise ValueError('raised where the first cell put it')" in traceback
    assert "fails_later()" in traceback  # the calling cell's own line

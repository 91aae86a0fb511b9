"""One error hierarchy: every exception class of the package derives from `Fsdp2nbError`, and the
magics show a usage mistake as one line but any other error (a bug) with its traceback."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import threading

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import fsdp2nb
from fsdp2nb.errors import Fsdp2nbError, NoPoolRunning, RankError, UsageMistake
from fsdp2nb.frontend.magics import FSDP2Magics
from fsdp2nb.worker.stdin import InterruptedAtPrompt

SIGNALS = {InterruptedAtPrompt}
"""Not errors but interrupts, like KeyboardInterrupt: a BaseException that user code's
`except Exception` must not swallow, so they cannot derive from Fsdp2nbError (an Exception)."""


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for module_info in pkgutil.walk_packages(fsdp2nb.__path__, "fsdp2nb."):
        module = importlib.import_module(module_info.name)
        found += [value for value in vars(module).values() if inspect.isclass(value)
                  and issubclass(value, BaseException) and value.__module__ == module.__name__]
    return found


def test_every_exception_class_of_the_package_derives_from_the_base():
    classes = _exception_classes()
    assert len(classes) >= 30, [cls.__name__ for cls in classes]  # the walk found the package's classes
    outside = [f"{cls.__module__}.{cls.__qualname__}" for cls in classes
               if not issubclass(cls, Fsdp2nbError) and cls not in SIGNALS]
    assert not outside, f"exception classes that do not derive from fsdp2nb.Fsdp2nbError: {outside}"
    assert all(not issubclass(cls, Exception) for cls in SIGNALS)


def test_rank_error_is_public_and_still_importable_where_it_was():
    from fsdp2nb.frontend.errors import RankError as where_it_was

    assert {"RankError", "Fsdp2nbError", "UsageMistake"} <= set(fsdp2nb.__all__)
    assert fsdp2nb.RankError is RankError is where_it_was
    assert issubclass(RankError, Fsdp2nbError) and issubclass(UsageMistake, ValueError)


def test_config_errors_stay_value_errors_of_the_hierarchy():
    from fsdp2nb.pool.spec import PoolSpec

    with pytest.raises(ValueError, match="devices is empty") as caught:
        PoolSpec(devices=())
    assert isinstance(caught.value, UsageMistake)


class _Session:
    """Stands in for the NotebookSession: `detach` raises what the test gives it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.lifecycle_lock = threading.RLock()
        self.pool = None

    def add_snapshot_listener(self, listener) -> None:
        """The magics hear the ranks' profiles through it; no pool here sends any."""

    def detach(self) -> str:
        raise self.error


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    yield shell
    shell.magics_manager.magics["line"].pop("fsdp2", None)
    shell.magics_manager.magics["cell"].pop("fsdp2", None)


def _run(shell: InteractiveShell, error: BaseException, capsys):
    shell.register_magics(FSDP2Magics(shell, _Session(error)))
    result = shell.run_cell("%fsdp2 detach")
    captured = capsys.readouterr()
    return result.error_in_exec, captured.out + captured.err


def test_a_usage_mistake_in_a_magic_is_one_line(shell, capsys):
    raised, shown = _run(shell, NoPoolRunning("no pool is running, so there is nothing to detach"), capsys)
    assert isinstance(raised, UsageError)
    assert [line for line in shown.splitlines() if line.strip()] == [
        "UsageError: no pool is running, so there is nothing to detach"]


def test_a_value_error_from_a_bug_in_a_magic_shows_its_traceback(shell, capsys):
    raised, shown = _run(shell, ValueError("a bug's error"), capsys)
    assert type(raised) is ValueError
    assert "Traceback" in shown and "detach" in shown and "a bug's error" in shown, shown
    assert not any(line.startswith("UsageError:") for line in shown.splitlines())

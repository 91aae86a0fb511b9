"""Every error a user can cause derives from `Fsdp2nbError`: a walk over the package's source fails
on a `raise` of a bare builtin error (`raise ValueError(...)`) unless its line, or the comment line
just above it, says why it is an internal matter (`# internal: <why>`), so a new bare raise in a
user-facing path cannot slip in unnoticed. A user mistake raises a class of `fsdp2nb/errors.py`
that derives from the builtin it replaced as well, so `except ValueError` still catches it."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import fsdp2nb

PACKAGE = Path(fsdp2nb.__file__).parent

CHECKED = frozenset((
    "ValueError", "TypeError", "RuntimeError", "NotImplementedError", "KeyError", "IndexError", "LookupError",
    "OSError", "IOError", "FileNotFoundError", "FileExistsError", "IsADirectoryError", "NotADirectoryError",
    "PermissionError", "TimeoutError", "Exception",
))
"""The builtins a user mistake would have raised. Left out on purpose: the protocol signals Python
itself defines (AttributeError from a module's `__getattr__`, EOFError and ConnectionError from a
closed socket, KeyboardInterrupt, StopIteration), AssertionError (an invariant by definition) and
MemoryError (the fault injection stands in for the allocator)."""

MARKER = "# internal:"

TO_CONVERT: dict[str, str] = {}
"""Bare raises still to be given a class (`path: the raise's first line`), with the reason they are not yet."""


@dataclass(frozen=True)
class BareRaise:
    where: str
    name: str
    line: str

    @property
    def key(self) -> str:
        """How TO_CONVERT names it: by its file and text, which other edits of the file leave alone."""
        return f"{self.where.rpartition(':')[0]}: {self.line}"


def bare_raises(source: str, relative: str) -> list[BareRaise]:
    """The `raise <builtin>` statements of one module, and the builtin errors it makes to raise
    later (`return RuntimeError(...)`), that carry no `# internal:` marker."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        elif isinstance(node, ast.Call):
            raised = node.func
        else:
            continue
        if not (isinstance(raised, ast.Name) and raised.id in CHECKED):
            continue
        line, above = lines[node.lineno - 1], lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        if MARKER in line or above.startswith(MARKER):
            continue
        found.append(BareRaise(f"{relative}:{node.lineno}", raised.id, line.strip()))
    return sorted(set(found), key=lambda r: (int(r.where.rpartition(":")[2]), r.name))


def _package_bare_raises() -> list[BareRaise]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += bare_raises(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    return found


def test_no_bare_builtin_raise_in_the_package_without_an_internal_marker():
    unexplained = [f"{r.where}: {r.line}" for r in _package_bare_raises() if r.key not in TO_CONVERT]
    assert not unexplained, (
        "raise an fsdp2nb.errors class (deriving from the builtin too) for a user's mistake, or mark an "
        f"internal invariant with `{MARKER} <why>` on the raise's line:\n" + "\n".join(unexplained))


def test_the_allow_list_names_only_raises_that_are_still_there():
    still_there = {r.key for r in _package_bare_raises()}
    assert set(TO_CONVERT) <= still_there, sorted(set(TO_CONVERT) - still_there)


def test_the_walk_finds_a_bare_raise_and_accepts_a_marked_one():
    source = ("def f(x):\n"
              "    if x:\n"
              "        raise ValueError('bad x')\n"
              "    raise RuntimeError('never')  # internal: f is called with x set\n"
              "    # internal: the next line is unreachable too\n"
              "    raise KeyError(x)\n"
              "    raise AttributeError(x)\n"
              "    raise UsageMistake('fine')\n"
              "    return OSError('made here, raised by the caller')\n")
    assert bare_raises(source, "m.py") == [BareRaise("m.py:3", "ValueError", "raise ValueError('bad x')"),
                                           BareRaise("m.py:9", "OSError", "return OSError('made here, raised by the caller')")]


def test_the_classes_that_replaced_builtins_are_still_those_builtins():
    from fsdp2nb import errors

    replaced = {errors.NotReady: RuntimeError, errors.NoProcessGroup: ValueError, errors.NotSupported: NotImplementedError,
                errors.ModelNotFound: FileNotFoundError, errors.CheckpointNotFound: FileNotFoundError,
                errors.UnsafeDirectory: PermissionError, errors.MissingWeights: KeyError}
    for cls, builtin in replaced.items():
        assert issubclass(cls, errors.Fsdp2nbError) and issubclass(cls, builtin), cls
    assert issubclass(errors.UnsafeDirectory, RuntimeError)  # the reaper's raised a RuntimeError
    assert str(errors.MissingWeights("no tensor for 'a.b'")) == "no tensor for 'a.b'"  # not quoted as a key

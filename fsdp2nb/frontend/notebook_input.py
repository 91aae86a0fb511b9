"""Lines of input for the ranks, asked of the notebook: what `RequestWait` calls when a rank's
input(), getpass or debugger prompt waits.

A blocking cell asks the frontend as a plain cell's input() does: ipykernel has replaced
`input` and `getpass.getpass` for the cell with its own, which send an `input_request` (and
raise StdinNotImplementedError where the frontend takes no input, as nbclient). A background
run's cell has returned, so nothing can answer it: its prompt is refused at once.
"""

from __future__ import annotations

import getpass

from fsdp2nb.wire.sigint import sigint_raises


class NoInputBox(RuntimeError):
    """No one can answer a rank's prompt; the message says why and what to do."""


def ask_notebook(prompt: str, password: bool) -> str:
    """The line the user types at `prompt` (hidden where `password`); the stop button raises
    KeyboardInterrupt here, as it does at a plain cell's input()."""
    with sigint_raises():
        return getpass.getpass(prompt) if password else input(prompt)


def refuse_in_background(prompt: str, password: bool) -> str:
    raise NoInputBox("it runs in the background (--bg), whose cell has returned, so no input box can answer; "
                     "run the cell without --bg to use input() or pdb there")

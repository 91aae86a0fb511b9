"""breakpoint() on a rank, answered in JupyterLab's own stdin box.

A `%%fsdp2 --ranks 0` cell stops at breakpoint(); the rank's pdb prompt shows in the cell's output
area as `[0] (Pdb) ` beside JupyterLab's input box, each answer goes to rank 0 and pdb's reply comes
back labelled `[0] ...` above the next prompt, and after `c` the cell ends without an error. The
whole session is screenshotted to /tmp/dash-shots (FSDP2NB_SHOTS) and, with
FSDP2NB_DEBUGGER_SCREENSHOT=path, also to path."""

from __future__ import annotations

import os
import re

import nbformat

from tests.support.lab_page import Page

DEBUG_CELL = 2
PROMPT = "[0] (Pdb) "

# The cell's output area as a list of its children, in order: stdin boxes (the prompt beside the
# box, and whether the test already answered it) and rendered outputs (mime type and text).
_OUTPUTS = r"""(index) => {
  const area = document.querySelectorAll('.jp-CodeCell')[index].querySelector('.jp-OutputArea');
  return [...area.querySelectorAll(':scope > .jp-OutputArea-child')].map(child => {
    const box = child.querySelector('.jp-Stdin');
    if (box) {
      const input = box.querySelector('input.jp-Stdin-input');
      return {kind: 'stdin', prompt: box.querySelector('.jp-Stdin-prompt').firstChild.textContent,
              answered: !input || input.dataset.answered === 'yes'};
    }
    const output = child.querySelector('.jp-OutputArea-output');
    return {kind: output.dataset.mimeType || output.className, text: output.textContent};
  });
}"""
_FRESH_BOX = "input.jp-Stdin-input:not([data-answered=yes])"


def _notebook(path) -> None:
    cells = [nbformat.v4.new_code_cell("%load_ext fsdp2nb"),
             nbformat.v4.new_code_cell("%fsdp2 start --cpu 2 --no-dashboard"),
             nbformat.v4.new_code_cell("%%fsdp2 --ranks 0\nx = 41\nbreakpoint()\nprint('after', x)")]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def _outputs(page: Page) -> list[dict]:
    return page.page.evaluate(_OUTPUTS, DEBUG_CELL)


def _wait_for_prompt(page: Page, answered: int, above: str) -> list[dict]:
    """Wait for a stdin box the test has not answered yet, after the echoes of the `answered`
    lines before it, with the output `above` (a substring) right above it; returns the output
    area then. JupyterLab itself keeps an answered box on screen for a moment after the next one
    shows (a plain kernel's input() does the same): those are told apart by the mark `_answer`
    puts on them. The kernel writes a rank's output before it asks for the line, but output and
    input requests travel on separate channels (iopub, stdin), so the box may show a moment before
    the line above it; JupyterLab still places that line above the box."""
    page.page.wait_for_function(
        f"([index, above]) => {{ const outputs = ({_OUTPUTS})(index).filter(o => o.kind !== 'stdin' || !o.answered); "
        f"return outputs.filter(o => o.kind === 'application/vnd.jupyter.stdout' "
        f"&& /^\\[0\\] \\(Pdb\\) /.test(o.text)).length === {answered} "
        f"&& !!document.querySelectorAll('.jp-CodeCell')[index].querySelector('{_FRESH_BOX}') "
        f"&& outputs.length > 1 && (outputs[outputs.length - 2].text || '').includes(above); }}",
        arg=[DEBUG_CELL, above], timeout=120_000)
    outputs = _outputs(page)
    fresh = [o for o in outputs if o["kind"] == "stdin" and not o["answered"]]
    assert len(fresh) == 1 and outputs[-1] == fresh[0], outputs  # one open prompt, nothing printed below it
    assert fresh[0]["prompt"] == PROMPT, outputs
    assert "[*]" in page.page.locator(".jp-CodeCell").nth(DEBUG_CELL).locator(".jp-InputArea-prompt").text_content()
    return [o for o in outputs if o["kind"] != "stdin" or not o["answered"]]


def _answer(page: Page, line: str, typed_shot=None) -> None:
    """Type `line` into the open box and press Enter (with `typed_shot`, screenshot the cell
    with the line typed first)."""
    cell = page.page.locator(".jp-CodeCell").nth(DEBUG_CELL)
    box = cell.locator(_FRESH_BOX)
    box.evaluate("input => { input.dataset.answered = 'yes'; }")
    box = cell.locator("input.jp-Stdin-input[data-answered=yes]").last
    box.fill(line)
    if typed_shot:
        cell.scroll_into_view_if_needed()
        cell.screenshot(path=str(typed_shot))
    box.press("Enter")


def _texts(outputs: list[dict]) -> str:
    return "".join(o.get("text", "") for o in outputs)


def test_breakpoint_on_a_rank_is_a_debugger_session_in_the_notebook(lab, browser, shots):
    _notebook(lab.root / "debugger.ipynb")
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = Page(context.new_page())
    try:
        _debug_session(page, lab, shots)
    except Exception:
        page.page.screenshot(path=str(shots / "debugger-failure.png"))  # what the page showed when it failed
        raise
    finally:
        context.close()


def _debug_session(page: Page, lab, shots) -> None:
    page.open(lab.url("debugger.ipynb"))
    for index in range(2):
        page.run(index)
        page.wait_done(index)
    assert "started 2 ranks" in page.output(1) and "error" not in page.output(1).lower(), page.output(1)
    cell = page.page.locator(".jp-CodeCell").nth(DEBUG_CELL)

    page.run(DEBUG_CELL)
    outputs = _wait_for_prompt(page, answered=0, above="[0] -> breakpoint()")
    assert "[0] -> breakpoint()" in _texts(outputs), outputs  # where pdb stopped, above its prompt
    _answer(page, "p x")

    outputs = _wait_for_prompt(page, answered=1, above="[0] 41")
    # pdb's reply, labelled by rank, arrives before its next prompt and sits right above it
    assert outputs[-2]["text"] == "[0] 41\n", outputs
    _answer(page, "!x = 7")

    _wait_for_prompt(page, answered=2, above="[0] (Pdb) ")
    _answer(page, "c", typed_shot=shots / "debugger-prompt.png")  # the open box, `c` typed

    page.wait_done(DEBUG_CELL)
    # the last answered box leaves the screen a moment after it was answered (JupyterLab's own pace)
    page.page.wait_for_function(f"(index) => !({_OUTPUTS})(index).some(o => o.kind === 'stdin')",
                                arg=DEBUG_CELL, timeout=30_000)
    outputs = _outputs(page)
    kinds = {o["kind"] for o in outputs}
    assert kinds == {"application/vnd.jupyter.stdout"}, outputs  # no box left, no stderr, no error
    text = _texts(outputs)
    assert "Error" not in text and "Traceback" not in text, text
    # The session reads in order: where it stopped, each answer echoed after the rank's prompt,
    # pdb's reply, then the cell's own print with the changed value.
    expected = [r"\[0\] -> breakpoint\(\)\n", r"\[0\] \(Pdb\) +p x\n", r"\[0\] 41\n", r"\[0\] \(Pdb\) +!x = 7\n",
                r"\[0\] \(Pdb\) +c\n", r"\[0\] after 7\n"]
    found = re.search("(?s)" + ".*?".join(f"({pattern})" for pattern in expected), text)
    assert found, text
    assert text.endswith("[0] after 7\n") and "[1]" not in text, text

    cell.scroll_into_view_if_needed()
    cell.screenshot(path=str(shots / "debugger-session.png"))
    if os.environ.get("FSDP2NB_DEBUGGER_SCREENSHOT"):
        cell.screenshot(path=os.environ["FSDP2NB_DEBUGGER_SCREENSHOT"])

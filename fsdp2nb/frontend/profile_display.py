"""A profiled cell's view, which comes after the cell: the ranks reply first and send their
profiles after, so the cell ends with a placeholder under its output, replaced in place
(`update_display_data`, by its display id) once every rank's profile has come.

The replacement is sent from a thread of this module, as a reply to the profiled cell's request:
an update never adds an output, so nothing lands under a later cell. A frontend that reads no
message after its cell ended (nbclient) gets the view before the cell ends instead."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterator
from html import escape

from fsdp2nb.frontend.profiles import PendingProfile, ProfileCollector
from fsdp2nb.profile_analysis import ProfileAnalysis

logger = logging.getLogger(__name__)

PLACEHOLDER = "profile: the ranks send it after their replies; it shows here once all have come"


def show_when_complete(collector: ProfileCollector, pending: PendingProfile, exited: Callable[[], Collection[int]],
                       on_profile: Callable[[ProfileAnalysis], None]) -> None:
    """Show the placeholder under the cell now; a thread waits for the profile and replaces it."""
    from IPython.display import display

    handle = display({"text/plain": PLACEHOLDER, "text/html": _html_line(PLACEHOLDER, "fsdp2nb-profile-pending")},
                     raw=True, display_id=True)
    cell_request = _current_parent()
    replace = (collector, pending, exited, handle, cell_request, on_profile)
    if not _frontend_updates_ended_cells():
        _replace_when_complete(*replace)  # before the cell ends, where such a frontend still listens
        return
    threading.Thread(target=_replace_when_complete, args=replace, name="fsdp2nb-profile-view", daemon=True).start()


def _replace_when_complete(collector: ProfileCollector, pending: PendingProfile,
                           exited: Callable[[], Collection[int]], handle, cell_request: dict | None,
                           on_profile: Callable[[ProfileAnalysis], None]) -> None:
    try:
        collector.wait_for(pending, exited)
        with _replying_to(cell_request):
            handle.update(view_bundle(pending), raw=True)
        if pending.profile is not None:
            on_profile(pending.profile.analysis)
    except Exception as error:  # the cell has ended: its placeholder is the only place to say so
        logger.exception("fsdp2nb: the profile view of cell %s failed", pending.cell_id)
        with _replying_to(cell_request):
            handle.update({"text/plain": f"profile: could not be shown: {error}"}, raw=True)


def view_bundle(pending: PendingProfile) -> dict[str, str]:
    """The view that replaces the placeholder: the profile, and a line for ranks whose did not come."""
    note = pending.note()
    if pending.profile is None:
        return {"text/plain": note, "text/html": _html_line(note, "fsdp2nb-profile-missing")}
    html, text = pending.profile._repr_html_(), repr(pending.profile)
    if note:
        html, text = _html_line(note, "fsdp2nb-profile-missing") + html, f"{note}\n{text}"
    return {"text/plain": text, "text/html": html}


def _html_line(text: str, css_class: str) -> str:
    lines = "<br>".join(escape(line) for line in text.splitlines())
    return f'<div class="{css_class}"><i>{lines}</i></div>'


def _frontend_updates_ended_cells() -> bool:
    """Whether the frontend applies display updates that come after their cell ended.

    JupyterLab and Notebook do, and ask with `allow_stdin` set; nbclient (`nbconvert --execute`)
    reads only the running cell's messages, and asks without stdin: there the cell waits."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    get_parent = getattr(kernel, "get_parent", None)
    request = get_parent() if get_parent is not None else None
    if not request:
        return False
    return bool(request.get("content", {}).get("allow_stdin", False))


def _current_parent() -> dict | None:
    """The request of the cell now running (ipykernel's display publisher knows it), or None."""
    from IPython import get_ipython

    publisher = getattr(get_ipython(), "display_pub", None)
    parent = getattr(publisher, "parent_header", None)
    return dict(parent) if parent else None


@contextlib.contextmanager
def _replying_to(cell_request: dict | None) -> Iterator[None]:
    """Displays from this thread as replies to `cell_request`, not to whatever cell runs now."""
    from IPython import get_ipython

    publisher = getattr(get_ipython(), "display_pub", None)
    set_thread_parent = getattr(publisher, "set_thread_parent", None)
    reset_thread_parent = getattr(publisher, "reset_thread_parent", None)
    if cell_request is None or set_thread_parent is None or reset_thread_parent is None:
        yield
        return
    token = set_thread_parent(cell_request)
    try:
        yield
    finally:
        reset_thread_parent(token)

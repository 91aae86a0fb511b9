"""The dashboard as an ipywidgets 8 tree: rank memory, training curves, checkpoints, buttons.

A view renders a `DashboardModel` and turns clicks into calls of an `Actions` object; it knows
nothing of processes. Views are created on the main thread; `refresh` (from the owner's
updater thread) only sets traits whose value changed, so an idle dashboard sends nothing.
Clicks are served on the subshell the frontend sent them on (see `serve_clicks_on_subshell`),
so they act while a training cell keeps the main thread busy.
"""

from __future__ import annotations

import html
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import ipywidgets as widgets

from fsdp2nb.errors import Fsdp2nbError
from fsdp2nb.widgets import markup
from fsdp2nb.widgets.model import DashboardModel

logger = logging.getLogger(__name__)


class ActionRefused(Fsdp2nbError):
    """Bad input or a wrong moment for an action: its one-line message goes to the panel, nothing changes."""


class Actions(Protocol):
    """What the dashboard's buttons ask of the pool's owner. Each returns the line the panel shows
    (or raises ActionRefused); each may be called from a subshell thread while a cell runs."""

    def stop(self) -> str: ...
    def restart(self) -> str: ...
    def reset_peak(self) -> str: ...
    def save(self) -> str: ...
    def load(self, step: int) -> str: ...
    def delete(self, step: int, latest_confirmed: bool = False) -> str:
        """`latest_confirmed`: the user confirmed twice that LATEST itself goes."""
    def export(self, path: str) -> str: ...


def serve_clicks_on_subshell(widget: widgets.Widget) -> bool:
    """Serve this widget's messages on a subshell, never behind the running cell.

    ipykernel 7.4 routes a comm message, on its shell-channel thread, to the subshell that the
    comm's `_reply_subshell_for` names; by default the subshell of the last message the comm
    itself sent, which for a widget made in a cell is the main shell. JupyterLab and Notebook 7
    send widget messages on a subshell of their own: that choice is kept. A message sent to the
    main shell goes to a subshell of fsdp2nb's own instead: frontends without subshells do so,
    and so does a proxy kernel between the frontend and this one (jupyter-distributed strips
    the subshell id, which names a subshell of the proxy). Private hooks, so they are checked
    here and the panel says when they are missing (tests/kernel pins the behaviour)."""
    comm = getattr(widget, "comm", None)
    if comm is None or not callable(getattr(comm, "_reply_subshell_for", None)):
        return False
    comm._reply_subshell_for = _subshell_for_click
    return True


_own_subshell: str | None = None
"""fsdp2nb's subshell in this kernel, made for the first click that came to the main shell."""


def _subshell_for_click(data: object, default: str | None) -> str | None:
    """Runs on ipykernel's shell-channel thread, the one that makes subshells."""
    global _own_subshell
    if default is not None:
        return default
    try:
        from ipykernel.kernelbase import Kernel

        manager = Kernel.instance().shell_channel_thread.manager
        if _own_subshell not in manager.list_subshell():  # None, or deleted by a frontend
            _own_subshell = manager._create_subshell()
    except Exception:  # another ipykernel: the main shell serves it, after the running cell
        logger.debug("fsdp2nb could not make a subshell for dashboard clicks", exc_info=True)
        return default
    return _own_subshell


def kernel_has_subshells() -> bool:
    from ipykernel.kernelbase import Kernel

    return Kernel.initialized() and bool(getattr(Kernel.instance(), "_supports_kernel_subshells", False))


def _click_waits_for_cells() -> bool:
    """Whether this click is served on the kernel's main thread, in turn with the cells."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        from ipykernel.kernelbase import Kernel

        return Kernel.initialized() and bool(Kernel.instance().get_parent().get("header"))
    except Exception:  # not in a kernel (unit tests call handlers directly)
        return False


def _button(description: str, style: str = "", tooltip: str = "") -> widgets.Button:
    button = widgets.Button(description=description, button_style=style, tooltip=tooltip,
                            layout=widgets.Layout(width="auto"))
    button.add_class("fsdp2nb-button")
    return button


class DashboardView:
    """One displayed dashboard; every view of a model stays live."""

    def __init__(self, model: DashboardModel, actions: Actions) -> None:
        self._model = model
        self._actions = actions
        self._busy = threading.Lock()  # one action at a time: a double click is one save
        self.header = widgets.HTML()
        self.stop_button = _button("Stop", "warning", "interrupt every rank (the cell's stop button)")
        self.restart_button = _button("Restart", "danger", "a fresh pool: every rank's state is lost")
        self.reset_peak_button = _button("Reset peak", "", "start the peak memory readings afresh")
        self.question = widgets.HTML()
        self.confirm = widgets.HBox([self.question, _button("Yes", "danger"), _button("Cancel")],
                                    layout=widgets.Layout(align_items="center"))
        self.confirm.add_class("fsdp2nb-confirm")
        self.confirm.layout.display = "none"
        self._confirmed = None  # the action the shown question asks about
        # Made here, on the main thread: one per rank, and one for ranks a later, larger pool adds.
        self._rank_rows = [widgets.HTML() for _ in range(model.facts.world_size)]
        self._more_ranks = widgets.HTML()
        self.ranks = widgets.VBox([*self._rank_rows, self._more_ranks])
        self._shown_save_version = 0
        self._shown_notice = ""
        self._drawn: tuple | None = None
        self.plot = widgets.HTML()
        self.metric = widgets.Dropdown(options=["loss"], value="loss", layout=widgets.Layout(width="160px"))
        self.metric_view = widgets.ToggleButtons(options=["rank 0", "mean", "all ranks"], value="rank 0",
                                                 style={"button_width": "84px"})
        self.checkpoint_header = widgets.HTML()
        self.steps = widgets.Select(options=[], rows=5, layout=widgets.Layout(width="460px"))
        self.steps.add_class("fsdp2nb-steps")
        self.trainer_checkpoints = widgets.HTML()  # a Trainer's checkpoint-N directories, read-only
        self.trainer_checkpoints.add_class("fsdp2nb-trainer-checkpoints")
        self.save_button = _button("Save now", "primary", "save at once, or at the next maybe_save while training")
        self.load_button = _button("Load selected")
        self.delete_button = _button("Delete selected")
        self.export_path = widgets.Text(placeholder="/path/for/hf-export", layout=widgets.Layout(width="340px"))
        self.export_button = _button("Export HF")
        self.progress = widgets.HTML()  # the newest load, save or export, summed over the ranks
        self.message = widgets.HTML()
        self.message.add_class("fsdp2nb-message")
        self.note = widgets.HTML()
        self.root = self._layout()
        self._connect()
        self.clicks_on_subshell = all([serve_clicks_on_subshell(w) for w in self._all_widgets()])
        if not (self.clicks_on_subshell and kernel_has_subshells()):
            self.note.value = _note("this kernel cannot serve clicks while a cell runs (no subshells): "
                                    "Stop, Save and Reset peak act once the running cell ends")

    def _layout(self) -> widgets.VBox:
        toolbar = widgets.HBox([self.header, self.stop_button, self.restart_button, self.reset_peak_button],
                               layout=widgets.Layout(align_items="center"))
        buttons = widgets.VBox([self.save_button, self.load_button, self.delete_button])
        export = widgets.HBox([self.export_path, self.export_button])
        checkpoints = widgets.VBox([self.checkpoint_header, widgets.HBox([self.steps, buttons]), export,
                                    self.trainer_checkpoints])
        curves = widgets.VBox([widgets.HBox([self.metric, self.metric_view]), self.plot])
        root = widgets.VBox([toolbar, self.confirm, self.ranks, curves, checkpoints, self.progress, self.message,
                             self.note],
                            layout=widgets.Layout(border="1px solid #e5e7eb", padding="6px 10px"))
        root.add_class("fsdp2nb-dashboard")
        return root

    def _all_widgets(self) -> list[widgets.Widget]:
        found, pending = [], [self.root]
        while pending:
            widget = pending.pop()
            found.append(widget)
            pending.extend(getattr(widget, "children", ()))
        return found

    def _connect(self) -> None:
        self.stop_button.on_click(lambda _: self._act(self._actions.stop))
        self.restart_button.on_click(lambda _: self._ask("Restart the pool? All rank state is lost.",
                                                         self._actions.restart))
        self.confirm.children[1].on_click(lambda _: self._answer(True))
        self.confirm.children[2].on_click(lambda _: self._answer(False))
        self.reset_peak_button.on_click(lambda _: self._act(self._actions.reset_peak))
        self.save_button.on_click(lambda _: self._act(self._actions.save))
        self.load_button.on_click(lambda _: self._ask_about_step(
            "Load step {}? The model, optimizer and RNG on every rank are replaced.", self._actions.load))
        self.delete_button.on_click(lambda _: self._ask_delete())
        self.export_button.on_click(lambda _: self._act(lambda: self._actions.export(self.export_path.value)))

    def _ask(self, question: str, action) -> None:  # what Yes runs
        self._confirmed = action
        self.question.value = f"<b>{html.escape(question)}</b>"
        self.confirm.layout.display = "flex"

    def _ask_about_step(self, question: str, action) -> None:  # takes the step
        step = self.steps.value
        if step is None:
            self.message.value = _line("select a checkpoint in the list first", "#dc2626")
            return
        self._ask(question.format(step), lambda: action(step))

    def _ask_delete(self) -> None:
        """Delete asks once; for LATEST, a second time, saying what a resume would load instead."""
        view, step = self._model.checkpoint, self.steps.value
        if view is None or step is None or step != view.latest_step:
            self._ask_about_step("Delete step {}? Its files are removed.", self._actions.delete)
            return
        previous = max((e.step for e in view.entries if e.valid and e.step < step), default=None)
        then = (f"a resume would then load step {previous}, the previous one" if previous is not None
                else "no complete checkpoint would be left to resume from")
        second = _FollowUp(f"Step {step} is LATEST: {then}. Delete it anyway?",
                           lambda: self._actions.delete(step, True))
        self._ask(f"Delete step {step}? Its files are removed.", second)

    def _answer(self, yes: bool) -> None:
        action, self._confirmed = self._confirmed, None
        self.confirm.layout.display = "none"
        if yes and isinstance(action, _FollowUp):
            self._ask(action.question, action.action)
        elif yes and action is not None:
            self._act(action)

    def _act(self, action) -> None:  # a callable returning the panel's line
        """Run one action, putting its outcome (or why it was refused) on the message line."""
        if _click_waits_for_cells():
            self.note.value = _note("clicks reach this kernel's main shell and it cannot move them to a "
                                    "subshell (ipykernel 7.4 can): while a cell runs they wait for it")
        if not self._busy.acquire(blocking=False):
            self.message.value = _line("still working on the previous click", "#b45309")
            return
        try:
            self.message.value = _line(action(), "#15803d")
        except ActionRefused as refused:
            self.message.value = _line(str(refused), "#dc2626")
        except Exception as error:  # shown whole: the panel is where the user looks
            logger.exception("fsdp2nb dashboard action failed")
            self.message.value = _line(f"{type(error).__name__}: {error}", "#dc2626")
        finally:
            self._busy.release()

    # --- updates (any thread) -----------------------------------------------------------------

    def refresh(self, pool_line: str) -> None:
        """Bring every widget up to date with the model; unchanged values are not sent."""
        model = self._model
        _set(self.header, "value", f"{markup.STYLE}<b>fsdp2nb</b> · pool {html.escape(pool_line)}")
        self._refresh_ranks(model)
        self._refresh_plot(model)
        view = model.checkpoint
        trainer_view = model.trainer_checkpoints
        _set(self.checkpoint_header, "value", markup.checkpoint_header(view, trainer_view))
        self._refresh_steps(markup.checkpoint_options(view))
        _set(self.trainer_checkpoints, "value", markup.trainer_checkpoints_html(trainer_view))
        _set(self.progress, "value", markup.task_html(model.tasks.latest(model.facts.world_size)))
        version = model.save_text_version  # first: a change between the two reads is shown next time
        text = model.save_text
        if text and version != self._shown_save_version:
            self._shown_save_version = version
            self.message.value = _line(text, "#dc2626" if "failed" in text else "#15803d")
        if model.notice and model.notice != self._shown_notice:
            self._shown_notice = model.notice
            self.message.value = _line(model.notice, "#dc2626")

    def _refresh_plot(self, model: DashboardModel) -> None:
        names = tuple(model.metrics.names(0)) or ("loss",)
        if names != tuple(self.metric.options):
            chosen = self.metric.value
            self.metric.options = names
            self.metric.value = chosen if chosen in names else ("loss" if "loss" in names else names[0])
        name = self.metric.value or names[0]
        drawn = (model.metrics.version, name, self.metric_view.value)
        if drawn != self._drawn:  # a plot is the dearest part of a refresh: redrawn only when new
            self._drawn = drawn
            _set(self.plot, "value", markup.metric_plot(model.metrics.series(name, self.metric_view.value), name))

    def _refresh_ranks(self, model: DashboardModel) -> None:
        rows = [markup.rank_row_html(row) for row in model.rows()]
        for index, widget in enumerate(self._rank_rows):
            _set(widget, "value", rows[index] if index < len(rows) else "")
        _set(self._more_ranks, "value", "".join(rows[len(self._rank_rows):]))

    def _refresh_steps(self, options: list[tuple[str, int]]) -> None:
        if tuple(options) == tuple(self.steps.options):
            return
        selected = self.steps.value
        self.steps.options = options
        self.steps.value = selected if selected in {step for _, step in options} else None


@dataclass(frozen=True)
class _FollowUp:
    """A second question that a Yes leads to, instead of acting."""

    question: str
    action: Callable[[], str]


def _set(widget: widgets.Widget, name: str, value: object) -> None:
    if getattr(widget, name) != value:
        setattr(widget, name, value)


def _line(text: str, colour: str) -> str:
    return f'<span style="color:{colour}">{html.escape(text)}</span>'


def _note(text: str) -> str:
    return f'<small style="color:#6b7280">{html.escape(text)}</small>'

"""The dashboard in a real ipykernel: what its comms send while a cell runs, and a click on a
subshell (as JupyterLab sends it) served during a `%%fsdp2` training cell."""

from __future__ import annotations

import os

import pytest

from tests.support.dashboard_comms import SETUP, Iopub, click, create_subshell
from tests.support.kernel_client import WITHOUT_GPUS, Kernel


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    kernel = Kernel(env=WITHOUT_GPUS)
    iopub = Iopub(kernel)
    iopub.run(f"%load_ext fsdp2nb\nckpt_dir = {str(root / 'ckpt')!r}\nflag = {str(root / 'flag')!r}")
    iopub.started = iopub.run("%fsdp2 start --cpu 2")
    iopub.run("%fsdp2 push ckpt_dir flag")
    setup = iopub.run(SETUP)
    assert not [m for m in setup if m["msg_type"] == "error"], setup
    iopub.root = root
    yield iopub
    kernel.stop()


def test_start_shows_a_widget_with_a_text_fallback(dash):
    displays = [m["content"]["data"] for m in dash.started if m["msg_type"] == "display_data"]
    (shown,) = [d for d in displays if "application/vnd.jupyter.widget-view+json" in d]
    text = shown["text/plain"]
    assert "rank  state" in text and "\n0     " in text and "\n1     " in text
    assert dash.comm_of(_model_name="ButtonModel", description="Save now")


def test_rank_rows_update_while_a_cell_runs(dash):
    """The cell runs until the test has seen a rank row say "busy" (or 60 s pass)."""
    busy_seen = []

    def on_message(message):
        state = message["content"].get("data", {}).get("state", {}) if message["msg_type"] == "comm_msg" else {}
        if 'data-state="busy"' in str(state.get("value", "")) and not busy_seen:
            busy_seen.append(message)
            open(dash.root / "flag", "w").close()

    code = ("%%fsdp2\nimport os, time\ndeadline = time.monotonic() + 60\n"
            "while not os.path.exists(flag) and time.monotonic() < deadline:\n    time.sleep(0.05)\n"
            "print('flag seen' if os.path.exists(flag) else 'no flag')")
    messages = dash.run(code, on_message=on_message)
    os.remove(dash.root / "flag")
    outputs = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    assert busy_seen and "[all] flag seen" in outputs
    assert messages.index(busy_seen[0]) < len(messages) - 1


def test_the_header_follows_a_cell_as_it_starts_and_ends(dash):
    """With the periodic refresh an hour away, the header still says busy during a cell and
    ready after it: the panel is refreshed as a request starts and as it ends."""
    header = dash.wait_for_shown("<b>fsdp2nb</b> · pool")
    dash.run("import time\nimport fsdp2nb.frontend.dashboard_link as _link\n_link.REFRESH_S = 3600.0\n"
             "time.sleep(1)")  # the panel's current wait ends, the next lasts an hour
    try:
        before = len(dash.updates)
        dash.run("%%fsdp2\nimport time\ntime.sleep(1)")
        assert dash.was_sent(header, "value", "· busy", after=before, timeout=10), dash.updates[before:]
        busy_at = next(i for i, (cid, state) in enumerate(dash.updates) if i >= before and cid == header
                       and "· busy" in state.get("value", ""))
        assert dash.was_sent(header, "value", "· ready", after=busy_at + 1, timeout=10), dash.updates[busy_at:]
    finally:
        dash.run("_link.REFRESH_S = 0.5")
        dash.run("%%fsdp2\npass")  # wakes the panel's thread from its hour


def test_save_clicked_on_a_subshell_lands_at_the_next_maybe_save(dash):
    save = dash.comm_of(_model_name="ButtonModel", description="Save now")
    subshell = create_subshell(dash.kernel)
    clicked = []

    def on_message(message):
        if message["msg_type"] == "stream" and "step 1 " in message["content"]["text"] and not clicked:
            clicked.append(True)
            click(dash.kernel, save, subshell)

    code = ("%%fsdp2\nfor step in range(1, 3000):\n    loss = train_step(step)\n"
            "    if rank == 0 and step == 1: print(f'step {step} trained', flush=True)\n"
            "    if ckpt.maybe_save(step):\n        print(f'saved at step {step}')\n        break\n"
            "    time.sleep(0.02)\nckpt.wait()")
    message_widget = dash.comm_of(_model_name="HTMLModel", _dom_classes=["fsdp2nb-message"])
    updates_before = len(dash.updates)
    messages = dash.run(code, on_message=on_message)
    outputs = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    assert clicked, outputs
    saved = [int(line.split()[-1]) for line in outputs.splitlines() if "saved at step" in line]
    assert saved and len(set(saved)) == 1, outputs  # every rank served it at the same step
    assert (dash.root / "ckpt" / f"step-{saved[0]:06d}").is_dir()
    shown = [state["value"] for comm_id, state in dash.updates[updates_before:]
             if comm_id == message_widget and "value" in state]
    assert any("save requested" in text for text in shown), shown
    # Then the message follows the save to its end, however late the last sample comes.
    assert f"saved step {saved[0]}" in dash.wait_for(message_widget, "value", f"saved step {saved[0]}")


def test_metrics_magic_returns_the_logged_losses(dash):
    code = ("rows = %fsdp2 metrics\nrows = rows.to_dict('records') if hasattr(rows, 'to_dict') else rows\n"
            "print(sorted({r['rank'] for r in rows}), all('loss' in r for r in rows), len(rows) > 0)")
    messages = dash.run(code)
    out = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    assert out.strip() == "[0, 1] True True", out


def _stdout(messages: list[dict]) -> str:
    return "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")


def test_what_a_cell_logged_is_in_the_metrics_when_it_returns(dash):
    """The points a cell logs reach the kernel with its reply, not with a later snapshot (the
    next may come half a second later): the very next cell's `%fsdp2 metrics` has them, each time."""
    read = ("rows = %fsdp2 metrics\nrows = rows.to_dict('records') if hasattr(rows, 'to_dict') else rows\n"
            "print(sorted(r['rank'] for r in rows if r['step'] == {step}))")
    for step in range(80_000, 80_006):
        logged = dash.run(f"%%fsdp2\nfsdp2nb.log({step}, loss=float(rank))")
        assert not [m for m in logged if m["msg_type"] == "error"], _stdout(logged)
        seen = _stdout(dash.run(read.format(step=step))).strip()
        assert seen == "[0, 1]", (step, seen)


def test_terminal_ipython_prints_the_text_tables(tmp_path):
    """No kernel, no widget frontend: `%fsdp2 dashboard` prints the same facts as text."""
    import subprocess
    import sys

    script = tmp_path / "dash.ipy"
    script.write_text("%load_ext fsdp2nb\n%fsdp2 start --cpu 2 --no-dashboard\n%fsdp2 dashboard\n%fsdp2 stop\n")
    ipython = [sys.executable, "-m", "IPython", "--no-banner", "--colors=NoColor", str(script)]
    done = subprocess.run(ipython, capture_output=True, text=True, timeout=120, env={**os.environ, **WITHOUT_GPUS})
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert any(line.startswith("fsdp2nb pool: --cpu 2 · ready") for line in lines), done.stdout
    assert [line.split()[:2] for line in lines if line[:2] in ("0 ", "1 ")] == [["0", "idle"], ["1", "idle"]]
    assert "no tracked checkpointer" in done.stdout


def test_reset_peak_and_stop_act_during_a_cell(dash):
    """Reset peak, then Stop, clicked on a subshell while a cell runs: the cell ends interrupted."""
    buttons = {name: dash.comm_of(_model_name="ButtonModel", description=name) for name in ("Reset peak", "Stop")}
    subshell = create_subshell(dash.kernel)
    clicked, first_update = [], len(dash.updates)

    def on_message(message):
        if message["msg_type"] == "stream" and "waiting" in message["content"]["text"] and not clicked:
            clicked.append(True)
            click(dash.kernel, buttons["Reset peak"], subshell)
            click(dash.kernel, buttons["Stop"], subshell)

    messages = dash.run("%%fsdp2\nimport time\nprint('waiting', flush=True)\nfor _ in range(1200):\n"
                        "    time.sleep(0.05)\nprint('not stopped')", on_message=on_message)
    outputs = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    errors = ["\n".join(m["content"]["traceback"]) for m in messages if m["msg_type"] == "error"]
    assert clicked and "not stopped" not in outputs, outputs
    assert len(errors) == 1 and "KeyboardInterrupt" in errors[0], errors  # as the stop button does
    message_widget = dash.comm_of(_model_name="HTMLModel", _dom_classes=["fsdp2nb-message"])
    lines = [state["value"] for cid, state in dash.updates[first_update:] if cid == message_widget and "value" in state]
    assert any("peak memory readings restarted" in line for line in lines) and "stop sent" in lines[-1], lines


BAD_INPUT = """
import fsdp2nb
link = fsdp2nb._session.dashboard_link()
def attempt(action, *args):
    try:
        print("DONE", action(*args))
    except Exception as refused:
        print(type(refused).__name__, refused)
attempt(link.export, {file!r} + "/export")
attempt(link.load, 424242)
attempt(link.delete, link.model.checkpoint.latest_step)
attempt(link.delete, 424242)
"""


def test_bad_input_gets_one_line_and_changes_nothing(dash):
    """Through the link the buttons call, in the kernel: each refusal is one line, the steps stay."""
    steps_before = sorted(p.name for p in (dash.root / "ckpt").iterdir())
    a_file = dash.root / "a-file"
    a_file.write_text("")
    messages = dash.run(BAD_INPUT.format(file=str(a_file)))
    lines = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream").splitlines()
    assert [line.split()[0] for line in lines] == ["ActionRefused"] * 4, lines
    assert "is a file" in lines[0] and "step 424242 is not a complete checkpoint" in lines[1]
    assert "is LATEST" in lines[2] and "not a finished checkpoint" in lines[3]
    assert sorted(p.name for p in (dash.root / "ckpt").iterdir()) == steps_before


def test_a_save_no_maybe_save_reached_is_made_when_the_cell_ends(dash):
    save = dash.comm_of(_model_name="ButtonModel", description="Save now")
    message_widget = dash.comm_of(_model_name="HTMLModel", _dom_classes=["fsdp2nb-message"])
    subshell = create_subshell(dash.kernel)
    clicked = []

    def on_message(message):
        if message["msg_type"] == "stream" and "waiting" in message["content"]["text"] and not clicked:
            clicked.append(True)
            click(dash.kernel, save, subshell)
        state = message["content"].get("data", {}).get("state", {}) if message["msg_type"] == "comm_msg" else {}
        if message["content"].get("comm_id") == message_widget and "requested" in state.get("value", ""):
            open(dash.root / "flag", "w").close()  # the click was taken: let the cell end

    code = ("%%fsdp2\nimport os\ntrain_step(5000)\nckpt.maybe_save(5000)\nprint('waiting', flush=True)\n"
            "for _ in range(1200):\n    if os.path.exists(flag): break\n    time.sleep(0.05)")
    messages = dash.run(code, on_message=on_message)
    os.remove(dash.root / "flag")
    outputs = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    assert clicked and "saved step 5000 at the end of the cell" in outputs, outputs
    assert (dash.root / "ckpt" / "step-005000").is_dir()


RUN_AGAIN = """%%fsdp2
again.append(fsdp2nb.Checkpointer(again_dir, keep=None).track(model=model, optimizer=optimizer))
train_step(7000)
if rank == 0: print('waiting', flush=True)
for _ in range(1200):  # maybe_save is collective: every rank leaves at the same call
    if again[-1].maybe_save(7000): break
    time.sleep(0.05)
again[-1].wait()
"""


def test_a_run_again_into_the_same_directory_says_saved(dash):
    """A notebook run again from the top into the same directory saves the same step number:
    LATEST names that step before and after the save, and the panel still says it was saved."""
    save = dash.comm_of(_model_name="ButtonModel", description="Save now")
    message_widget = dash.comm_of(_model_name="HTMLModel", _dom_classes=["fsdp2nb-message"])
    subshell = create_subshell(dash.kernel)
    dash.run(f"%%fsdp2\nagain, again_dir = [], {str(dash.root / 'again')!r}")
    try:
        for run in ("first", "second"):
            clicked = []

            def on_message(message, clicked=clicked):
                if message["msg_type"] == "stream" and "waiting" in message["content"]["text"] and not clicked:
                    clicked.append(True)
                    click(dash.kernel, save, subshell)

            messages = dash.run(RUN_AGAIN, on_message=on_message)
            errors = [m["content"]["evalue"] for m in messages if m["msg_type"] == "error"]
            assert clicked and not errors, (run, errors)
            shown = dash.wait_for(message_widget, "value", "saved step 7000", timeout=30)
            assert "saved step 7000" in shown, (run, shown)
        click(dash.kernel, save, subshell)  # idle: saved at once, the same step a third time
        assert "the list shows" in dash.wait_for(message_widget, "value", "the list shows", timeout=30)
        assert "saved step 7000" in dash.wait_for(message_widget, "value", "saved step 7000", timeout=30)
    finally:  # the other tests save through the fixture's checkpointer again
        dash.run("%%fsdp2\nfor checkpointer in again: checkpointer.close()\n"
                 "ckpt.track(model=model, optimizer=optimizer)")
    assert (dash.root / "again" / "step-007000").is_dir()


def test_a_save_clicked_right_after_the_cell_that_tracks_a_checkpointer_is_made(dash):
    """The first click after the cell that tracks a checkpointer saves: the panel learns of the
    checkpointer with the cell's reply, not from a snapshot that may come half a second later."""
    save = dash.comm_of(_model_name="ButtonModel", description="Save now")
    message_widget = dash.comm_of(_model_name="HTMLModel", _dom_classes=["fsdp2nb-message"])
    for attempt in range(3):
        dash.run("%%fsdp2\nckpt.close()")  # none tracked; wait until the panel says so
        assert dash.wait_for_shown("no tracked checkpointer: run"), "the panel kept showing the closed checkpointer"
        tracked = dash.run("%%fsdp2\nckpt = fsdp2nb.Checkpointer(ckpt_dir, keep=None).track(model=model, "
                           f"optimizer=optimizer)\ntrain_step({8000 + attempt})\nckpt.maybe_save({8000 + attempt})")
        assert not [m for m in tracked if m["msg_type"] == "error"], _stdout(tracked)
        updates_before = len(dash.updates)
        click(dash.kernel, save, None)  # at once: idle, so served on fsdp2nb's own subshell
        said = dash.next_value(message_widget, "value", updates_before)
        assert said is not None and "saved; the list shows the new step" in said, (attempt, said)
        assert f"saved step {8000 + attempt}" in dash.wait_for(message_widget, "value", f"saved step {8000 + attempt}")
    assert (dash.root / "ckpt" / "step-008002").is_dir()


def test_a_click_sent_to_the_main_shell_is_served_during_the_cell(dash):
    """jupyter-distributed's proxy kernel forwards a click without its subshell id (the id names
    a subshell of the proxy), as frontends without subshells send it: it must not wait for the
    cell. The loop gives the save 30 s (a loaded machine starts the subshell slowly), then says
    it was not served."""
    save = dash.comm_of(_model_name="ButtonModel", description="Save now")
    clicked = []

    def on_message(message):
        if message["msg_type"] == "stream" and "waiting" in message["content"]["text"] and not clicked:
            clicked.append(True)
            click(dash.kernel, save, None)

    code = ("%%fsdp2\ntrain_step(6000)\nprint('waiting', flush=True)\nserved = False\n"
            "for _ in range(600):\n    served = ckpt.maybe_save(6000)\n    if served: break\n"
            "    time.sleep(0.05)\nckpt.wait()\nprint('served during the cell' if served else 'not served')")
    messages = dash.run(code, on_message=on_message)
    outputs = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    message_widget = dash.comm_of(_model_name="HTMLModel", _dom_classes=["fsdp2nb-message"])
    said = [state.get("value") for comm_id, state in dash.updates if comm_id == message_widget]
    assert clicked and "[all] served during the cell" in outputs, (outputs, said[-3:])
    notes = [state.get("value", "") for _, state in dash.updates if "main shell" in str(state.get("value", ""))]
    assert not notes, notes

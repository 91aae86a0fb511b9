"""The dashboard's Stop acts on a background run while the kernel is idle."""

import queue
import time

import pytest

from tests.support.dashboard_comms import SETUP, Iopub, click
from tests.support.kernel_client import WITHOUT_GPUS, Kernel


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    root = tmp_path_factory.mktemp("background")
    kernel = Kernel(env=WITHOUT_GPUS)
    iopub = Iopub(kernel)
    iopub.run(f"%load_ext fsdp2nb\nckpt_dir = {str(root / 'ckpt')!r}")
    iopub.run("%fsdp2 start --cpu 2")
    iopub.run("%fsdp2 push ckpt_dir")
    setup = iopub.run(SETUP)
    assert not [m for m in setup if m["msg_type"] == "error"], setup
    iopub.root = root
    yield iopub
    kernel.stop()


def _read_until(dash: Iopub, text: str, seen: list[dict], timeout: float = 120) -> list[dict]:
    """Messages from `seen` (read already) on, until a stream message that contains `text`."""
    if any(m["msg_type"] == "stream" and text in m["content"]["text"] for m in seen):
        return seen
    deadline, seen = time.monotonic() + timeout, list(seen)
    while time.monotonic() < deadline:
        try:
            message = dash.kernel.client.get_iopub_msg(timeout=1.0)
        except queue.Empty:
            continue
        dash._track(message)
        seen.append(message)
        if message["msg_type"] == "stream" and text in message["content"]["text"]:
            return seen
    raise TimeoutError(f"{text!r} not seen within {timeout} s")


def _until_header_says(dash: Iopub, text: str, timeout: float = 120) -> None:
    """Read iopub until a widget's value contains `text` (the panel refreshes twice a second)."""
    deadline = time.monotonic() + timeout
    while not any(text in str(state.get("value", "")) for state in dash.comms.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no widget said {text!r} within {timeout} s")
        try:
            dash._track(dash.kernel.client.get_iopub_msg(timeout=1.0))
        except queue.Empty:
            pass


def test_dashboard_stop_interrupts_a_background_run(dash):
    stop = dash.comm_of(_model_name="ButtonModel", description="Stop")
    started = dash.run("%%fsdp2 --bg --name looper\nimport time\nprint('looping', flush=True)\n"
             "for _ in range(1200):\n    time.sleep(0.05)\nprint('not stopped')")
    _read_until(dash, "looping", started)
    _until_header_says(dash, "(looper) running")  # the panel's pool line names the run
    click(dash.kernel, stop, subshell_id=None)  # sent to the main shell, as VS Code sends it
    waited = dash.run("%fsdp2 wait looper")
    errors = ["\n".join(m["content"]["traceback"]) for m in waited if m["msg_type"] == "error"]
    assert errors and "KeyboardInterrupt" in errors[-1]
    _until_header_says(dash, "(looper) interrupted")
    state = dash.run("print(looper.state)")
    assert "interrupted\n" in [m["content"]["text"] for m in state if m["msg_type"] == "stream"]


def test_save_clicked_during_a_background_run_lands_at_the_next_maybe_save(dash):
    save = dash.comm_of(_model_name="ButtonModel", description="Save now")
    started = dash.run("%%fsdp2 --bg --name trainer\nfor step in range(1, 3000):\n    loss = train_step(step)\n"
             "    if rank == 0 and step == 1: print('step 1 trained', flush=True)\n"
             "    if ckpt.maybe_save(step):\n        print(f'saved at step {step}', flush=True)\n        break\n"
             "    time.sleep(0.02)\nckpt.wait()")
    seen = _read_until(dash, "step 1 trained", started)
    click(dash.kernel, save, subshell_id=None)  # sent to the main shell, as VS Code sends it
    outputs = "".join(m["content"]["text"] for m in _read_until(dash, "saved at step", seen) if m["msg_type"] == "stream")
    waited = dash.run("%fsdp2 wait trainer")
    assert not [m for m in waited if m["msg_type"] == "error"]
    saved = [int(line.split()[-1]) for line in outputs.splitlines() if "saved at step" in line]
    assert saved and (dash.root / "ckpt" / f"step-{saved[0]:06d}").is_dir()

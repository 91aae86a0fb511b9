"""The dashboard's Stop acts on a background run while the kernel is idle."""

import queue
import time

import pytest

from fsdp2nb.testing.kernel_client import WITHOUT_GPUS, Kernel
from tests.kernel.test_dashboard import Iopub, _click


@pytest.fixture(scope="module")
def dash():
    kernel = Kernel(env=WITHOUT_GPUS)
    iopub = Iopub(kernel)
    iopub.run("%load_ext fsdp2nb")
    iopub.run("%fsdp2 start --cpu 2")
    yield iopub
    kernel.stop()


def _read_until(dash: Iopub, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = dash.kernel.client.get_iopub_msg(timeout=1.0)
        except queue.Empty:
            continue
        dash._track(message)
        if message["msg_type"] == "stream" and text in message["content"]["text"]:
            return
    raise TimeoutError(f"{text!r} not seen within {timeout} s")


def test_dashboard_stop_interrupts_a_background_run(dash):
    stop = dash.comm_of(_model_name="ButtonModel", description="Stop")
    dash.run("%%fsdp2 --bg --name looper\nimport time\nprint('looping', flush=True)\n"
             "for _ in range(1200):\n    time.sleep(0.05)\nprint('not stopped')")
    _read_until(dash, "looping")
    _click(dash.kernel, stop, subshell_id=None)  # the kernel is idle: served on the main shell
    waited = dash.run("%fsdp2 wait looper")
    errors = ["\n".join(m["content"]["traceback"]) for m in waited if m["msg_type"] == "error"]
    assert errors and "KeyboardInterrupt" in errors[-1]
    state = dash.run("print(looper.state)")
    assert "interrupted\n" in [m["content"]["text"] for m in state if m["msg_type"] == "stream"]

"""Drive a real ipykernel through jupyter_client, exactly as a notebook front end does.

Needs the `test` extra (jupyter_client, ipykernel); imported only by tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import time
from dataclasses import dataclass, field

from jupyter_client.manager import KernelManager


@dataclass
class CellRun:
    """The iopub messages one execute request produced, in arrival order."""

    status: str
    messages: list[dict] = field(default_factory=list)
    reply: dict = field(default_factory=dict)

    @property
    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.messages
                       if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(m["content"]["text"] for m in self.messages
                       if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")

    @property
    def error(self) -> dict | None:
        errors = [m["content"] for m in self.messages if m["msg_type"] == "error"]
        return errors[0] if errors else None

    @property
    def traceback_text(self) -> str:
        import re

        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(self.error["traceback"])) if self.error else ""

    @property
    def displays(self) -> list[dict]:
        return [m["content"] for m in self.messages if m["msg_type"] in ("display_data", "execute_result")]

    @property
    def display_ids(self) -> list[str]:
        """The display ids of the run's displays that may be updated later."""
        return [d["transient"]["display_id"] for d in self.displays if d.get("transient", {}).get("display_id")]

    @property
    def result_text(self) -> str:
        """The text of the cell's value (`Out[n]`), or "" when it has none."""
        results = [m["content"]["data"].get("text/plain", "") for m in self.messages
                   if m["msg_type"] == "execute_result"]
        return results[-1] if results else ""


WITHOUT_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
"""For kernels of CPU tests: their expectations (`--gpus` refused for want of CUDA, pools on
CPU ranks by default) must hold on a machine with GPUs too."""


class Kernel:
    """A started kernel with a blocking client; `stop()` shuts it down.

    `env` adds to (or overrides) this process's environment for the kernel and its ranks."""

    def __init__(self, env: dict[str, str] | None = None, cwd: str | None = None,
                 argv_prefix: list[str] | None = None) -> None:
        # Unix sockets in a private directory, as scripts/run_demo.py's kernel. TCP ports would be
        # picked free by the manager and bound by the kernel later: on a busy host another process
        # took one in between now and then, and the kernel died at start ("Address already in use").
        self._sockets = tempfile.TemporaryDirectory(prefix="kernel-sockets-")
        sockets = os.path.join(self._sockets.name, "kernel")
        if argv_prefix:
            self.manager = self._manager_with_prefix(argv_prefix, sockets)
        else:
            self.manager = KernelManager(kernel_name="python3", transport="ipc", ip=sockets)
        self.manager.start_kernel(env={**os.environ, **(env or {})}, cwd=cwd)
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self.other_messages: list[dict] = []
        """iopub messages `execute` read that belong to other requests (a background run's)."""
        self._replies: dict[str, dict] = {}

    def _manager_with_prefix(self, argv_prefix: list[str], sockets: str) -> KernelManager:
        """A kernel started through `argv_prefix` (e.g. `ip netns exec HOST`): on Unix sockets, a
        kernel in another network namespace is reached as any other (it has a loopback of its own)."""
        import json
        import sys

        from jupyter_client.kernelspec import KernelSpecManager

        spec_path = os.path.join(self._sockets.name, "specs", "prefixed")
        os.makedirs(spec_path)
        argv = [*argv_prefix, sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        with open(os.path.join(spec_path, "kernel.json"), "w") as spec:
            json.dump({"argv": argv, "display_name": "prefixed", "language": "python"}, spec)
        specs = KernelSpecManager(kernel_dirs=[os.path.dirname(spec_path)])
        return KernelManager(kernel_name="prefixed", kernel_spec_manager=specs, transport="ipc", ip=sockets)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.pid

    def execute(self, code: str, timeout: float = 120, on_message=None) -> CellRun:
        return self.collect(self.client.execute(code), code, timeout, on_message)

    def submit(self, code: str) -> str:
        """Send an execute request without waiting; `collect` its run later."""
        return self.client.execute(code)

    def collect(self, msg_id: str, code: str = "", timeout: float = 120, on_message=None) -> CellRun:
        """The run of request `msg_id`: its iopub messages until idle, and its reply."""
        run = CellRun(status="")
        deadline = time.monotonic() + timeout
        kept = [m for m in self.other_messages if m["parent_header"].get("msg_id") == msg_id]
        self.other_messages = [m for m in self.other_messages if m["parent_header"].get("msg_id") != msg_id]
        while True:
            if kept:
                message = kept.pop(0)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no idle status within {timeout} s for: {code[:80]!r}")
                try:
                    message = self.client.get_iopub_msg(timeout=min(remaining, 1.0))
                except queue.Empty:
                    continue
            if message["parent_header"].get("msg_id") != msg_id:
                self.other_messages.append(message)
                continue
            if on_message is not None:
                on_message(message)
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                break
            if message["msg_type"] not in ("status", "execute_input"):
                run.messages.append(message)
        while msg_id not in self._replies:
            reply = self.client.get_shell_msg(timeout=10)
            self._replies[reply["parent_header"].get("msg_id")] = reply
        run.reply = reply = self._replies.pop(msg_id)
        run.status = reply["content"]["status"]
        return run

    def messages_for(self, msg_id: str, until, timeout: float = 120) -> list[dict]:
        """iopub messages with parent `msg_id` (kept or still to come) until `until(messages)`."""
        deadline = time.monotonic() + timeout
        while True:
            mine = [m for m in self.other_messages if m["parent_header"].get("msg_id") == msg_id]
            if until(mine):
                return mine
            if time.monotonic() > deadline:
                raise TimeoutError(f"messages for {msg_id} did not complete within {timeout} s")
            try:
                self.other_messages.append(self.client.get_iopub_msg(timeout=1.0))
            except queue.Empty:
                pass

    def display_update(self, run: CellRun, display_id: str, timeout: float = 120) -> dict:
        """The content of the `update_display_data` that replaced display `display_id` of `run`
        (sent during the run or after it ended, as a reply to the run's request)."""
        msg_id = run.reply["parent_header"]["msg_id"]

        def updated(messages):
            return any(_updates(m, display_id) for m in messages)

        mine = [m for m in run.messages if _updates(m, display_id)]
        if not mine:
            mine = [m for m in self.messages_for(msg_id, updated, timeout) if _updates(m, display_id)]
        return mine[-1]["content"]

    def execute_and_interrupt(self, code: str, when_printed: str, timeout: float = 100) -> CellRun:
        """Run `code` and press the stop button once its output first contains `when_printed`."""
        pressed = []

        def on_message(message):
            if not pressed and message["msg_type"] == "stream" and when_printed in message["content"]["text"]:
                pressed.append(True)
                self.manager.interrupt_kernel()

        return self.execute(code, timeout=timeout, on_message=on_message)

    def stop(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)
        self._sockets.cleanup()


@contextlib.contextmanager
def kernels_with_fsdp2nb(env: dict[str, str], argv_prefix: list[str] | None = None):
    """Yields `start()`, which starts a kernel with fsdp2nb loaded; every kernel started ends on exit."""
    started: list[Kernel] = []

    def start() -> Kernel:
        kernel = Kernel(env=env, argv_prefix=argv_prefix)
        started.append(kernel)
        assert kernel.execute("%load_ext fsdp2nb").status == "ok"
        return kernel

    try:
        yield start
    finally:
        for kernel in started:
            with contextlib.suppress(Exception):  # one that died already (the tests kill some)
                kernel.stop()


def _updates(message: dict, display_id: str) -> bool:
    return (message["msg_type"] == "update_display_data"
            and message["content"].get("transient", {}).get("display_id") == display_id)

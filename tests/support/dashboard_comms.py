"""The dashboard as a front end sees it: every iopub message of a real kernel, the widgets'
states they carry, and button clicks sent as JupyterLab sends them."""

from __future__ import annotations

import queue
import time

from tests.support.kernel_client import Kernel

SETUP = """%%fsdp2
import time, fsdp2nb
from torch.distributed.fsdp import fully_shard
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = fsdp2nb.Checkpointer(ckpt_dir, keep=None).track(model=model, optimizer=optimizer)

def train_step(step):
    x = torch.randn(4, 16)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    fsdp2nb.log(step, loss=loss.item())
    return loss.item()
"""


class Iopub:
    """Every iopub message, whatever its parent (the dashboard's thread has none of ours)."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.comms: dict[str, dict] = {}  # comm id -> last known state
        self.updates: list[tuple[str, dict]] = []  # every state update, in order

    def run(self, code: str, on_message=None, timeout: float = 180) -> list[dict]:
        msg_id = self.kernel.client.execute(code)
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.kernel.client.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                continue
            seen.append(message)
            self._track(message)
            if on_message is not None:
                on_message(message)
            if (message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "status"
                    and message["content"]["execution_state"] == "idle"):
                return seen
        raise TimeoutError(f"no idle status within {timeout} s for {code[:60]!r}")

    def _track(self, message: dict) -> None:
        content = message["content"]
        if message["msg_type"] == "comm_open":
            self.comms[content["comm_id"]] = dict(content["data"].get("state", {}))
        elif message["msg_type"] == "comm_msg" and content["data"].get("method") == "update":
            self.comms.setdefault(content["comm_id"], {}).update(content["data"]["state"])
            self.updates.append((content["comm_id"], content["data"]["state"]))

    def wait_for(self, comm_id: str, key: str, wanted: str, timeout: float = 60) -> str:
        """The comm's `key` once it contains `wanted`: the dashboard's thread may still be sending
        updates after the cell's idle status (its samples are not tied to the cell)."""
        deadline = time.monotonic() + timeout
        while wanted not in self.comms[comm_id].get(key, "") and time.monotonic() < deadline:
            try:
                self._track(self.kernel.client.get_iopub_msg(timeout=0.5))
            except queue.Empty:
                continue
        return self.comms[comm_id].get(key, "")

    def _track_until(self, found, timeout: float):
        """`found()` once it is not None, tracking iopub messages meanwhile; None after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = found()
            if result is not None:
                return result
            try:
                self._track(self.kernel.client.get_iopub_msg(timeout=0.5))
            except queue.Empty:
                continue
        return None

    def next_value(self, comm_id: str, key: str, after: int, timeout: float = 60) -> str | None:
        """The first `key` the comm was sent after update number `after` (`len(self.updates)`
        before the action), once it comes; None after `timeout`."""
        return self._track_until(lambda: next((state[key] for cid, state in self.updates[after:]
                                               if cid == comm_id and key in state), None), timeout)

    def was_sent(self, comm_id: str, key: str, wanted: str, after: int, timeout: float = 60) -> bool:
        """Whether the comm was sent a `key` containing `wanted` after update number `after`,
        waiting for it up to `timeout`: a later update (another message) may already have
        replaced it."""
        return self._track_until(lambda: any(cid == comm_id and wanted in str(state.get(key, ""))
                                             for cid, state in self.updates[after:]) or None, timeout) is True

    def wait_for_shown(self, wanted: str, timeout: float = 60) -> str:
        """The id of a comm whose `value` contains `wanted`, once one does (None after `timeout`)."""
        return self._track_until(lambda: next((cid for cid, known in self.comms.items()
                                               if wanted in str(known.get("value", ""))), None), timeout)

    def comm_of(self, **state) -> str:
        return next(cid for cid, known in self.comms.items() if all(known.get(k) == v for k, v in state.items()))


def create_subshell(kernel: Kernel) -> str:
    """A new subshell of `kernel`, as JupyterLab asks for one to send comm messages on."""
    request = kernel.client.session.msg("create_subshell_request", {})
    kernel.client.control_channel.send(request)
    while True:
        reply = kernel.client.get_control_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == request["header"]["msg_id"]:
            return reply["content"]["subshell_id"]


def click(kernel: Kernel, comm_id: str, subshell_id: str | None) -> None:
    """What JupyterLab sends for a button click under its default commsOverSubshells setting;
    with `subshell_id` None, what a frontend without subshells, or a proxy kernel in between
    (jupyter-distributed), sends: a click for the main shell."""
    message = kernel.client.session.msg("comm_msg", {"comm_id": comm_id,
                                                     "data": {"method": "custom", "content": {"event": "click"}}})
    if subshell_id is not None:
        message["header"]["subshell_id"] = subshell_id
    kernel.client.shell_channel.send(message)

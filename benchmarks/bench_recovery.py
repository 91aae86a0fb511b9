"""From a failed collective to a pool that runs the next cell, against a restart and a reload.

On 4 CPU ranks with the tiny Llama loaded (`tests.support.training_cells.SETUP`: model,
optimizer, Checkpointer), one real kernel. Three failures, each measured from the moment it
happens (the failing rank's clock just before it raises, or the stop button) to the end of the
next cell that runs a collective on every rank:
- a rank raising while the others wait in all_reduce;
- a rank raising inside FSDP2's forward while the others wait in its all-gather;
- the stop button while rank 0 sleeps in Python and the others wait in all_reduce.
Against what the same failures cost before the groups could be re-formed: `%fsdp2 restart` and
the set-up cell run again (the model reloaded; the optimizer state is lost all the same).
Rounds alternate the two in one run. Run: .venv/bin/python -m benchmarks.bench_recovery [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support.kernel_client import WITHOUT_GPUS, Kernel
from tests.support.training_cells import SETUP

NUM_RANKS = 4
NEXT_CELL = "%%fsdp2\nt = torch.ones(1)\ndist.all_reduce(t)"
FAILURES = {
    "raise while others wait in all_reduce": (
        "%%fsdp2\nimport time\nt = torch.ones(1)\nif rank == 1:\n    print(repr(time.monotonic()), flush=True)\n"
        "    raise ValueError('bad batch')\ndist.all_reduce(t)"),
    "raise inside FSDP2's forward": (
        "%%fsdp2\nimport time\ndef fail(module, args):\n    if rank == 1:\n"
        "        print(repr(time.monotonic()), flush=True)\n        raise RuntimeError('out of memory (simulated)')\n"
        "hook = model.model.layers[1].register_forward_pre_hook(fail)\ntry:\n    train_step(0)\nfinally:\n"
        "    hook.remove()"),
}
STOP_CELL = ("%%fsdp2\nimport time\nt = torch.ones(1)\nprint('waiting', flush=True)\nif rank == 0:\n"
             "    time.sleep(60)\ndist.all_reduce(t)")


def _failed_at(stdout: str) -> float:
    """The failing rank's clock, printed just before it raised (one monotonic clock for all processes)."""
    return float(stdout.strip().splitlines()[-1].split("] ", 1)[1])


def recover_in_place(kernel: Kernel, failing_cell: str) -> float:
    """Seconds from the failure to the end of the next cell."""
    run = kernel.execute(failing_cell, timeout=300)
    assert run.status == "error" and "re-formed in place" in run.traceback_text, run.traceback_text
    after = kernel.execute(NEXT_CELL)
    assert after.status == "ok", after.traceback_text
    return time.monotonic() - _failed_at(run.stdout)


def recover_from_stop(kernel: Kernel) -> float:
    pressed: list[float] = []

    def on_message(message: dict) -> None:
        if not pressed and message["msg_type"] == "stream" and "waiting" in message["content"]["text"]:
            time.sleep(0.3)  # every rank is where it waits
            pressed.append(time.monotonic())
            kernel.manager.interrupt_kernel()

    run = kernel.execute(STOP_CELL, timeout=300, on_message=on_message)
    assert run.status == "error" and "re-formed in place" in run.traceback_text, run.traceback_text
    after = kernel.execute(NEXT_CELL)
    assert after.status == "ok", after.traceback_text
    return time.monotonic() - pressed[0]


def restart_and_reload(kernel: Kernel) -> float:
    """What a failure cost before: a fresh pool, then the model loaded again."""
    started = time.monotonic()
    assert kernel.execute(f"%fsdp2 restart --cpu {NUM_RANKS} --no-dashboard").status == "ok"
    _set_up(kernel)
    after = kernel.execute(NEXT_CELL)
    assert after.status == "ok", after.traceback_text
    return time.monotonic() - started


def _set_up(kernel: Kernel) -> None:
    assert kernel.execute("%fsdp2 push model_dir ckpt_dir").status == "ok"
    run = kernel.execute(SETUP, timeout=300)
    assert run.status == "ok", run.traceback_text
    run = kernel.execute("%%fsdp2\ntrain_step(0)")  # the optimizer has state to keep
    assert run.status == "ok", run.traceback_text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kernel = Kernel(env=WITHOUT_GPUS)
    in_place: dict[str, list[float]] = {name: [] for name in (*FAILURES, "stop button, ranks in all_reduce")}
    restarts: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        try:
            kernel.execute("%load_ext fsdp2nb")
            kernel.execute(f"%fsdp2 start --cpu {NUM_RANKS} --no-dashboard")
            kernel.execute(f"model_dir = {os.path.join(root, 'model')!r}\nckpt_dir = {os.path.join(root, 'ckpt')!r}")
            _set_up(kernel)
            for _ in range(args.rounds):
                for name, cell in FAILURES.items():
                    in_place[name].append(recover_in_place(kernel, cell))
                in_place["stop button, ranks in all_reduce"].append(recover_from_stop(kernel))
                restarts.append(restart_and_reload(kernel))
        finally:
            kernel.stop()
    restart = statistics.median(restarts)
    print(f"{NUM_RANKS} CPU ranks, tiny Llama with optimizer state; median of {args.rounds} rounds")
    print(f"restart + model reload (state lost): {restart:.2f} s")
    for name, times in in_place.items():
        median = statistics.median(times)
        print(f"{name}: error to next cell done {median:.2f} s, state kept ({median / restart:.2f}x the restart)")
    print("goal: at most 1 s from the error to a pool that runs the next cell")


if __name__ == "__main__":
    main()

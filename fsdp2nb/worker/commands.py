"""What `%fsdp2 save`/`load` and the dashboard's buttons run on every rank (a `RunCommand`).

Each command of `wire.requests.RankCommand` has one handler in `HANDLERS`; the kernel sends
typed commands, never Python source, so a renamed command fails where it is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from fsdp2nb.errors import UnknownRequest
from fsdp2nb.wire.requests import (
    DeleteCheckpoint,
    ExportHF,
    LoadCheckpoint,
    RankCommand,
    ReformGroups,
    SaveCheckpoint,
    SaveIfRequested,
)


def run_command(command: RankCommand) -> None:
    """Run `command` on this rank (every rank of the pool runs it: most are collective)."""
    handler = HANDLERS.get(type(command))
    if handler is None:
        raise UnknownRequest(f"{type(command).__name__} is not a command this rank knows; "
                             f"it knows {', '.join(cls.__name__ for cls in HANDLERS)}")
    handler(command)


def save_checkpoint(step: int | None, request_id: int = 0) -> None:
    """Save through the tracked checkpointer and wait until the save is committed. With a
    `request_id` the save serves that request, so the dashboard learns what became of it."""
    from fsdp2nb.checkpoint.requests import post_save_request
    from fsdp2nb.checkpoint.tracking import tracked_checkpointer

    checkpointer = tracked_checkpointer()
    step = step if step is not None else checkpointer.last_step
    if request_id and step is not None:
        post_save_request(request_id)
        checkpointer.maybe_save(step)  # every rank posted the same fresh id: it saves
    else:
        checkpointer.save(step)  # without a step seen, says how to give one
    checkpointer.wait()
    if _is_rank0():
        status = checkpointer.status()
        print(f"saved step {status.latest_step} in {status.directory}")


def load_checkpoint(target: int | str) -> None:
    """Restore model, optimizer, scheduler, RNG and step from a checkpoint of the tracked checkpointer."""
    from fsdp2nb.checkpoint.tracking import tracked_checkpointer

    step = tracked_checkpointer().load(target)
    if _is_rank0():
        print(f"loaded step {step}")


def _is_rank0() -> bool:
    from fsdp2nb.collectives import get_rank

    return get_rank() == 0


def delete_checkpoint(step: int) -> None:
    """Remove one step directory (the dashboard's Delete); rank 0 removes, every rank waits for it."""
    import torch.distributed as dist

    from fsdp2nb.checkpoint.layout import point_latest_at_newest, read_latest, remove_step_dir
    from fsdp2nb.checkpoint.tracking import tracked_checkpointer

    checkpointer = tracked_checkpointer()
    if _is_rank0():
        was_latest = read_latest(checkpointer.directory) == step
        remove_step_dir(checkpointer.directory, step)
        if was_latest:  # LATEST now names the newest complete step left, or nothing
            point_latest_at_newest(checkpointer.directory)
    if dist.is_initialized():
        dist.barrier()


def export_hf(path: str) -> None:
    """Write the tracked model in Hugging Face format to `path` (the dashboard's Export)."""
    from fsdp2nb.checkpoint import hf_export
    from fsdp2nb.checkpoint.tracking import tracked_checkpointer

    hf_export.export_hf(tracked_checkpointer().tracked_model, path)


def save_if_requested() -> None:
    """At the end of a cell: serve a save asked for from the dashboard that no `maybe_save` reached,
    at the last step the checkpointer saw. Every rank agrees on it inside `maybe_save`. Without a
    tracked checkpointer a Trainer's callback served it at a step's end, or it is dropped."""
    from fsdp2nb.checkpoint.requests import process_requests
    from fsdp2nb.checkpoint.tracking import current_checkpointer

    checkpointer = current_checkpointer()
    if checkpointer is None:  # a Trainer with fsdp2nb.TrainerCallback serves requests at its step ends
        requests, request_id = process_requests(), process_requests().pending()
        if request_id:  # served as failed: a later Trainer must not take it for a new click
            why = "no checkpointer tracks a model and no Trainer step with fsdp2nb.TrainerCallback ended after it"
            requests.mark_served(request_id)
            requests.mark_failed(request_id, why)
            if _is_rank0():
                print(f"the save asked for from the dashboard was dropped: {why}")
        return
    step = checkpointer.last_step
    if step is None:
        if _is_rank0():
            print("the save asked for from the dashboard was dropped: the checkpointer has seen no step yet")
        return
    if checkpointer.maybe_save(step):
        checkpointer.wait()
        if _is_rank0():
            print(f"saved step {step} at the end of the cell: the save was asked for after its last maybe_save")


def reform_groups(generation: int, after_release: int | None) -> None:
    """After the kernel released this rank's collectives (`after_release`, None after a collective
    that failed by itself): connect every process group afresh and reshard the FSDP2 modules whose
    iteration failed (those in the user's namespace, a Trainer's, the tracked checkpointer's). The
    user's variables, parameters and optimizer state stay."""
    from fsdp2nb.worker.reformable_groups import reform_groups as reform
    from fsdp2nb.worker.reformable_groups import unreformable_groups

    reform(generation, after_release)
    plain = unreformable_groups()
    if plain and _is_rank0():
        print(f"process group(s) {', '.join(plain)} were made with another backend and cannot be re-formed: "
              "their next collective fails; make groups with the pool's default backend "
              "(dist.new_group(ranks), without backend=)", file=sys.stderr)
    if "torch.distributed.fsdp" not in sys.modules:  # no FSDP2 module exists: nothing to reshard
        return
    from IPython import get_ipython

    from fsdp2nb.checkpoint.tracking import current_checkpointer
    from fsdp2nb.engine.failed_iteration import reset_failed_iterations

    shell = get_ipython()
    candidates = list(shell.user_ns.values()) if shell is not None else []
    checkpointer = current_checkpointer()
    if checkpointer is not None:
        candidates.append(checkpointer.tracked_model)
    reset_failed_iterations(candidates)


HANDLERS: dict[type, Callable[[Any], None]] = {
    SaveCheckpoint: lambda command: save_checkpoint(command.step, command.request_id),
    LoadCheckpoint: lambda command: load_checkpoint(command.target),
    DeleteCheckpoint: lambda command: delete_checkpoint(command.step),
    ExportHF: lambda command: export_hf(command.path),
    SaveIfRequested: lambda command: save_if_requested(),
    ReformGroups: lambda command: reform_groups(command.generation, command.after_release),
}
"""The handler of each command the kernel can send (`RankCommand`)."""

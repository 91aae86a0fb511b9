"""What `%fsdp2 save` and `%fsdp2 load` run on every rank while the pool is idle."""

from __future__ import annotations


def save_checkpoint(step: int | None) -> None:
    """Save through the tracked checkpointer and wait until the save is committed."""
    from fsdp2nb.checkpoint.tracking import tracked_checkpointer

    checkpointer = tracked_checkpointer()
    checkpointer.save(step)
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

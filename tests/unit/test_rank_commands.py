"""The commands the kernel sends the ranks (`%fsdp2 save`/`load`, the dashboard's buttons) are typed
messages, and every one the frontend can send has a handler on the ranks: a renamed or new
command fails here, not in a kernel test."""

import ast
import inspect
from pathlib import Path
from typing import get_args

import pytest
import torch

import fsdp2nb.frontend
from fsdp2nb.checkpoint import Checkpointer
from fsdp2nb.checkpoint.tracking import TrackedCheckpointer
from fsdp2nb.wire import requests
from fsdp2nb.wire.signing import KEY_BYTES, Signer
from fsdp2nb.worker import commands

COMMANDS = get_args(requests.RankCommand)
EXAMPLES = (requests.SaveCheckpoint(), requests.SaveCheckpoint(step=4), requests.LoadCheckpoint(target="latest"),
            requests.LoadCheckpoint(target=2), requests.DeleteCheckpoint(step=1), requests.ExportHF(path="/tmp/hf"),
            requests.SaveIfRequested(), requests.ReformGroups(generation=7))


def _commands_the_frontend_sends() -> set[str]:
    """The command classes the frontend builds as it calls `_run_on_ranks` (directly or through
    `_run_checkpoint_command`), read from its source."""
    sent = set()
    for path in Path(fsdp2nb.frontend.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("_run_on_ranks", "_run_checkpoint_command")):
                built = node.args[-1]
                if isinstance(built, ast.Call):
                    assert isinstance(built.func, ast.Name), f"{path.name}:{node.lineno}: build a command by its class"
                    sent.add(built.func.id)
    return sent


def test_every_command_the_frontend_sends_is_one_the_ranks_handle():
    sent = _commands_the_frontend_sends()
    assert sent == {"SaveCheckpoint", "LoadCheckpoint", "DeleteCheckpoint", "ExportHF", "SaveIfRequested"}
    assert sent <= {cls.__name__ for cls in COMMANDS}, "a command the frontend sends is missing from RankCommand"
    assert set(commands.HANDLERS) == set(COMMANDS), "each RankCommand needs exactly one handler on the ranks"


def test_the_frontend_sends_no_python_source_to_the_ranks():
    for path in Path(fsdp2nb.frontend.__file__).parent.glob("*.py"):
        assert "__import__(" not in path.read_text(), path.name


def test_commands_keep_their_type_and_fields_through_a_frame():
    assert {type(example) for example in EXAMPLES} == set(COMMANDS)
    signer = Signer(b"k" * KEY_BYTES)
    for example in EXAMPLES:
        message = requests.RunCommand(cell_id=5, command=example)
        received = signer.unpack(signer.pack(message))
        assert type(received) is requests.RunCommand and received == message
        assert type(received.command) is type(example)


def test_a_command_the_rank_does_not_know_is_refused_by_name():
    with pytest.raises(TypeError, match=r"str is not a command this rank knows; it knows SaveCheckpoint, "):
        commands.run_command("save_checkpoint(None)")


def test_commands_save_load_and_delete_through_the_tracked_checkpointer(tmp_path, capsys):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, async_save=False) as checkpointer:
        checkpointer.track(model=model, optimizer=optimizer)
        commands.run_command(requests.SaveCheckpoint(step=1))
        commands.run_command(requests.SaveCheckpoint(step=2))
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        commands.run_command(requests.LoadCheckpoint(target=1))
        commands.run_command(requests.LoadCheckpoint(target="latest"))
        assert torch.equal(model.weight, saved)
        commands.run_command(requests.DeleteCheckpoint(step=2))
        assert [entry.step for entry in checkpointer.list()] == [1] and checkpointer.latest() == 1
        commands.run_command(requests.SaveIfRequested())  # nothing was requested: no save
        assert [entry.step for entry in checkpointer.list()] == [1]
    assert capsys.readouterr().out.splitlines() == [
        f"saved step 1 in {tmp_path}", f"saved step 2 in {tmp_path}", "loaded step 1", "loaded step 2"]


def test_the_checkpointer_has_every_member_the_ranks_use(tmp_path):
    members = {name for name in vars(TrackedCheckpointer) if not name.startswith("_")}
    members |= set(TrackedCheckpointer.__annotations__)
    assert {"save", "load", "wait", "status", "last_step", "tracked_model", "directory"} <= members
    with Checkpointer(tmp_path, async_save=False) as checkpointer:
        for name in members:
            inspect.getattr_static(checkpointer, name)  # raises AttributeError if it is gone


def test_a_request_no_trainer_step_served_is_dropped_at_the_cell_end_in_one_line(capsys):
    """No tracked checkpointer: a Trainer's callback serves requests at its step ends; one left
    unserved when the cell ends is marked failed, so a later Trainer does not take it for a click."""
    from fsdp2nb.checkpoint.requests import post_save_request, process_requests
    from fsdp2nb.checkpoint.tracking import current_checkpointer

    assert current_checkpointer() is None
    request_id = post_save_request()
    commands.save_if_requested()
    outcome = process_requests().outcome()
    assert process_requests().pending() == 0 and outcome.served == request_id
    assert outcome.error is not None and "no Trainer step" in outcome.error
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("the save asked for from the dashboard was dropped: no checkpointer tracks a model")

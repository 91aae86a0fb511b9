"""The Trainer's `checkpoint-N` directories as the dashboard lists them, from real directories."""

from __future__ import annotations

import json

from fsdp2nb.checkpoint.trainer_dirs import list_trainer_checkpoints


def _checkpoint(root, step: int, *, ranks: int = 2, dcp_done: bool = True, state: str | None = "{}") -> None:
    dcp = root / f"checkpoint-{step}" / "fsdp2nb_dcp"
    dcp.mkdir(parents=True)
    for rank in range(ranks):
        (dcp / f"__{rank}_0.distcp").write_bytes(b"x" * 100)
    if dcp_done:
        (dcp / ".metadata").write_bytes(b"m")
    if state is not None:
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text(state)


def test_complete_and_incomplete_checkpoints_oldest_first(tmp_path):
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 12, dcp_done=False)  # a save that died before DCP's metadata
    _checkpoint(tmp_path, 14, state='{"global_step": 1')  # trainer_state.json cut short
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "runs").mkdir()
    status = list_trainer_checkpoints(str(tmp_path))
    assert [(e.step, e.valid) for e in status.entries] == [(2, True), (10, True), (12, False), (14, False)]
    assert status.latest_step == 10 and status.directory == str(tmp_path)
    first = status.entries[0]
    assert first.world_size == 2 and first.size_bytes == 200 + 1 + 2 and first.wall_time is not None
    assert first.path == str(tmp_path / "checkpoint-2")


def test_a_directory_not_made_yet_lists_nothing(tmp_path):
    status = list_trainer_checkpoints(str(tmp_path / "not-yet"))
    assert status.entries == () and status.latest_step is None
    assert json.dumps(status.directory)  # a plain string, as the wire carries it

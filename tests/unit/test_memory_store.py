"""The snapshot store as the kernel reads it (no torch): which step every rank holds, and which
stores the reaper frees."""

from __future__ import annotations

import struct

import pytest

from fsdp2nb.host import memory_store


@pytest.fixture()
def root(tmp_path, monkeypatch):
    monkeypatch.setenv(memory_store.SHARED_MEMORY_DIR_ENV, str(tmp_path))
    return memory_store.stores_root()


def _manifest(folder, rank: int, steps: list[int | None], world_size: int = 2) -> None:
    """Rank `rank`'s manifest, and its two slots' steps on the board (None: being written)."""
    folder.mkdir(parents=True, exist_ok=True)
    memory_store.write_manifest(folder, rank, {
        "version": memory_store.MANIFEST_VERSION, "directory": "/ckpt/run", "rank": rank,
        "world_size": world_size, "local_world_size": world_size, "mesh": "cpu(2,)", "pid": 1,
        "layouts": [[], []]})
    board = memory_store.board_path(folder)
    raw = bytearray(board.read_bytes() if board.exists() else bytes(16 * world_size))
    raw[16 * rank:16 * rank + 16] = struct.pack("<2q", *(0 if step is None else step + 1 for step in steps))
    board.write_bytes(bytes(raw))
    (folder / f"rank-{rank:05d}.slot0").write_bytes(b"x" * 100)


def test_the_kept_step_is_the_newest_that_every_rank_holds(root):
    store = memory_store.session_store(123, 4.5)
    folder = memory_store.checkpointer_folder(store, "/ckpt/run")
    _manifest(folder, 0, [7, 6])
    _manifest(folder, 1, [None, 6])  # rank 1 died while copying step 7
    [kept] = memory_store.kept_snapshots(store)
    assert (kept.step, kept.directory, kept.num_ranks_here, kept.world_size) == (6, "/ckpt/run", 2, 2)
    assert kept.num_bytes >= 200
    assert kept.describe().startswith("step 6 of /ckpt/run (")


def test_a_store_missing_a_rank_or_a_common_step_keeps_nothing(root):
    store = memory_store.session_store(123, 4.5)
    folder = memory_store.checkpointer_folder(store, "/ckpt/run")
    _manifest(folder, 0, [7, 6])
    assert memory_store.kept_snapshots(store) == []  # rank 1 has no manifest
    _manifest(folder, 1, [8, None])
    assert memory_store.kept_snapshots(store) == []
    assert memory_store.kept_snapshots("") == []


def test_the_sweep_frees_stores_whose_kernel_or_kept_pool_is_gone(root, tmp_path):
    alive_kernel = memory_store.session_store(10, 1.0)
    dead_kernel = memory_store.session_store(11, 2.0)
    (tmp_path / "pools" / "lab").mkdir(parents=True)  # a kept pool's directory, wherever its TMPDIR put it
    kept_alive, kept_gone, spared, unmarked = (memory_store.kept_store(name)
                                                for name in ("lab", "old", "restarting", "unmarked"))
    for store in (alive_kernel, dead_kernel, unmarked):
        store.mkdir()
    memory_store.mark_owner(kept_alive, tmp_path / "pools" / "lab")
    memory_store.mark_owner(kept_gone, tmp_path / "pools" / "old")
    memory_store.mark_owner(spared, tmp_path / "pools" / "restarting")
    removed = memory_store.sweep_stores(lambda pid, started: (pid, started) == (10, 1.0),
                                        spare=str(spared))
    assert removed == 2
    assert sorted(path.name for path in root.iterdir()) == sorted(
        [alive_kernel.name, kept_alive.name, spared.name, unmarked.name])


def test_the_board_a_rank_maps_reads_the_same_to_the_kernel(tmp_path):
    board = memory_store.Board(tmp_path, 2)
    try:
        board.set(1, 0, 7)
        board.mark_failed(0, 1, 3)
        assert memory_store.read_board(tmp_path, 2) == [(-1, -5), (7, -1)]  # a failed copy: no step
        assert memory_store.read_board(tmp_path, 3)[2] == (-1, -1)  # a rank beyond the board: none
    finally:
        board.close()

"""directory_swap on plain directories: what is kept, what is dropped, and each way of swapping."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fsdp2nb.checkpoint.directory_swap import (
    commit_staging,
    exchange_paths,
    is_mount,
    staging_paths,
    start_staging,
    unescape_mount_path,
)


def _keep_notes(name: str) -> bool:
    return name.startswith("notes")


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def target(tmp_path) -> Path:
    target = tmp_path / "out"
    (target / "notes-dir").mkdir(parents=True)
    (target / "notes-dir" / "a.txt").write_text("kept dir")
    (target / "notes.md").write_text("kept")
    (target / "weights.bin").write_text("old weights")
    (target / "shared.txt").write_text("old version")
    return target


def _stage_new(target: Path, **options) -> Path:
    staging = start_staging(target, **options)
    (staging / "weights2.bin").write_text("new weights")
    (staging / "shared.txt").write_text("new version")
    return staging


NEW_TREE = {"notes-dir/a.txt": "kept dir", "notes.md": "kept", "shared.txt": "new version",
            "weights2.bin": "new weights"}


@pytest.mark.parametrize("exchange", [exchange_paths, lambda a, b: False], ids=["renameat2", "two-renames"])
def test_a_swap_keeps_carried_entries_and_drops_the_rest(target, exchange):
    os.chmod(target, 0o2770)
    staging = _stage_new(target)
    assert staging.parent == target.parent  # a sibling: the target can be renamed
    commit_staging(staging, target, carry=_keep_notes, exchange=exchange)
    assert _tree(target) == NEW_TREE
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o2770
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]


def test_staging_inside_a_target_that_cannot_be_renamed(target):
    staging = _stage_new(target, inside=True)
    assert staging.parent == target
    commit_staging(staging, target, carry=_keep_notes)
    assert _tree(target) == NEW_TREE
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]


def test_a_new_target_is_renamed_into_place(tmp_path):
    target = tmp_path / "new" / "out"
    staging = start_staging(target)
    (staging / "f").write_text("x")
    commit_staging(staging, target, carry=_keep_notes)
    assert _tree(target) == {"f": "x"} and sorted(p.name for p in target.parent.iterdir()) == ["out"]


def test_a_crash_between_the_two_renames_is_undone_by_the_next_start(target):
    before = _tree(target)
    staging, aside = staging_paths(target, inside=False)
    target.rename(aside)  # the old directory moved aside, the staged one not yet renamed in
    staging.mkdir()
    start_staging(target)
    assert _tree(target) == before and not aside.exists()


def test_mount_points_are_recognised_from_mountinfo(tmp_path):
    assert unescape_mount_path(r"/mnt/my\040models\134x") == "/mnt/my models\\x"
    assert is_mount(Path("/")) and not is_mount(tmp_path)

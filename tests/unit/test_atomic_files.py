"""`atomic_files`: the new content whole in place, private where asked, never written through a
planted link, a file made first kept by `create_atomically`, and no temporary file left behind,
even where the write fails."""

from __future__ import annotations

import os
import stat

import pytest

from fsdp2nb.atomic_files import create_atomically, replace_atomically


def test_the_new_content_replaces_the_old_and_nothing_else_is_left(tmp_path):
    target = tmp_path / "record"
    target.write_bytes(b"old")
    replace_atomically(target, b"new", durable=True)
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["record"]


def test_a_private_file_is_readable_by_this_user_only(tmp_path):
    replace_atomically(tmp_path / "signed", b"x", private=True)
    assert stat.S_IMODE((tmp_path / "signed").stat().st_mode) == 0o600


def test_a_failed_replace_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()  # a directory where the file should go: os.replace fails
    with pytest.raises(OSError):
        replace_atomically(target, b"new")
    assert os.listdir(tmp_path) == ["taken"]


def test_a_link_planted_where_a_temporary_once_went_is_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"theirs")
    target = tmp_path / "record"
    (tmp_path / f".record.{os.getpid()}.tmp").symlink_to(victim)  # a name guessed from this process's id
    replace_atomically(target, b"new", private=True)
    assert victim.read_bytes() == b"theirs"
    assert not target.is_symlink() and target.read_bytes() == b"new"


def test_create_atomically_keeps_the_file_made_first_and_reserves_room(tmp_path):
    board = tmp_path / "board"
    assert create_atomically(board, private=True, num_reserved_bytes=64)
    assert board.stat().st_size == 64 and stat.S_IMODE(board.stat().st_mode) == 0o600
    board.write_bytes(b"\1" * 64)
    assert not create_atomically(board, private=True, num_reserved_bytes=128)
    assert board.read_bytes() == b"\1" * 64
    assert os.listdir(tmp_path) == ["board"]

"""`atomic_files.replace_atomically`: the new content whole in place, private where asked, and
no temporary file left behind, even where the write fails."""

from __future__ import annotations

import os
import stat

import pytest

from fsdp2nb.atomic_files import replace_atomically


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

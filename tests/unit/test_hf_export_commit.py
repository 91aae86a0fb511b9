"""export_hf swaps a finished export in whole: a failed or interrupted export leaves the
previous one loadable and unchanged, and files the export does not own are carried over."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp2nb import export_hf
from fsdp2nb.checkpoint.directory_swap import staging_paths
from fsdp2nb.examples.tiny_models import make_tiny_model


class _FailingProcessor:
    def save_pretrained(self, directory) -> None:
        (Path(directory) / "tokenizer.json").write_text("{}")  # half written when it fails
        raise OSError("disk full")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _hidden_siblings(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def earlier_export(tmp_path):
    out = tmp_path / "export"
    export_hf(make_tiny_model("llama", seed=0), out, max_shard_bytes=20_000)
    (out / "README.md").write_text("my notes")
    return out


def test_a_failed_export_leaves_the_previous_one_untouched(earlier_export):
    before = _snapshot(earlier_export)
    with pytest.raises(OSError, match="disk full"):
        export_hf(make_tiny_model("llama", seed=1), earlier_export, processor=_FailingProcessor())
    assert _snapshot(earlier_export) == before
    assert _hidden_siblings(earlier_export) == []


def test_a_new_export_replaces_weights_and_keeps_user_files(earlier_export):
    from transformers import AutoModelForCausalLM

    (earlier_export / "model.safetensors").write_bytes(b"stale single-file weights")
    (earlier_export / "notes").mkdir()
    (earlier_export / "notes" / "run.txt").write_text("lr 1e-4")
    model = make_tiny_model("llama", seed=1)
    export_hf(model, earlier_export)

    assert (earlier_export / "README.md").read_text() == "my notes"
    assert (earlier_export / "notes" / "run.txt").read_text() == "lr 1e-4"
    assert not (earlier_export / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(earlier_export)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert _hidden_siblings(earlier_export) == []


def test_an_export_stopped_mid_swap_is_restored_by_the_next(earlier_export):
    before = _snapshot(earlier_export)
    staging, aside = staging_paths(earlier_export, inside=False)
    # A crash between the fallback swap's two renames: the old export aside, a new one staged.
    earlier_export.rename(aside)
    staging.mkdir()
    (staging / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(OSError, match="disk full"):
        export_hf(make_tiny_model("llama", seed=1), earlier_export, processor=_FailingProcessor())
    assert _snapshot(earlier_export) == before
    assert _hidden_siblings(earlier_export) == []


def test_a_file_as_output_dir_is_refused(tmp_path):
    target = tmp_path / "weights.bin"
    target.write_bytes(b"keep")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        export_hf(make_tiny_model("llama", seed=0), target)
    assert target.read_bytes() == b"keep"


def test_an_export_through_a_symlink_replaces_its_target(earlier_export):
    link = earlier_export.with_name("latest-export")
    link.symlink_to(earlier_export, target_is_directory=True)
    export_hf(make_tiny_model("llama", seed=1), link)
    assert link.is_symlink() and (earlier_export / "README.md").read_text() == "my notes"
    assert _hidden_siblings(earlier_export) == []


def test_the_replaced_directory_keeps_its_permissions(earlier_export):
    import os
    import stat

    os.chmod(earlier_export, 0o2770)
    export_hf(make_tiny_model("llama", seed=1), earlier_export)
    assert stat.S_IMODE(os.stat(earlier_export).st_mode) == 0o2770

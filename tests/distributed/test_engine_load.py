"""Sharded loading on 2 and 4 gloo ranks: every tensor bit-exact, buffers as from_pretrained, ties kept."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
from tests.support.gloo_harness import run_ranks

INIT_MODES = ("meta", "rank0", "default")


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _fsdp_unit_names(model) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _load_every_way(path: str) -> dict:
    """Load with each init mode; return full tensors, buffers, tie status and what meta loading read."""
    from fsdp2nb.engine import FSDP2Engine, load_model

    results = {}
    for init in INIT_MODES:
        engine = FSDP2Engine(mixed_precision="fp32")
        model, processor = load_model(path, init=init, engine=engine)
        base = model
        results[init] = dict(
            state=_full_state(model),
            buffers={k: b.detach().clone() for k, b in model.named_buffers()},
            tied=base.get_input_embeddings().weight is base.get_output_embeddings().weight,
            processor=type(processor).__name__,
            units=_fsdp_unit_names(model),
            bytes_requested=engine.last_load_report.bytes_requested if init == "meta" else None,
            direct_io=engine.last_load_report.direct_io if init == "meta" else None,
        )
    return results


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _evict_from_page_cache(path: Path) -> bool:
    """Make `path` cold, as a checkpoint not read since boot is; whether it is now cold and can be
    read with O_DIRECT (else the direct path is not checked).

    FADV_DONTNEED skips pages still in another CPU's LRU batch, so it is repeated until they go.
    """
    from fsdp2nb.engine.direct_reads import cached_fraction

    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(20):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if cached_fraction(fd, os.fstat(fd).st_size) < 0.1:
                return True
            time.sleep(0.05)
    finally:
        os.close(fd)
    return False


@pytest.mark.parametrize(("family", "tied", "world_size", "cold"),
                         [("llama", False, 2, True), ("qwen2", True, 4, False), ("gemma", True, 2, False)])
def test_every_init_mode_loads_the_checkpoint_exactly(tmp_path, family, tied, world_size, cold):
    # The cold one is several times the disk's read-ahead (8 MiB here), which reading the header
    # would otherwise bring into the page cache whole.
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, tie_word_embeddings=tied,
                                **(dict(vocab_size=40_000, intermediate_size=30_000) if cold else {}))
    # A cold file is read with direct I/O, a cached one through the page cache: both paths checked.
    direct_possible = _evict_from_page_cache(path / "model.safetensors") if cold else False
    per_rank = run_ranks(_load_every_way, world_size, str(path))
    stored = load_file(path / "model.safetensors")
    reference = _reference(path)
    ref_buffers = dict(reference.named_buffers())
    for init in INIT_MODES:
        got = per_rank[0][init]
        for key, tensor in stored.items():
            assert torch.equal(got["state"][key], tensor), f"{init}: {key} differs from the checkpoint"
        assert set(got["state"]) == set(reference.state_dict()), init
        for key, buffer in ref_buffers.items():
            assert torch.equal(got["buffers"][key], buffer), f"{init}: buffer {key} differs from from_pretrained"
        assert all(r[init]["tied"] == tied for r in per_rank), init
        assert got["processor"] != "NoneType"
    # Per-block units plus embedding and [final norm, head] (one unit, both modules marked) when
    # untied; a tied pair stays in the root.
    units = per_rank[0]["meta"]["units"]
    untied_units = ["model.embed_tokens", "model.norm", "lm_head"]
    expected = ["", "model.layers.0", "model.layers.1"] + ([] if tied else untied_units)
    assert sorted(units) == sorted(expected)
    if tied:
        assert torch.equal(per_rank[0]["meta"]["state"]["lm_head.weight"], stored["model.embed_tokens.weight"])
    # Shards of a 1-D mesh are disjoint and cover every tensor, so the slices add up exactly.
    requested = [r["meta"]["bytes_requested"] for r in per_rank]
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    assert sum(requested) == checkpoint_bytes
    if cold and direct_possible:
        assert all(r["meta"]["direct_io"] for r in per_rank)
    if not cold:
        assert not any(r["meta"]["direct_io"] for r in per_rank)  # a file just written is cached
    assert max(requested) < 1.1 * checkpoint_bytes / world_size + 1024  # small 1-D tensors split unevenly


def _load_formats_and_failures(paths: dict[str, str]) -> dict:
    from fsdp2nb.engine import FSDP2Engine, load_model

    out: dict = {}
    for name in ("sharded", "bin", "bare_prefix"):
        model, _ = load_model(paths[name], engine=FSDP2Engine(mixed_precision="fp32"))
        out[name] = _full_state(model)
    try:
        load_model(paths["missing"], engine=FSDP2Engine(mixed_precision="fp32"))
        out["missing_error"] = None
    except KeyError as error:
        out["missing_error"] = str(error)
    engine = FSDP2Engine(mixed_precision="fp32")
    model, _ = load_model(paths["missing"], engine=engine, allow_missing=["model.norm.weight"])
    out["allowed"] = (engine.last_load_report.zero_filled, _full_state(model)["model.norm.weight"])
    out["unexpected"] = engine.last_load_report.unexpected
    try:
        FSDP2Engine(mixed_precision="fp32", offload_params=True)
        out["offload_error"] = None
    except ValueError as error:
        out["offload_error"] = str(error)
    return out


def _rewrite(source: Path, target: Path, edit) -> Path:
    """Copy a single-file checkpoint directory, passing its tensors through `edit`."""
    target.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    save_file(edit(load_file(source / "model.safetensors")), target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_sharded_bin_prefix_and_missing_keys(tmp_path, caplog):
    base = save_tiny_checkpoint(tmp_path / "base", "qwen2", tie_word_embeddings=True)
    stored = load_file(base / "model.safetensors")
    paths = {
        "sharded": save_tiny_checkpoint(tmp_path / "sharded", "qwen2", tie_word_embeddings=True, checkpoint_format="sharded"),
        "bin": save_tiny_checkpoint(tmp_path / "bin", "qwen2", tie_word_embeddings=True, checkpoint_format="bin"),
        # A checkpoint of the bare decoder: keys lack the "model." prefix of the causal-LM class.
        "bare_prefix": _rewrite(base, tmp_path / "bare", lambda sd: {k.removeprefix("model."): v for k, v in sd.items()}),
        "missing": _rewrite(
            base, tmp_path / "missing",
            lambda sd: {**{k: v for k, v in sd.items() if k != "model.norm.weight"}, "extra.weight": torch.ones(2)},
        ),
    }
    assert len(list(paths["sharded"].glob("*.safetensors"))) > 1
    out = run_ranks(_load_formats_and_failures, 2, {k: str(v) for k, v in paths.items()})[0]
    for name in ("sharded", "bin", "bare_prefix"):
        for key, tensor in stored.items():
            assert torch.equal(out[name][key], tensor), f"{name}: {key}"
    assert out["missing_error"] is not None and "model.norm.weight" in out["missing_error"]
    zero_filled, norm = out["allowed"]
    assert zero_filled == ["model.norm.weight"] and torch.count_nonzero(norm) == 0
    assert out["unexpected"] == ["extra.weight"]
    assert out["offload_error"] is not None and "offload_params=True" in out["offload_error"]


def test_logging_is_library_safe():
    from fsdp2nb.engine import sharded_load

    assert sharded_load.logger.name == "fsdp2nb.engine.sharded_load"
    assert not logging.getLogger("fsdp2nb").handlers

"""Turn a local path or a Hub id into a local checkpoint directory, downloading once per node."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from fsdp2nb.collectives import is_distributed
from fsdp2nb.errors import ModelNotFound

logger = logging.getLogger(__name__)

# Only what loading needs: config, weight index and tokenizer/processor files (chat templates
# included), then the weights in one format: safetensors where the repository has them.
SUPPORT_PATTERNS: tuple[str, ...] = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja")
WEIGHT_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/true/yes/on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _default_download(repo_id: str, *, local_files_only: bool) -> str:
    from huggingface_hub import snapshot_download

    for weights in WEIGHT_PATTERNS:
        directory = snapshot_download(repo_id, local_files_only=local_files_only,
                                      allow_patterns=[*SUPPORT_PATTERNS, weights])
        if any(Path(directory).glob(weights)):
            break
    return directory


def looks_like_a_path(name: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else is meant as a local path."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.path.exists(name)


def resolve_model_dir(
    name_or_path: str | os.PathLike, *, download: Callable[..., str] = _default_download
) -> str:
    """A local directory for `name_or_path`.

    A local path is used as is. A Hub id is fetched by local rank 0 of each node (offline when
    HF_HUB_OFFLINE is set); the other local ranks wait at a barrier and then resolve it from the
    node's cache without network access.
    """
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return path
    if looks_like_a_path(path):
        raise ModelNotFound(f"{path!r} is not a model directory (it {'is a file' if os.path.exists(path) else 'does not exist'}); "
                            "give the directory holding config.json and the weights, or a Hub id like 'owner/name'")
    distributed = is_distributed()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if distributed else 0))
    failure: BaseException | None = None
    resolved = ""
    if local_rank == 0:
        try:
            resolved = download(path, local_files_only=hub_offline())
        except BaseException as error:  # reach the barrier first so other ranks do not hang
            failure = error
    if distributed:
        dist.barrier()
    if failure is not None:
        raise failure
    if local_rank != 0:
        resolved = download(path, local_files_only=True)
    logger.info("resolved %s to %s", path, resolved)
    return resolved

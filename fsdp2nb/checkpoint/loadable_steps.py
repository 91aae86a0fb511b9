"""Which step directories a load can restore, and which one it restores.

A load's target ("latest", a step, or a step directory's path) is resolved to a directory by
rank 0 and agreed on by every rank; every rank then checks the files (sizes, and its share of
the checksums) before any live tensor is touched. A step found damaged is remembered: listings
call it invalid from then on, until a new save of the step replaces its directory. "latest"
falls back to the newest intact step before a damaged one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdp2nb.checkpoint import layout
from fsdp2nb.checkpoint.layout import CheckpointEntry, CheckpointMetadata
from fsdp2nb.errors import CheckpointLoadError, InvalidValue

logger = logging.getLogger(__name__)


class LoadableSteps:
    """The steps of one checkpoint directory as a load sees them: listed (with the damage loads
    found), resolved from a load's target, and checked on every rank before the load."""

    def __init__(self, directory: Path, *, checksums: bool, rank: int, world_size: int,
                 distributed: bool) -> None:
        self.directory = directory
        self.checksums = checksums
        """Whether the files' CRC32s are checked before a load (see CheckpointerConfig.checksums)."""
        self._rank, self._world_size, self._distributed = rank, world_size, distributed
        self._listing_cache: tuple[tuple, tuple] | None = None  # see listing
        # Steps a load found damaged where sizes cannot tell (a same-size overwrite): step ->
        # (identity of its directory, what is damaged). A new save of the step is a new directory.
        self._damaged: dict[int, tuple[tuple[int, int], str]] = {}

    def intact_step_collectively(self, target: int | str | os.PathLike,
                                 group: dist.ProcessGroup | None) -> tuple[Path, CheckpointMetadata]:
        """The step directory to load and its metadata, once every rank found its files intact."""
        candidates = self._resolve_collectively(target, group)
        for number, step_dir in enumerate(candidates):
            metadata = layout.read_metadata(step_dir)
            damage = self._damage_collectively(step_dir, metadata, group)
            if damage is None:
                assert metadata is not None  # a missing one is damage
                return step_dir, metadata
            step = layout.parse_step_dir(step_dir.name)
            self._remember_damage(step_dir, damage)
            if number + 1 == len(candidates):
                older = " and no older step is intact" if number else ""
                raise CheckpointLoadError(f"checkpoint step {step} is damaged: {damage}{older}; "
                                          "nothing was loaded. Load another step (see list())")
            if self._rank == 0:
                logger.warning("checkpoint step %s is damaged (%s); loading step %s, the newest intact one",
                               step, damage, layout.parse_step_dir(candidates[number + 1].name))
        raise AssertionError("_resolve_collectively returns at least one directory")

    def _remember_damage(self, step_dir: Path, damage: str) -> None:
        """list(), latest() and the dashboard call the step invalid from now on."""
        identity = _dir_identity(step_dir)
        step = layout.parse_step_dir(step_dir.name)
        if identity is not None and step is not None:
            self._damaged[step] = (identity, damage)
            self._listing_cache = None

    def _known_damage(self, step: int) -> str | None:
        """What a load found damaged in `step`'s directory as it is now, or None."""
        known = self._damaged.get(step)
        if known is None or known[0] != _dir_identity(self.directory / layout.step_dir_name(step)):
            return None
        return known[1]

    def entries(self) -> list[CheckpointEntry]:
        """The step directories, with those a load found damaged marked invalid."""
        return [dataclasses.replace(entry, valid=False) if entry.valid and self._known_damage(entry.step) else entry
                for entry in layout.list_entries(self.directory)]

    def _damage_collectively(self, step_dir: Path, metadata: CheckpointMetadata | None,
                             group: dist.ProcessGroup | None) -> str | None:
        """What is damaged in `step_dir`, the same words on every rank; None when every file is
        whole. Sizes are checked by every rank, the checksums' reading is shared out."""
        damage = layout.why_incomplete(step_dir, metadata)
        if damage is None and self.checksums:
            assert metadata is not None
            share = sorted(metadata.files)[self._rank::self._world_size]
            damage = layout.checksum_damage(step_dir, metadata, share)
        reports = [damage]
        if self._distributed:
            reports = [None] * self._world_size
            dist.all_gather_object(reports, damage, group=group)
        return next((report for report in reports if report is not None), None)

    def _resolve_collectively(self, target: int | str | os.PathLike,
                              group: dist.ProcessGroup | None) -> list[Path]:
        """Rank 0 picks the directories to try, best first, and every rank gets the same answer
        (or the same error): "latest" may fall back to older steps, anything else names one."""
        if isinstance(target, bool) or not isinstance(target, (int, str, os.PathLike)):
            raise InvalidValue(f"target={target!r} must be 'latest', a step (int >= 0) or a step directory path")
        if isinstance(target, int) and target < 0:
            raise InvalidValue(f"step={target!r} must be an int >= 0")
        answer: list[Any] = [None]
        if self._rank == 0:
            try:
                answer = [[str(path) for path in self._resolve(target)]]
            except ValueError as exc:
                answer = [str(exc)]
        if self._distributed:
            dist.broadcast_object_list(answer, src=0, group=group)
        if isinstance(answer[0], str):
            raise CheckpointLoadError(answer[0])
        return [Path(path) for path in answer[0]]

    def _resolve(self, target: int | str | os.PathLike) -> list[Path]:
        if target == "latest":
            step = self.latest_valid_step()
            if step is None:
                raise CheckpointLoadError(f"no complete checkpoint in {self.directory}")
            complete = [e for e in self.entries() if e.valid and e.step <= step]
            return [Path(e.path) for e in reversed(complete)]
        if isinstance(target, str) and target.isdigit():
            target = int(target)
        if isinstance(target, int):
            step_dir = self.directory / layout.step_dir_name(target)
            reason = layout.why_incomplete(step_dir, layout.read_metadata(step_dir))
            if reason is not None:
                steps = [e.step for e in self.entries() if e.valid]
                why = f" ({reason})" if step_dir.is_dir() else ""
                raise CheckpointLoadError(f"step={target} has no complete checkpoint in {self.directory}{why}; "
                                          f"available: {steps}")
            return [step_dir]
        step_dir = Path(target).absolute()
        reason = layout.why_incomplete(step_dir, layout.read_metadata(step_dir))
        if reason is not None:
            raise CheckpointLoadError(f"path={str(target)!r} is not a complete checkpoint directory ({reason})")
        return [step_dir]

    def listing(self) -> tuple[int | None, tuple[CheckpointEntry, ...]]:
        """(latest valid step, step directories), read again only when the directory changed:
        the dashboard asks twice a second, and listing reads every step's metadata and sizes."""
        key = layout.change_key(self.directory)
        cached = self._listing_cache
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        listing = (self.latest_valid_step(warn=False), tuple(self.entries()))
        self._listing_cache = (key, listing) if key is not None else None
        return listing

    def latest_valid_step(self, warn: bool = True) -> int | None:
        """LATEST's step, or the newest complete one when LATEST names none; `warn` says so in a
        line (not for the dashboard's polling, which would repeat it outside the cell)."""
        step = layout.read_latest(self.directory)
        reason = "LATEST is missing or garbled"
        if step is not None:
            step_dir = self.directory / layout.step_dir_name(step)
            damage = layout.why_incomplete(step_dir, layout.read_metadata(step_dir)) or self._known_damage(step)
            if damage is None:
                return step
            reason = f"LATEST names step {step}, which cannot be loaded ({damage})"
        valid = [e.step for e in self.entries() if e.valid]
        if valid and warn:
            logger.warning("%s; using step %d, the newest complete one", reason, valid[-1])
        return valid[-1] if valid else None


def _dir_identity(path: Path) -> tuple[int, int] | None:
    """What changes when a directory is replaced (a new save of its step), or None if it is gone."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_ctime_ns  # a renamed-in directory has a new ctime, even on a reused inode

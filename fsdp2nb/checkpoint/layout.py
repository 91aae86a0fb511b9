"""The on-disk layout of a checkpoint directory, and the file operations that keep it consistent.

    directory/
      LATEST                      "step-000100\n", replaced atomically after a save is committed
      step-000100/
        .metadata, __*_*.distcp   one DCP save of {"model", "optim"}
        rank-00000.pt ...         each rank's RNG, scheduler and extra state
        fsdp2nb-checkpoint.json   written last, before the rename: a directory without it is no checkpoint;
                                  it records every other file's size and CRC32, checked before a load
      .tmp-step-000200-<token>/   a save in progress (or abandoned by a crash)
      .old-step-000100-<token>/   a checkpoint being replaced by a second save of the same step
      .del-step-000050-<token>/   a checkpoint being removed by retention
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from fsdp2nb.atomic_files import replace_atomically
from fsdp2nb.errors import CheckpointNotFound
from fsdp2nb.wire.records import CheckpointEntry

logger = logging.getLogger(__name__)

LATEST_FILE = "LATEST"
METADATA_FILE = "fsdp2nb-checkpoint.json"
DCP_METADATA_FILE = ".metadata"
FORMAT_VERSION = 1
CHECKSUM_SUFFIX = ".crc32"
"""A shard's CRC32, computed while it was written, waits beside it in `<shard>.crc32` until the
commit folds it into the metadata."""
SHARD_SUFFIX = ".distcp"
_READ_CHUNK = 8 * 1024 * 1024
_STEP_RE = re.compile(r"step-(\d+)")
_TMP_RE = re.compile(r"\.(tmp|old|del)-(step-\d+)-[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What fsdp2nb-checkpoint.json records about one checkpoint."""

    step: int
    """Training step the checkpoint was taken at."""
    world_size: int
    """Number of ranks that wrote it (and rank files present)."""
    wall_time: float
    """Seconds since the epoch when the save was requested."""
    trainable_only: bool
    """True when frozen parameters (a LoRA base) were left out and must come from the base model."""
    versions: dict[str, str] = field(default_factory=dict)
    """Library versions of the writer (torch, transformers, peft, fsdp2nb)."""
    rebuild: dict[str, object] = field(default_factory=dict)
    """What a trainable-only checkpoint needs to be rebuilt: base model name, adapter configs."""
    format_version: int = FORMAT_VERSION
    """Layout version of this file."""
    files: dict[str, list[int | None]] = field(default_factory=dict)
    """Every other file of the step: name -> [size in bytes, CRC32 or None when not computed].
    Empty in checkpoints written before sizes and checksums were recorded."""


def step_dir_name(step: int) -> str:
    """`step-000100` for step 100."""
    return f"step-{step:06d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed step directory name, or None for any other name."""
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def tmp_dir_name(step: int, token: str) -> str:
    return f".tmp-{step_dir_name(step)}-{token}"


def old_dir_name(step: int, token: str) -> str:
    return f".old-{step_dir_name(step)}-{token}"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_file(path: Path) -> None:
    """Make a file another writer (save_file, a processor) closed durable."""
    _fsync(path, os.O_RDONLY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it; the caller fsyncs the directory."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def why_unwritable(directory: Path, rank: int) -> OSError | None:
    """Why files cannot be created in `directory` (created if missing), or None when they can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # os.access is not enough as root; a real write also catches read-only mounts and /proc.
        probe = directory / f".probe-{rank}-{os.getpid()}"
        write_durable(probe, b"ok")
        probe.unlink()
    except OSError as exc:
        return exc
    return None


def write_metadata(step_dir: Path, metadata: CheckpointMetadata) -> None:
    payload = json.dumps(dataclasses.asdict(metadata), indent=1, sort_keys=True).encode()
    write_durable(step_dir / METADATA_FILE, payload)
    fsync_dir(step_dir)


def read_metadata(step_dir: Path) -> CheckpointMetadata | None:
    """The metadata of `step_dir`, or None when it is missing, unreadable or incomplete."""
    try:
        raw = json.loads((step_dir / METADATA_FILE).read_text())
        names = {f.name for f in dataclasses.fields(CheckpointMetadata)}
        metadata = CheckpointMetadata(**{k: v for k, v in raw.items() if k in names})
    except (OSError, ValueError, TypeError):
        return None
    return metadata if _well_formed(metadata.files) else None


def _well_formed(files: object) -> bool:
    """Whether the `files` record is {name: [size, crc or None]} (a damaged one makes no checkpoint)."""
    return isinstance(files, dict) and all(
        isinstance(record, list) and len(record) == 2 and isinstance(record[0], int)
        and (record[1] is None or isinstance(record[1], int)) for record in files.values())


def is_complete(step_dir: Path, metadata: CheckpointMetadata | None) -> bool:
    """True when `step_dir` holds everything a load needs, each file at the size it was written."""
    return why_incomplete(step_dir, metadata) is None


def why_incomplete(step_dir: Path, metadata: CheckpointMetadata | None) -> str | None:
    """What makes `step_dir` unloadable, short of reading its files: None when nothing does.

    Sizes only (one stat per file), so listing stays cheap; `checksum_damage` reads the bytes."""
    if metadata is None:
        return f"{METADATA_FILE} is missing or unreadable"
    if metadata.step != parse_step_dir(step_dir.name):
        return f"{METADATA_FILE} names step {metadata.step}"
    missing = missing_files(step_dir, metadata.world_size)
    if missing:
        return f"{missing[0]} is missing"
    return size_damage(step_dir, metadata)


def size_damage(step_dir: Path, metadata: CheckpointMetadata) -> str | None:
    """The first file whose size differs from the one recorded at save time, said in words."""
    for name, (size, _crc) in sorted(metadata.files.items()):
        try:
            actual = (step_dir / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
        if actual != size:
            return f"{name} is {actual} bytes, {size} were written"
    return None


def checksum_damage(step_dir: Path, metadata: CheckpointMetadata, names: list[str]) -> str | None:
    """The first of `names` whose bytes no longer match the CRC32 recorded at save time, in words."""
    for name in names:
        size, crc = metadata.files[name]
        if crc is None:
            continue
        try:
            actual = file_crc32(step_dir / name)
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
        if actual != crc:
            return f"{name} holds other bytes than were written (its CRC32 differs)"
    return None


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL on large chunks
    return crc


def record_files(step_dir: Path) -> dict[str, list[int | None]]:
    """[size, CRC32] of each file of a finished save, for the metadata; removes the shards'
    checksum files. A shard's CRC32 was computed as it was written (None where checksums are
    off); the small files (rank files, DCP's metadata) are read here."""
    records: dict[str, list[int | None]] = {}
    for path in sorted(step_dir.iterdir()):
        if path.name == METADATA_FILE or path.name.endswith(CHECKSUM_SUFFIX) or not path.is_file():
            continue
        sidecar = path.with_name(path.name + CHECKSUM_SUFFIX)
        if sidecar.is_file():
            crc: int | None = int(sidecar.read_text(), 16)
        else:
            crc = None if path.name.endswith(SHARD_SUFFIX) else file_crc32(path)
        records[path.name] = [path.stat().st_size, crc]
    for sidecar in step_dir.glob(f"*{CHECKSUM_SUFFIX}"):
        sidecar.unlink()
    return records


def missing_files(step_dir: Path, world_size: int) -> list[str]:
    """The files a load needs that `step_dir` lacks (besides the metadata, written last)."""
    needed = [DCP_METADATA_FILE, *(rank_file_name(r) for r in range(world_size))]
    return [name for name in needed if not (step_dir / name).is_file()]


def read_latest(directory: Path) -> int | None:
    """The step LATEST names, or None when it is missing or garbled (bytes that are not text too)."""
    try:
        return parse_step_dir((directory / LATEST_FILE).read_bytes().decode("ascii").strip())
    except (OSError, UnicodeDecodeError):
        return None


def write_latest(directory: Path, step: int) -> None:
    replace_atomically(directory / LATEST_FILE, f"{step_dir_name(step)}\n".encode(), durable=True)


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed while we looked: retention ran concurrently
    return total


_SETTLED_S = 2.0  # longer than any file system's timestamp tick (whole seconds on some)


def change_key(directory: Path) -> tuple[int, int, int] | None:
    """What changes whenever an entry of `directory` is added, removed or renamed (commits,
    LATEST, retention all rename there; a committed step is never changed in place). None when
    the directory changed in the last moment: a second change within one tick of the file
    system's clock would leave the same time, so such a key would not be safe to compare."""
    try:
        info = os.stat(directory)
    except OSError:
        return None
    if time.time() - info.st_mtime < _SETTLED_S:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_nlink


def list_entries(directory: Path) -> list[CheckpointEntry]:
    """Every committed step directory, sorted by step; invalid ones included and flagged."""
    entries = []
    for child in directory.iterdir() if directory.is_dir() else ():
        step = parse_step_dir(child.name)
        if step is None or not child.is_dir():
            continue
        metadata = read_metadata(child)
        entries.append(CheckpointEntry(
            step=step, path=str(child), wall_time=metadata.wall_time if metadata else None,
            size_bytes=dir_size(child), world_size=metadata.world_size if metadata else None,
            valid=is_complete(child, metadata),
        ))
    return sorted(entries, key=lambda e: e.step)


def commit_step_dir(directory: Path, tmp_dir: Path, step: int, token: str) -> None:
    """Rename a finished temporary directory into place; an existing same-step checkpoint is replaced.

    The old directory is moved aside first and removed only after the new one is in place;
    `recover_and_clean` puts it back if a crash leaves no `step-N` behind.
    """
    final = directory / step_dir_name(step)
    aside = directory / old_dir_name(step, token)
    if final.exists():
        os.rename(final, aside)
    try:
        os.rename(tmp_dir, final)
    except OSError:
        if aside.exists():  # put the replaced checkpoint back rather than wait for a sweep
            os.rename(aside, final)
        raise
    fsync_dir(directory)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)


def recover_and_clean(directory: Path, keep_names: frozenset[str] = frozenset()) -> None:
    """Remove abandoned temporary directories; restore a replaced checkpoint a crash left aside."""
    for child in sorted(directory.iterdir()):
        match = _TMP_RE.fullmatch(child.name)
        if match is None or child.name in keep_names:
            continue
        final = directory / match.group(2)
        if match.group(1) == "old" and not final.exists():
            logger.warning("restoring %s: a replacing save of the same step did not finish", final.name)
            os.rename(child, final)
            continue
        logger.info("removing abandoned %s", child.name)
        shutil.rmtree(child, ignore_errors=True)
    fsync_dir(directory)


def apply_retention(directory: Path, keep: int | None, newest: int, protected: frozenset[int]) -> list[int]:
    """Delete the oldest valid checkpoints up to step `newest` beyond `keep`, never one in
    `protected`; return the deleted steps.

    Steps above `newest` are left alone and not counted: they were saved by a run that has
    since been resumed from an earlier step, and are the user's to keep or delete. Counting
    them would delete the new run's checkpoints first, the one it resumed from included."""
    if keep is None:
        return []
    valid = [e for e in list_entries(directory) if e.valid and e.step <= newest]
    excess = len(valid) - keep
    deleted = []
    for entry in valid:
        if excess <= 0:
            break
        if entry.step in protected:
            continue
        # Renamed first so that a crash halfway through the removal leaves no half-deleted `step-N`.
        doomed = directory / f".del-{Path(entry.path).name}-{os.getpid():x}"
        os.rename(entry.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(entry.step)
        excess -= 1
    return deleted


def remove_step_dir(directory: Path, step: int) -> None:
    """Delete one step directory: renamed first, so a crash midway leaves no half-deleted `step-N`."""
    final = Path(directory) / step_dir_name(step)
    if not final.is_dir():
        raise CheckpointNotFound(f"there is no checkpoint of step {step} in {directory}")
    doomed = Path(directory) / f".del-{final.name}-{os.getpid():x}"
    os.rename(final, doomed)
    fsync_dir(Path(directory))
    shutil.rmtree(doomed, ignore_errors=True)


def point_latest_at_newest(directory: Path) -> int | None:
    """After LATEST's step was deleted: name the newest complete step left (or remove LATEST)."""
    valid = [entry.step for entry in list_entries(Path(directory)) if entry.valid]
    if valid:
        write_latest(Path(directory), valid[-1])
        return valid[-1]
    (Path(directory) / LATEST_FILE).unlink(missing_ok=True)
    fsync_dir(Path(directory))
    return None

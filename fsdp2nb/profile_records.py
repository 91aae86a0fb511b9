"""How a rank's profiled ops travel (`RankProfile.ops`): packed int64 records, five to an op.

A profiled training step has tens of thousands of ops; one dataclass each would cost more to
pickle than the step took. Each record is (name index, lane, kind, start ns, duration ns), start
on the rank's clock. Shared by the rank that packs and the kernel that reads (no torch).
"""

from __future__ import annotations

from array import array
from typing import Final, NamedTuple

OP: Final = 0
"""A CPU op or a user's `record_function` range."""
COLLECTIVE: Final = 1
"""A collective in flight on the host (gloo's `gloo:all_reduce`, from its enqueue to its end)."""
GPU_KERNEL: Final = 2
"""A GPU kernel that computes."""
GPU_COLLECTIVE: Final = 3
"""A GPU kernel of a collective (NCCL)."""
GPU_COPY: Final = 4
"""A GPU memory copy or set."""
KIND_NAMES: Final = ("op", "collective", "gpu kernel", "gpu collective", "gpu copy")
GPU_LANE_BASE: Final = 1 << 20
"""GPU streams' lanes follow the host threads' (a thread's lane is a small number)."""
_FIELDS: Final = 5


class OpRecord(NamedTuple):
    """One op of one rank, its times on the rank's clock (a tuple: a profile has many)."""

    name: str
    lane: int
    """A thread (CPU) or a stream (GPU), numbered per rank."""
    kind: int
    start_ns: int
    duration_ns: int

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


def pack(flat_records: list[int]) -> bytes:
    """Records given one after another (name index, lane, kind, start ns, duration ns) as bytes."""
    return array("q", flat_records).tobytes()


def unpack(names: tuple[str, ...], packed: bytes) -> list[OpRecord]:
    """The records `pack` made, with their names."""
    flat = array("q")
    flat.frombytes(packed)
    columns = [flat[field::_FIELDS] for field in range(_FIELDS)]
    named = [names[index] for index in columns[0]]
    return list(map(OpRecord._make, zip(named, *columns[1:], strict=True)))


def pack_ints(values: list[int]) -> bytes:
    """int64 values one after another (a rank's summary: intervals, op totals)."""
    return array("q", values).tobytes()


def unpack_flat(packed: bytes) -> list[int]:
    """What `pack` or `pack_ints` packed, one value after another."""
    flat = array("q")
    flat.frombytes(packed)
    return flat.tolist()


def unpack_ints(packed: bytes, width: int) -> list[tuple[int, ...]]:
    """What `pack_ints` packed, as tuples of `width` values."""
    flat = unpack_flat(packed)
    return list(zip(*(flat[field::width] for field in range(width)), strict=True))

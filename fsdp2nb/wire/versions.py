"""Which version of the wire each end speaks, and the tags that name its message types.

A kept pool outlives upgrades: a kernel with a newer fsdp2nb may attach to ranks started by an
older one, and ranks on another host may run another install. The two ends compare versions
before anything else crosses: in every connection's greeting and hello (wire/admission.py,
wire/channels.py) and in a kept pool's attach record (pool/kept/directory.py). A version is
`PROTOCOL_VERSION` (protocol.py, raised by hand with every change of a message) and the schema
fingerprint, a hash of the module, name and field names of every message type and record that
crosses (`schema_fingerprint`), so that a change whose version was not raised is refused too.

The greeting, the hello and the attach record are the version exchange itself, so their layout
is the same in every version: the greeting is the challenge and then `WireVersion.to_bytes()`
(JSON); the hello and the record are signed envelopes, a pickled tuple of builtins that every
version reads (`envelope`, `open_envelope`). Every other message travels as (tag, field values),
where the tag is a hash of its type's name and field names (`TAGS`): a type added, removed or
reordered shifts no other's tag, and a message decodes only as the type whose name and fields
it was packed with.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from fsdp2nb.wire import protocol
from fsdp2nb.wire.protocol import PROTOCOL_VERSION, VERSIONED_TYPES, WIRE_TYPES

ENVELOPE_MARK = "fsdp2nb-wire"
"""The first item of a versioned envelope: (mark, version as a dict, type name, fields as a dict)."""
MAX_VERSION_BYTES = 256
"""More than a version's JSON takes (a greeting is refused past its challenge and this)."""


def signature(cls: type) -> str:
    """`Name(field,field,...)`: what identifies a message type on the wire."""
    return f"{cls.__name__}({','.join(field.name for field in dataclasses.fields(cls))})"


def _schema_types() -> list[type]:
    """Every dataclass of protocol.py and its `SCHEMA_MODULES`: the messages and every record
    they carry or embed."""
    modules = (protocol, *protocol.SCHEMA_MODULES)
    return sorted((value for module in modules for value in vars(module).values()
                   if dataclasses.is_dataclass(value) and isinstance(value, type)
                   and value.__module__ == module.__name__), key=lambda cls: cls.__name__)


def schema_fingerprint() -> str:
    """A hash of every message type's and record's module, name and field names (16 hex digits)."""
    return fingerprint(_schema_types())


def fingerprint(types: list[type]) -> str:
    """A hash of these types' modules, names and field names. The module counts because pickle
    names a record embedded in a message by its module and class."""
    text = "\n".join(f"{cls.__module__}.{signature(cls)}" for cls in types)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tag(cls: type) -> int:
    return int.from_bytes(hashlib.sha256(signature(cls).encode()).digest()[:4], "big")


TAGS: dict[type, int] = {cls: _tag(cls) for cls in WIRE_TYPES}
"""Message type -> its tag on the wire."""
BY_TAG: dict[int, tuple[type, tuple[str, ...]]] = {
    tag: (cls, tuple(field.name for field in dataclasses.fields(cls))) for cls, tag in TAGS.items()}
"""Tag -> the message type and its field names."""
if len(BY_TAG) != len(WIRE_TYPES):  # two signatures hashed alike: rename a type
    raise RuntimeError("two wire message types have the same tag")  # internal: two message types hash alike, a bug of the protocol module
_VERSIONED = {cls.__name__: cls for cls in VERSIONED_TYPES}


@dataclass(frozen=True)
class WireVersion:
    """What one end speaks: the protocol version, the schema fingerprint and (for the advice
    given on a mismatch) the fsdp2nb release it comes from."""

    protocol: int
    schema: str
    package: str = ""
    """fsdp2nb's version; empty where unknown."""

    def matches(self, other: WireVersion) -> bool:
        return self.protocol == other.protocol and self.schema == other.schema

    def to_dict(self) -> dict:
        return {"protocol": self.protocol, "schema": self.schema, "fsdp2nb": self.package}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> WireVersion:
        """The version in a greeting; protocol 0 for a greeting without one (an fsdp2nb from
        before protocol versions) or one that does not parse."""
        return cls.from_dict(_json_object(data))

    @classmethod
    def from_dict(cls, fields: Any) -> WireVersion:
        if not isinstance(fields, dict):
            return BEFORE_VERSIONS
        protocol_version, schema = fields.get("protocol"), fields.get("schema")
        package = fields.get("fsdp2nb")
        if not isinstance(protocol_version, int) or not isinstance(schema, str):
            return BEFORE_VERSIONS
        return cls(protocol_version, schema, package if isinstance(package, str) else "")

    def describe(self, other: WireVersion | None = None) -> str:
        """`wire protocol 3 (fsdp2nb 0.4.1)`; with the schema where `other` has the same protocol."""
        if self.protocol == 0:
            return "wire protocol 0 (an fsdp2nb from before protocol versions)"
        details = [f"fsdp2nb {self.package}"] if self.package else []
        if other is not None and other.protocol == self.protocol:
            details.append(f"schema {self.schema}")
        return f"wire protocol {self.protocol}" + (f" ({', '.join(details)})" if details else "")


BEFORE_VERSIONS = WireVersion(0, "", "")
"""What an end that predates protocol versions speaks (its greeting or record carries none)."""


@functools.cache
def ours() -> WireVersion:
    """What this process speaks."""
    return WireVersion(PROTOCOL_VERSION, schema_fingerprint(), _package_version())


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("fsdp2nb")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return ""


def install_hint(version: WireVersion, where: str) -> str:
    """` (fsdp2nb X, `pip install -e .` in a checkout of it, WHERE)`: what installs `version`'s
    release (fsdp2nb is installed from a clone); empty if unknown."""
    return f" (fsdp2nb {version.package}: `pip install -e .` in a checkout of it, {where})" if version.package else ""


def _json_object(data: bytes) -> Any:
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


# --- the versioned envelope: the hello and the attach record ------------------------------------


def envelope(message: Any) -> tuple:
    """`message` (one of `VERSIONED_TYPES`) as a tuple of builtins that every version unpickles."""
    return ENVELOPE_MARK, ours().to_dict(), type(message).__name__, dict(vars(message))


@dataclass(frozen=True)
class Opened:
    """A versioned envelope, opened: who sent it and, where it speaks this end's version, the message."""

    version: WireVersion
    type_name: str
    fields: dict
    message: Any | None
    """The message rebuilt; None where the versions differ (or the type is not one this end knows)."""


def open_envelope(content: Any) -> Opened | None:
    """The envelope in a verified payload's content; None where it is none. A tagged message of
    an fsdp2nb from before protocol versions (a hello, an attach record) opens as protocol 0."""
    if isinstance(content, tuple) and len(content) == 2 and isinstance(content[0], int):
        return Opened(BEFORE_VERSIONS, "", {}, None)
    if not (isinstance(content, tuple) and len(content) == 4 and content[0] == ENVELOPE_MARK):
        return None
    _, version_fields, type_name, fields = content
    version = WireVersion.from_dict(version_fields)
    if not isinstance(type_name, str) or not isinstance(fields, dict):
        return None
    cls = _VERSIONED.get(type_name)
    if cls is None or not version.matches(ours()) or set(fields) != {field.name for field in dataclasses.fields(cls)}:
        return Opened(version, type_name, fields, None)
    message = object.__new__(cls)  # as signing._rebuild does: without running the frozen __init__
    vars(message).update(fields)
    return Opened(version, type_name, fields, message)

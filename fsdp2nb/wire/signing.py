"""Signing: a frame's payload is `hmac_sha256(key, payload) + payload`.

A message of `WIRE_TYPES` is pickled as its type's tag and its field values, a hello or an attach
record as a versioned envelope (wire/versions.py); a frame whose signature fails is dropped
without being unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
from typing import Any

from fsdp2nb.wire.versions import BY_TAG, TAGS, Opened, envelope, open_envelope

logger = logging.getLogger(__name__)

KEY_BYTES = 32
_SIGNATURE_BYTES = hashlib.sha256().digest_size
Frame = bytes | bytearray
"""A frame or payload: as built (bytes) or as read off a socket (bytearray), never copied to convert."""


class Signer:
    """Packs messages into signed frames and unpacks only frames whose signature verifies.

    A message of `WIRE_TYPES` is pickled as (its type's tag, its field values): plain tuples
    take pickle's quickest path, where a dataclass is looked up by module and name on both
    sides. The tag names the type and its fields, so a message packed by another version of
    the schema fails to decode instead of decoding as another type. The key is absorbed into
    an HMAC object once; each frame is signed by a copy of it.
    """

    def __init__(self, key: bytes, *, log: logging.Logger = logger) -> None:
        if len(key) < KEY_BYTES:
            raise ValueError(f"the pool key must have at least {KEY_BYTES} bytes, got {len(key)}")  # internal: the pool makes its own keys
        self._keyed_mac = hmac.new(key, digestmod="sha256")
        self._log = log
        """Where dropped frames are reported (the kernel's pool log: never a notebook cell)."""
        self.num_rejected = 0
        self.num_undecodable = 0

    def pack(self, message: Any) -> bytes:
        tag = TAGS.get(type(message))
        encoded = (tag, tuple(vars(message).values())) if tag is not None else (None, message)
        payload = pickle.dumps(encoded, protocol=pickle.HIGHEST_PROTOCOL)
        return self._sign(payload) + payload

    def pack_versioned(self, message: Any) -> bytes:
        """A hello or an attach record, in the envelope every version reads (wire/versions.py)."""
        payload = pickle.dumps(envelope(message), protocol=pickle.HIGHEST_PROTOCOL)
        return self._sign(payload) + payload

    def open_versioned(self, frame: Frame) -> Opened | None:
        """The envelope in a frame: its sender's version, and its message if that is this end's;
        None when the signature fails or the frame holds no envelope."""
        payload = self.verify(frame)
        if payload is None:
            self._log.warning("dropped a message that failed signature verification")
            return None
        return self.decode_versioned(payload)

    def decode_versioned(self, payload: Frame) -> Opened | None:
        """The envelope in a verified payload (see `open_versioned`)."""
        try:
            return open_envelope(pickle.loads(payload))
        except Exception:  # signed by the other end, yet no pickle this end reads
            self.num_undecodable += 1
            self._log.exception("dropped a signed message that could not be decoded")
            return None

    def unpack(self, frame: Frame) -> Any | None:
        """The message, or None when the frame is malformed, its signature is wrong or it does
        not decode here."""
        payload = self.verify(frame)
        if payload is None:
            self._log.warning("dropped a message that failed signature verification")
            return None
        return self.decode(payload)

    def verify(self, frame: Frame) -> Frame | None:
        """The payload of a frame whose signature verifies; None (and counted) otherwise."""
        signature, payload = frame[:_SIGNATURE_BYTES], frame[_SIGNATURE_BYTES:]
        if len(frame) <= _SIGNATURE_BYTES or not hmac.compare_digest(signature, self._sign(payload)):
            self.num_rejected += 1
            return None
        return payload

    def _sign(self, payload: Frame) -> bytes:
        mac = self._keyed_mac.copy()
        mac.update(payload)
        return mac.digest()

    def decode(self, payload: Frame) -> Any | None:
        """The message in a verified payload; None when this end cannot rebuild it."""
        try:
            tag, content = pickle.loads(payload)
            return content if tag is None else _rebuild(tag, content)
        except Exception:  # signed by the other end, but not something this end can rebuild
            self.num_undecodable += 1  # (e.g. a display whose metadata holds a rank-only class)
            self._log.exception("dropped a signed message that could not be decoded")
            return None


def _rebuild(tag: int, values: tuple) -> Any:
    """The message from its field values, without running its (frozen) __init__."""
    known = BY_TAG.get(tag)
    if known is None:
        raise ValueError(f"no message type of this fsdp2nb has the tag {tag!r}: the sender speaks "  # internal: a verified frame of another protocol version, refused by the receiver
                         "another version of the wire protocol")
    cls, names = known
    if len(values) != len(names):
        raise ValueError(f"a {cls.__name__} needs {len(names)} fields, got {len(values)}")  # internal: as above
    message: Any = object.__new__(cls)
    vars(message).update(zip(names, values, strict=True))
    return message

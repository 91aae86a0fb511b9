import pickle

import pytest

from fsdp2nb.pool.protocol import RunCell
from fsdp2nb.pool.transport import Signer

UNPICKLED = []


class _Tripwire:
    """Unpickling this records that it happened: a forged message must never get that far."""

    def __reduce__(self):
        return (UNPICKLED.append, ("unpickled",))


def test_round_trip_with_the_same_key():
    signer = Signer(b"k" * 32)
    assert signer.unpack(signer.pack(RunCell(cell_id=3, code="x"))) == RunCell(cell_id=3, code="x")


def test_forged_or_tampered_messages_are_dropped_unread():
    signer, forger = Signer(b"k" * 32), Signer(b"f" * 32)
    assert signer.unpack(forger.pack(_Tripwire())) is None
    frame = signer.pack(RunCell(cell_id=1, code="x"))
    assert signer.unpack(frame[:32] + pickle.dumps(_Tripwire())) is None
    assert signer.unpack(frame[:20]) is None
    assert UNPICKLED == [] and signer.num_rejected == 3


def test_short_keys_are_refused():
    with pytest.raises(ValueError, match="at least 32 bytes"):
        Signer(b"short")

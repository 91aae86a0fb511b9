"""A versioned wire: both ends compare versions in the greeting, the hello and a kept pool's attach
record, and refuse another version in one line; a message decodes only as the type it was packed as."""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from fsdp2nb.errors import WireVersionMismatch
from fsdp2nb.pool.kept import holder, listing
from fsdp2nb.pool.kept.directory import RECORD_FILE, read_attach_record, write_attach_record
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.admission import CHALLENGE_BYTES
from fsdp2nb.wire.channels import KernelChannels, RankChannels
from fsdp2nb.wire.framing import Link
from fsdp2nb.wire.protocol import PROTOCOL_VERSION, WIRE_TYPES, AttachRecord, ChannelHello
from fsdp2nb.wire.requests import RunCell
from fsdp2nb.wire.signing import KEY_BYTES, Signer
from fsdp2nb.wire.versions import (
    BEFORE_VERSIONS,
    ENVELOPE_MARK,
    WireVersion,
    fingerprint,
    ours,
    schema_fingerprint,
    signature,
)
from tests.support.channels import wait_until

SCHEMAS = {1: "d553d414a6717092", 2: "fc6e6598dd546d43", 3: "fa82194cc008491d", 4: "84d9f9b794046348",
           5: "f8858efd28ebed7f", 6: "f5c898d35b74ffba", 7: "ffbd6d67d50a47a6",
           8: "9c47fdb83e2c2617", 9: "06ec384c12166044", 10: "05dedf7760739fb3",
           11: "5189db933b5f33b0"}
"""Each protocol version's schema fingerprint. A change to the schema's types (wire/protocol.py and
its SCHEMA_MODULES) changes the fingerprint: raise PROTOCOL_VERSION with it and add the new pair
here (never edit an old one)."""

FUTURE = WireVersion(PROTOCOL_VERSION + 1, "0123456789abcdef", "9.9.9")


def test_the_schema_of_this_protocol_version_is_the_one_it_was_released_with():
    assert SCHEMAS.get(PROTOCOL_VERSION) == schema_fingerprint(), (
        f"the wire schema is now {schema_fingerprint()}: raise PROTOCOL_VERSION in wire/protocol.py and add "
        "the new version's fingerprint to SCHEMAS")
    assert ours() == WireVersion(PROTOCOL_VERSION, schema_fingerprint(), ours().package)


def test_a_record_moved_to_another_module_changes_the_schema():
    """Pickle names a record embedded in a message (a CellFinished's ErrorInfo) by its module and
    class, so an end that declares it elsewhere cannot unpickle it: the move must change the
    fingerprint, though the record's name and fields stay."""
    from fsdp2nb.wire.records import ErrorInfo

    moved = dataclasses.make_dataclass("ErrorInfo", [field.name for field in dataclasses.fields(ErrorInfo)],
                                       frozen=True)
    moved.__module__ = "fsdp2nb.wire.protocol"
    assert signature(moved) == signature(ErrorInfo)
    assert fingerprint([moved]) != fingerprint([ErrorInfo])


def test_the_schema_holds_every_record_a_message_embeds():
    """A record that a message carries (a RankSnapshot's CheckpointView and what that embeds) is
    part of the fingerprint, wherever the split of the schema declares it."""
    from fsdp2nb.wire.versions import _schema_types

    names = {cls.__name__ for cls in _schema_types()}
    assert {"CheckpointView", "CheckpointStatus", "CheckpointEntry", "MetricPoint", "ErrorInfo",
            "MemoryShortage", "ProgressUpdate", "ThreadStack", "SaveCheckpoint", "LaunchPlan",
            "RankPlan"} <= names
    assert {cls.__name__ for cls in (*WIRE_TYPES, AttachRecord, ChannelHello)} <= names


def test_a_message_packed_by_position_decodes_as_nothing_here():
    """What an fsdp2nb from before versions sent: (index in its tuple of types, field values). An
    index shifted by one type added before it used to decode silently as a neighbour of the same
    shape; now no index is a tag, whatever it points at."""
    signer = Signer(secrets.token_bytes(KEY_BYTES))
    for index, cls in enumerate(WIRE_TYPES):
        values = tuple(field.default if field.default is not dataclasses.MISSING else 0
                       for field in dataclasses.fields(cls))
        payload = pickle.dumps((index, values))
        assert signer.unpack(signer._sign(payload) + payload) is None, cls.__name__
    assert signer.num_undecodable == len(WIRE_TYPES)


def test_a_tag_names_its_type_and_fields():
    from fsdp2nb.wire import versions

    # Another version's RunCell, with one field more: same name, another signature, another tag.
    theirs = dataclasses.make_dataclass("RunCell", [*(field.name for field in dataclasses.fields(RunCell)),
                                                    "started_by"], frozen=True)
    assert signature(theirs) != signature(RunCell)
    assert versions._tag(theirs) not in versions.BY_TAG
    signer = Signer(secrets.token_bytes(KEY_BYTES))
    payload = pickle.dumps((versions._tag(theirs), (1, "x", None, None, None, "them")))
    assert signer.unpack(signer._sign(payload) + payload) is None
    assert signer.unpack(signer.pack(RunCell(cell_id=1, code="x"))) == RunCell(cell_id=1, code="x")


def _envelope_frame(signer: Signer, version: WireVersion, message) -> bytes:
    payload = pickle.dumps((ENVELOPE_MARK, version.to_dict(), type(message).__name__, dict(vars(message))))
    return signer._sign(payload) + payload


def test_an_envelope_of_another_version_says_which_and_gives_no_message():
    signer = Signer(secrets.token_bytes(KEY_BYTES))
    hello = ChannelHello(role="events", rank=0, challenge=b"c" * 32)
    assert signer.open_versioned(signer.pack_versioned(hello)).message == hello
    opened = signer.open_versioned(_envelope_frame(signer, FUTURE, hello))
    assert opened.version == FUTURE and opened.message is None and opened.fields["rank"] == 0
    old = pickle.dumps((0, ("events", 0, b"c" * 32, 0)))  # a hello from before versions
    assert signer.open_versioned(signer._sign(old) + old).version == BEFORE_VERSIONS
    assert FUTURE.describe(ours()) == f"wire protocol {PROTOCOL_VERSION + 1} (fsdp2nb 9.9.9)"


@pytest.fixture
def kernel_channels(tmp_path):
    signer = Signer(secrets.token_bytes(KEY_BYTES))
    logged: list[str] = []

    class Log:
        def warning(self, text, *args):
            logged.append(text % args)

        exception = info = warning

    channels = KernelChannels(signer, str(tmp_path / "k.sock"), log=Log())
    yield channels, signer, logged
    channels.close()


def test_the_kernel_refuses_a_hello_of_another_version_in_one_line(kernel_channels):
    channels, signer, logged = kernel_channels
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(channels.address)
    link = Link(client)
    greeting = bytes(link.receive(max_bytes=512))
    assert WireVersion.from_bytes(greeting[CHALLENGE_BYTES:]) == ours()  # the kernel says its version
    hello = ChannelHello(role="events", rank=3, challenge=greeting[:CHALLENGE_BYTES])
    link.send(_envelope_frame(signer, FUTURE, hello))
    assert wait_until(lambda: channels.refused_version is not None)
    line = channels.refused_version
    assert line.startswith(f"rank 3 speaks wire protocol {PROTOCOL_VERSION + 1} (fsdp2nb 9.9.9), this kernel "
                           f"speaks wire protocol {PROTOCOL_VERSION}"), line
    assert "install one fsdp2nb on every host" in line and "\n" not in line
    assert any(line in entry for entry in logged) and not channels._links
    client.close()


def test_a_rank_refuses_a_kernel_of_another_version_and_tells_it(tmp_path, kernel_channels):
    _, signer, _ = kernel_channels
    address = str(tmp_path / "old.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen()
    heard: list = []

    def old_kernel():
        sock, _ = server.accept()
        link = Link(sock)
        link.send(os.urandom(CHALLENGE_BYTES))  # a greeting without a version: before versions
        heard.append(signer.open_versioned(bytes(link.receive())))
        sock.close()

    thread = threading.Thread(target=old_kernel)
    thread.start()
    with pytest.raises(WireVersionMismatch) as refused:
        RankChannels(signer, address, rank=None)
    thread.join()
    server.close()
    text = str(refused.value)
    assert "speaks wire protocol 0 (an fsdp2nb from before protocol versions)" in text
    assert f"the host agent on {socket.gethostname()} speaks wire protocol {PROTOCOL_VERSION}" in text
    assert heard[0].version == ours()  # its hello went out first, so the kernel can say so too


def _pool_dir(tmp_path: Path, key: bytes) -> holder.KeptMeta:
    holder.write_key(tmp_path, key)
    meta = holder.KeptMeta(keep=holder.KeepOptions(name="lab", keep_for_s=None), spec=PoolSpec(devices=("cpu", "cpu")),
                         pool_id="p", agent=(os.getpid(), 0.0), log_dir=str(tmp_path), runtime_dir="",
                         created=time.time())
    meta.write(tmp_path)
    return meta


def test_a_kept_pool_of_another_version_is_refused_before_anything_is_written(tmp_path):
    key = secrets.token_bytes(KEY_BYTES)
    meta, signer = _pool_dir(tmp_path, key), Signer(key)
    record = AttachRecord(serial=4, address="/old.sock", holder_pid=0, holder_start_time=0.0, since=1.0)
    write_attach_record(str(tmp_path), signer, record)
    holder.check_wire_version(tmp_path, signer, meta)  # this version's: nothing to say
    assert read_attach_record(str(tmp_path), signer) == record

    old = pickle.dumps((23, tuple(vars(record).values())))  # AttachRecord's place in the old tuple
    (tmp_path / RECORD_FILE).write_bytes(signer._sign(old) + old)
    with pytest.raises(WireVersionMismatch) as refused:
        holder.check_wire_version(tmp_path, signer, meta)
    assert str(refused.value) == (
        "kept pool 'lab' speaks wire protocol 0 (an fsdp2nb from before protocol versions), this kernel "
        f"speaks {ours().describe(BEFORE_VERSIONS)}: attach it from a kernel with the fsdp2nb that started it, "
        f"or end it with `kill {os.getpid()}` (its host agent; rank state is lost)")
    assert read_attach_record(str(tmp_path), signer) is None  # agent and ranks follow no such record
    pool = listing._describe(tmp_path, meta)
    assert str(pool) == ("lab: --cpu 2, speaks wire protocol 0 (an fsdp2nb from before protocol versions), "
                         f"this kernel {ours().describe(BEFORE_VERSIONS)}: it cannot be attached here")

    (tmp_path / RECORD_FILE).write_bytes(_envelope_frame(signer, FUTURE, record))
    with pytest.raises(WireVersionMismatch, match=r"install fsdp2nb 9\.9\.9 \(`pip install -e \.` in a checkout of it\) and restart the kernel"):
        holder.check_wire_version(tmp_path, signer, meta)

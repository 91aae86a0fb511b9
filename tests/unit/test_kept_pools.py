"""Kept pools without processes: durations, names, the signed attach record, keys, reconnecting."""

import os
import secrets
import socket
import stat
import threading
import time

import pytest

from fsdp2nb.errors import KeptPoolUnreadable
from fsdp2nb.pool.kept import holder, listing
from fsdp2nb.pool.kept.directory import (
    ActivitySlot,
    create_activity_board,
    mark_rank_ended,
    pool_is_idle_since,
    read_activity,
    read_attach_record,
    read_exit_reports,
    write_attach_record,
    write_exit_report,
)
from fsdp2nb.wire.channels import KernelChannels, RankChannels
from fsdp2nb.wire.events import RankExited, StreamOutput
from fsdp2nb.wire.protocol import AttachRecord
from fsdp2nb.wire.signing import Signer


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400),
                                               ("1.5h", 5400), ("none", None), ("None", None)])
def test_keep_for_durations(text, seconds):
    assert holder.parse_keep_for(text) == seconds


@pytest.mark.parametrize("text", ["5 parsecs", "5", "0s", "-3m", "", "1w", "s"])
def test_keep_for_refuses_what_is_no_duration_in_one_line(text):
    with pytest.raises(ValueError, match="is not a duration") as caught:
        holder.parse_keep_for(text)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["../x", ".hidden", "a/b", "", "x" * 65, "sp ace"])
def test_pool_names_cannot_leave_the_kept_directory(name):
    with pytest.raises(ValueError, match="is not a pool name"):
        holder.check_pool_name(name)


def _record(serial: int = 1) -> AttachRecord:
    return AttachRecord(serial=serial, address="/x/pool.sock", holder_pid=os.getpid(), holder_start_time=1.0,
                        since=time.time())


def test_attach_record_verifies_only_under_the_pool_key(tmp_path):
    key = secrets.token_bytes(32)
    write_attach_record(str(tmp_path), Signer(key), _record(3))
    assert read_attach_record(str(tmp_path), Signer(key)).serial == 3
    assert read_attach_record(str(tmp_path), Signer(secrets.token_bytes(32))) is None  # a wrong key: nothing
    data = bytearray((tmp_path / "attach").read_bytes())
    data[-1] ^= 1
    (tmp_path / "attach").write_bytes(bytes(data))
    assert read_attach_record(str(tmp_path), Signer(key)) is None  # tampered: nothing


def test_the_key_file_must_be_private(tmp_path):
    holder.write_key(tmp_path, b"k" * 32)
    assert stat.S_IMODE(os.stat(tmp_path / "key").st_mode) == 0o600
    assert holder.read_key(tmp_path) == b"k" * 32
    os.chmod(tmp_path / "key", 0o644)
    with pytest.raises(KeptPoolUnreadable, match="0600"):
        holder.read_key(tmp_path)


def test_hold_refuses_a_live_holder_unless_taken(tmp_path):
    key = secrets.token_bytes(32)
    parent = os.getppid()  # a live process other than this one
    from fsdp2nb.host.process_identity import process_key

    write_attach_record(str(tmp_path), Signer(key), AttachRecord(
        serial=4, address="/a", holder_pid=parent, holder_start_time=process_key(parent)[1], since=time.time()))
    with pytest.raises(holder.PoolHeldError, match=f"held by kernel {parent}.*--take"):
        holder.hold(tmp_path, Signer(key), "/b", take=False, name="p")
    assert read_attach_record(str(tmp_path), Signer(key)).address == "/a"  # nothing changed
    record = holder.hold(tmp_path, Signer(key), "/b", take=True, name="p")
    assert (record.serial, record.holder_pid, record.address) == (5, os.getpid(), "/b")
    assert holder.let_go(tmp_path, Signer(key))
    assert read_attach_record(str(tmp_path), Signer(key)).holder_pid == 0
    assert not holder.let_go(tmp_path, Signer(key))  # not held here any more: nothing written


def test_activity_board_tells_running_and_idle(tmp_path):
    create_activity_board(str(tmp_path), 2)
    slots = [ActivitySlot(str(tmp_path), rank) for rank in range(2)]
    assert pool_is_idle_since(str(tmp_path)) is not None
    slots[1].started(7, 3)
    work = read_activity(str(tmp_path))
    assert work[1].running_cell_id == 7 and work[1].execution_count == 3 and work[0].running_cell_id is None
    assert pool_is_idle_since(str(tmp_path)) is None
    assert listing.describe_run(work).startswith("In[3] running on rank 1")
    slots[1].ended()
    work = read_activity(str(tmp_path))
    assert work[1].running_cell_id is None and work[1].last_cell_id == 7
    assert pool_is_idle_since(str(tmp_path)) == pytest.approx(time.time(), abs=5)


def test_a_kept_rank_end_reconnects_and_drops_events_meanwhile(tmp_path):
    """The kernel goes; sends are dropped, never raised; a reconnect to the next kernel's socket
    goes through admission, and a reader blocked on the old connection is woken."""
    key = secrets.token_bytes(32)
    first = KernelChannels(Signer(key), str(tmp_path / "a.sock"))
    rank = RankChannels(Signer(key), str(tmp_path / "a.sock"), rank=0, kept=True)
    generation = rank.generation
    first.close()
    for _ in range(3):  # False: the rank keeps a reply it could not send (worker/rank.py)
        assert rank.send_event(StreamOutput(rank=0, cell_id=None, stream="stdout", text="lost\n")) is False
    # A peer that closed with bytes unread ends the connection with a reset instead of an EOF;
    # the rank's loop takes both as the kernel gone (worker/rank.py).
    with pytest.raises((EOFError, ConnectionResetError)):
        rank.receive_request(1000)
    woken = threading.Event()
    waiter = threading.Thread(target=lambda: rank.wait_for_reconnect(generation) and woken.set())
    waiter.start()
    second = KernelChannels(Signer(key), str(tmp_path / "b.sock"))
    received = []
    try:
        rank.reconnect(str(tmp_path / "b.sock"))
        waiter.join(5)
        assert woken.is_set()
        assert rank.send_event(StreamOutput(rank=0, cell_id=None, stream="stdout", text="back\n"))
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            second.receive(100, received.append)
        assert [event.text for event in received] == ["back\n"]
    finally:
        rank.close()
        second.close()


def test_reconnect_with_the_wrong_key_is_refused(tmp_path):
    """A kernel whose key is not the pool's admits none of the rank's connections."""
    key = secrets.token_bytes(32)
    impostor = KernelChannels(Signer(secrets.token_bytes(32)), str(tmp_path / "x.sock"))
    first = KernelChannels(Signer(key), str(tmp_path / "a.sock"))
    rank = RankChannels(Signer(key), str(tmp_path / "a.sock"), rank=0, kept=True)
    try:
        rank.reconnect(str(tmp_path / "x.sock"))  # the connections open, then the impostor drops them
        time.sleep(0.5)
        with pytest.raises(ConnectionError):
            impostor.send(0, StreamOutput(rank=0, cell_id=None, stream="stdout", text="x"), connect_timeout_s=0.5)
    finally:
        rank.close()
        first.close()
        impostor.close()


def test_unix_sockets_only(tmp_path):
    """A kept pool listens where any local pool does: a Unix socket, no network address."""
    channels = KernelChannels(Signer(secrets.token_bytes(32)), str(tmp_path / "p.sock"))
    try:
        assert channels.address == str(tmp_path / "p.sock")
        assert channels._server.family == socket.AF_UNIX
    finally:
        channels.close()


def test_the_board_says_which_ranks_wait_for_input_and_a_dead_rank_runs_nothing(tmp_path):
    create_activity_board(str(tmp_path), 3)
    slots = [ActivitySlot(str(tmp_path), rank) for rank in range(3)]
    for slot in slots:
        slot.started(9, 4)
    slots[0].waiting_for_input(True)
    line = listing.describe_run(read_activity(str(tmp_path)))
    assert line.startswith("In[4] running on ranks 0-2 for ") and line.endswith(", rank 0 waiting for input")
    mark_rank_ended(str(tmp_path), 1)  # the agent, for a rank that died
    work = read_activity(str(tmp_path))
    assert work[1].running_cell_id is None and work[1].last_cell_id == 9 and work[0].waiting_for_input
    assert listing.describe_run(work).startswith("In[4] running on ranks 0, 2 for ")
    slots[0].waiting_for_input(False)
    assert not read_activity(str(tmp_path))[0].waiting_for_input


def test_exit_reports_are_read_only_under_the_pool_key(tmp_path):
    key = secrets.token_bytes(32)
    report = RankExited(rank=1, pid=123, exit_code=3, signal_name=None, stderr_tail=("boom",))
    write_exit_report(str(tmp_path), Signer(key), report)
    assert stat.S_IMODE(os.stat(tmp_path / "exited-1").st_mode) == 0o600
    assert read_exit_reports(str(tmp_path), Signer(key)) == {1: report}
    assert read_exit_reports(str(tmp_path), Signer(secrets.token_bytes(32))) == {}
    assert holder.describe_deaths([report]) == "rank 1 died (exit code 3)"


def test_a_noted_run_is_read_back_and_only_the_last_few_are_kept(tmp_path):
    for cell_id in range(1, 21):
        holder.note_run(tmp_path, cell_id, holder.NotedRun(execution_count=cell_id + 2, name="train", kernel_pid=7,
                                                       started=100.0))
    runs = holder.noted_runs(tmp_path)
    assert sorted(runs) == list(range(5, 21))
    assert runs[20] == holder.NotedRun(execution_count=22, name="train", kernel_pid=7, started=100.0)
    (tmp_path / holder.RUNS_FILE).write_text("not json")
    assert holder.noted_runs(tmp_path) == {}

"""A rank given a message that is no request of its requests channel says so; it never runs it as
another request (an unknown type used to be taken for a pull) and lives on."""

import threading

from fsdp2nb.wire.events import CellFinished
from fsdp2nb.wire.requests import Interrupt, ResetPeak, Shutdown
from fsdp2nb.worker.rank import Rank


class _Channels:
    """The rank's connections: requests from a list, events recorded."""

    generation = 0

    def __init__(self, requests: list) -> None:
        self.requests = requests
        self.sent: list = []

    def receive_request(self, timeout_ms: int):
        return self.requests.pop(0)

    def send_event(self, message) -> bool:
        self.sent.append(message)
        return True


def _rank(requests: list) -> Rank:
    """A Rank without a process group or a shell: only its request loop's state."""
    rank = Rank.__new__(Rank)
    rank.rank, rank._cell_id, rank._interrupted_cell_id, rank._in_request = 1, None, None, False
    rank._reply_lock, rank._channels, rank._follower, rank._activity = threading.Lock(), _Channels(requests), None, None
    return rank


def test_an_unknown_request_fails_as_such_instead_of_running_as_a_pull():
    finished = _rank([])._run_request(Interrupt(cell_id=3))
    assert finished.status == "error" and finished.error.ename == "UnknownRequest", finished
    assert finished.error.evalue.startswith("Interrupt is not a request a rank runs; it runs RunCell, ")


def test_the_request_loop_refuses_what_is_no_request_and_goes_on(capfd):
    rank = _rank([Interrupt(cell_id=4), ResetPeak(), Shutdown()])
    rank.serve()  # returns at Shutdown: neither message ended the loop
    assert rank._channels.requests == []
    [reply] = rank._channels.sent
    assert isinstance(reply, CellFinished) and reply.cell_id == 4 and reply.error.ename == "UnknownRequest"
    assert "rank 1 ignored a message: ResetPeak is not a request a rank runs" in capfd.readouterr().err

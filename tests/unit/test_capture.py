import os
import threading
import time

from fsdp2nb.worker.capture import (
    FdCapture,
    LineStream,
    OutputSync,
    PartialLineFlusher,
    _partial_marker_length,
)


def test_output_is_synced_from_several_threads_at_once(tmp_path):
    # A rank syncs before each reply on its main thread, and before each display() on whatever
    # thread displays: both may run together.
    fd = os.open(os.devnull, os.O_WRONLY)
    forwarded: list[str] = []
    with open(tmp_path / "rank.log", "ab", buffering=0) as log:
        sync = OutputSync([FdCapture(fd, forwarded.append, log)])
        errors: list[BaseException] = []

        def print_and_sync(name: str) -> None:
            try:
                for i in range(20_000):
                    if i % 1000 == 0:
                        os.write(fd, f"{name} {i}\n".encode())
                    sync.sync()
            except BaseException as error:  # any failure is the finding
                errors.append(error)

        threads = [threading.Thread(target=print_and_sync, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        os.close(fd)
    assert errors == []
    lines = "".join(forwarded).splitlines()
    assert sorted(lines) == sorted(f"{name} {i}" for name in "ab" for i in range(0, 20_000, 1000))


def test_partial_marker_detection():
    marker = b"\x00sync-123\x00"
    assert _partial_marker_length(b"text\x00syn", marker) == 4
    assert _partial_marker_length(b"text\x00", marker) == 1
    assert _partial_marker_length(b"text\x00x", marker) == 0
    assert _partial_marker_length(b"plain", marker) == 0


def _captured_stream(tmp_path):
    fd = os.open(os.devnull, os.O_WRONLY)
    forwarded: list[str] = []
    log = open(tmp_path / "rank.log", "ab", buffering=0)  # closed by the GC with the test
    flusher = PartialLineFlusher()
    stream = LineStream(fd, flusher)
    flusher.streams.append(stream)
    return stream, OutputSync([FdCapture(fd, forwarded.append, log)], flusher), forwarded


def test_a_print_reaches_the_reader_as_one_piece(tmp_path):
    # print() writes its arguments, separators and newline one by one; sent one by one, a slow
    # machine showed them in the notebook as broken, interleaved lines.
    stream, sync, forwarded = _captured_stream(tmp_path)
    for step in range(50):
        print("step", step, "loss", 0.5, file=stream)
    sync.sync()
    assert "".join(forwarded) == "".join(f"step {step} loss 0.5\n" for step in range(50))
    assert all(piece.endswith("\n") for piece in forwarded)  # never a line in pieces


def test_a_partial_line_is_forwarded_without_a_flush(tmp_path):
    stream, _, forwarded = _captured_stream(tmp_path)
    print("loading 50%", end="", file=stream)
    deadline = time.monotonic() + 30
    while not forwarded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert forwarded == ["loading 50%"]

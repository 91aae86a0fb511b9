"""A new kernel's reaper waits for the ranks of a dead kernel that write its snapshot to disk."""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
import threading
import time

from fsdp2nb.host import memory_store
from fsdp2nb.host.persisting import mark_persisting
from fsdp2nb.host.process_identity import process_key
from fsdp2nb.pool import reaper


class _Heard(logging.Handler):
    def __init__(self, words: str) -> None:
        super().__init__(logging.INFO)
        self.words, self.event = words, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


def _finished_process_key():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    key = process_key(done.pid)
    done.wait()
    return key


@contextlib.contextmanager
def _reaping_a_dead_kernels_pool(pool_id: str, until: float, notes: list[str] | None = None):
    """A dead kernel's pool of one process (it ends once its stdin closes, as a rank does once its
    write is done), its store marked as persisting until `until`, and a reaper started on it
    that has said it waits. Yields that process and the reaper's thread."""
    owner = _finished_process_key()
    store = memory_store.session_store(*owner)
    store.mkdir(mode=0o700)
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    heard = _Heard("to write its snapshot to disk")
    reaper.logger.addHandler(heard)
    level = reaper.logger.level
    reaper.logger.setLevel(logging.INFO)
    reaping = threading.Thread(target=reaper.reap_orphans, kwargs={"notes": notes})
    try:
        reaper.record_pool(pool_id, owner, [process_key(process.pid)])
        mark_persisting(store, until=until)
        reaping.start()
        assert heard.event.wait(timeout=60), "the reaper never said it waits"
        yield owner, process, reaping
    finally:
        reaper.logger.removeHandler(heard)
        reaper.logger.setLevel(level)
        if process.poll() is None:
            process.kill()
        process.wait()
        if reaping.ident is not None:  # started
            reaping.join(timeout=60)
        reaper.forget_pool(pool_id)
        shutil.rmtree(store, ignore_errors=True)


def test_ranks_writing_a_dead_kernels_snapshot_end_by_themselves_before_the_reaper_acts():
    notes: list[str] = []
    with _reaping_a_dead_kernels_pool("test-persisting", float("1e12"), notes) as (owner, rank, reaping):
        assert rank.poll() is None and reaping.is_alive()
        rank.stdin.close()  # the write is done
        reaping.join(timeout=60)
        assert not reaping.is_alive()
        assert rank.wait(timeout=10) == 0, "the rank ended by itself, not by the reaper's SIGKILL"
    assert len(notes) == 1 and notes[0].startswith("waited ") and f"ranks of kernel {owner[0]}, which ended" in notes[0]
    assert "test-persisting/pool.log says what" in notes[0], notes


def test_once_the_time_is_up_the_agent_ends_its_ranks_itself_and_the_reaper_waits_for_that():
    bound = time.time() + 0.5
    # An "agent" still busy a second after the bound, as one that ends its ranks and logs why.
    with _reaping_a_dead_kernels_pool("test-persisting-bound", bound) as (_, agent, reaping):
        while time.time() < bound + 1.0:
            time.sleep(0.05)
        assert agent.poll() is None, "the reaper killed the agent as soon as the bound had passed"
        agent.stdin.close()  # the agent has ended its ranks and written its log line
        reaping.join(timeout=60)
        assert not reaping.is_alive()
        assert agent.wait(timeout=10) == 0, "the agent ended by itself, not by the reaper's SIGKILL"

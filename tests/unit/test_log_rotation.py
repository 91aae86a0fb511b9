"""The ranks' logs and pool.log rotate: a session that prints or logs for days keeps a bounded
amount on disk, and the last lines are still found right after a rotation."""

from __future__ import annotations

import os

from fsdp2nb.host.rank_logs import RotatingLog, read_tail, rotated_path
from fsdp2nb.pool.pool_log import close_pool_log, open_pool_log


def _bytes_on_disk(directory) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def test_a_rank_log_keeps_at_most_twice_its_limit(tmp_path):
    path = str(tmp_path / "rank-0.log")
    log = RotatingLog(path, max_bytes=4096)
    line = b"step 12345 loss 1.234567\n"
    for _ in range(2000):  # 50 KB written, twelve times the limit
        log.write(line)
    log.close()
    assert _bytes_on_disk(tmp_path) <= 2 * 4096
    assert os.path.getsize(path) <= 4096 and os.path.getsize(rotated_path(path)) > 0


def test_a_rank_log_appends_to_what_an_earlier_rank_left_and_counts_it(tmp_path):
    path = tmp_path / "rank-0.log"
    path.write_bytes(b"x" * 4000)
    log = RotatingLog(str(path), max_bytes=4096)
    log.write(b"y" * 200)  # would pass the limit: the earlier rank's 4000 bytes are moved aside
    log.close()
    assert path.read_bytes() == b"y" * 200
    assert open(rotated_path(str(path)), "rb").read() == b"x" * 4000


def test_the_tail_reaches_into_the_part_moved_aside(tmp_path):
    path = str(tmp_path / "rank-1.log")
    log = RotatingLog(path, max_bytes=64)
    for number in range(10):
        log.write(f"line {number}\n".encode())  # 7 bytes each: rotates after the ninth
    log.close()
    assert read_tail(path, 21) == ["line 7", "line 8", "line 9"]


def test_pool_log_keeps_at_most_twice_its_limit(tmp_path):
    path = tmp_path / "pool.log"
    log = open_pool_log(str(path), max_bytes=4096)
    for number in range(2000):
        log.warning("refused a connection from peer %d: bad hello", number)
    close_pool_log(log)
    assert _bytes_on_disk(tmp_path) <= 2 * 4096 + 200  # a record is written whole past the limit
    assert "peer 1999" in path.read_text()

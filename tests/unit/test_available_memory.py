"""The host's available memory as a rank plans with it: what its memory cgroup has left where that
is less than the machine's, the cgroup's droppable page cache counted as free."""

from __future__ import annotations

import psutil

from fsdp2nb import host_memory

MIB = 2**20


def _cgroup_v2(tmp_path, limit: str, current: int, stat: str = ""):
    group = tmp_path / "cg" / "pod" / "rank"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(limit + "\n")
    (group / "memory.current").write_text(f"{current}\n")
    if stat:
        (group / "memory.stat").write_text(stat)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pod/rank\n")
    return str(proc), tmp_path / "cg"


def test_a_container_s_limit_less_its_usage_is_what_is_available(tmp_path):
    proc, root = _cgroup_v2(tmp_path, str(300 * MIB), 100 * MIB)
    assert host_memory.available_bytes(proc, root) == 200 * MIB


def test_the_cgroup_s_inactive_file_cache_counts_as_available(tmp_path):
    proc, root = _cgroup_v2(tmp_path, str(300 * MIB), 250 * MIB, stat=f"anon 1\ninactive_file {120 * MIB}\nactive_file 7\n")
    assert host_memory.available_bytes(proc, root) == 170 * MIB


def test_a_cgroup_over_its_limit_has_nothing_available(tmp_path):
    proc, root = _cgroup_v2(tmp_path, str(100 * MIB), 101 * MIB)
    assert host_memory.available_bytes(proc, root) == 0


def test_without_a_cgroup_limit_the_machine_s_available_memory_counts(tmp_path):
    proc, root = _cgroup_v2(tmp_path, "max", 100 * MIB)
    assert host_memory.available_bytes(proc, root) > 200 * MIB
    assert host_memory.available_bytes(proc, root) <= psutil.virtual_memory().total

"""Reading a memory cgroup's limit and OOM-kill count from files laid out as v1 and v2 lay them out."""

from __future__ import annotations

from fsdp2nb import host_memory


def _v2(tmp_path, limit: str, events: str):
    group = tmp_path / "cg" / "user.slice" / "kernel"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(limit + "\n")
    (group / "memory.events").write_text(events)
    (group / "memory.current").write_text("1000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/kernel\n")
    return proc, tmp_path / "cg"


def test_v2_limit_and_oom_kills(tmp_path):
    proc, root = _v2(tmp_path, "4096", "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    directory = host_memory.cgroup_memory_dir(str(proc), root)
    assert directory == root / "user.slice" / "kernel"
    assert host_memory.cgroup_limit_bytes(directory) == 4096
    assert host_memory.oom_kill_count(directory) == 2


def test_v2_without_a_limit(tmp_path):
    proc, root = _v2(tmp_path, "max", "oom_kill 0\n")
    assert host_memory.cgroup_limit_bytes(host_memory.cgroup_memory_dir(str(proc), root)) is None


def test_v1_memory_controller(tmp_path):
    group = tmp_path / "cg" / "memory" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(1 << 62))  # "no limit"
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/docker/abc\n0::/\n")
    directory = host_memory.cgroup_memory_dir(str(proc), tmp_path / "cg")
    assert directory == group
    assert host_memory.cgroup_limit_bytes(directory) is None
    assert host_memory.oom_kill_count(directory) == 5


def test_nothing_readable_is_unknown(tmp_path):
    assert host_memory.cgroup_memory_dir(str(tmp_path / "missing"), tmp_path) is None
    assert host_memory.kernel_log_names_oom_kill(1, kmsg=str(tmp_path / "no-kmsg")) is None
    assert host_memory.host_limit_bytes() > 0

"""Several real hosts on one Linux machine, made of network namespaces, for multi-host tests.

Each host is a network namespace with its own network stack: `lo` up, one private address on a
veth link and no default route, so traffic goes only between the hosts (and to each host's own
loopback). Two hosts are joined by one veth pair; more hosts by a bridge in a third, "switch"
namespace, one veth pair from each host to it. Every link lives inside the namespaces, so deleting
them deletes the links, and nothing is added to the machine's own network.

    with TestHosts(2) as hosts:
        subprocess.run([*hosts[1].exec_prefix(), "ping", "-c1", hosts[0].address], check=True)

Names are unique per process and per instance (`f2nb<pid>x<k>h<i>`), so concurrent runs do not
collide; `close()` ends every process left in the namespaces (SIGTERM, then SIGKILL) and deletes
only the namespaces this instance made. Making namespaces needs root (CAP_SYS_ADMIN) and iproute2:
`TestHosts.unavailable_reason()` says why they cannot be made here, for a test's skip message.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import shutil
import signal
import subprocess
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SUBNET_PREFIX = "10.213.0."
"""Host i gets SUBNET_PREFIX + str(i + 1), in a /24."""
PREFIX_LEN = 24
MAX_HOSTS = 200

_instance_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class TestHost:
    """One namespace seen as a host."""

    __test__ = False  # not a pytest test class

    index: int
    """Position in its TestHosts, 0 first."""
    name: str
    """The namespace's name (`ip netns exec NAME ...`)."""
    address: str
    """The host's private IPv4 address, on `interface`."""
    interface: str
    """The veth interface inside the namespace that carries `address`."""

    def exec_prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this host."""
        return ["ip", "netns", "exec", self.name]

    def pids(self) -> list[int]:
        """The processes now running in this host's namespace (empty once it is gone)."""
        return namespace_pids(self.name)

    def run(self, args: list[str], **kwargs) -> subprocess.CompletedProcess:
        """`subprocess.run(args)` inside this host; keyword arguments as for subprocess.run."""
        return subprocess.run([*self.exec_prefix(), *args], **kwargs)

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """`subprocess.Popen(args)` inside this host; keyword arguments as for subprocess.Popen."""
        return subprocess.Popen([*self.exec_prefix(), *args], **kwargs)


class TestHosts:
    """`num_hosts` network namespaces joined by veth links; a context manager that owns them."""

    __test__ = False  # not a pytest test class

    def __init__(self, num_hosts: int = 2, *, grace_s: float = 3.0) -> None:
        if not 2 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts={num_hosts!r}: must be in 2..{MAX_HOSTS}")
        reason = self.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot make test hosts: {reason}")
        stem = f"f2nb{os.getpid()}x{next(_instance_counter)}"
        self.hosts: list[TestHost] = [
            TestHost(index=i, name=f"{stem}h{i}", address=f"{SUBNET_PREFIX}{i + 1}", interface=f"veth{i}")
            for i in range(num_hosts)
        ]
        self._switch = f"{stem}sw" if num_hosts > 2 else None
        # Every namespace this instance made, in creation order; the finalizer deletes exactly these.
        self._made: list[str] = []
        self._finalizer = weakref.finalize(self, _teardown, self._made, grace_s)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- construction ---------------------------------------------------------------------------

    def _build(self) -> None:
        for name in [h.name for h in self.hosts] + ([self._switch] if self._switch else []):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        if self._switch is None:
            a, b = self.hosts
            _ip("link", "add", a.interface, "netns", a.name, "type", "veth",
                "peer", "name", b.interface, "netns", b.name)
        else:
            _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._switch, "link", "set", "br0", "up")
            for host in self.hosts:
                port = f"port{host.index}"
                _ip("link", "add", host.interface, "netns", host.name, "type", "veth",
                    "peer", "name", port, "netns", self._switch)
                _ip("-n", self._switch, "link", "set", port, "master", "br0", "up")
        for host in self.hosts:
            _ip("-n", host.name, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", host.interface)
            _ip("-n", host.name, "link", "set", host.interface, "up")
        logger.info("test hosts up: %s", ", ".join(f"{h.name}={h.address}" for h in self.hosts))

    # -- use ------------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> TestHost:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[TestHost]:
        return iter(self.hosts)

    @property
    def names(self) -> list[str]:
        """The hosts' namespace names, host 0 first (the switch namespace, if any, is not a host)."""
        return [h.name for h in self.hosts]

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this instance made and has not yet deleted, the switch included."""
        return list(self._made)

    def __enter__(self) -> TestHosts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """End every process left in the namespaces, then delete them. Safe to call twice."""
        self._finalizer()

    # -- availability ---------------------------------------------------------------------------

    @staticmethod
    @functools.cache
    def unavailable_reason() -> str | None:
        """Why namespaces cannot be made here, or None when they can (probed once per process)."""
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            return "making network namespaces needs root (CAP_SYS_ADMIN); run the tests as root"
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2) on PATH"
        probe = f"f2nb{os.getpid()}probe"
        added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if added.returncode != 0:
            return f"`ip netns add` refused: {added.stderr.strip() or added.returncode}"
        try:
            veth = subprocess.run(
                ["ip", "link", "add", "veth0", "netns", probe, "type", "veth",
                 "peer", "name", "veth1", "netns", probe],
                capture_output=True, text=True,
            )
            if veth.returncode != 0:
                return f"`ip link add ... type veth` refused: {veth.stderr.strip() or veth.returncode}"
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None


def namespace_pids(name: str) -> list[int]:
    """The pids in network namespace `name` (`ip netns pids`); empty when it does not exist."""
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    if out.returncode != 0:
        return []
    return [int(tok) for tok in out.stdout.split()]


def list_namespaces() -> list[str]:
    """The names of the machine's named network namespaces (`ip netns list`)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def kill_namespace_processes(names: str | list[str], grace_s: float = 3.0) -> None:
    """SIGTERM every process in the namespace(s) `names`, wait up to `grace_s`, then SIGKILL the rest.

    All namespaces share one grace period. New processes may appear while old ones exit (a
    supervisor restarting a child), so the namespaces are swept until empty or the sweeps give up.
    """
    names = [names] if isinstance(names, str) else names

    def alive() -> list[int]:
        return _alive([pid for name in names for pid in namespace_pids(name)])

    _signal_all(alive(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(50):
        pids = alive()
        if not pids:
            return
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.05)
    logger.warning("namespaces %s still have processes %s after SIGKILL", names, alive())


def _teardown(made: list[str], grace_s: float) -> None:
    """The finalizer: end the processes, then delete the namespaces, last made first."""
    kill_namespace_processes(list(made), grace_s)
    for name in reversed(list(made)):
        out = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
        if out.returncode != 0 and name in list_namespaces():
            logger.warning("could not delete namespace %s: %s", name, out.stderr.strip())
            continue
        made.remove(name)


def _alive(pids: list[int]) -> list[int]:
    """The pids that are not zombies (a zombie is dead; only its parent's wait removes it)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue  # never signal ourselves, should a caller have entered a namespace
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")

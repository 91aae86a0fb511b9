"""Where the kernel listens and how ranks reach it: a Unix socket, or TCP with TLS across hosts.

An address is a Unix socket path (one host: in the pool's private directory) or `tcp://HOST:PORT`
(several hosts: HOST is the kernel's cluster-facing address, never a wildcard). TCP connections
send small frames at once (no Nagle delay) and keep alive, so a host that vanished without closing
its connections is noticed within `KEEPALIVE_LIMIT_S`.
"""

from __future__ import annotations

import ipaddress
import socket

from fsdp2nb.errors import InvalidValue
from fsdp2nb.wire.tls import check_fingerprint, client_context

TCP_SCHEME = "tcp://"
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
KEEPALIVE_LIMIT_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES
CONNECT_TIMEOUT_S = 30.0


def is_tcp(address: str) -> bool:
    return address.startswith(TCP_SCHEME)


def tcp_address(host: str, port: int) -> str:
    return f"{TCP_SCHEME}{host}:{port}"


def split_tcp_address(address: str) -> tuple[str, int]:
    """`tcp://10.0.0.1:4567` -> ("10.0.0.1", 4567); ValueError for anything else."""
    host, _, port = address.removeprefix(TCP_SCHEME).rpartition(":")
    host = host.strip("[]")
    if not is_tcp(address) or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not an address such as tcp://10.0.0.1:4567")  # internal: addresses come from the launch plan, not from users
    return host, int(port)


def check_listen_host(host: str) -> None:
    """Refuse a wildcard: the pool listens on one cluster-facing address only."""
    try:
        parsed = ipaddress.ip_address(host)
    except ValueError:
        raise InvalidValue(f"--listen {host!r} is not an IP address; give this host's address on the "
                           "cluster network, e.g. 10.0.0.5") from None
    if parsed.is_unspecified:
        raise InvalidValue(f"--listen {host} would listen on every interface; give this host's address "
                           "on the cluster network instead")


def listen(address: str) -> socket.socket:
    """A listening socket for `address`; a TCP port of 0 picks a free one (see `bound_address`)."""
    if not is_tcp(address):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
    else:
        host, port = split_tcp_address(address)
        check_listen_host(host)
        server = socket.socket(_family(host), socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
    server.listen(128)
    return server


def bound_address(server: socket.socket) -> str:
    """The address peers connect to, with the port the system picked."""
    if server.family == socket.AF_UNIX:
        return server.getsockname()
    host, port = server.getsockname()[:2]
    return tcp_address(host if server.family == socket.AF_INET else f"[{host}]", port)


def tune_tcp(sock: socket.socket) -> None:
    """No Nagle delay on small frames; keepalive probes to notice a vanished host."""
    if sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def connect(address: str, fingerprint: str = "") -> socket.socket:
    """A connection to the kernel: the Unix socket, or TCP whose TLS certificate must match
    `fingerprint` (UntrustedPeer otherwise)."""
    if not is_tcp(address):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(address)
        return client
    if not fingerprint:
        raise ValueError("a TCP address needs the pool certificate's fingerprint")  # internal: the launch plan always carries the fingerprint
    host, port = split_tcp_address(address)
    raw = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    tune_tcp(raw)
    secure = client_context().wrap_socket(raw, server_side=False)
    try:
        check_fingerprint(secure, fingerprint)
    except BaseException:
        secure.close()
        raise
    secure.settimeout(None)
    return secure


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET

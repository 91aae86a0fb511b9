"""The pool's channels over TCP with TLS, as ranks on other hosts use them (here on 127.0.0.1)."""

import socket
import ssl
import struct

import pytest

from fsdp2nb.wire.events import StreamOutput
from fsdp2nb.wire.protocol import ChannelHello
from fsdp2nb.wire.requests import RunCell
from fsdp2nb.wire.signing import KEY_BYTES, Signer
from tests.support.channels import ListLog, read_until, wait_until

pytest.importorskip("cryptography", reason="multi-host pools need `pip install cryptography`")


@pytest.fixture
def tls_kernel(tmp_path):
    from fsdp2nb.wire.channels import KernelChannels
    from fsdp2nb.wire.tls import make_pool_certificate

    log = ListLog()
    signer = Signer(b"k" * KEY_BYTES, log=log.logger)
    certificate = make_pool_certificate(str(tmp_path))
    kernel = KernelChannels(signer, "tcp://127.0.0.1:0", log=log.logger, certificate=certificate)
    yield kernel, signer, certificate, log
    kernel.close()


def _stream(rank: int, text: str) -> StreamOutput:
    return StreamOutput(rank=rank, cell_id=1, stream="stdout", text=text)


def test_events_and_requests_cross_a_tls_link_in_order(tls_kernel):
    from fsdp2nb.wire.channels import RankChannels

    kernel, signer, certificate, _ = tls_kernel
    assert kernel.address.startswith("tcp://127.0.0.1:") and not kernel.address.endswith(":0")
    rank = RankChannels(signer, kernel.address, rank=0, fingerprint=certificate.fingerprint)
    try:
        texts = [f"line {i}" for i in range(200)] + ["x" * 300_000]  # many records, one past 16 KiB ones
        for text in texts:
            rank.send_event(_stream(0, text))
        received = read_until(kernel, lambda r: len(r) == len(texts))
        assert [m.text for m in received] == texts
        big = RunCell(cell_id=7, code="y" * 100_000)
        kernel.send(0, RunCell(cell_id=6, code="small"))
        kernel.send(0, big)
        assert rank.receive_request(10_000) == RunCell(cell_id=6, code="small")
        assert rank.receive_request(10_000) == big
        assert rank.local_host() == "127.0.0.1"
    finally:
        rank.close()


def test_a_certificate_with_the_wrong_fingerprint_gets_no_link(tls_kernel):
    from fsdp2nb.wire.channels import RankChannels
    from fsdp2nb.wire.tls import UntrustedPeer

    kernel, signer, certificate, _ = tls_kernel
    wrong = "0" * 64
    with pytest.raises(UntrustedPeer, match="refusing to connect"):
        RankChannels(signer, kernel.address, rank=0, fingerprint=wrong)
    assert not kernel._links


def test_a_plain_tcp_client_gets_no_challenge_and_is_refused(tls_kernel):
    kernel, signer, _, log = tls_kernel
    host, port = kernel.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as plain:
        hello = signer.pack_versioned(ChannelHello(role="events", rank=0, challenge=b"x" * 32))
        plain.sendall(struct.pack("!Q", len(hello)) + hello)
        assert wait_until(lambda: log.matching("TLS handshake failed"))
    assert not kernel._links


def test_a_forged_or_replayed_hello_over_tls_gets_nothing(tls_kernel):
    kernel, signer, certificate, log = tls_kernel

    def connect():
        host, port = kernel.address.removeprefix("tcp://").rsplit(":", 1)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        sock = context.wrap_socket(socket.create_connection((host, int(port)), timeout=10))
        (size,) = struct.unpack("!Q", sock.recv(8))
        return sock, sock.recv(size)[:32]  # the challenge, then the kernel's wire version

    forger, challenge = connect()
    forged = Signer(b"f" * KEY_BYTES).pack_versioned(ChannelHello(role="events", rank=0, challenge=challenge))
    forger.sendall(struct.pack("!Q", len(forged)) + forged)
    assert wait_until(lambda: log.matching("failed signature verification"))
    first, challenge = connect()
    hello = signer.pack_versioned(ChannelHello(role="events", rank=0, challenge=challenge))
    first.sendall(struct.pack("!Q", len(hello)) + hello)
    first.close()
    replayer, _ = connect()
    replayer.sendall(struct.pack("!Q", len(hello)) + hello)
    assert wait_until(lambda: log.matching("replayed hello"))
    assert read_until(kernel, lambda r: r, timeout_s=0.3) == []
    forger.close()
    replayer.close()


def test_a_wildcard_listen_address_is_refused_with_one_line():
    from fsdp2nb.wire.endpoints import listen

    with pytest.raises(ValueError, match="every interface"):
        listen("tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="not an IP address"):
        listen("tcp://example.invalid:0")

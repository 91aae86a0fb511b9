"""TLS for a pool whose ranks reach the kernel over a network.

Each pool makes its own self-signed certificate; its SHA-256 fingerprint travels to the ranks in
the launch plan (through the launching engine, never a command line), and a rank talks only to a
peer that shows exactly that certificate. No certificate authority and no host names are
involved, so nothing outside the pool can vouch for an impostor. Inside the link, frames stay
HMAC-signed: TLS keeps the traffic private, the pool key still decides who may speak.

`cryptography` makes the certificate; it is imported only when a multi-host pool starts.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import ssl
from dataclasses import dataclass

from fsdp2nb.errors import Fsdp2nbError


class UntrustedPeer(Fsdp2nbError, ConnectionError):
    """The peer's certificate is not the pool's."""


@dataclass(frozen=True)
class PoolCertificate:
    """A pool's certificate and key, as files in its private runtime directory."""

    cert_path: str
    key_path: str
    fingerprint: str
    """SHA-256 of the certificate's DER bytes, in hex."""


def make_pool_certificate(directory: str, common_name: str = "fsdp2nb pool") -> PoolCertificate:
    """A fresh P-256 key and a self-signed certificate for it, written 0600 into `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a node's clock may lag a little
        .not_valid_after(now + datetime.timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    der = certificate.public_bytes(serialization.Encoding.DER)
    cert_path = os.path.join(directory, "pool-cert.pem")
    key_path = os.path.join(directory, "pool-key.pem")
    _write_private(cert_path, certificate.public_bytes(serialization.Encoding.PEM))
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return PoolCertificate(cert_path, key_path, hashlib.sha256(der).hexdigest())


def load_pool_certificate(directory: str) -> PoolCertificate:
    """The certificate `make_pool_certificate` wrote into `directory` (a kept pool's, for the
    kernel that attaches it: its ranks check the fingerprint they were launched with)."""
    cert_path = os.path.join(directory, "pool-cert.pem")
    with open(cert_path) as pem:
        der = ssl.PEM_cert_to_DER_cert(pem.read())
    return PoolCertificate(cert_path, os.path.join(directory, "pool-key.pem"), hashlib.sha256(der).hexdigest())


def _write_private(path: str, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def server_context(certificate: PoolCertificate) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(certificate.cert_path, certificate.key_path)
    # Session tickets would arrive on connections the ranks never read after their hello.
    context.num_tickets = 0
    return context


def client_context() -> ssl.SSLContext:
    """Trust is decided by `check_fingerprint` after the handshake, not by a CA or a host name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def check_fingerprint(sock: ssl.SSLSocket, expected: str) -> None:
    """Raise UntrustedPeer unless the peer showed the certificate whose fingerprint is `expected`."""
    der = sock.getpeercert(binary_form=True) or b""
    actual = hashlib.sha256(der).hexdigest()
    if not hmac.compare_digest(actual, expected):
        raise UntrustedPeer(f"the kernel's certificate has fingerprint {actual[:16]}..., not the pool's "
                            f"{expected[:16]}...: refusing to connect")

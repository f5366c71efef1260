"""A self-signed certificate for the listener, made at start (llm-d's ``--secure-proxy`` without
``--cert-path``).

It encrypts and proves nothing about who serves: a client must skip verification (kubelet's
HTTPS probes do). A new key each start, which exists in the process's memory only: it is never
written to a file (``ServerTls.in_memory``), so no exit — a SIGKILL or an OOM kill included —
leaves a private key behind, on a disk or in ``/dev/shm``.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl

from sidecar.security.tls import ServerTls

VALID_DAYS = 365


def self_signed_tls(minimum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2) -> ServerTls:
    """The listener's TLS with a new self-signed certificate for this host (and localhost,
    127.0.0.1, ::1); ``OSError`` when it cannot be held in memory files."""
    cert_pem, key_pem = _make(socket.gethostname())
    return ServerTls.in_memory(cert_pem, key_pem, minimum)


def _make(hostname: str) -> tuple[bytes, bytes]:
    # cryptography is imported here only: a sidecar without --secure-proxy never loads it.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname or "pd-sidecar")])
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    if hostname and hostname != "localhost":
        names.insert(0, x509.DNSName(hostname))
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem

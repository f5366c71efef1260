"""A self-signed certificate for the listener, made at start (llm-d's ``--secure-proxy`` without
``--cert-path``).

It encrypts and verifies nothing about who serves: a client must skip verification (kubelet's
HTTPS probes do). It lives as long as the process: a new key each start, in a private temporary
directory (``TMPDIR``, ``/tmp``; ``/dev/shm`` when the root filesystem is read-only), removed at
exit. ``ServerTls`` loads it like any other pair of files.
"""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import shutil
import socket
import tempfile

VALID_DAYS = 365


def write_self_signed() -> tuple[str, str]:
    """The certificate and key files of a new self-signed certificate for this host (and
    localhost, 127.0.0.1, ::1); ``OSError`` when no temporary directory is writable."""
    cert_pem, key_pem = _make(socket.gethostname())
    directory = _private_directory()
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    cert_file = os.path.join(directory, "tls.crt")
    key_file = os.path.join(directory, "tls.key")
    for path, data in ((cert_file, cert_pem), (key_file, key_pem)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
    return cert_file, key_file


def _private_directory() -> str:
    try:
        return tempfile.mkdtemp(prefix="pd-sidecar-tls-")
    except OSError:
        # A read-only root filesystem without an emptyDir on /tmp: the shared-memory tmpfs the
        # container runtime mounts is still writable.
        return tempfile.mkdtemp(prefix="pd-sidecar-tls-", dir="/dev/shm")


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

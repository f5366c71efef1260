"""Certificates the tests make (``trustme``), and a directory that rotates them as Kubernetes does.

A Secret mounted in a pod is a directory whose visible files are symlinks through ``..data``,
itself a symlink to a hidden, timestamped directory holding the real files. The kubelet updates
it atomically: it writes a new hidden directory, points a temporary symlink at it, renames that
over ``..data`` (one ``rename``), then removes the old directory. ``SecretDir`` does the same.
"""

from __future__ import annotations

import itertools
import os
import shutil
import ssl
from pathlib import Path

import trustme
from cryptography import x509


class Pki:
    """One CA and the certificates it issues, as files under ``directory``."""

    def __init__(self, directory: Path, name: str = "ca") -> None:
        self.ca = trustme.CA(organization_name=f"pd-sidecar tests {name}")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ca_file = str(directory / f"{name}.pem")
        self.ca.cert_pem.write_to_path(self.ca_file)
        self._count = itertools.count()

    def issue(self, *names: str) -> tuple[str, str, int]:
        """A certificate for ``names`` (host names or IP addresses): its file, its key's file,
        its serial number."""
        cert = self.ca.issue_cert(*names)
        n = next(self._count)
        cert_file = str(self.directory / f"cert-{n}.pem")
        key_file = str(self.directory / f"key-{n}.pem")
        cert.cert_chain_pems[0].write_to_path(cert_file)
        for pem in cert.cert_chain_pems[1:]:
            pem.write_to_path(cert_file, append=True)
        cert.private_key_pem.write_to_path(key_file)
        return cert_file, key_file, serial_of_pem(cert.cert_chain_pems[0].bytes())

    def client_context(self) -> ssl.SSLContext:
        """A client that trusts this CA only."""
        context = ssl.create_default_context(cafile=self.ca_file)
        return context


def serial_of_pem(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def serial_of_der(der: bytes) -> int:
    return x509.load_der_x509_certificate(der).serial_number


class SecretDir:
    """A directory laid out and updated like a mounted Kubernetes Secret."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self._versions = itertools.count()

    def file(self, name: str) -> str:
        """The visible path of a key of the Secret (what a setting names)."""
        return str(self.path / name)

    def write(self, files: dict[str, str]) -> None:
        """The Secret's new content: ``{key: path of a file to copy}``, swapped in atomically."""
        version = self.path / f"..2026_01_01_00_00_{next(self._versions):02d}.{os.getpid()}"
        version.mkdir()
        for name, source in files.items():
            shutil.copyfile(source, version / name)
        data = self.path / "..data"
        old = data.resolve() if data.is_symlink() else None
        temporary = self.path / "..data_tmp"
        temporary.symlink_to(version.name)
        os.replace(temporary, data)  # the one atomic step
        for name in files:
            visible = self.path / name
            if not visible.is_symlink():
                visible.symlink_to(f"..data/{name}")
        if old is not None:
            shutil.rmtree(old)

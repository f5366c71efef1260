"""TLS: the sidecar's own listener, its connections to the engines, and reloading both from files.

**The listener** (``ServerTls``): TLS 1.2 at least (``SIDECAR_TLS_MIN_VERSION``), its certificate
and key from ``SIDECAR_TLS_CERT_FILE`` / ``_KEY_FILE``. Kubernetes rotates a mounted Secret by
writing the new files into a new hidden directory and swapping the ``..data`` symlink the visible
names point through; so a change is seen in the *resolved* path (or its inode, size, modification
time), never by watching the names. A new certificate serves new handshakes; connections already
open keep theirs.

The context the server was started with is never modified: OpenSSL drops the private key of a
context whose new certificate does not match it, so a half-written pair loaded in place would
break every handshake that follows. Each reload builds a fresh context in a worker thread, and
only one that loaded completely becomes current; the server's context hands each new handshake
to it (``sni_callback``, which OpenSSL calls for every ClientHello, with or without a server
name). A pair that does not load leaves the previous certificate in service, logged as an error
and counted; it is tried again once the files change again.

**The engines** (``ClientTls``): what an ``https://`` engine connection verifies — the CA bundle
``SIDECAR_TLS_CA_FILE`` (empty: the system's), the client certificate for mTLS, or nothing at all
for a stage whose ``SIDECAR_{PREFILL,DECODE}_TLS_INSECURE_SKIP_VERIFY`` says so: one context that
verifies and one that does not, each stage given the one it asked for. Reloaded the same way; a
new context serves new connections (pooled connections are keyed by their context, so none made
with the old one is reused after a reload).

``FileWatch`` polls the files every ``SIDECAR_TLS_RELOAD_INTERVAL_S``: a few ``stat`` calls, in a
worker thread like every file read here, so the event loop never waits for a disk.

**A pair held in memory** (``ServerTls.in_memory``: the self-signed certificate) is never
written to a file: OpenSSL reads certificates and keys from paths only, so it gets anonymous
in-memory files (``memory_files``) by their ``/proc/self/fd`` paths, closed once read. Nothing
watches or reloads such a pair, and nothing of it outlives the process, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence

logger = logging.getLogger("sidecar.security.tls")

Fingerprint = tuple[tuple[str, int, int, int, int] | None, ...]
"""Per watched file: resolved path, device, inode, size, modification time (None: unreadable)."""


class TlsFilesError(Exception):
    """Certificate, key or CA files that cannot be loaded; the message names them and says why."""


def fingerprint(paths: Sequence[str]) -> Fingerprint:
    """What identifies the current content of ``paths`` (blocking: a few ``stat`` calls)."""
    found: list[tuple[str, int, int, int, int] | None] = []
    for path in paths:
        try:
            real = os.path.realpath(path)
            st = os.stat(real)
        except OSError:
            found.append(None)
            continue
        found.append((real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(found)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror.lower()}{where}"
    return str(exc) or type(exc).__name__


@contextlib.contextmanager
def memory_files(*contents: bytes, memfd: bool = True) -> Iterator[tuple[str, ...]]:
    """Paths that read ``contents`` while the block runs, backed by memory only: each an
    anonymous file (``memfd_create``), or where there is none (not Linux, or a seccomp profile
    that denies it; or ``memfd=False``) a pipe, which holds a few KiB for one read. Closed at the
    end of the block; nothing is ever written to a file system."""
    fds: list[int] = []
    directory = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        for data in contents:
            fds.append(_memory_file(data, memfd))
        yield tuple(f"{directory}/{fd}" for fd in fds)
    finally:
        for fd in fds:
            os.close(fd)


def _memory_file(data: bytes, memfd: bool) -> int:
    """A file descriptor that reads ``data``: an anonymous file, else a pipe's read end."""
    fd = _anonymous_file() if memfd else None
    if fd is None:
        fd, write = os.pipe()
        # Non-blocking: more than the pipe holds is an error, never a process stuck writing.
        os.set_blocking(write, False)
    else:
        write = fd
    try:
        written = os.write(write, data)
        if written != len(data):
            raise OSError(f"wrote {written} of {len(data)} bytes to a memory file")
    except OSError:
        os.close(fd)
        raise
    finally:
        if write != fd:
            os.close(write)
    return fd


def _anonymous_file() -> int | None:
    try:
        return os.memfd_create("pd-sidecar-tls", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux, or denied (a seccomp profile)
        return None


class ServerTls:
    """The listener's TLS: ``context`` goes to the server once; ``reload()`` changes what new
    handshakes get. Made from files (reloaded when they change), or ``in_memory``."""

    def __init__(
        self, cert_file: str, key_file: str, minimum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    ) -> None:
        self._cert_file = cert_file
        self._key_file = key_file
        self._minimum = minimum
        self.files: tuple[str, ...] = (cert_file, key_file)
        """What ``reload()`` loads again, and a ``FileWatch`` watches; empty in memory."""
        self.context = self._build()
        self._current = self.context
        self.context.sni_callback = self._pick

    @classmethod
    def in_memory(
        cls, cert_pem: bytes, key_pem: bytes, minimum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    ) -> ServerTls:
        """A pair that exists in this process's memory only (the self-signed certificate):
        loaded through ``memory_files``, no files to watch, never reloaded. ``TlsFilesError``
        when it does not load, ``OSError`` when no memory file can be made."""
        with memory_files(cert_pem, key_pem) as (cert_path, key_path):
            tls = cls(cert_path, key_path, minimum)
        tls.files = ()
        return tls

    def _build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = self._minimum
        try:
            context.load_cert_chain(self._cert_file, self._key_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsFilesError(
                f"cannot load the certificate {self._cert_file} with the key {self._key_file}: "
                f"{_reason(exc)}"
            ) from exc
        return context

    def _pick(self, connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        if connection.context is not self._current:
            connection.context = self._current

    async def reload(self) -> None:
        """Load the files again; ``TlsFilesError`` (and the previous certificate kept) if they
        do not load. A pair in memory stays as it is."""
        if self.files:
            self._current = await asyncio.to_thread(self._build)


class ClientTls:
    """What engine connections over ``https://`` use: a ``verified`` context and, when some
    stage skips verification (``insecure``), an ``unverified`` one; ``context(insecure)`` picks,
    ``reload()`` replaces both."""

    def __init__(
        self,
        *,
        ca_file: str | None,
        cert_file: str | None,
        key_file: str | None,
        insecure: bool = False,
    ) -> None:
        self._ca_file = ca_file
        self._cert_file = cert_file
        self._key_file = key_file
        self.insecure = insecure
        """Whether some stage accepts any certificate."""
        self.verified, self.unverified = self._build_both()

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self._ca_file, self._cert_file, self._key_file) if f)

    def context(self, insecure: bool) -> ssl.SSLContext:
        """The context of a stage that skips verification (``insecure``) or verifies; a stage
        that was not said to skip at construction verifies."""
        return self.unverified if insecure and self.unverified is not None else self.verified

    def _build_both(self) -> tuple[ssl.SSLContext, ssl.SSLContext | None]:
        return self._build(False), self._build(True) if self.insecure else None

    def _build(self, insecure: bool) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            try:
                if self._ca_file:
                    context.load_verify_locations(cafile=self._ca_file)
                else:
                    context.load_default_certs(ssl.Purpose.SERVER_AUTH)
            except (OSError, ssl.SSLError) as exc:
                raise TlsFilesError(
                    f"cannot load the CA bundle {self._ca_file}: {_reason(exc)}"
                ) from exc
        if self._cert_file and self._key_file:
            try:
                context.load_cert_chain(self._cert_file, self._key_file)
            except (OSError, ssl.SSLError) as exc:
                raise TlsFilesError(
                    f"cannot load the client certificate {self._cert_file} with the key "
                    f"{self._key_file}: {_reason(exc)}"
                ) from exc
        return context

    async def reload(self) -> None:
        self.verified, self.unverified = await asyncio.to_thread(self._build_both)


class FileWatch:
    """Calls ``reload`` whenever the content of ``files`` changed (``fingerprint``), every
    ``interval_s``; ``on_result(ok)`` counts each attempt."""

    def __init__(
        self,
        name: str,
        files: Sequence[str],
        reload: Callable[[], Awaitable[None]],
        *,
        interval_s: float,
        on_result: Callable[[bool], None],
    ) -> None:
        self._name = name
        self._files = tuple(files)
        self._reload = reload
        self._interval_s = interval_s
        self._on_result = on_result
        self._seen: Fingerprint | None = None

    async def start(self) -> None:
        """What the files are now (already loaded by the constructor of what they feed)."""
        self._seen = await asyncio.to_thread(fingerprint, self._files)

    async def check(self) -> bool | None:
        """One look at the files: None when unchanged, else whether the reload succeeded."""
        now = await asyncio.to_thread(fingerprint, self._files)
        if now == self._seen:
            return None
        # Tried once per change: a bad pair is not retried (and logged) every interval.
        self._seen = now
        try:
            await self._reload()
        except TlsFilesError as exc:
            logger.error("%s: the files changed, but %s; kept the previous ones", self._name, exc)
            self._on_result(False)
            return False
        logger.info("%s: reloaded %s", self._name, ", ".join(self._files))
        self._on_result(True)
        return True

    async def run(self) -> None:
        """Check forever; cancelled at shutdown."""
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check()

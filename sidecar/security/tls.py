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
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Sequence

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


class ServerTls:
    """The listener's TLS: ``context`` goes to the server once; ``reload()`` changes what new
    handshakes get."""

    def __init__(
        self, cert_file: str, key_file: str, minimum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    ) -> None:
        self._cert_file = cert_file
        self._key_file = key_file
        self._minimum = minimum
        self.context = self._build()
        self._current = self.context
        self.context.sni_callback = self._pick

    @property
    def files(self) -> tuple[str, ...]:
        return (self._cert_file, self._key_file)

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
        do not load."""
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

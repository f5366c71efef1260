"""Where prefill endpoints come from: a static list and a headless Service's DNS records.

``resolve`` returns the current set; the scheduler diffs it against its pool (an endpoint that
disappears drains). DNS answers both A and AAAA records; a failed lookup keeps the last answer,
since a DNS hiccup must not empty the pool.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from sidecar.fleet.endpoints import Endpoint

logger = logging.getLogger("sidecar.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""(name, port) → IP addresses (A and AAAA)."""
Listener = Callable[[tuple[Endpoint, ...]], Awaitable[None]]
"""Told every answer of ``resolve`` (the KV-event subscribers follow the pool so)."""


async def system_resolver(name: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return sorted({str(info[4][0]) for info in infos})


class Discovery:
    def __init__(
        self,
        static: tuple[Endpoint, ...],
        dns: Endpoint | None,
        *,
        resolver: Resolver = system_resolver,
    ) -> None:
        self._static = static
        self._dns = dns
        self._resolver = resolver
        self._resolved: tuple[Endpoint, ...] = ()
        self._listeners: list[Listener] = []
        self.last_error: str | None = None

    def listen(self, listener: Listener) -> None:
        """Call ``listener`` with every answer ``resolve`` gives, after it is made."""
        self._listeners.append(listener)

    @property
    def uses_dns(self) -> bool:
        return self._dns is not None

    def describe(self) -> dict[str, object]:
        return {
            "static": [str(e) for e in self._static],
            "dns": str(self._dns) if self._dns else None,
            "dns_last_error": self.last_error,
        }

    async def resolve(self) -> tuple[Endpoint, ...]:
        if self._dns is not None:
            try:
                addresses = await self._resolver(self._dns.host, self._dns.port)
            except OSError as exc:
                if self.last_error is None:
                    logger.warning("DNS lookup of %s failed: %s", self._dns, exc)
                self.last_error = str(exc)
            else:
                self.last_error = None
                self._resolved = tuple(Endpoint(a.lower(), self._dns.port) for a in addresses)
        current = tuple(dict.fromkeys(self._static + self._resolved))
        for listener in self._listeners:
            await listener(current)
        return current

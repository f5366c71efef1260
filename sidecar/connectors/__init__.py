"""KV connectors: one module per protocol, each owning its whole exchange with the engines.

Protocols differ in order, not only in fields — vLLM NIXL is prefill, wait, then decode with the
prefill's answer; SGLang sends both legs at once — so ``run`` is the connector's: built from the
shared ``Parts`` (the prefill's attempts with the retry/fallback/disconnect policy and the
staged KV's handle, one decode send, the background work), it returns the decode answer to relay
or a refusal to pass on. The pipeline never names a wire field and never orders legs.

Every connector keeps one KV-lifecycle contract (``tests/test_contract.py`` runs it on each): KV a
prefill staged is never left for the engine's expiry — whatever fails, and whenever the client
leaves, it is either taken by the decode leg or released.

What a protocol is before any request — its name and aliases, whether its decode server can
prefill, its defaults — is in ``sidecar.fleet.connectors``, which the settings read; this package
imports no connector (nor aiohttp) until one is used: ``sidecar.app`` builds the configured one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # for annotations only: importing the package loads no connector
    from sidecar.config import Settings
    from sidecar.connectors.exchange import Answer, Body, Exchange, Refused
    from sidecar.connectors.parts import Parts


class Connector(Protocol):
    name: str

    def unsupported(self, body: Body) -> str | None:
        """Why this request cannot be disaggregated (a short reason, recorded), or None."""
        ...

    def sanitize(self, body: Body) -> bool:
        """Remove, in place, fields a client must not set (KV-transfer instructions); return
        whether anything was removed."""
        ...

    async def run(self, ex: Exchange) -> Answer | Refused:
        """The whole exchange with the engines for one request placed by the scheduler.

        Returns the decode engine's started answer, or an engine's refusal for the client;
        raises ``SidecarError`` for anything else. Must leave no KV staged behind it, whether
        it returns, raises or is cancelled.
        """
        ...


ConnectorFactory = Callable[["Settings", "Parts"], Connector]
"""Builds the connector from the settings and the shared parts (``sidecar.app.make_connector``;
a test may plug in a connector of its own)."""

__all__ = ["Connector", "ConnectorFactory"]

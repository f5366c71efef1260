"""KV connectors: one module per protocol, each owning its whole exchange with the engines.

Protocols differ in order, not only in fields — vLLM NIXL is prefill, wait, then decode with the
prefill's answer; SGLang sends both legs at once — so ``run`` is the connector's: built from the
shared ``Parts`` (one prefill call with the retry/fallback/disconnect policy, one decode send, one
background release), it returns the decode answer to relay or a refusal to pass on. The pipeline
never names a wire field and never orders legs.

Every connector keeps one KV-lifecycle contract (``tests/test_contract.py`` runs it on each): KV a
prefill staged is never left for the engine's expiry — whatever fails, and whenever the client
leaves, it is either taken by the decode leg or released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sidecar.config import Settings
from sidecar.connectors.nixl import NixlConnector
from sidecar.connectors.nixl_push import NixlPushConnector
from sidecar.connectors.parts import Parts
from sidecar.connectors.sglang import SglangConnector
from sidecar.connectors.shared_storage import SharedStorageConnector
from sidecar.exchange import Answer, Body, Exchange, Refused


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


ConnectorFactory = Callable[[Settings, Parts], Connector]
"""Builds the connector from the settings and the shared parts (``make_connector``; a test may
plug in a connector of its own)."""


def make_connector(settings: Settings, parts: Parts) -> Connector:
    name = settings.connector
    if name == NixlConnector.name:
        return NixlConnector(parts, rewrite_remote_host=settings.rewrite_remote_host)
    if name == NixlPushConnector.name:
        return NixlPushConnector(parts, rewrite_remote_host=settings.rewrite_remote_host)
    if name == SglangConnector.name:
        return SglangConnector(parts, bootstrap_port=settings.sglang_bootstrap_port)
    if name == SharedStorageConnector.name:
        return SharedStorageConnector(parts)
    raise ValueError(f"unknown connector {name!r}")


__all__ = [
    "Connector",
    "ConnectorFactory",
    "NixlConnector",
    "NixlPushConnector",
    "Parts",
    "SglangConnector",
    "SharedStorageConnector",
    "make_connector",
]

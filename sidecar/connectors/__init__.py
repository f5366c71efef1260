"""KV connectors: what each engine family needs on the prefill and decode legs.

One module per protocol behind the ``Connector`` protocol. The pipeline never names a wire field;
it asks the connector. Serial connectors (vLLM NIXL, shared storage) run the prefill leg, then build
the decode leg from its answer. Concurrent connectors (SGLang bootstrap, a later issue) set
``concurrent_legs`` and prepare both bodies before either is sent, since the decode engine waits for
the prefill's KV itself.
"""

from __future__ import annotations

from typing import Any, Protocol

from sidecar.connectors.nixl import NixlConnector
from sidecar.endpoints import Endpoint

Body = dict[str, Any]


class Connector(Protocol):
    name: str
    concurrent_legs: bool

    def unsupported(self, body: Body) -> str | None:
        """Why this request cannot be disaggregated (a short reason, recorded), or None."""
        ...

    def sanitize(self, body: Body) -> bool:
        """Remove, in place, fields a client must not set (KV-transfer instructions); return
        whether anything was removed."""
        ...

    def prefill_body(self, body: Body, route: str) -> Body:
        """The prefill leg's body, derived from the client's (which must not be mutated).

        ``route`` is ``completions`` or ``chat_completions``.
        """
        ...

    def kv_params(self, prefill_answer: Any, endpoint: Endpoint) -> Body | None:
        """Usable KV-transfer instructions from the prefill's JSON answer, or None (fall back)."""
        ...

    def decode_body(self, body: Body, kv_params: Body) -> Body:
        """The decode leg's body: the client's plus the KV-transfer instructions."""
        ...

    def release_body(self, body: Body, kv_params: Body, route: str) -> Body | None:
        """A decode-engine request that frees KV staged for a client who left before its decode
        leg was sent, or None when the connector frees nothing that way."""
        ...


def make_connector(name: str, *, rewrite_remote_host: bool = False) -> Connector:
    if name == NixlConnector.name:
        return NixlConnector(rewrite_remote_host=rewrite_remote_host)
    raise ValueError(f"unknown connector {name!r}")


__all__ = ["Body", "Connector", "NixlConnector", "make_connector"]

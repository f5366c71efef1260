"""What is known of each KV connector protocol before any request: its name, the other names it
goes by, whether its decode server can prefill, its defaults. One frozen value per protocol.

The settings' validation and the scheduler read these without importing the connectors
themselves (``sidecar.connectors``: their exchanges need the engine client, aiohttp). What a
connector sends the engines stays in its own module (``sidecar/connectors/nixl.py``,
``sglang.py``, ...); ``tests/test_connectors.py`` keeps the names here and there the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConnectorFacts:
    name: str
    """Its ``SIDECAR_CONNECTOR`` value (and its connector class's ``name``)."""
    aliases: tuple[str, ...] = ()
    """Other values of ``SIDECAR_CONNECTOR`` that name it."""
    cannot_prefill: str | None = None
    """Why its decode server cannot prefill a prompt itself, or None when it can. Then every
    request disaggregates, and a failed prefill cannot fall back to the decode engine."""

    @property
    def remote_only(self) -> bool:
        """Every request is prefilled remotely: the decode server cannot prefill."""
        return self.cannot_prefill is not None


@dataclass(frozen=True, slots=True)
class SglangFacts(ConnectorFacts):
    bootstrap_port: int = 8998
    """SGLang's default ``--disaggregation-bootstrap-port``, where a prefill server takes KV
    rendezvous: ``SIDECAR_SGLANG_BOOTSTRAP_PORT``' default."""


NIXL = ConnectorFacts("nixl", aliases=("nixlv2",))
"""vLLM's ``NixlConnector``; llm-d calls its protocol ``nixlv2``."""
NIXL_PUSH = ConnectorFacts("nixl-push", aliases=("nixl_push",))
"""vLLM's ``NixlPushConnector``."""
SGLANG = SglangFacts(
    "sglang", cannot_prefill="an SGLang decode server cannot prefill a prompt itself"
)
"""SGLang's PD disaggregation (a bootstrap rendezvous)."""
SHARED_STORAGE = ConnectorFacts("shared-storage", aliases=("shared_storage",))
"""vLLM's ``ExampleConnector`` and LMCache-style stores."""

CONNECTORS: dict[str, ConnectorFacts] = {
    facts.name: facts for facts in (NIXL, NIXL_PUSH, SGLANG, SHARED_STORAGE)
}
"""Every protocol, by its name."""
_NAMED = {alias: facts for facts in CONNECTORS.values() for alias in (facts.name, *facts.aliases)}


def named(name: str) -> ConnectorFacts | None:
    """The protocol called ``name`` or one of its aliases (case and surrounding spaces
    ignored), or None."""
    return _NAMED.get(name.strip().lower())

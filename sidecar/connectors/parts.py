"""The shared parts every connector's choreography is built from."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.connectors.background import BackgroundWork
from sidecar.connectors.decode import DecodeSend
from sidecar.connectors.prefill import Prefill


@dataclass(frozen=True, slots=True)
class Parts:
    prefill: Prefill
    """The prefill attempts: the retry, fallback and disconnect policy, and the staged KV."""
    decode: DecodeSend
    """One send to the local decode engine, returned once its answer started."""
    background: BackgroundWork
    """Background work that outlives the request: releases, prefills finishing, aborted legs."""

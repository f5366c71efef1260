"""Shared scheduling state: reservations, speed estimates and ejections.

A backend keeps this sidecar's own reservations locally, always, and offers a ``view()`` of the
whole pool's state that costs no I/O: the memory backend's view is its own state; the Redis
backend's is the last state Redis returned (every sidecar's reservations) with this sidecar's
newer changes applied. Only ``refresh`` may wait for the network, once and briefly, before a
decision that reads the view; reservations, releases, speeds and ejections are published off the
request path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar.scheduling.model import Speed


@dataclass(frozen=True, slots=True)
class Load:
    tokens: int = 0
    requests: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    endpoint: str
    tokens: int
    ahead_tokens: int
    """Tokens already reserved on the endpoint when this one was made (its queue at send)."""


@dataclass(frozen=True, slots=True)
class SharedView:
    loads: dict[str, Load]
    speeds: dict[str, Speed]
    ejected_until: dict[str, float]
    """Unix time until which another sidecar ejected an endpoint."""


class StateBackend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def view(self) -> SharedView:
        """The pool's state as last known; no I/O."""
        ...

    async def refresh(self, endpoints: Collection[str] = ()) -> None:
        """Bring ``view()`` up to date before a decision reads it: at most one bounded round
        trip, never raises (a slow or absent store leaves the view as it was). ``endpoints``:
        the pool's, for a backend that reads per endpoint (the others read everything)."""
        ...

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        """Count ``tokens`` against ``endpoint`` now; published off the request path."""
        ...

    def release(self, reservation: Reservation) -> None:
        """Stop counting a reservation (prefill finished, failed or cancelled); never blocks."""
        ...

    def publish_speed(self, endpoint: str, speed: Speed) -> None: ...

    def publish_ejection(self, endpoint: str, until_unix: float) -> None: ...

    def share_prefixes(self, learnt: Callable[[str, Sequence[bytes]], None]) -> bool:
        """Share the prefill prefix index from ``start`` on: ``publish_prefix`` sends, and
        ``learnt(endpoint, hashes)`` is called with the other sidecars' placements. False when
        the backend has nobody to share with (memory)."""
        ...

    def publish_prefix(self, endpoint: str, hashes: Sequence[bytes]) -> None:
        """A prompt with these block hashes was sent to ``endpoint``; published off the request
        path (nothing when not sharing)."""
        ...

    def status(self) -> dict[str, Any]:
        """For /debug/scheduler."""
        ...


class OwnReservations:
    """This sidecar's reservations per endpoint, the part of the state it is the authority on."""

    def __init__(self) -> None:
        self.loads: dict[str, Load] = {}

    def add(self, endpoint: str, tokens: int, requests: int) -> None:
        load = self.loads.get(endpoint, Load())
        updated = Load(load.tokens + tokens, load.requests + requests)
        if updated.requests <= 0:
            self.loads.pop(endpoint, None)
        else:
            self.loads[endpoint] = updated


class MemoryState:
    """This sidecar's own view: nothing shared, nothing to fail."""

    name = "memory"

    def __init__(self) -> None:
        self._own = OwnReservations()
        self._speeds: dict[str, Speed] = {}
        self._ejected: dict[str, float] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def view(self) -> SharedView:
        return SharedView(dict(self._own.loads), dict(self._speeds), dict(self._ejected))

    async def refresh(self, endpoints: Collection[str] = ()) -> None:
        return None

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        ahead = self._own.loads.get(endpoint, Load()).tokens
        self._own.add(endpoint, tokens, 1)
        return Reservation(endpoint, tokens, ahead)

    def release(self, reservation: Reservation) -> None:
        self._own.add(reservation.endpoint, -reservation.tokens, -1)

    def publish_speed(self, endpoint: str, speed: Speed) -> None:
        self._speeds[endpoint] = speed

    def publish_ejection(self, endpoint: str, until_unix: float) -> None:
        self._ejected[endpoint] = until_unix

    def share_prefixes(self, learnt: Callable[[str, Sequence[bytes]], None]) -> bool:
        return False

    def publish_prefix(self, endpoint: str, hashes: Sequence[bytes]) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"backend": self.name, "connected": True}

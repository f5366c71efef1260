"""Fault injection: a board of pending faults that generation requests consume.

A fault applies to the next ``count`` generation requests whose role matches, once such a request
has been parsed, validated and logged (a request the emulator would reject anyway does not consume
a fault). ``health_down`` is not consumed by requests: it holds until the board is cleared.

Hung and stalled requests wait on :meth:`FaultBoard.wait_released`; :meth:`FaultBoard.release`
wakes every request waiting at that moment (later ones wait for the next release).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

MAX_PENDING_FAULTS = 1000


class FaultKind(StrEnum):
    STATUS = "status"
    HANG = "hang"
    RESET = "reset"
    DISCONNECT = "disconnect"
    STALL = "stall"
    BLOAT = "bloat"
    HEALTH_DOWN = "health_down"


class FaultRole(StrEnum):
    ANY = "any"
    PREFILL = "prefill"  # kv_transfer_params.do_remote_decode
    DECODE = "decode"  # kv_transfer_params.do_remote_prefill
    PLAIN = "plain"  # neither


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One fault as requested by a test or the CLI.

    ``status`` is used by ``status`` faults only, ``after_chunks`` by ``disconnect`` and ``stall``,
    ``size`` by ``bloat``.
    """

    kind: FaultKind
    count: int = 1
    role: FaultRole = FaultRole.ANY
    status: int = 500
    after_chunks: int = 1
    size: int = 64 * 1024 * 1024
    """``bloat``: bytes of padding put before the answer's own fields."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError("fault count must be >= 1")
        if not 400 <= self.status <= 599:
            raise ValueError("fault status must be an HTTP error status (400-599)")
        if self.after_chunks < 0:
            raise ValueError("fault after_chunks must be >= 0")
        if self.size < 0:
            raise ValueError("fault size must be >= 0")

    def matches(self, *, is_prefill: bool, is_decode: bool) -> bool:
        if self.role is FaultRole.ANY:
            return True
        if self.role is FaultRole.PREFILL:
            return is_prefill
        if self.role is FaultRole.DECODE:
            return is_decode
        return not (is_prefill or is_decode)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: object) -> FaultSpec:
        """Build from the body of ``POST /emulator/faults``; raises ValueError when invalid."""
        if not isinstance(obj, Mapping):
            raise ValueError("fault body must be a JSON object")
        unknown = set(obj) - {"kind", "count", "role", "status", "after_chunks", "size"}
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        ints: dict[str, int] = {}
        for name in ("count", "status", "after_chunks", "size"):
            value = obj.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"fault {name} must be an integer")
            ints[name] = value
        kind = obj.get("kind")
        role = obj.get("role", "any")
        if not isinstance(kind, str) or kind not in FaultKind.__members__.values():
            raise ValueError(f"fault kind must be one of {[k.value for k in FaultKind]}")
        if not isinstance(role, str) or role not in FaultRole.__members__.values():
            raise ValueError(f"fault role must be one of {[r.value for r in FaultRole]}")
        return cls(kind=FaultKind(kind), role=FaultRole(role), **ints)

    @classmethod
    def parse_cli(cls, text: str) -> FaultSpec:
        """Parse ``KIND[:ARG[:COUNT]][@ROLE]``.

        ARG is the status for ``status``, ``after_chunks`` for ``disconnect``/``stall`` and the
        padding's size in bytes for ``bloat``; the other kinds take only ``KIND[:COUNT]``.
        Examples: ``status:503:2``, ``hang``, ``disconnect:3@decode``, ``bloat:1000000@prefill``,
        ``health_down``.
        """
        spec, _, role = text.partition("@")
        kind, *args = spec.split(":")
        if kind not in FaultKind.__members__.values():
            raise ValueError(f"unknown fault kind {kind!r}")
        fault_kind = FaultKind(kind)
        try:
            numbers = [int(arg) for arg in args]
        except ValueError as exc:
            raise ValueError(f"fault {text!r}: arguments must be integers") from exc
        fields: dict[str, int] = {}
        if fault_kind is FaultKind.STATUS:
            names: tuple[str, ...] = ("status", "count")
        elif fault_kind in (FaultKind.DISCONNECT, FaultKind.STALL):
            names = ("after_chunks", "count")
        elif fault_kind is FaultKind.BLOAT:
            names = ("size", "count")
        else:
            names = ("count",)
        if len(numbers) > len(names):
            raise ValueError(f"fault {text!r}: too many arguments")
        fields.update(zip(names, numbers, strict=False))
        if role and role not in FaultRole.__members__.values():
            raise ValueError(f"fault {text!r}: unknown role {role!r}")
        return cls(kind=fault_kind, role=FaultRole(role or "any"), **fields)


@dataclass(slots=True)
class _Pending:
    spec: FaultSpec
    remaining: int


class FaultBoard:
    """Pending faults of one emulator instance (bounded to MAX_PENDING_FAULTS entries)."""

    def __init__(self, initial: tuple[FaultSpec, ...] = ()) -> None:
        self._pending: list[_Pending] = []
        self._health_down = False
        self._released = asyncio.Event()
        self._held = 0
        self.padding_sent = 0
        """Bytes of ``bloat`` padding written to clients so far (what a client that stops
        reading a bloated answer let through)."""
        for spec in initial:
            self.add(spec)

    @property
    def health_down(self) -> bool:
        return self._health_down

    def add(self, spec: FaultSpec) -> None:
        if spec.kind is FaultKind.HEALTH_DOWN:
            self._health_down = True
            return
        if len(self._pending) >= MAX_PENDING_FAULTS:
            raise ValueError(f"too many pending faults (max {MAX_PENDING_FAULTS})")
        self._pending.append(_Pending(spec, spec.count))

    def take(self, *, is_prefill: bool, is_decode: bool) -> FaultSpec | None:
        """Consume one use of the oldest pending fault matching this request, if any."""
        for entry in self._pending:
            if entry.spec.matches(is_prefill=is_prefill, is_decode=is_decode):
                entry.remaining -= 1
                if entry.remaining <= 0:
                    self._pending.remove(entry)
                return entry.spec
        return None

    def pending(self) -> list[dict[str, Any]]:
        listed = [{**p.spec.to_json(), "remaining": p.remaining} for p in self._pending]
        if self._health_down:
            listed.append({**FaultSpec(FaultKind.HEALTH_DOWN).to_json(), "remaining": None})
        return listed

    def clear(self) -> None:
        self._pending.clear()
        self._health_down = False

    def release(self) -> None:
        """Wake every request currently hung or stalled."""
        released, self._released = self._released, asyncio.Event()
        released.set()

    @property
    def held(self) -> int:
        """Requests hung or stalled right now, waiting for :meth:`release`."""
        return self._held

    async def wait_released(self) -> None:
        self._held += 1
        try:
            await self._released.wait()
        finally:
            self._held -= 1

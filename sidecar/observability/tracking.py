"""Request lifecycle records: one per generation request, in flight or in a bounded history.

A record is written only by the task serving its request; readers (``/debug/requests``) take
snapshots with ``as_dict``. Phase times are seconds since ``started_at`` on the monotonic clock, so
a wall-clock step cannot make a phase negative.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class State(StrEnum):
    RECEIVED = "received"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


REQUEST_TASK_PREFIX = "pd-sidecar:request:"
"""Every task doing one request's work is named ``<prefix><request id>:<part>`` (``task_name``):
its handler, its prefill call, its KV release. A task left behind is found by its name (tests,
debuggers, ``asyncio.all_tasks()``)."""


def task_name(request_id: str, part: str) -> str:
    return f"{REQUEST_TASK_PREFIX}{request_id}:{part}"


def name_this_task(request_id: str, part: str) -> None:
    """Name the running task (a handler aiohttp started) after the request it serves."""
    task = asyncio.current_task()
    if task is not None:
        task.set_name(task_name(request_id, part))


class Decision(StrEnum):
    REMOTE = "remote"
    """Prefill on another pod, KV pulled by the decode engine."""
    LOCAL = "local"
    """Decoded on the local engine without KV transfer, by choice or by fallback."""


class Phase(StrEnum):
    PREFILL_SENT = "prefill_sent"
    PREFILL_DONE = "prefill_done"
    DECODE_SENT = "decode_sent"
    FIRST_BYTE = "first_byte"
    DONE = "done"


DURATIONS: dict[str, tuple[Phase | None, Phase]] = {
    "prefill": (Phase.PREFILL_SENT, Phase.PREFILL_DONE),
    "ttft": (None, Phase.FIRST_BYTE),
    "decode": (Phase.DECODE_SENT, Phase.DONE),
    "total": (None, Phase.DONE),
}
"""Each reported duration's phases: from ``start`` (None: the request's start) to ``end``."""


@dataclass(slots=True, eq=False)
class RequestRecord:
    id: str
    """The client's ``x-request-id`` (or the one the sidecar made), as its answer carries it."""
    path: str
    engine_id: str
    """The ``x-request-id`` its engine legs carried (``sidecar.headers.engine_request_id``)."""
    started_at: float = field(default_factory=time.time)
    decision: Decision | None = None
    reason: str | None = None
    fallback_reason: str | None = None
    prefill_endpoint: str | None = None
    predicted_prefill_s: float | None = None
    predicted_cached_tokens: int | None = None
    """Tokens of the prompt the prefill prefix index predicted the prefill endpoint holds."""
    tokenize_s: float | None = None
    """Seconds spent getting the prompt's token ids for the exact indexes (SIDECAR_KV_EVENTS),
    part of the time to first token; None when not asked."""
    cached_source: str | None = None
    """Where the predicted cached tokens came from: ``events`` or ``approximate`` (None: events
    off)."""
    prefill_attempts: int = 0
    decode_rank: int | None = None
    """Index (into SIDECAR_DECODE_URLS; 0 with one decode URL) of the rank the request went to."""
    decode_url: str | None = None
    state: State = State.RECEIVED
    status: int | None = None
    error: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def elapsed(self) -> float:
        """Seconds since the request arrived."""
        return time.monotonic() - self._t0

    def mark(self, phase: Phase) -> float:
        """Record ``phase`` now (first time wins) and return its offset in seconds."""
        return self.phases.setdefault(phase, time.monotonic() - self._t0)

    def span(self, start: Phase | None, end: Phase) -> float | None:
        """Seconds between two phases (start None: the request's start); None if one is missing."""
        if end not in self.phases or (start is not None and start not in self.phases):
            return None
        return self.phases[end] - (self.phases[start] if start is not None else 0.0)

    def durations(self) -> dict[str, float | None]:
        """Seconds per reported duration: ``prefill``, ``ttft``, ``decode``, ``total``."""
        return {name: self.span(start, end) for name, (start, end) in DURATIONS.items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "engine_id": self.engine_id,
            "path": self.path,
            "decision": self.decision,
            "reason": self.reason,
            "fallback_reason": self.fallback_reason,
            "prefill_endpoint": self.prefill_endpoint,
            "prefill_attempts": self.prefill_attempts,
            "decode_rank": self.decode_rank,
            "decode_url": self.decode_url,
            "state": self.state,
            "status": self.status,
            "error": self.error,
            "started_at": self.started_at,
            "prefill_predicted_ms": _ms(self.predicted_prefill_s),
            "prefill_predicted_cached_tokens": self.predicted_cached_tokens,
            "cached_source": self.cached_source,
            "tokenize_ms": _ms(self.tokenize_s),
            "prefill_observed_ms": _ms(self.observed_prefill_s()),
            "phases": {str(name): round(value, 6) for name, value in self.phases.items()},
            "durations_ms": {name: _ms(value) for name, value in self.durations().items()},
        }

    def observed_prefill_s(self) -> float | None:
        """What the prediction is judged against: the prefill leg when it went remote, the time
        to first byte when the decode engine prefilled."""
        if self.decision == Decision.REMOTE:
            return self.span(Phase.PREFILL_SENT, Phase.PREFILL_DONE)
        return self.span(None, Phase.FIRST_BYTE)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class Tracker:
    """Records in flight (unbounded only by the requests being served) and a bounded history."""

    def __init__(self, history: int) -> None:
        self._inflight: dict[int, RequestRecord] = {}
        self._recent: deque[RequestRecord] = deque(maxlen=history)
        self._keys = itertools.count()

    @property
    def history_size(self) -> int:
        return self._recent.maxlen or 0

    def start(self, request_id: str, path: str, engine_id: str) -> tuple[int, RequestRecord]:
        key = next(self._keys)
        record = RequestRecord(id=request_id, path=path, engine_id=engine_id)
        self._inflight[key] = record
        return key, record

    def finish(self, key: int) -> None:
        record = self._inflight.pop(key, None)
        if record is not None:
            self._recent.append(record)

    def inflight_count(self) -> int:
        return len(self._inflight)

    def recent_count(self) -> int:
        return len(self._recent)

    def inflight(self) -> Iterator[RequestRecord]:
        """Newest first."""
        return reversed(list(self._inflight.values()))

    def recent(self) -> Iterator[RequestRecord]:
        """Newest first."""
        return reversed(self._recent)

    def find(self, request_id: str) -> RequestRecord | None:
        """The most recent record with this id — the client's, or the engines' (a vLLM log line
        names that one) — in flight or finished."""
        for record in itertools.chain(self.inflight(), self.recent()):
            if request_id in (record.id, record.engine_id):
                return record
        return None

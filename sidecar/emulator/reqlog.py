"""A bounded log of the generation requests the emulator received (every ``/v1/*`` path and the
engines' other generation routes), for tests asserting exact bodies, the request target as it
came on the request line, and the W3C trace context each one carried."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
"""W3C Trace Context: version-trace_id-parent_id-flags, lower-case hex."""


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    method: str
    path: str
    """The path the emulator routed on (percent-escapes decoded, as vLLM's server does)."""
    target: str
    """The request target exactly as the request line carried it (path and query)."""
    headers: Mapping[str, str]  # lower-case names; repeated headers joined with ", "
    body: Any  # parsed JSON, or None when the body is empty or not JSON

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "target": self.target,
            "headers": dict(self.headers),
            "body": self.body,
            "trace": self.trace(),
        }

    def trace(self) -> dict[str, Any] | None:
        """The trace context the request carried (None: no ``traceparent``): the headers as
        received, and the trace id, the parent span id and the sampled flag when the
        ``traceparent`` is well formed (else those are null)."""
        traceparent = self.headers.get("traceparent")
        if traceparent is None:
            return None
        match = _TRACEPARENT.match(traceparent.strip())
        valid = match is not None and match.group(1) != "ff"
        return {
            "traceparent": traceparent,
            "tracestate": self.headers.get("tracestate"),
            "trace_id": match.group(2) if match and valid else None,
            "parent_id": match.group(3) if match and valid else None,
            "sampled": bool(int(match.group(4), 16) & 1) if match and valid else None,
        }


def parse_body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None


class RequestLog:
    """Oldest first; the oldest entries fall off beyond ``size``."""

    def __init__(self, size: int) -> None:
        self._entries: deque[LoggedRequest] = deque(maxlen=size)

    def record(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        raw_body: bytes,
        target: str | None = None,
    ) -> None:
        merged: dict[str, str] = {}
        for name, value in headers:
            key = name.lower()
            merged[key] = f"{merged[key]}, {value}" if key in merged else value
        entry = LoggedRequest(method, path, target or path, merged, parse_body(raw_body))
        self._entries.append(entry)

    def entries(self) -> list[LoggedRequest]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()

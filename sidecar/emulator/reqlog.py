"""A bounded log of the /v1/* requests the emulator received, for tests asserting exact bodies."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    method: str
    path: str
    headers: Mapping[str, str]  # lower-case names; repeated headers joined with ", "
    body: Any  # parsed JSON, or None when the body is empty or not JSON

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "headers": dict(self.headers),
            "body": self.body,
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
        self, method: str, path: str, headers: list[tuple[str, str]], raw_body: bytes
    ) -> None:
        merged: dict[str, str] = {}
        for name, value in headers:
            key = name.lower()
            merged[key] = f"{merged[key]}, {value}" if key in merged else value
        self._entries.append(LoggedRequest(method, path, merged, parse_body(raw_body)))

    def entries(self) -> list[LoggedRequest]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()

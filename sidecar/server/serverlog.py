"""What aiohttp's HTTP server logs about requests it cannot parse: one rate-limited line each.

aiohttp logs a request it cannot parse (a bad request line, a bad header: ``BadHttpMessage``)
with ``logger.exception``: eleven ERROR lines of traceback, 578 bytes, for a 61-byte request.
Any client can send those, so one is worth a single WARNING line, and a flood of them at most
``LINES_PER_WINDOW`` lines per ``WINDOW_S``, the next line saying how many were left out. The
client got aiohttp's 400 either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

LINES_PER_WINDOW = 10
WINDOW_S = 60.0
SHOWN_CHARS = 200
"""How much of the parser's message (which may quote the client's bytes) a line shows."""


class ServerLog:
    """Stands in for the ``aiohttp.server`` logger of one listener (``AppRunner(logger=...)``).

    Parse errors become one line on ``logger`` (WARNING; DEBUG where aiohttp logs at DEBUG, a
    non-HTTP first request), rate-limited with a fixed window: O(1) memory, however many clients
    send them. Anything else (an exception escaping a handler) is logged as aiohttp would, on
    ``logger``.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        lines_per_window: int = LINES_PER_WINDOW,
        window_s: float = WINDOW_S,
    ) -> None:
        self._logger = logger or logging.getLogger("sidecar.http")
        self._clock = clock
        self._lines = lines_per_window
        self._window_s = window_s
        self._window_start = clock()
        self._logged = 0
        self._left_out = 0

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self._malformed(logging.WARNING, args, exc_info)
        else:
            self._logger.exception(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: str, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self._malformed(logging.DEBUG, args, exc_info)
        else:
            self._logger.debug(msg, *args, exc_info=exc_info, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)  # warning, info, isEnabledFor...: the logger's own

    def _malformed(self, level: int, args: tuple[Any, ...], exc: HttpProcessingError) -> None:
        if not self._logger.isEnabledFor(level):
            return
        now = self._clock()
        if now - self._window_start >= self._window_s:
            self._window_start, self._logged = now, 0
        if self._logged >= self._lines:
            self._left_out += 1
            return
        self._logged += 1
        left_out, self._left_out = self._left_out, 0
        reason = " ".join(str(exc.message).split())[:SHOWN_CHARS]
        self._logger.log(
            level,
            "malformed HTTP request from %s: %s %s%s",
            args[0] if args else "an unknown client",
            exc.code,
            reason,
            f" ({left_out} more not logged)" if left_out else "",
        )

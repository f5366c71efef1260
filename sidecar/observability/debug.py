"""``/debug/*`` views: lifecycle records in flight and recently finished, as JSON or as the page
of ``sidecar.observability.debug_page``."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web
from multidict import MultiMapping

from sidecar.errors import BadRequest, NotFound, error_response
from sidecar.observability.debug_page import DebugPage, prefers_html
from sidecar.observability.tracking import State, Tracker

DEFAULT_LIMIT = 100
MAX_LIMIT_DIGITS = 9
"""``?limit=`` is at most this many ASCII digits (any history fits; the value is clamped to it)."""
QUERY = ("state", "limit")
SERVER_TIME_HEADER = "x-sidecar-time"
"""On the JSON of ``/debug/requests``: this sidecar's Unix time (seconds) when it answered, so
the page draws requests in flight up to the sidecar's now, whatever the browser's clock says."""


class DebugViews:
    def __init__(self, tracker: Tracker, page: DebugPage) -> None:
        self._tracker = tracker
        self._page = page

    async def requests(self, request: web.Request) -> web.Response:
        """``{"inflight": [...], "recent": [...], "held": {...}, "limit": n, "max_limit": m}``,
        newest first; ``?state=`` and ``?limit=`` (1 to the history size, in at most 9 ASCII
        digits; larger values are clamped) filter both lists. ``held`` counts the records of
        each list whatever the filters (so a reader knows what a limit left out), ``limit`` is
        the one applied and ``max_limit`` the largest allowed. Any other parameter, or one given
        twice, is a 400: a typo never silently widens the answer.

        A client preferring ``text/html`` (a browser) gets the page instead, which reads the same
        parameters (``state`` as its first filter, ``limit`` for what it fetches)."""
        try:
            state, limit = self._query(request)
        except BadRequest as exc:
            return error_response(exc, None)
        if prefers_html(request.headers.get("Accept")):
            return _vary(self._page.document())
        response = _vary(
            _json(
                {
                    "inflight": _select(self._tracker.inflight(), state, limit),
                    "recent": _select(self._tracker.recent(), state, limit),
                    "held": {
                        "inflight": self._tracker.inflight_count(),
                        "recent": self._tracker.recent_count(),
                    },
                    "limit": limit,
                    "max_limit": self._tracker.history_size,
                }
            )
        )
        response.headers[SERVER_TIME_HEADER] = f"{time.time():.3f}"
        return response

    async def index(self, request: web.Request) -> web.Response:
        """``/debug`` leads to the page (its query kept), by a relative reference: behind a path
        prefix (``kubectl proxy``'s) it stays under it."""
        query = request.query_string
        raise web.HTTPFound("debug/ui" + (f"?{query}" if query else ""))

    async def ui(self, request: web.Request) -> web.Response:
        """The page, whatever the ``Accept`` header; the query is checked as for JSON."""
        try:
            self._query(request)
        except BadRequest as exc:
            return error_response(exc, None)
        return self._page.document()

    async def ui_asset(self, request: web.Request) -> web.Response:
        response = self._page.asset(request.match_info["name"])
        return response if response is not None else await self.unknown(request)

    def _query(self, request: web.Request) -> tuple[State | None, int]:
        _known_once(request.query)
        state = _state(request.query.get("state"))
        return state, _limit(request.query.get("limit"), self._tracker.history_size)

    async def request(self, request: web.Request) -> web.Response:
        record = self._tracker.find(request.match_info["id"])
        if record is None:
            return error_response(NotFound("no request with this id is known"), None)
        return _json(record.as_dict())

    async def unknown(self, request: web.Request) -> web.Response:
        return error_response(NotFound(f"no debug view at {request.path}"), None)


def _select(records: Any, state: State | None, limit: int) -> list[dict[str, Any]]:
    chosen = []
    for record in records:
        if state is None or record.state == state:
            chosen.append(record.as_dict())
            if len(chosen) == limit:
                break
    return chosen


def _known_once(query: MultiMapping[str]) -> None:
    seen: set[str] = set()
    for name, _ in query.items():  # keys() would fold repeats into one
        if name not in QUERY:
            raise BadRequest(f"unknown query parameter {name!r}; known: {', '.join(QUERY)}")
        if name in seen:
            raise BadRequest(f"query parameter {name!r} given more than once")
        seen.add(name)


def _state(value: str | None) -> State | None:
    if value is None:
        return None
    try:
        return State(value)
    except ValueError:
        allowed = ", ".join(State)
        raise BadRequest(f"state must be one of: {allowed}") from None


def _limit(value: str | None, maximum: int) -> int:
    if value is None:
        return min(DEFAULT_LIMIT, maximum)
    # str.isdigit() is true of "²" and "①" too, which int() refuses; and int() of thousands of
    # digits is refused (or slow): only a few ASCII digits are a limit.
    if not (0 < len(value) <= MAX_LIMIT_DIGITS and value.isascii() and value.isdigit()):
        raise BadRequest(f"limit must be a positive integer of at most {MAX_LIMIT_DIGITS} digits")
    if int(value) < 1:
        raise BadRequest("limit must be a positive integer")
    return min(int(value), maximum)


def _vary(response: web.Response) -> web.Response:
    """One URL, two representations: a cache must key on ``Accept``."""
    response.headers["Vary"] = "Accept"
    return response


def _json(payload: Any) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")

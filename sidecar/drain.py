"""Shutdown under one budget: everything is done within ``SIDECAR_DRAIN_TIMEOUT_S`` + 1 s.

The sequence (``RunningSidecar.close``, docs/behavior.md "Graceful drain"):

1. ``begin()`` fixes the deadline; ``/ready`` answers 503.
2. The listeners stop accepting; keep-alive connections close once their request is answered.
3. ``wait_then_cut()`` waits for the requests in flight until the deadline, then cancels the
   rest and gives them ``CUT_GRACE_S`` to unwind (their engine calls are handled as when a
   client leaves).
4. Background work (KV releases, finishing prefills) gets ``background_s()``: what is left of the
   budget, and at least ``CUT_GRACE_S`` so that the releases of the requests just cut can go out.
5. Sessions and the state backend close; each of those steps is bounded on its own.

The handlers in flight are known from a middleware, so the sidecar never relies on aiohttp's own
shutdown timeout (which waits once for the handlers, then once more after cancelling them: twice
the timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

CUT_GRACE_S = 0.25
"""How long a cancelled request, or the background work, gets once the deadline has passed."""
BUDGET_SLACK_S = 1.0
"""The process exits within the drain timeout plus this, whatever is in flight."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._deadline: float | None = None
        self._handlers: set[asyncio.Task[object]] = set()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Knows every request in flight, so that the drain can wait for it or cut it."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            return await handler(request)
        finally:
            self._handlers.discard(task)

    def in_flight(self) -> int:
        return len(self._handlers)

    def begin(self) -> None:
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + self.timeout_s

    def remaining(self) -> float:
        """Seconds left of the drain timeout (all of it before ``begin()``)."""
        if self._deadline is None:
            return self.timeout_s
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def background_s(self) -> float:
        return max(self.remaining(), CUT_GRACE_S)

    async def wait_then_cut(self) -> int:
        """Wait for the requests in flight until the deadline; cancel the rest. Returns how
        many were cancelled."""
        self.begin()
        loop = asyncio.get_running_loop()
        assert self._deadline is not None
        while self._handlers and loop.time() < self._deadline:
            await asyncio.wait(list(self._handlers), timeout=self._deadline - loop.time())
        stragglers = list(self._handlers)
        for task in stragglers:
            task.cancel()
        if stragglers:
            # A cancelled request unwinds at once (nothing in the request path awaits after a
            # cancellation); the grace only bounds a bug, it is not a wait anyone relies on.
            await asyncio.wait(stragglers, timeout=CUT_GRACE_S)
        return len(stragglers)

"""The ``endpoint`` label of the per-prefill-endpoint metrics: bounded whatever the traffic names.

A pool member (settings, DNS) has its own value from the moment it joins until it leaves, when
its series are removed. A target named by a request header (``x-prefiller-host-port``) outside
the pool gets one of ``HEADER_ENDPOINT_SLOTS`` values while any is free; further ones share
``OTHER``. Prefill pods come and go (a restarted pod has a new address), so a slot whose target
has made no call for ``HEADER_ENDPOINT_IDLE_S`` is recycled for a new target (its series removed)
rather than held forever by an address that is gone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

OTHER = "other"
"""The label of header-named targets beyond the slots."""
HEADER_ENDPOINT_SLOTS = 32
"""Header-named targets outside the pool with a label of their own at a time."""
HEADER_ENDPOINT_IDLE_S = 600.0
"""Seconds without a call after which a header-named target's slot may go to another."""


class EndpointLabels:
    """Pure bookkeeping: which ``host:port`` keys have a label value of their own.

    ``on_evict(key)`` is called when a header target's slot is recycled: its series must go.
    """

    __slots__ = ("_clock", "_headers", "_idle_s", "_members", "_on_evict", "_slots")

    def __init__(
        self,
        on_evict: Callable[[str], None],
        *,
        slots: int = HEADER_ENDPOINT_SLOTS,
        idle_s: float = HEADER_ENDPOINT_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_evict = on_evict
        self._slots = slots
        self._idle_s = idle_s
        self._clock = clock
        self._members: set[str] = set()
        self._headers: OrderedDict[str, float] = OrderedDict()
        """Header targets by their last call, least recent first."""

    def joined(self, key: str) -> None:
        """A pool member: its own label until it leaves (a header slot it held is freed, its
        series kept)."""
        self._members.add(key)
        self._headers.pop(key, None)

    def left(self, key: str) -> None:
        """A pool member left (the caller removes its series)."""
        self._members.discard(key)

    def label(self, key: str) -> str:
        """The label value of a call to ``key`` now."""
        if key in self._members:
            return key
        headers = self._headers
        now = self._clock()
        if key in headers:
            headers[key] = now
            headers.move_to_end(key)
            return key
        if len(headers) >= self._slots:
            if not headers:
                return OTHER
            oldest, last = next(iter(headers.items()))
            if now - last < self._idle_s:
                return OTHER
            del headers[oldest]
            self._on_evict(oldest)
        headers[key] = now
        return key

    def header_targets(self) -> list[str]:
        """The header targets holding a slot, least recently called first."""
        return list(self._headers)

"""Every path the sidecar does not own goes to the decode engine unchanged, streaming both ways."""

from __future__ import annotations

import asyncio

from aiohttp import web

from sidecar.errors import SidecarError, error_response
from sidecar.headers import passthrough_headers
from sidecar.metrics import Metrics
from sidecar.relay import ClientGone, relay
from sidecar.tracking import RequestRecord, State
from sidecar.upstream import Engines


class Passthrough:
    def __init__(self, *, decode_url: str, engines: Engines, metrics: Metrics) -> None:
        self._decode_url = decode_url
        self._engines = engines
        self._metrics = metrics

    async def handle(self, request: web.Request) -> web.StreamResponse:
        # Not tracked in /debug/requests; the record only carries the relay's bookkeeping.
        record = RequestRecord(id="", path=request.path)
        status: int | None = None
        cancelled = False
        try:
            upstream = await self._engines.send(
                request.method,
                self._decode_url + request.raw_path,
                headers=passthrough_headers(request.headers),
                role="the decode engine",
                data=request.content.iter_any() if request.body_exists else None,
            )
            try:
                answer = await relay(request, upstream, record, request_id=None, cached_tokens=None)
            finally:
                upstream.close()
            status = answer.status if record.state != State.FAILED else None
            return answer
        except SidecarError as exc:
            status = exc.status
            return error_response(exc, None)
        except (asyncio.CancelledError, ClientGone):
            cancelled = True
            raise
        finally:
            self._metrics.observe_passthrough(status, cancelled)

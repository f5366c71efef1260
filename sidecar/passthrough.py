"""Every path the sidecar does not own goes to the decode engine unchanged, streaming both ways."""

from __future__ import annotations

import asyncio

from aiohttp import web

from sidecar.errors import EngineTimeout, SidecarError, error_response
from sidecar.headers import passthrough_headers
from sidecar.metrics import Metrics
from sidecar.relay import relay
from sidecar.tracking import RequestRecord, State
from sidecar.upstream import Engines


class Passthrough:
    def __init__(
        self,
        *,
        decode_url: str,
        engines: Engines,
        metrics: Metrics,
        first_byte_timeout_s: float,
        idle_timeout_s: float,
    ) -> None:
        self._decode_url = decode_url
        self._engines = engines
        self._metrics = metrics
        self._first_byte_timeout_s = first_byte_timeout_s
        self._idle_timeout_s = idle_timeout_s

    async def handle(self, request: web.Request) -> web.StreamResponse:
        # Not tracked in /debug/requests; the record only carries the relay's bookkeeping.
        record = RequestRecord(id="", path=request.path)
        status: int | None = None
        cancelled = False
        first_byte_by = asyncio.get_running_loop().time() + self._first_byte_timeout_s
        try:
            try:
                async with asyncio.timeout_at(first_byte_by):
                    upstream = await self._engines.send(
                        request.method,
                        self._decode_url + request.raw_path,
                        headers=passthrough_headers(request.headers),
                        role="the decode engine",
                        data=request.content.iter_any() if request.body_exists else None,
                    )
            except TimeoutError:
                raise EngineTimeout("the decode engine sent no answer in time") from None
            try:
                answer = await relay(
                    request,
                    upstream,
                    record,
                    request_id=None,
                    cached_tokens=None,
                    first_byte_by=first_byte_by,
                    idle_timeout_s=self._idle_timeout_s,
                )
            finally:
                upstream.close()
            cancelled = record.state == State.CANCELLED
            broken = record.state in (State.FAILED, State.CANCELLED)
            status = None if broken else answer.status
            return answer
        except SidecarError as exc:
            status = exc.status
            return error_response(exc, None)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._metrics.observe_passthrough(status, cancelled)

"""The prefill leg and its failure policy: retries, timeouts, fallback.

Transient failures (connect error, reset, timeout, 502/503/504) are retried up to ``retries``
times with a doubling backoff — on another endpoint when the scheduler chose it, on the same one
when the gateway named it. Any other 5xx, a 3xx, or an answer without usable KV parameters is not
retried. A 4xx is the client's own fault: returned to it as is, never retried. When the prefill
finally fails, ``fallback`` decides: ``local`` decodes without KV (the decode engine recomputes
the prompt), ``fail`` answers 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from sidecar.connectors import Connector
from sidecar.endpoints import Endpoint
from sidecar.errors import (
    REQUEST_ID_HEADER,
    EngineError,
    EngineTimeout,
    EngineUnreachable,
    PrefillFailed,
)
from sidecar.metrics import Metrics
from sidecar.scheduling.scheduler import Placement, Scheduler
from sidecar.tracking import Decision, Phase, RequestRecord, State
from sidecar.upstream import Engines, parse_json, read_body

logger = logging.getLogger("sidecar.prefill")

TRANSIENT_STATUSES = frozenset({502, 503, 504})
SALVAGE_GRACE_S = 0.25
"""How long a prefill whose client left may still deliver an answer that is already on its way
(its KV staged), before the call is aborted."""


@dataclass(frozen=True, slots=True)
class Prefilled:
    kv_params: dict[str, Any]
    cached_tokens: int | None


Orphaned = Callable[[Prefilled], None]


@dataclass(frozen=True, slots=True)
class _Failure:
    reason: str
    """The record's fallback_reason and the fallbacks metric's label."""
    outcome: str
    """The prefill_requests metric's outcome label."""
    detail: str
    transient: bool


class PrefillLeg:
    def __init__(
        self,
        *,
        connector: Connector,
        engines: Engines,
        scheduler: Scheduler,
        metrics: Metrics,
        retries: int,
        backoff_s: float,
        fallback: str,
        timeout_s: float,
        connect_timeout_s: float,
    ) -> None:
        self._connector = connector
        self._engines = engines
        self._scheduler = scheduler
        self._metrics = metrics
        self._retries = retries
        self._backoff_s = backoff_s
        self._fallback = fallback
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s

    async def run(
        self,
        path: str,
        route: str,
        body: dict[str, Any],
        headers: CIMultiDict[str],
        placement: Placement,
        record: RequestRecord,
        deadline: float | None,
        orphaned: Orphaned,
    ) -> Prefilled | web.Response | None:
        """KV params; the prefill's own 4xx answer; or None: decode locally (a fallback).

        Raises ``PrefillFailed`` when the prefill failed and the fallback is ``fail``. When the
        client leaves as a prefill's answer arrives, ``orphaned`` gets the KV to release.
        """
        record.state = State.PREFILLING
        record.mark(Phase.PREFILL_SENT)
        data = orjson.dumps(self._connector.prefill_body(body, route))
        tried: set[str] = set()
        current: Placement | None = placement
        attempt = 0
        result: _Failure | None = None
        while current is not None and current.endpoint is not None:
            attempt += 1
            record.prefill_attempts = attempt
            record.prefill_endpoint = str(current.endpoint)
            outcome = await self._attempt(path, data, headers, current, record, deadline, orphaned)
            if not isinstance(outcome, _Failure):
                return outcome
            result = outcome
            tried.add(str(current.endpoint))
            retry = result.transient and attempt <= self._retries and not _past(deadline)
            if not retry:
                break
            logger.info(
                "request %s: prefill on %s failed (%s), retrying",
                record.id,
                current.endpoint,
                result.detail,
                extra={"request_id": record.id},
            )
            self._metrics.prefill_retries.inc()
            await asyncio.sleep(self._backoff_s * 2 ** (attempt - 1))
            current = await self._scheduler.retry(current, tried)
        self._give_up(record, result)
        return None

    async def _attempt(
        self,
        path: str,
        data: bytes,
        headers: CIMultiDict[str],
        placement: Placement,
        record: RequestRecord,
        deadline: float | None,
        orphaned: Orphaned,
    ) -> Prefilled | web.Response | _Failure:
        """One call; tells the scheduler how it went, whatever happens."""
        assert placement.endpoint is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        endpoint_ok: bool | None = None  # None: cancelled, or the client's own fault
        call = asyncio.ensure_future(
            self._call(path, data, headers, placement.endpoint, record, deadline)
        )
        try:
            try:
                result = await asyncio.shield(call)
            except asyncio.CancelledError:
                await self._abort(call, orphaned)
                raise
            if isinstance(result, _Failure):
                endpoint_ok = False
                self._metrics.prefill_requests.labels(result.outcome).inc()
            elif isinstance(result, Prefilled):
                endpoint_ok = True
                self._metrics.prefill_requests.labels("success").inc()
            else:
                self._metrics.prefill_requests.labels("client_error").inc()
            return result
        finally:
            record.phases[Phase.PREFILL_DONE] = record.elapsed()
            self._scheduler.prefill_finished(
                placement, ok=endpoint_ok, seconds=loop.time() - started
            )

    async def _abort(
        self, call: asyncio.Future[Prefilled | web.Response | _Failure], orphaned: Orphaned
    ) -> None:
        """The client left during the prefill. Abort the call (the engine then drops a prefill
        it is still computing) unless its answer is already arriving: then the engine has
        staged the KV, and only a pull frees it before its expiry."""
        done, _ = await asyncio.wait({call}, timeout=SALVAGE_GRACE_S)
        if not done:
            call.cancel()
            return
        if not call.cancelled() and call.exception() is None:
            result = call.result()
            if isinstance(result, Prefilled):
                orphaned(result)

    async def _call(
        self,
        path: str,
        data: bytes,
        headers: CIMultiDict[str],
        endpoint: Endpoint,
        record: RequestRecord,
        deadline: float | None,
    ) -> Prefilled | web.Response | _Failure:
        timeout_s = self._timeout_s
        if deadline is not None:
            timeout_s = max(0.001, min(timeout_s, deadline - asyncio.get_running_loop().time()))
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)
        try:
            upstream = await self._engines.send(
                "POST",
                endpoint.url + path,
                headers=headers,
                data=data,
                client_timeout=timeout,
                role="the prefill engine",
            )
            answer = await read_body(upstream)
        except EngineTimeout as exc:
            return _Failure("prefill_timeout", "timeout", exc.message, transient=True)
        except EngineUnreachable as exc:
            return _Failure("prefill_unreachable", "unreachable", exc.message, transient=True)

        status = upstream.status
        if 400 <= status < 500:
            record.state = State.FAILED
            record.error = f"prefill answered {status}"
            return web.Response(
                status=status,
                body=answer,
                headers={
                    "content-type": upstream.headers.get("content-type", "application/json"),
                    REQUEST_ID_HEADER: headers[REQUEST_ID_HEADER],
                },
            )
        if status >= 300:
            return _Failure(
                "prefill_error",
                "server_error",
                f"prefill answered {status}",
                transient=status in TRANSIENT_STATUSES,
            )
        try:
            parsed = parse_json(answer, "prefill")
        except EngineError as exc:
            return _Failure("prefill_bad_response", "bad_response", exc.message, transient=False)
        kv_params = self._connector.kv_params(parsed, endpoint)
        if kv_params is None:
            return _Failure(
                "no_kv_params", "bad_response", "answer has no usable KV params", transient=False
            )
        return Prefilled(kv_params, _cached_tokens(parsed))

    def _give_up(self, record: RequestRecord, failure: _Failure | None) -> None:
        reason = failure.reason if failure else "no_endpoint_left"
        detail = failure.detail if failure else "no other prefill endpoint to retry on"
        self._metrics.fallbacks.labels(reason).inc()
        record.fallback_reason = reason
        if self._fallback == "fail":
            record.error = f"prefill failed: {detail}"
            raise PrefillFailed(f"the prefill failed and the fallback is 'fail': {detail}")
        record.decision = Decision.LOCAL
        logger.warning(
            "request %s: prefill on %s failed (%s), decoding locally",
            record.id,
            record.prefill_endpoint,
            detail,
            extra={"request_id": record.id},
        )


def _past(deadline: float | None) -> bool:
    return deadline is not None and asyncio.get_running_loop().time() >= deadline


def _cached_tokens(answer: Any) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None

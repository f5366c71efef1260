"""The prefill call: retries, timeouts, fallback, and what happens when its client leaves.

A shared part of every connector that runs a prefill leg. Transient failures (connect error,
reset, timeout, 502/503/504) are retried up to ``SIDECAR_PREFILL_RETRIES`` times with a doubling
backoff — on another endpoint when the scheduler chose it, on the same one when the gateway named
it. Any other 5xx, a 3xx, or an answer the connector cannot use is not retried. A 4xx is the
client's own fault: ``Refused``, never retried. When the prefill finally fails,
``SIDECAR_PREFILL_FALLBACK`` decides: ``local`` returns ``Fallback``, ``fail`` raises
``PrefillFailed`` (503).

A client that leaves while the call runs (``SIDECAR_PREFILL_ON_DISCONNECT``): ``abort`` cancels
the call (the engine drops a prefill it is still computing); ``finish`` lets it end in the
background and hands its KV to ``orphaned`` (to be released); ``auto`` finishes a call predicted to
end within ``AUTO_FINISH_WITHIN_S`` and aborts one that is queued or far from done (the scheduler
predicts: ``Scheduler.prefill_outlook``). Whatever the mode, a call whose answer has started to
arrive is finished: the engine is done, its KV staged. The call's own task reports to the
scheduler when it really ends, so an endpoint's slot is never counted free while the engine still
works on it. Nothing here awaits after a cancellation: a second one cannot
skip a step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.aftercare import Aftercare
from sidecar.body import Wire
from sidecar.config import Settings
from sidecar.endpoints import Endpoint
from sidecar.errors import (
    EngineAnswerTooLarge,
    EngineError,
    EngineTimeout,
    EngineUnreachable,
    PrefillFailed,
    foreign_refusal,
    is_error_body,
)
from sidecar.exchange import Exchange, Fallback, Prefilled, Refused
from sidecar.metrics import Metrics
from sidecar.scheduling.placement import Placement
from sidecar.scheduling.scheduler import Scheduler
from sidecar.tracing import Leg
from sidecar.tracking import task_name
from sidecar.upstream import Engines, parse_json

logger = logging.getLogger("sidecar.prefill")

TRANSIENT_STATUSES = frozenset({502, 503, 504})
AUTO_FINISH_WITHIN_S = 0.5
"""``auto``: a prefill whose client left is let finish when its prompt's own compute, or its
predicted remaining time (overdue included), is within this many seconds; one queued or further
from done is aborted."""

Outcome = Prefilled | Refused | Fallback
BodyFor = Callable[[Endpoint], Wire]
"""The prefill leg's body for an endpoint (a protocol may name the endpoint in the body)."""
Accept = Callable[[object, Endpoint], Prefilled | None]
"""A 2xx prefill answer (parsed JSON; ``b""`` when the call is not ``json``: its body was read
to its end and dropped) → ``Prefilled``, or None when it is unusable."""
Orphaned = Callable[[Prefilled], None]
"""Gets the KV of a prefill whose client left."""


@dataclass(frozen=True, slots=True)
class _Failure:
    reason: str
    """The record's fallback_reason and the fallbacks metric's label."""
    outcome: str
    """The prefill_requests metric's outcome label."""
    detail: str
    transient: bool


_Result = Prefilled | Refused | _Failure


@dataclass(frozen=True, slots=True)
class _CallSpec:
    """What a connector asked of its prefill calls (``PrefillCall.run``'s arguments)."""

    accept: Accept
    orphaned: Orphaned
    json: bool
    abort_on_disconnect: bool


class PrefillCall:
    def __init__(
        self,
        settings: Settings,
        *,
        engines: Engines,
        scheduler: Scheduler,
        metrics: Metrics,
        aftercare: Aftercare,
    ) -> None:
        self._settings = settings
        self._engines = engines
        self._scheduler = scheduler
        self._metrics = metrics
        self._aftercare = aftercare

    async def run(
        self,
        ex: Exchange,
        *,
        body_for: BodyFor,
        accept: Accept,
        orphaned: Orphaned,
        json: bool = True,
        abort_on_disconnect: bool = False,
    ) -> Outcome:
        """Prefill ``ex`` where it was placed, retrying and falling back as configured.

        ``json``: the answer is read (at most ``SIDECAR_MAX_PREFILL_ANSWER_BYTES``; a longer one
        is a failed prefill) and parsed before ``accept`` sees it; else a 2xx answer, which may
        be a stream, is read to its end without keeping any of it, and ``accept`` gets ``b""``.
        ``abort_on_disconnect``: a cancelled call is aborted, even one whose answer has started,
        whatever ``SIDECAR_PREFILL_ON_DISCONNECT`` says (a protocol whose prefill waits for its
        decode, which is gone then, and stages nothing to release).
        """
        spec = _CallSpec(accept, orphaned, json, abort_on_disconnect)
        tried: set[str] = set()
        current: Placement | None = ex.placement
        attempt = 0
        failure: _Failure | None = None
        last = ex.placement.endpoint
        while current is not None and current.endpoint is not None:
            attempt += 1
            last = current.endpoint
            try:
                data = body_for(current.endpoint)
            except BaseException:
                self._scheduler.prefill_finished(current, ok=None)  # no call will give it back
                raise
            ex.progress.prefill_sent(current.endpoint, attempt)
            result = await self._attempt(ex, data, current, spec, attempt)
            if not isinstance(result, _Failure):
                return result
            failure = result
            tried.add(str(current.endpoint))
            retries = self._settings.prefill_retries
            if not (failure.transient and attempt <= retries and not _past(ex.deadline)):
                break
            logger.info(
                "request %s: prefill on %s failed (%s), retrying",
                ex.request_id,
                current.endpoint,
                failure.detail,
                extra={"request_id": ex.request_id},
            )
            self._metrics.prefill_retries.inc()
            await asyncio.sleep(self._settings.prefill_retry_backoff_s * 2 ** (attempt - 1))
            current = await self._scheduler.retry(current, tried)
        return self._give_up(ex, failure, last)

    async def _attempt(
        self,
        ex: Exchange,
        data: Wire,
        placement: Placement,
        spec: _CallSpec,
        attempt: int,
    ) -> _Result:
        endpoint = placement.endpoint
        assert endpoint is not None
        started = asyncio.get_running_loop().time()
        answering = asyncio.Event()
        leg = None
        if ex.trace is not None:
            leg = ex.trace.leg(
                "prefill",
                self._engines.prefill_url(endpoint) + ex.path,
                {
                    "pd_sidecar.prefill.endpoint": str(endpoint),
                    "pd_sidecar.prefill.attempt": attempt,
                },
            )
        call = asyncio.create_task(
            self._call(ex, data, endpoint, spec, answering, leg),
            name=task_name(ex.request_id, "prefill"),
        )
        call.add_done_callback(functools.partial(self._ended, placement, started, leg))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._client_left(call, placement, started, answering.is_set(), spec)
            raise
        finally:
            ex.progress.prefill_ended()

    def _ended(
        self,
        placement: Placement,
        started: float,
        leg: Leg | None,
        call: asyncio.Future[_Result],
    ) -> None:
        """The call is over, whoever waited for it: tell the scheduler, count it, end its span."""
        ok: bool | None = None  # cancelled, or the client's own fault: says nothing
        outcome, error, cached = "cancelled", None, None
        # (An exception is a bug, logged by whoever awaits the call: the request, or _salvage.)
        if not call.cancelled() and call.exception() is None:
            result = call.result()
            if isinstance(result, _Failure):
                ok = False
                outcome, error = result.outcome, result.detail
                self._metrics.prefill_requests_by(result.outcome).inc()
            elif isinstance(result, Prefilled):
                ok = True
                outcome, cached = "success", result.cached_tokens
                self._metrics.prefill_requests_by("success").inc()
            else:
                outcome, error = "client_error", result.error
                self._metrics.prefill_requests_by("client_error").inc()
        elif not call.cancelled():
            outcome, error = "error", repr(call.exception())
        seconds = asyncio.get_running_loop().time() - started
        self._scheduler.prefill_finished(placement, ok=ok, seconds=seconds)
        if leg is not None:
            leg.end(outcome, error=error, attributes={"pd_sidecar.cached_tokens": cached})

    def _client_left(
        self,
        call: asyncio.Future[_Result],
        placement: Placement,
        started: float,
        answering: bool,
        spec: _CallSpec,
    ) -> None:
        """Abort the call or let it finish (module docstring); synchronous on purpose."""
        if call.done():  # its answer came in with the cancellation
            _salvage(call, spec.orphaned)
            return
        # An engine whose status line is in has finished the prefill (and staged its KV):
        # aborting saves nothing then, and only reading the answer can free the KV. Unless the
        # protocol stages nothing for the client's leg to take (``abort_on_disconnect``).
        if spec.abort_on_disconnect:
            action = "abort"
        elif answering:
            action = "finish"
        else:
            action = self._action(placement, started)
        if action == "finish" and self._aftercare.adopt(call):
            call.add_done_callback(functools.partial(_salvage, orphaned=spec.orphaned))
        else:
            if answering and not spec.abort_on_disconnect:
                # staged KV that cannot be read now: left to the engine's expiry
                self._metrics.kv_releases.labels("skipped").inc()
            action = "abort"
            call.cancel()
            self._aftercare.watch(call)
        self._metrics.prefill_disconnects.labels(action).inc()

    def _action(self, placement: Placement, started: float) -> str:
        mode = self._settings.prefill_on_disconnect
        if mode != "auto":
            return mode
        if not self._settings.release_on_disconnect:
            return "abort"  # finishing would only stage KV that nobody releases
        elapsed = asyncio.get_running_loop().time() - started
        outlook = self._scheduler.prefill_outlook(placement, elapsed)
        if outlook.queued:
            return "abort"  # not started: nothing to race with, all of its compute saved
        if outlook.compute_s <= AUTO_FINISH_WITHIN_S:
            return "finish"  # little compute to save, whatever the fitted overhead says
        return "finish" if outlook.remaining_s <= AUTO_FINISH_WITHIN_S else "abort"

    async def _call(
        self,
        ex: Exchange,
        data: Wire,
        endpoint: Endpoint,
        spec: _CallSpec,
        answering: asyncio.Event,
        leg: Leg | None,
    ) -> _Result:
        """One prefill call; sets ``answering`` once the engine's status line is in."""
        timeout_s = self._settings.prefill_timeout_s
        if ex.deadline is not None:
            remaining = ex.deadline - asyncio.get_running_loop().time()
            timeout_s = max(0.001, min(timeout_s, remaining))
        try:
            upstream = await self._engines.send(
                "POST",
                self._engines.prefill_url(endpoint) + ex.path,
                headers=ex.headers if leg is None else leg.headers(ex.headers),
                data=data,
                total_s=timeout_s,
                role="the prefill engine",
                server_name=self._engines.prefill_server_name(endpoint),
            )
            answering.set()
            if leg is not None:
                leg.responded(upstream.status)
            answer = b""
            if spec.json or not 200 <= upstream.status < 300:
                answer = await upstream.read(self._settings.max_prefill_answer_bytes)
            else:  # a protocol that needs nothing of a 2xx answer but its end
                await upstream.drain()
        except EngineAnswerTooLarge as exc:
            # Not a transient fault: the answer of a vLLM prefill leg is one token and its KV
            # parameters. KV such an engine staged cannot be released (its parameters were not
            # read): it stays until the engine's expiry.
            detail = f"{exc.message} (SIDECAR_MAX_PREFILL_ANSWER_BYTES)"
            return _Failure("prefill_too_large", "bad_response", detail, transient=False)
        except EngineTimeout as exc:
            # A timeout after the status line: the engine finished (its KV is staged) and the
            # body stalled. Another endpoint would compute the prompt again; fall back instead.
            transient = not answering.is_set()
            return _Failure("prefill_timeout", "timeout", exc.message, transient=transient)
        except EngineUnreachable as exc:
            return _Failure("prefill_unreachable", "unreachable", exc.message, transient=True)

        status = upstream.status
        if 400 <= status < 500:
            if is_error_body(answer):  # the engine's own refusal: the client sees it as is
                content_type = upstream.headers.get("content-type", "application/json")
                return Refused(status, answer, content_type, f"prefill answered {status}")
            body = foreign_refusal("prefill target", status, answer)
            return Refused(status, body, "application/json", f"prefill target answered {status}")
        if status >= 300:
            return _Failure(
                "prefill_error",
                "server_error",
                f"prefill answered {status}",
                transient=status in TRANSIENT_STATUSES,
            )
        parsed: object = answer
        if spec.json:
            try:
                parsed = parse_json(answer, "prefill")
            except EngineError as exc:
                return _Failure(
                    "prefill_bad_response", "bad_response", exc.message, transient=False
                )
        prefilled = spec.accept(parsed, endpoint)
        if prefilled is None:
            return _Failure(
                "no_kv_params", "bad_response", "answer has no usable KV params", transient=False
            )
        return prefilled

    def _give_up(self, ex: Exchange, failure: _Failure | None, last: Endpoint | None) -> Fallback:
        reason = failure.reason if failure else "no_endpoint_left"
        detail = failure.detail if failure else "no other prefill endpoint to retry on"
        self._metrics.fallbacks.labels(reason).inc()
        local = self._settings.prefill_fallback == "local"
        ex.progress.fell_back(reason, local=local)
        if not local:
            raise PrefillFailed(f"the prefill failed and the fallback is 'fail': {detail}")
        logger.warning(
            "request %s: prefill on %s failed (%s), decoding locally",
            ex.request_id,
            last,
            detail,
            extra={"request_id": ex.request_id},
        )
        return Fallback(reason)


def _salvage(call: asyncio.Future[_Result], orphaned: Orphaned) -> None:
    """The KV of a call that delivered after its client left goes to ``orphaned``."""
    if call.cancelled():
        return
    error = call.exception()
    if error is not None:
        logger.error("prefill call failed after its client left", exc_info=error)
        return
    result = call.result()
    if isinstance(result, Prefilled):
        orphaned(result)


def _past(deadline: float | None) -> bool:
    return deadline is not None and asyncio.get_running_loop().time() >= deadline

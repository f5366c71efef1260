"""The prefill leg: its attempts (retries, timeouts, fallback) and the KV one stages.

A connector prefills by iterating attempts, each written as straight code::

    async for attempt in prefill.attempts(ex):      # the endpoint, the number, the budget left
        with attempt.staged(release) as kv:          # a prefill that stages KV for the decode
            outcome = await kv.prefill(data, accept)   # Prefilled | Refused | Failed
            ...                                      # decode; kv.taken() once it has the KV
    # the attempts ran out: decode locally (SIDECAR_PREFILL_FALLBACK=local)

or, for a protocol that sends both legs at once (SGLang), ``kv.start(...)``: the call's task,
which the exit aborts unless it ended or was handed over (``kv.hand_over``).

**Retries.** An attempt that failed transiently (connect error, reset, timeout, 502/503/504) is
followed by another, up to ``SIDECAR_PREFILL_RETRIES`` more, after a doubling backoff — on another
endpoint when the scheduler chose it, on the same one when the gateway named it. Any other 5xx, a
3xx, or an answer the connector cannot use is not retried. A 4xx is the client's own fault:
``Refused``, never retried. When the attempts run out, ``SIDECAR_PREFILL_FALLBACK`` decides:
``local`` ends the iteration (the connector decodes locally), ``fail`` raises ``PrefillFailed``
(503).

**Staged KV** (``StagedKv``) has one owner: the handle the attempt gives the connector. Its
``taken()`` (the decode leg has it) and ``release()`` are idempotent, and its exit releases KV
that was not taken — a decode that failed, was refused, or whose client left — by scheduling the
release in the background work that outlives the request (``sidecar.connectors.background``), never
by awaiting it. Each outcome is counted once: ``sent``/``failed`` by the release itself, ``skipped``
by whoever could not send it (``Attempt.send_release``, ``OnDisconnect``).

**A client that leaves while the prefill runs**: the call is finished in the background or
aborted, as ``sidecar.connectors.disconnect`` (the client-disconnect policy) decides; each attempt
asks it (``Attempt.client_left``), and every abort of a running call goes through it.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn

from sidecar.body import Wire
from sidecar.config import Settings
from sidecar.connectors.background import BackgroundWork
from sidecar.connectors.disconnect import OnDisconnect
from sidecar.connectors.exchange import Body, Exchange, Prefilled, Refused
from sidecar.engines.upstream import EngineAnswer, Engines, parse_json
from sidecar.errors import (
    REQUEST_ID_HEADER,
    EngineAnswerTooLarge,
    EngineBadResponse,
    EngineTimeout,
    EngineUnreachable,
    PrefillFailed,
    foreign_refusal,
    is_error_body,
)
from sidecar.fleet.endpoints import Endpoint
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import Leg
from sidecar.observability.tracking import task_name
from sidecar.scheduling.placement import Placement
from sidecar.scheduling.scheduler import Scheduler

logger = logging.getLogger("sidecar.connectors.prefill")

TRANSIENT_STATUSES = frozenset({502, 503, 504})
Accept = Callable[[object, Endpoint], Prefilled | None]
"""A 2xx prefill answer, as its ``Reader`` gave it → ``Prefilled``, or None when unusable."""
Reader = Callable[[EngineAnswer, int], Awaitable[object]]
"""How a 2xx prefill answer is read, given the most bytes to keep."""


async def json_answer(upstream: EngineAnswer, limit: int) -> object:
    """The answer read (at most ``limit`` bytes: ``SIDECAR_MAX_PREFILL_ANSWER_BYTES``) and
    parsed."""
    return parse_json(await upstream.read(limit), "prefill")


async def drained(upstream: EngineAnswer, limit: int) -> object:
    """A 2xx answer that may stream and whose content nobody needs, only its end: read to its end
    without keeping any of it (``b""``)."""
    await upstream.drain()
    return b""


@dataclass(frozen=True, slots=True)
class Failed:
    """A prefill attempt that staged nothing usable."""

    reason: str
    """The record's fallback_reason and the fallbacks metric's label."""
    outcome: str
    """The prefill_requests metric's outcome label."""
    detail: str
    transient: bool
    """Worth another attempt."""


Result = Prefilled | Refused | Failed


@dataclass(frozen=True, slots=True)
class Release:
    """How a connector frees the KV its prefill staged: a request built from the prefill's
    answer, sent to the decode ranks (any of them can pull it), its answer dropped."""

    body: Callable[[Prefilled], Body]
    request_id: str
    """The ``x-request-id`` it carries (the engine may match staged KV by it)."""


@dataclass(frozen=True, slots=True)
class PrefillOptions:
    """The settings the prefill leg uses, under their own names (``from_settings``): its
    retries and their backoff, its timeout and answer cap, the fallback, the disconnect mode."""

    retries: int
    retry_backoff_s: float
    timeout_s: float
    max_answer_bytes: int
    fallback_local: bool
    on_disconnect: str
    """``auto``, ``abort`` or ``finish``."""

    @classmethod
    def from_settings(cls, settings: Settings) -> PrefillOptions:
        return cls(
            retries=settings.prefill_retries,
            retry_backoff_s=settings.prefill_retry_backoff_s,
            timeout_s=settings.prefill_timeout_s,
            max_answer_bytes=settings.max_prefill_answer_bytes,
            fallback_local=settings.prefill_fallback == "local",
            on_disconnect=settings.prefill_on_disconnect,
        )


class Prefill:
    """The prefill leg's policy, shared by every connector: ``attempts(ex)``."""

    def __init__(
        self,
        options: PrefillOptions,
        *,
        engines: Engines,
        scheduler: Scheduler,
        metrics: Metrics,
        background: BackgroundWork,
        release_urls: Callable[[Exchange], list[str]],
    ) -> None:
        """``release_urls``: where a release of a request's staged KV may go, in order."""
        self.options = options
        self.engines = engines
        self.scheduler = scheduler
        self.metrics = metrics
        self.background = background
        self.release_urls = release_urls
        self.disconnects = OnDisconnect(
            options.on_disconnect, scheduler=scheduler, background=background, metrics=metrics
        )
        """What is done with a call whose client left."""

    def attempts(self, ex: Exchange) -> Attempts:
        """``ex``'s prefill attempts, starting where it was placed (none when it was placed
        locally)."""
        return Attempts(self, ex)

    def ended(self, placement: Placement, started: float, leg: Leg, call: Call) -> None:
        """A call is over, whoever waited for it: tell the scheduler, count it, end its span."""
        ok: bool | None = None  # cancelled, or the client's own fault: says nothing
        outcome, error, cached = "cancelled", None, None
        counted: int | None = None
        # (An exception is a bug, logged by whoever awaits the call, or by the StagedKv it
        # delivers to after its client left.)
        seconds = asyncio.get_running_loop().time() - started
        if not call.cancelled() and call.exception() is None:
            result = call.result()
            if isinstance(result, Failed):
                ok = False
                outcome, error = result.outcome, result.detail
            elif isinstance(result, Prefilled):
                ok = True
                outcome, cached = "success", result.cached_tokens
                counted = result.prompt_tokens
            else:
                outcome, error = "client_error", result.error
            # Before the scheduler hears of it: an endpoint that leaves the pool with its last
            # call loses its series then.
            self.metrics.observe_prefill(str(placement.endpoint), outcome, seconds)
        elif not call.cancelled():
            outcome, error = "error", repr(call.exception())
        self.scheduler.prefill_finished(
            placement, ok=ok, seconds=seconds, prompt_tokens=counted, cached_tokens=cached
        )
        leg.end(outcome, error=error, attributes={"pd_sidecar.cached_tokens": cached})

    async def call(
        self,
        ex: Exchange,
        data: Wire,
        endpoint: Endpoint,
        url: str,
        accept: Accept,
        read: Reader,
        answering: asyncio.Event,
        leg: Leg,
    ) -> Result:
        """One prefill call to ``url`` (``endpoint``'s); sets ``answering`` once the engine's
        status line is in."""
        options = self.options
        timeout_s = options.timeout_s
        if ex.deadline is not None:
            remaining = ex.deadline - asyncio.get_running_loop().time()
            timeout_s = max(0.001, min(timeout_s, remaining))
        answer: object = b""
        try:
            upstream = await self.engines.requests.send(
                "POST",
                url,
                headers=leg.headers(ex.headers),
                data=data,
                total_s=timeout_s,
                role="the prefill engine",
                server_name=self.engines.prefill_server_name(endpoint),
            )
            answering.set()
            leg.responded(upstream.status)
            if 200 <= upstream.status < 300:
                answer = await read(upstream, options.max_answer_bytes)
            else:
                answer = await upstream.read(options.max_answer_bytes)
        except EngineAnswerTooLarge as exc:
            # Not a transient fault: the answer of a vLLM prefill leg is one token and its KV
            # parameters. KV such an engine staged cannot be released (its parameters were not
            # read): it stays until the engine's expiry.
            detail = f"{exc.message} (SIDECAR_MAX_PREFILL_ANSWER_BYTES)"
            return Failed("prefill_too_large", "bad_response", detail, transient=False)
        except EngineBadResponse as exc:
            return Failed("prefill_bad_response", "bad_response", exc.message, transient=False)
        except EngineTimeout as exc:
            # A timeout after the status line: the engine finished (its KV is staged) and the
            # body stalled. Another endpoint would compute the prompt again; fall back instead.
            transient = not answering.is_set()
            return Failed("prefill_timeout", "timeout", exc.message, transient=transient)
        except EngineUnreachable as exc:
            return Failed("prefill_unreachable", "unreachable", exc.message, transient=True)

        status = upstream.status
        if 400 <= status < 500:
            assert isinstance(answer, bytes)
            if is_error_body(answer):  # the engine's own refusal: the client sees it as is
                content_type = upstream.headers.get("content-type", "application/json")
                return Refused(status, answer, content_type, f"prefill answered {status}")
            body = foreign_refusal("prefill target", status, answer)
            return Refused(status, body, "application/json", f"prefill target answered {status}")
        if status >= 300:
            return Failed(
                "prefill_error",
                "server_error",
                f"prefill answered {status}",
                transient=status in TRANSIENT_STATUSES,
            )
        prefilled = accept(answer, endpoint)
        if prefilled is None:
            return Failed(
                "no_kv_params", "bad_response", "answer has no usable KV params", transient=False
            )
        return prefilled


Call = asyncio.Task[Result]


class Attempts:
    """The attempts of one request's prefill (an async iterator: the module's docstring).

    The next attempt is made only after one that failed transiently, while retries and the
    request's time are left; after any other, the iteration ends — at once after a usable one,
    by the fallback policy after a failed one.
    """

    __slots__ = ("_current", "_ex", "_prefill", "_tried")

    def __init__(self, prefill: Prefill, ex: Exchange) -> None:
        self._prefill = prefill
        self._ex = ex
        self._current: Attempt | None = None
        self._tried: set[str] = set()

    def __aiter__(self) -> Attempts:
        return self

    async def __anext__(self) -> Attempt:
        ex, prefill = self._ex, self._prefill
        last = self._current
        if last is None:
            if self._tried or ex.placement.endpoint is None:
                raise StopAsyncIteration
            return self._next(ex.placement, 1)
        last.close()  # one that was never sent gives its reservation back
        failed = last.failed
        if failed is None:  # a usable one, or none sent: nothing to retry
            self._current = None
            self._tried.add(str(last.endpoint))
            raise StopAsyncIteration
        self._tried.add(str(last.endpoint))
        if failed.transient and last.number <= prefill.options.retries and not _past(ex.deadline):
            logger.info(
                "request %s: prefill on %s failed (%s), retrying",
                ex.request_id,
                last.endpoint,
                failed.detail,
                extra={"request_id": ex.request_id},
            )
            prefill.metrics.prefill_retries.inc()
            await asyncio.sleep(prefill.options.retry_backoff_s * 2 ** (last.number - 1))
            placement = await prefill.scheduler.retry(last.placement, self._tried, ex.exact)
            if placement is not None and placement.endpoint is not None:
                return self._next(placement, last.number + 1)
        self._current = None
        self._give_up(failed, last.endpoint)

    def _next(self, placement: Placement, number: int) -> Attempt:
        self._current = Attempt(self._prefill, self._ex, placement, number)
        return self._current

    def _give_up(self, failed: Failed, last: Endpoint) -> NoReturn:
        ex, prefill = self._ex, self._prefill
        prefill.metrics.fallbacks.labels(failed.reason).inc()
        local = prefill.options.fallback_local
        ex.progress.fell_back(failed.reason, local=local)
        if not local:
            raise PrefillFailed(f"the prefill failed and the fallback is 'fail': {failed.detail}")
        logger.warning(
            "request %s: prefill on %s failed (%s), decoding locally",
            ex.request_id,
            last,
            failed.detail,
            extra={"request_id": ex.request_id},
        )
        raise StopAsyncIteration


class Attempt:
    """One prefill attempt on one endpoint, a context manager: its call is sent by ``start``
    (or ``StagedKv.prefill``) in a task of its own, and aborted on exit unless it ended or was
    handed over; an attempt never sent gives its reservation back on exit."""

    __slots__ = (
        "_call",
        "_closed",
        "_ex",
        "_handed_over",
        "_prefill",
        "_progressing",
        "answering",
        "number",
        "placement",
        "started",
    )

    def __init__(self, prefill: Prefill, ex: Exchange, placement: Placement, number: int) -> None:
        self._prefill = prefill
        self._ex = ex
        self.placement = placement
        self.number = number
        """1 for the first attempt."""
        self._call: Call | None = None
        self._handed_over = False
        self._closed = False
        self._progressing = False
        self.answering = asyncio.Event()
        """Set once the engine's status line is in: it has finished the prefill."""
        self.started = 0.0

    @property
    def endpoint(self) -> Endpoint:
        endpoint = self.placement.endpoint
        assert endpoint is not None
        return endpoint

    @property
    def budget_s(self) -> float | None:
        """Seconds left of the request's time (None: no limit)."""
        deadline = self._ex.deadline
        return None if deadline is None else deadline - asyncio.get_running_loop().time()

    @property
    def failed(self) -> Failed | None:
        """How the call failed; None when it was not sent, has not ended, or did not fail."""
        call = self._call
        if call is None or not call.done() or call.cancelled() or call.exception() is not None:
            return None
        result = call.result()
        return result if isinstance(result, Failed) else None

    def staged(self, release: Release | None) -> StagedKv:
        """This attempt, for a protocol whose prefill stages KV that the decode leg takes.
        ``release``: how to free it; None when nothing is staged for this request alone (a
        store that keeps blocks by its own policy)."""
        return StagedKv(self, release)

    def start(self, data: Wire, accept: Accept, read: Reader = json_answer) -> Call:
        """Send the prefill call, in a task of its own (the record shows it sent)."""
        assert self._call is None, "one call per attempt"
        assert not self._closed, "sent before the attempt's exit"
        prefill, ex, endpoint = self._prefill, self._ex, self.endpoint
        ex.progress.prefill_sent(self.placement, self.number)
        self._progressing = True
        self.started = asyncio.get_running_loop().time()
        url = prefill.engines.prefill_url(endpoint) + ex.path
        leg = ex.trace.leg(
            "prefill",
            url,
            {
                "pd_sidecar.prefill.endpoint": str(endpoint),
                "pd_sidecar.prefill.attempt": self.number,
            },
        )
        call = asyncio.create_task(
            prefill.call(ex, data, endpoint, url, accept, read, self.answering, leg),
            name=task_name(ex.request_id, "prefill"),
        )
        call.add_done_callback(functools.partial(self._call_ended, leg))
        self._call = call
        return call

    def _call_ended(self, leg: Leg, call: Call) -> None:
        self._prefill.ended(self.placement, self.started, leg, call)
        self.prefill_done()

    def prefill_done(self) -> None:
        """The record counts the prefill done (once): its call ended, its client left, or the
        decode has the KV already (legs sent at once)."""
        if self._progressing:
            self._progressing = False
            self._ex.progress.prefill_ended()

    def hand_over(self, call: Call) -> bool:
        """Let the running call end in the background, the request's own part over; False when
        the background is full (the exit aborts it then)."""
        self.prefill_done()
        if call.done() or self._prefill.background.adopt(call):
            self._handed_over = True
        return self._handed_over

    def client_left(self, delivered: Callable[[Call], None], *, stages_kv: bool) -> None:
        """The client left while its connector waited for the call: it is finished in the
        background (``delivered`` is called with it once it ends) or aborted, as the
        client-disconnect policy decides (``OnDisconnect.prefill_left``). ``stages_kv``: a
        finished call's KV would be released."""
        call = self._call
        assert call is not None, "left before the call was sent"
        self._prefill.disconnects.prefill_left(self, call, delivered, stages_kv=stages_kv)

    def send_release(self, release: Release, prefilled: Prefilled) -> None:
        """Free the KV this attempt's prefill staged (``prefilled``), in the background: nothing
        when releases are off, ``skipped`` counted when the background is full."""
        prefill, ex = self._prefill, self._ex
        if not prefill.background.releasing:
            return
        headers = ex.headers.copy()
        headers[REQUEST_ID_HEADER] = release.request_id
        data = ex.encode(release.body(prefilled))
        if not prefill.background.release(
            ex.request_id, prefill.release_urls(ex), headers, data, ex.trace
        ):
            prefill.metrics.kv_releases.labels("skipped").inc()

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.close(left=kind is not None and issubclass(kind, asyncio.CancelledError))

    def close(self, *, left: bool = False) -> None:
        """Abort the call unless it ended or was handed over (``left``: because its client left,
        counted: ``OnDisconnect.abort``); give back the reservation of an attempt never sent.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        call = self._call
        if call is None:  # no call will give it back
            self._prefill.scheduler.prefill_finished(self.placement, ok=None)
            return
        self.prefill_done()
        if not call.done() and not self._handed_over:
            self._prefill.disconnects.abort(call, left=left)


class _State(enum.Enum):
    WAITING = "waiting"
    """No usable prefill (yet)."""
    STAGED = "staged"
    TAKEN = "taken"
    RELEASED = "released"


class StagedKv:
    """KV that one attempt's prefill stages for the request's decode leg: taken by it, or
    released — once, whatever happens (the module's docstring). A context manager: its exit
    releases KV not taken and closes the attempt. It sees only the attempt's public side: the
    call (``start``), its hand-over, the client-disconnect policy (``Attempt.client_left``) and
    the release (``Attempt.send_release``)."""

    __slots__ = ("_attempt", "_prefilled", "_release", "_state")

    def __init__(self, attempt: Attempt, release: Release | None) -> None:
        self._attempt = attempt
        self._release = release
        self._prefilled: Prefilled | None = None
        self._state = _State.WAITING

    async def prefill(self, data: Wire, accept: Accept, read: Reader = json_answer) -> Result:
        """The attempt's call; a cancellation (the client left) is met by the client-disconnect
        policy, synchronously: a call it finishes delivers its KV here, to be released."""
        call = self._attempt.start(data, accept, read)
        try:
            result = await asyncio.shield(call)
        except asyncio.CancelledError:
            stages_kv = self._release is not None
            self._attempt.client_left(self._release_when_done, stages_kv=stages_kv)
            raise
        if isinstance(result, Prefilled):
            self._staged(result)
        return result

    def start(self, data: Wire, accept: Accept, read: Reader = json_answer) -> Call:
        """The attempt's call, for a protocol that waits for it along with its decode leg (the
        exit aborts it unless it ended or was handed over: ``OnDisconnect.abort``)."""
        return self._attempt.start(data, accept, read)

    def hand_over(self, call: Call) -> bool:
        """``Attempt.hand_over``: the call's answer is read to its end in the background."""
        return self._attempt.hand_over(call)

    def taken(self) -> None:
        """The decode leg has the KV (its engine answered): nothing to release."""
        if self._state is _State.STAGED:
            self._state = _State.TAKEN

    def release(self) -> None:
        """Free the staged KV in the background (nothing when there is none, or it was taken
        or released already)."""
        if self._state is not _State.STAGED:
            return
        self._state = _State.RELEASED
        recipe, prefilled = self._release, self._prefilled
        if recipe is not None and prefilled is not None:
            self._attempt.send_release(recipe, prefilled)

    def __enter__(self) -> StagedKv:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.release()
        self._attempt.__exit__(kind, *rest)

    def _staged(self, prefilled: Prefilled) -> None:
        if self._state is _State.WAITING:
            self._prefilled = prefilled
            self._state = _State.STAGED

    def _release_when_done(self, call: Call) -> None:
        """The KV of a call that delivered after its client left is released."""
        if call.cancelled():
            return
        error = call.exception()
        if error is not None:
            logger.error("prefill call failed after its client left", exc_info=error)
            return
        result = call.result()
        if isinstance(result, Prefilled):
            self._staged(result)
            self.release()


def _past(deadline: float | None) -> bool:
    return deadline is not None and asyncio.get_running_loop().time() >= deadline

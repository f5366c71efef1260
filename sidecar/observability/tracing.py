"""OpenTelemetry tracing (``SIDECAR_TRACING=true``): the only module that imports ``opentelemetry``.

The SDK is the optional extra ``tracing``; it is imported when a ``Tracing`` is built,
never otherwise. With tracing off, the app's ``Tracing`` is ``NO_TRACING``, a request's trace
``NO_TRACE`` and its legs ``NO_LEG``, whose methods do nothing (no ``None`` checks anywhere),
and the client's ``traceparent``/``tracestate`` reach the engines untouched (``sidecar.headers``).

With tracing on, each generation request gets a server span, the child of the gateway's W3C trace
context (or the root of a new trace), and one child span per phase::

    POST /v1/completions          server   pd_sidecar.request_id, decision, reason, ...
    ├─ placement                  internal pd_sidecar.decision, reason, prefill.endpoint
    ├─ prefill                    client   one per attempt: endpoint, attempt, outcome
    ├─ decode                     client   until the decode engine's first byte
    ├─ relay                      internal the answer to the client
    └─ kv_release                 client   when staged KV is released (may end after its parent)

Every engine leg's ``traceparent`` names the span of that leg (a prefill attempt, the decode
send, a release), replacing the client's, so the engines' own spans (vLLM's
``--otlp-traces-endpoint``) hang under the sidecar's legs in one trace. Spans are passed
explicitly (no context variables are attached), which keeps concurrent legs apart.

Configuration is the SDK's: ``OTEL_TRACES_SAMPLER``/``_ARG``, ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_*``, ``OTEL_BSP_*`` are read by the SDK itself.
The one variable read here is the exporter's protocol (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else
``OTEL_EXPORTER_OTLP_PROTOCOL``), which picks the exporter class: the documented exception to
"only ``config.py`` reads the environment" (docs/configuration.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from multidict import CIMultiDict
from yarl import URL

from sidecar import __version__
from sidecar.extras import install_hint
from sidecar.fleet.endpoints import Endpoint
from sidecar.observability.tracking import RequestRecord, State

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

logger = logging.getLogger("sidecar.observability.tracing")

EXTRA = install_hint("tracing")
SERVICE_NAME = "pd-sidecar"
"""``service.name`` when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one."""
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
EXPORTERS = {
    "http/protobuf": (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry-exporter-otlp-proto-http",
    ),
    "grpc": (
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "opentelemetry-exporter-otlp-proto-grpc",
    ),
}
"""OTLP protocol → (the exporter's module, its package). The extra holds the HTTP one."""


class _Decided(Protocol):
    @property
    def reason(self) -> str: ...


class _Rank(Protocol):
    @property
    def index(self) -> int: ...


class Placed(Protocol):
    """What the placement span reads of a placement (``sidecar.scheduling.placement.Placement``:
    the scheduling layer sits above this one)."""

    @property
    def decision(self) -> _Decided: ...

    @property
    def endpoint(self) -> Endpoint | None: ...

    @property
    def rank(self) -> _Rank: ...


class TracingUnavailable(Exception):
    """SIDECAR_TRACING=true cannot be honoured; the message is one line (exit status 2)."""


class Tracing:
    """A tracer provider of its own (never the process-global one), its tracer and the W3C
    propagator. Built once per app; ``close`` flushes and shuts it down. Tracing off is
    ``NO_TRACING``, whose methods do nothing."""

    enabled = True
    """False for ``NO_TRACING`` alone."""

    def __init__(self, provider: TracerProvider, *, exporter: str = "") -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self.tracer: Tracer = provider.get_tracer("pd-sidecar", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.in_context = trace.set_span_in_context
        self.nothing = trace.INVALID_SPAN
        """Stands for a span not recorded: its methods do nothing."""
        self.kinds = trace.SpanKind
        self.status = trace.Status
        self.error = trace.StatusCode.ERROR
        sampler = provider.sampler.get_description()
        service = provider.resource.attributes.get("service.name")
        self.description = f"service {service}, sampler {sampler}, exporter {exporter or 'none'}"

    @classmethod
    def when(cls, enabled: bool) -> Tracing:
        """What ``SIDECAR_TRACING`` (``enabled``) asks for: a provider built from the ``OTEL_*``
        variables (``from_environment``; raises ``TracingUnavailable``), or ``NO_TRACING``."""
        return cls.from_environment() if enabled else NO_TRACING

    @classmethod
    def from_environment(cls) -> Tracing:
        """The provider the ``OTEL_*`` variables describe, exporting through a bounded batch
        queue (``OTEL_BSP_*``). Raises ``TracingUnavailable`` when the SDK or the protocol's
        exporter is not installed, or the protocol is unknown."""
        protocol = "http/protobuf"
        for variable in PROTOCOL_VARIABLES:
            value = os.environ.get(variable, "").strip()
            if value:
                protocol, named_by = value, variable
                break
        else:
            named_by = "the default"
        if protocol not in EXPORTERS:
            known = ", ".join(EXPORTERS)
            raise TracingUnavailable(
                f"SIDECAR_TRACING=true: {named_by}={protocol} is not supported (one of: {known})"
            )
        module_name, package = EXPORTERS[protocol]
        try:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise TracingUnavailable(
                f"SIDECAR_TRACING=true needs the OpenTelemetry SDK, which is not installed: {EXTRA}"
            ) from None
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise TracingUnavailable(
                f"SIDECAR_TRACING=true with OTLP protocol {protocol} ({named_by}) needs "
                f"{package}, which is not installed"
            ) from None
        exporter = module.OTLPSpanExporter()
        return cls.with_processor(
            BatchSpanProcessor(exporter), exporter=f"OTLP {protocol} to {otlp_endpoint(protocol)}"
        )

    @classmethod
    def with_exporter(cls, exporter: SpanExporter, *, schedule_delay_s: float = 5.0) -> Tracing:
        """A provider exporting to ``exporter`` in batches (tests pass their own)."""
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        processor = BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_s * 1000)
        return cls.with_processor(processor, exporter=type(exporter).__name__)

    @classmethod
    def with_processor(cls, processor: Any, *, exporter: str) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        resource = Resource.create({"service.version": __version__})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        # The sampler comes from OTEL_TRACES_SAMPLER(_ARG); the app shuts the provider down.
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(processor)
        return cls(provider, exporter=exporter)

    def request(
        self,
        headers: Mapping[str, str],
        method: str,
        path: str,
        request_id: str,
        route: str | None = None,
    ) -> RequestTrace:
        """The server span of a request arriving with ``headers`` (its trace context, if any).
        Named ``{method} {route}`` for a route of the sidecar's own, else ``{method}``: a
        passthrough path is the client's, too many names for a span (HTTP convention)."""
        parent = self.propagator.extract(headers)
        span = self.tracer.start_span(
            f"{method} {route}" if route is not None else method,
            context=parent,
            kind=self.kinds.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path,
                "pd_sidecar.request_id": request_id,
            },
        )
        return RequestTrace(self, span)

    async def close(self, timeout_s: float) -> None:
        """Export what is queued and shut the provider down, within ``timeout_s``. The SDK's
        calls block: they run in a thread of their own, abandoned (spans lost) at the timeout."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        millis = max(1, int(timeout_s * 1000))

        def shut() -> None:
            try:
                self._provider.force_flush(millis)
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed already
                    loop.call_soon_threadsafe(_set_done, done)

        threading.Thread(target=shut, name="tracing-shutdown", daemon=True).start()
        try:
            # Not ``wait_for``: on Python 3.11 it can swallow a cancellation that comes as
            # ``done`` is set (CPython gh-86296).
            async with asyncio.timeout(timeout_s):
                await done
        except TimeoutError:
            logger.warning("tracing: spans not exported within %.2gs were dropped", timeout_s)


def otlp_endpoint(protocol: str) -> str:
    """Where the OTLP exporter of ``protocol`` sends spans, by the OpenTelemetry specification's
    exporter configuration ("OTLP Exporter Configuration"): ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    as it is; else ``OTEL_EXPORTER_OTLP_ENDPOINT``, to which the HTTP exporter appends
    ``v1/traces``; else the default, ``http://localhost:4318/v1/traces`` (HTTP) or
    ``http://localhost:4317`` (gRPC). For the start log line only: the exporter reads them itself.
    """
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    grpc = protocol == "grpc"
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not base:
        return "http://localhost:4317" if grpc else "http://localhost:4318/v1/traces"
    if grpc:
        return base
    return base + ("v1/traces" if base.endswith("/") else "/v1/traces")


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class RequestTrace:
    """One request's spans. Every span it starts is ended by ``end`` at the latest (legs that
    outlive the request, a prefill finishing or a release, end on their own).

    A request the sampler dropped records nothing: it starts no child span, and its legs carry
    the request span's own context (flagged not sampled), which is all an engine needs to
    follow the decision. Most requests are such at a low sampling ratio: they cost the least.
    """

    __slots__ = ("_context", "_open", "_tracing", "recording", "span")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self.span = span
        self.recording = span.is_recording()
        self._context: Context = tracing.in_context(span)
        self._open: list[Span] = []

    def headers(self, base: Mapping[str, str]) -> CIMultiDict[str]:
        """``base`` carrying the request span itself (a passthrough: one span, one leg)."""
        return Leg(self._tracing, self.span).headers(base)

    def phase(self, name: str) -> Span:
        """An internal child span (placement, relay), ended by ``done`` or by ``end``."""
        if not self.recording:
            return self._tracing.nothing
        span = self._tracing.tracer.start_span(name, context=self._context)
        self._open.append(span)
        return span

    def done(self, span: Span, attributes: Mapping[str, Any] | None = None) -> None:
        if attributes and span.is_recording():
            span.set_attributes(_present(attributes))
        span.end()
        with contextlib.suppress(ValueError):
            self._open.remove(span)

    def leg(self, name: str, url: str, attributes: Mapping[str, Any] | None = None) -> Leg:
        """A client span for one call to an engine at ``url`` (``scheme://host:port[/path]``)."""
        if not self.recording:
            return Leg(self._tracing, self._tracing.nothing, carried=self.span)
        span = self._tracing.tracer.start_span(
            name, context=self._context, kind=self._tracing.kinds.CLIENT
        )
        if span.is_recording():
            address = URL(url)
            span.set_attributes(
                _present(
                    {
                        "http.request.method": "POST",
                        "server.address": address.host,
                        "server.port": address.port,
                        "url.path": address.path if address.path != "/" else None,
                        **(attributes or {}),
                    }
                )
            )
        return Leg(self._tracing, span)

    def placed(self, span: Span, placement: Placed) -> None:
        """End the placement span with the decision."""
        if span.is_recording():
            remote = placement.endpoint is not None
            span.set_attributes(
                _present(
                    {
                        "pd_sidecar.decision": "remote" if remote else "local",
                        "pd_sidecar.reason": placement.decision.reason,
                        "pd_sidecar.prefill.endpoint": str(placement.endpoint) if remote else None,
                        "pd_sidecar.decode_rank": placement.rank.index,
                    }
                )
            )
        self.done(span)

    def end(self, record: RequestRecord) -> None:
        """End the request span with what its record says (and any phase still open: the
        request ended inside it). ERROR: a 5xx, a stream broken after its 200, an internal
        error; a 4xx is the client's (OpenTelemetry's HTTP server convention)."""
        status = record.status
        failed = record.state == State.FAILED and not (status is not None and 400 <= status < 500)
        attributes: dict[str, Any] = {}
        if self.span.is_recording():
            attributes = {
                "pd_sidecar.engine_request_id": record.engine_id,
                "pd_sidecar.decision": record.decision and str(record.decision),
                "pd_sidecar.reason": record.reason,
                "pd_sidecar.fallback_reason": record.fallback_reason,
                "pd_sidecar.prefill.endpoint": record.prefill_endpoint,
                "pd_sidecar.prefill.attempts": record.prefill_attempts or None,
                "pd_sidecar.decode_rank": record.decode_rank,
            }
        self.finish(status, str(record.state), record.error if failed else None, attributes)

    def finish(
        self,
        status: int | None,
        state: str,
        error: str | None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """End the request span: ``state`` completed, failed or cancelled; ``error`` marks it
        ERROR."""
        for span in self._open:
            span.end()
        self._open.clear()
        fields = {"http.response.status_code": status, "pd_sidecar.state": state}
        _end(self._tracing, self.span, {**fields, **(attributes or {})}, error)


class Leg:
    """The client span of one engine call, and the headers that carry it."""

    __slots__ = ("_carried", "_tracing", "span")

    def __init__(self, tracing: Tracing, span: Span, *, carried: Span | None = None) -> None:
        """``carried``: the span whose context the leg's headers carry (None: ``span``)."""
        self._tracing = tracing
        self.span = span
        self._carried = span if carried is None else carried

    def headers(self, base: Mapping[str, str]) -> CIMultiDict[str]:
        """``base`` with this leg's ``traceparent`` (and ``tracestate``) instead of any other."""
        headers = CIMultiDict(base)
        carried = self._carried
        if not carried.get_span_context().is_valid:  # OTEL_SDK_DISABLED: the client's, then
            return headers
        headers.popall(TRACEPARENT, None)
        headers.popall(TRACESTATE, None)
        self._tracing.propagator.inject(headers, context=self._tracing.in_context(carried))
        return headers

    def responded(self, status: int) -> None:
        """The engine's status line is in."""
        self.span.set_attribute("http.response.status_code", status)

    def ended_by(self, exc: BaseException, attributes: Mapping[str, Any] | None = None) -> None:
        """The call raised: ``cancelled`` (the client left, or the other leg failed), else
        ``error`` with the exception's message."""
        if isinstance(exc, asyncio.CancelledError):
            self.end("cancelled", attributes=attributes)
            return
        message = getattr(exc, "message", None) or repr(exc)
        self.end("error", error=str(message), attributes=attributes)

    def end(
        self,
        outcome: str,
        *,
        status: int | None = None,
        error: str | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """``error``: why the call failed, which marks the span ERROR."""
        fields = {"pd_sidecar.outcome": outcome, "http.response.status_code": status}
        _end(self._tracing, self.span, {**fields, **(attributes or {})}, error)


class NoTracing(Tracing):
    """Tracing off (``NO_TRACING``): every request's trace is ``NO_TRACE``; nothing to close.
    (Each method takes ``Tracing``'s arguments, against which the callers' types are checked.)"""

    enabled = False

    def __init__(self) -> None:
        """Nothing to hold: no provider, and ``opentelemetry`` is never imported."""
        self.description = "off"

    def request(self, *args: object, **kwargs: object) -> RequestTrace:
        return NO_TRACE

    async def close(self, *args: object, **kwargs: object) -> None:
        pass


class NoTrace(RequestTrace):
    """A request's trace when tracing is off (``NO_TRACE``): every method does nothing, its
    legs are ``NO_LEG``, and headers go out as they came. (Each takes ``RequestTrace``'s
    arguments, against which the callers' types are checked.)"""

    __slots__ = ()

    def __init__(self) -> None:
        """Nothing to hold: no span, no provider."""

    def headers(self, base: Mapping[str, str]) -> CIMultiDict[str]:
        return NO_LEG.headers(base)

    def phase(self, *args: object, **kwargs: object) -> Span:
        return _NO_SPAN

    def leg(self, *args: object, **kwargs: object) -> Leg:
        return NO_LEG

    def done(self, *args: object, **kwargs: object) -> None:
        pass

    def placed(self, *args: object, **kwargs: object) -> None:
        pass

    def end(self, *args: object, **kwargs: object) -> None:
        pass

    def finish(self, *args: object, **kwargs: object) -> None:
        pass


class NoLeg(Leg):
    """An engine call's span when tracing is off (``NO_LEG``): nothing recorded, the headers
    as they came."""

    __slots__ = ()

    def __init__(self) -> None:
        """Nothing to hold."""

    def headers(self, base: Mapping[str, str]) -> CIMultiDict[str]:
        return base if isinstance(base, CIMultiDict) else CIMultiDict(base)

    def responded(self, *args: object, **kwargs: object) -> None:
        pass

    def ended_by(self, *args: object, **kwargs: object) -> None:
        pass

    def end(self, *args: object, **kwargs: object) -> None:
        pass


NO_LEG = NoLeg()
NO_TRACE = NoTrace()
NO_TRACING = NoTracing()
_NO_SPAN = cast("Span", None)
"""What ``NoTrace.phase`` returns: only ``NoTrace`` ever sees it."""


def _end(tracing: Tracing, span: Span, attributes: Mapping[str, Any], error: str | None) -> None:
    """End ``span`` with its ``attributes`` (those not None); ``error`` marks it ERROR."""
    if span.is_recording():
        span.set_attributes(_present(attributes))
        if error is not None:
            span.set_status(tracing.status(tracing.error, error))
    span.end()


def _present(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry refuses None values: those attributes are left out."""
    return {key: value for key, value in attributes.items() if value is not None}

"""A local OTLP/HTTP receiver for the tracing tests: an aiohttp app on a free port that accepts
``POST /v1/traces`` (protobuf ``ExportTraceServiceRequest``, as the SDK's OTLP/HTTP exporter sends
it), decodes the spans with ``opentelemetry-proto`` and keeps them for the test to read.

``traced()`` builds the sidecar's ``Tracing`` exporting there through the production path (the
OTLP/HTTP exporter behind a batch processor), with a short schedule delay instead of any sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from sidecar.observability.tracing import Tracing

SERVER, CLIENT, INTERNAL = "server", "client", "internal"
_KINDS = {1: INTERNAL, 2: SERVER, 3: CLIENT, 4: "producer", 5: "consumer"}
STATUS_ERROR = 2
"""``Status.STATUS_CODE_ERROR`` of the OTLP protobuf."""


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    kind: str
    attributes: Mapping[str, Any]
    error: str | None
    """The status message when the status is ERROR, else None."""
    resource: Mapping[str, Any]
    ended: bool

    @property
    def failed(self) -> bool:
        return self.error is not None


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    return getattr(value, which) if which is not None else None


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


class Receiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._arrived = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource_spans in message.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex() or None,
                            kind=_KINDS.get(span.kind, str(span.kind)),
                            attributes=_attributes(span.attributes),
                            error=span.status.message if span.status.code == STATUS_ERROR else None,
                            resource=resource,
                            ended=span.end_time_unix_nano > 0,
                        )
                    )
        self._arrived.set()
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    async def until(
        self, check: Callable[[list[ReceivedSpan]], bool], within: float = 5.0
    ) -> list[ReceivedSpan]:
        """Wait for exports until ``check(spans)`` holds; the spans then."""
        async with asyncio.timeout(within):
            while not check(self.spans):
                self._arrived.clear()
                await self._arrived.wait()
        return list(self.spans)

    async def trace_of(self, request_id: str, spans: int, within: float = 5.0) -> Trace:
        """The ``spans`` spans of the trace whose request span carries ``request_id``, once
        they all arrived (and no more: checked again after the batch they came in)."""

        def complete(received: list[ReceivedSpan]) -> bool:
            root = _root(received, request_id)
            return root is not None and len(_in(received, root.trace_id)) >= spans

        received = await self.until(complete, within)
        root = _root(received, request_id)
        assert root is not None
        found = Trace(root, _in(received, root.trace_id))
        assert len(found.spans) == spans, [s.name for s in found.spans]
        return found


def _root(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan | None:
    for span in spans:
        if span.kind == SERVER and span.attributes.get("pd_sidecar.request_id") == request_id:
            return span
    return None


def _in(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [span for span in spans if span.trace_id == trace_id]


@dataclass(frozen=True)
class Trace:
    """One request's spans as received: its server span and all the spans of its trace."""

    request: ReceivedSpan
    spans: list[ReceivedSpan]

    def named(self, name: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.name == name]

    def one(self, name: str) -> ReceivedSpan:
        [span] = self.named(name)
        return span


def traced(receiver: Receiver) -> Tracing:
    """The sidecar's tracing, exporting to ``receiver`` over OTLP/HTTP in batches every 20 ms."""
    exporter = OTLPSpanExporter(endpoint=receiver.url + "/v1/traces", timeout=5)
    return Tracing.with_exporter(exporter, schedule_delay_s=0.02)


def traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"

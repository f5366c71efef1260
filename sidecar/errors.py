"""The sidecar's error tree and its one renderer.

::

    SidecarError                      status, type name, message
    ├── ClientError                   the client's request is at fault (4xx)
    │   ├── BadRequest                400 BadRequestError
    │   ├── Forbidden                 403 PermissionDeniedError (prefill target not allowed)
    │   ├── NotFound                  404 NotFoundError
    │   ├── RequestTimeout            408 RequestTimeoutError (client too slow to send)
    │   ├── PayloadTooLarge           413 RequestEntityTooLargeError (body too big, too many values)
    │   └── UnsupportedMediaType      415 UnsupportedMediaTypeError (a compressed request body)
    ├── UnknownTransferCoding         501 NotImplementedError (a transfer coding other than chunked)
    ├── Busy                          503 ServiceUnavailableError (bodies in flight over budget)
    │   └── TooManyConnections        503 (over SIDECAR_MAX_CONNECTIONS)
    └── EngineError                   an engine failed us (5xx towards the client)
        ├── EngineUnreachable         connect error, reset, no answer -> 503
        │   ├── EngineNotConnected    no connection opened: nothing was sent (another rank may)
        │   │   ├── EngineRefused     connection refused: nothing listens there
        │   │   └── EngineUntrusted   its TLS certificate did not verify
        │   ├── DecodeDown            the decode engine is known down: nothing sent -> 503
        │   └── PrefillFailed         prefill failed and SIDECAR_PREFILL_FALLBACK=fail -> 503
        ├── EngineTimeout             no answer in time -> 504
        ├── EngineBadResponse         an answer we cannot use -> 502
        │   └── EngineAnswerTooLarge  an answer over the size the sidecar reads
        └── EngineStreamBroken        the answer broke after it started -> 502
            └── EngineStreamIdle      ... by staying silent for SIDECAR_STREAM_IDLE_TIMEOUT_S

Foreign exceptions (aiohttp, asyncio) become these in ``sidecar.engines.upstream`` only. Every body
the sidecar writes uses vLLM's own error shape, so a client sees one format whoever failed::

    {"error": {"message": str, "type": str, "param": null, "code": <HTTP status>}}

An error's ``message`` is for the operator: it names the engine (``host:port``) and what failed in
its own words. Before the first byte that is the client's answer too (the engine's address tells a
gateway which pod failed). Once a stream has started, the client reads the error's ``shown``
sentence and the request id instead, and the message goes to the log and the request's record.
"""

from __future__ import annotations

import orjson
from aiohttp import web

REQUEST_ID_HEADER = "x-request-id"


class SidecarError(Exception):
    status = 500
    type_name = "InternalServerError"
    shown: str | None = None
    """What a client whose answer already started is told (the module docstring); None: the
    message itself, which then holds no address and no foreign exception's words."""
    retry_after_s: int | None = None
    """Seconds for the answer's ``Retry-After`` header; None: no such header."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(SidecarError):
    status = 400
    type_name = "BadRequestError"


class BadRequest(ClientError):
    pass


class Forbidden(ClientError):
    status = 403
    type_name = "PermissionDeniedError"


class RequestTimeout(ClientError):
    status = 408
    type_name = "RequestTimeoutError"


class NotFound(ClientError):
    status = 404
    type_name = "NotFoundError"


class PayloadTooLarge(ClientError):
    status = 413
    type_name = "RequestEntityTooLargeError"


class UnsupportedMediaType(ClientError):
    status = 415
    type_name = "UnsupportedMediaTypeError"


class UnknownTransferCoding(SidecarError):
    """RFC 9112 §6.1: a request with a transfer coding the server does not understand is
    answered 501."""

    status = 501
    type_name = "NotImplementedError"


class Busy(SidecarError):
    """The sidecar itself is at a limit (the bytes of request bodies in flight, its client
    connections): nothing was sent to an engine, and another sidecar may take the request."""

    status = 503
    type_name = "ServiceUnavailableError"


class TooManyConnections(Busy):
    """The sidecar holds as many client connections as it may (``sidecar.server.listener``)."""


class EngineError(SidecarError):
    status = 502
    type_name = "BadGatewayError"


class EngineUnreachable(EngineError):
    status = 503
    type_name = "ServiceUnavailableError"


class EngineNotConnected(EngineUnreachable):
    """No connection could be opened (refused, unresolved, connect timeout): the engine got
    nothing of the request, so another engine may take it."""


class EngineConnectTimeout(EngineNotConnected):
    """The connection was not opened within ``SIDECAR_CONNECT_TIMEOUT_S``: the engine may be up
    but slow to accept (its listen queue full, a lost SYN), and nothing was sent, so trying
    again is safe."""


class EngineRefused(EngineNotConnected):
    """The connection was refused: nothing listens at that address (the engine is not running,
    or not yet)."""


class EngineUntrusted(EngineNotConnected):
    """The engine's TLS certificate did not verify (unknown CA, wrong name, expired): the
    handshake was abandoned before anything was sent."""


class DecodeDown(EngineUnreachable):
    """The local decode engine is known down (its ``/health`` polls, ``/ready`` 503): no leg was
    sent, not even the prefill, whose staged KV no decode could take. ``retry_after_s``: when the
    next polls could find it back."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PrefillFailed(EngineUnreachable):
    pass


class EngineTimeout(EngineError):
    status = 504
    type_name = "GatewayTimeoutError"


class EngineBadResponse(EngineError):
    pass


class EngineAnswerTooLarge(EngineBadResponse):
    """An answer longer than the caller would read (its ``Content-Length``, or what arrived):
    dropped unread, its connection closed."""


class EngineStreamBroken(EngineError):
    shown = "the engine's answer broke off before its end"


class EngineStreamIdle(EngineStreamBroken):
    """The engine sent nothing for ``SIDECAR_STREAM_IDLE_TIMEOUT_S``."""

    shown = "the engine sent nothing within the stream's idle timeout"


def error_body(status: int, type_name: str, message: str) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_name, "param": None, "code": status}}
    )


_CLIENT_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}
"""Type names by status, as the OpenAI API (and its SDKs' exception classes) names them."""
SHOWN_BYTES = 200
"""How much of a foreign answer an error message quotes."""


def is_error_body(raw: bytes) -> bool:
    """The engine's own error shape: a JSON object whose ``error`` object holds a ``message``."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    error = answer.get("error") if isinstance(answer, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def foreign_refusal(who: str, status: int, raw: bytes) -> bytes:
    """An engine-shaped body for a 4xx whose own body is not one (an empty 404 from whatever
    answered at that address, say), quoting the start of what came."""
    shown = raw[:SHOWN_BYTES].decode("utf-8", "replace")
    message = f"{who} answered {status}: {shown}" if shown else f"{who} answered {status}"
    return error_body(status, _CLIENT_ERROR_TYPES.get(status, "BadRequestError"), message)


def error_response(error: SidecarError, request_id: str | None) -> web.Response:
    """The one place an error answer is written before any byte reached the client."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return web.Response(
        status=error.status,
        body=error_body(error.status, error.type_name, error.message),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(error: SidecarError, request_id: str | None) -> bytes:
    """The event that ends a stream that already answered 200: no ``[DONE]`` follows it. It
    says what happened in words that do not change with the engine or the library (the module
    docstring), and which request it was, for the log and ``/debug/requests``."""
    shown = error.shown or error.message
    if request_id:
        shown = f"{shown} (request id {request_id})"
    return b"data: " + error_body(error.status, error.type_name, shown) + b"\n\n"

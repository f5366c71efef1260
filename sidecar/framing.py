"""Request bodies are taken as the bytes they are: no content coding, no transfer coding but
``chunked`` (docs/behavior.md, "Bad input").

The engines' servers (uvicorn, for vLLM and SGLang) decode neither a compressed request body nor
a transfer coding other than ``chunked``, so a body the sidecar inflated would be one no engine
would have read; and a body inflated while its declared length went on to the engine lets the
engine frame the next request on a pooled connection from the wrong byte. So the listener never
inflates (``sidecar.server.listener``), and a request that declares a content coding other than
``identity`` is refused with 415 (``Accept-Encoding: identity``), one with a transfer coding
other than ``chunked`` with 501 (RFC 9112 §6.1) and its connection closed. No framing header of
the client's reaches an engine: each leg is framed from the bytes the sidecar sends
(``sidecar.headers``).
"""

from __future__ import annotations

from collections.abc import Awaitable

from aiohttp import hdrs, web

from sidecar.errors import UnknownTransferCoding, UnsupportedMediaType, error_response
from sidecar.headers import request_id_from
from sidecar.paths import Handler


def _codings(request: web.BaseRequest, name: str) -> list[str]:
    """The codings a header lists, lower case, across its repeats; empty members dropped."""
    return [
        coding.strip(" \t").lower()
        for value in request.headers.getall(name, ())
        for coding in value.split(",")
        if coding.strip(" \t")
    ]


@web.middleware
def identity_bodies(request: web.Request, handler: Handler) -> Awaitable[web.StreamResponse]:
    """Refuse a request whose body is coded (the module docstring); others go on.

    A plain function, not a coroutine, as ``sidecar.paths.canonical_paths``: a request with
    neither header costs two look-ups."""
    headers = request.headers
    if hdrs.CONTENT_ENCODING not in headers and hdrs.TRANSFER_ENCODING not in headers:
        return handler(request)
    transfer = _codings(request, hdrs.TRANSFER_ENCODING)
    if transfer and transfer != ["chunked"]:
        return _refused(
            request,
            UnknownTransferCoding(
                f"Transfer-Encoding {', '.join(transfer)} is not supported: "
                "send the body with chunked or a Content-Length"
            ),
        )
    content = _codings(request, hdrs.CONTENT_ENCODING)
    if any(coding != "identity" for coding in content):
        return _refused(
            request,
            UnsupportedMediaType(
                f"Content-Encoding {', '.join(content)} is not supported: "
                "send the request body uncompressed"
            ),
        )
    return handler(request)


async def _refused(
    request: web.Request, error: UnknownTransferCoding | UnsupportedMediaType
) -> web.StreamResponse:
    response = error_response(error, request_id_from(request.headers))
    if isinstance(error, UnsupportedMediaType):
        response.headers[hdrs.ACCEPT_ENCODING] = "identity"
    else:
        response.force_close()  # the body's end is the client's framing's, not ours
    return response

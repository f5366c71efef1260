"""Which headers cross the sidecar, in each direction."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.endpoints import Endpoint, parse_endpoint
from sidecar.errors import REQUEST_ID_HEADER, BadRequest

MAX_REQUEST_ID = 128
_PRINTABLE = re.compile(r"[\x20-\x7e]+")

PREFILLER_HOST_PORT = "x-prefiller-host-port"
GATEWAY_PREFILL_ENDPOINTS = "x-gateway-prefill-endpoints"
PREFILLER_URL = "x-prefiller-url"
PREFILL_HEADERS = (PREFILLER_HOST_PORT, GATEWAY_PREFILL_ENDPOINTS)
"""Where a gateway names the prefill server, in order of precedence (protocol.md §2)."""

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
"""RFC 9110 §7.6.1 connection-specific headers: never forwarded by a proxy."""

_NEVER_TO_ENGINE = HOP_BY_HOP | {
    "host",
    "content-length",
    PREFILLER_HOST_PORT,
    GATEWAY_PREFILL_ENDPOINTS,
    PREFILLER_URL,
}
# The pipeline reads the prefill answer itself and may rewrite the decode answer's usage: it asks
# for identity encoding on those legs (loopback traffic gains nothing from compression).
_NEVER_TO_ENGINE_LEG = _NEVER_TO_ENGINE | {"accept-encoding", "content-type", REQUEST_ID_HEADER}


def _without(headers: CIMultiDictProxy[str], dropped: frozenset[str]) -> CIMultiDict[str]:
    named = _connection_tokens(headers.getall("connection", ()))
    return CIMultiDict(
        (name, value)
        for name, value in headers.items()
        if name.lower() not in dropped and name.lower() not in named
    )


def _connection_tokens(values: Iterable[str]) -> frozenset[str]:
    """Headers named by ``Connection`` are hop-by-hop too."""
    return frozenset(token.strip().lower() for value in values for token in value.split(","))


def engine_leg_headers(client: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    """Headers for a prefill or decode leg: the client's end-to-end ones, our request id, JSON."""
    headers = _without(client, _NEVER_TO_ENGINE_LEG)
    headers[REQUEST_ID_HEADER] = request_id
    headers["content-type"] = "application/json"
    return headers


def passthrough_headers(client: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Headers for a request relayed unchanged to the decode engine."""
    return _without(client, frozenset(_NEVER_TO_ENGINE - {"content-length"}))


def client_response_headers(engine: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Engine answer headers a client may see (the relay sets framing itself)."""
    return _without(engine, HOP_BY_HOP | {"content-length"})


def gateway_prefill_target(client: CIMultiDictProxy[str]) -> Endpoint | None:
    """The prefill server a gateway named, or None when it named none.

    The first header present wins; a comma list or a repeated header yields its first entry.
    Raises ``BadRequest`` when the header is there but its first entry is not ``host:port``.
    """
    for name in PREFILL_HEADERS:
        values = client.getall(name, ())
        if values:
            first = ",".join(values).split(",", 1)[0]
            try:
                return parse_endpoint(first)
            except ValueError as exc:
                raise BadRequest(f"invalid {name} header: {exc}") from None
    return None


def request_id_from(client: CIMultiDictProxy[str]) -> str:
    """The client's ``x-request-id`` when it is 1–128 printable ASCII characters, else a new one."""
    value = client.get(REQUEST_ID_HEADER)
    if value is not None and 0 < len(value) <= MAX_REQUEST_ID and _PRINTABLE.fullmatch(value):
        return value
    return uuid.uuid4().hex

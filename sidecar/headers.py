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
DEFAULT_PREFILL_HEADERS = (PREFILLER_HOST_PORT, GATEWAY_PREFILL_ENDPOINTS)
"""Where a gateway names the prefill server by default, in order of precedence (protocol.md
§2). Other names are opt-in (``SIDECAR_PREFILL_HEADERS``)."""

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

# The pipeline reads the prefill answer itself and may rewrite the decode answer's usage: it asks
# for identity encoding on those legs (loopback traffic gains nothing from compression).
_NOT_ON_ENGINE_LEGS = frozenset({"accept-encoding", "content-type", REQUEST_ID_HEADER})


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


class GatewayHeaders:
    """The headers a gateway names the prefill server in, and what never reaches an engine.

    ``names`` are read in order, the first present wins. Every one of them, the default names
    and the legacy ``x-prefiller-url`` are stripped from every request to an engine, so a
    client cannot pass a prefill target through the sidecar to anything behind it.
    """

    def __init__(self, names: Iterable[str] = DEFAULT_PREFILL_HEADERS) -> None:
        self.names = tuple(names)
        """Lowercase (Settings normalizes them)."""
        prefill = {*self.names, *DEFAULT_PREFILL_HEADERS, PREFILLER_URL}
        self._passthrough_dropped = HOP_BY_HOP | {"host"} | prefill
        self._leg_dropped = self._passthrough_dropped | {"content-length"} | _NOT_ON_ENGINE_LEGS

    def prefill_target(self, client: CIMultiDictProxy[str]) -> Endpoint | None:
        """The prefill server a gateway named, or None when it named none.

        A comma list or a repeated header yields its first entry. Raises ``BadRequest`` when the
        header is there but its first entry is not ``host:port``.
        """
        for name in self.names:
            values = client.getall(name, ())
            if values:
                first = ",".join(values).split(",", 1)[0]
                try:
                    return parse_endpoint(first)
                except ValueError as exc:
                    raise BadRequest(f"invalid {name} header: {exc}") from None
        return None

    def engine_leg(self, client: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
        """Headers for a prefill or decode leg: the client's end-to-end ones, our request id,
        JSON."""
        headers = _without(client, self._leg_dropped)
        headers[REQUEST_ID_HEADER] = request_id
        headers["content-type"] = "application/json"
        return headers

    def passthrough(self, client: CIMultiDictProxy[str]) -> CIMultiDict[str]:
        """Headers for a request relayed unchanged to the decode engine."""
        return _without(client, self._passthrough_dropped)


def client_response_headers(engine: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Engine answer headers a client may see (the relay sets framing itself)."""
    return _without(engine, HOP_BY_HOP | {"content-length"})


def request_id_from(client: CIMultiDictProxy[str]) -> str:
    """The client's ``x-request-id`` when it is 1–128 printable ASCII characters, else a new one."""
    value = client.get(REQUEST_ID_HEADER)
    if value is not None and 0 < len(value) <= MAX_REQUEST_ID and _PRINTABLE.fullmatch(value):
        return value
    return uuid.uuid4().hex

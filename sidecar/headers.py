"""Which headers cross the sidecar, in each direction."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.caches import BoundedCache
from sidecar.defaults import PREFILL_HEADERS
from sidecar.errors import REQUEST_ID_HEADER, BadRequest
from sidecar.fleet.endpoints import Endpoint, parse_endpoint

MAX_REQUEST_ID = 128
PARSED_TARGETS_KEPT = 256
"""Prefill-header values whose parse is remembered (gateways name a handful of prefill pods;
beyond this many distinct values the oldest is forgotten)."""
_PRINTABLE = re.compile(r"[\x20-\x7e]+")

PREFILLER_URL = "x-prefiller-url"

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

FRAMING = frozenset({"content-length", "content-encoding", "expect"})
"""The client's framing of its body: each engine leg is framed from the bytes the sidecar sends
it (``sidecar.framing``); ``Expect: 100-continue`` was the sidecar's to answer."""

# The pipeline reads the prefill answer itself and may rewrite the decode answer's usage: it asks
# for identity encoding on those legs (loopback traffic gains nothing from compression).
_NOT_ON_ENGINE_LEGS = frozenset({"accept-encoding", "content-type", REQUEST_ID_HEADER})


def _without(headers: CIMultiDictProxy[str], dropped: frozenset[str]) -> CIMultiDict[str]:
    connection = headers.getall("connection", ())
    if connection:
        dropped = dropped | _connection_tokens(connection)
    return CIMultiDict(
        [(name, value) for name, value in headers.items() if name.lower() not in dropped]
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

    def __init__(
        self, names: Iterable[str] = PREFILL_HEADERS, *, sample: random.Random | None = None
    ) -> None:
        self.names = tuple(names)
        """Lowercase (Settings normalizes them)."""
        self._sample = sample
        """Where a header names several servers: one at random from this source
        (``SIDECAR_PREFILL_HEADER_SAMPLING``), or None for the first."""
        prefill = {*self.names, *PREFILL_HEADERS, PREFILLER_URL}
        self._passthrough_dropped = HOP_BY_HOP | FRAMING | {"host"} | prefill
        self._leg_dropped = self._passthrough_dropped | _NOT_ON_ENGINE_LEGS
        self._parsed: BoundedCache[str, Endpoint | str] = BoundedCache(PARSED_TARGETS_KEPT)
        """Header value → its endpoint, or why it is invalid (bounded: ``_parse``)."""

    def prefill_target(self, client: CIMultiDictProxy[str]) -> Endpoint | None:
        """The prefill server a gateway named, or None when it named none.

        A comma list or a repeated header yields its first entry, or with ``sample`` one entry
        at random. Raises ``BadRequest`` when the header is there but that entry is not
        ``host:port``.
        """
        for name in self.names:
            values = client.getall(name, ())
            if values:
                if self._sample is None:
                    entry = values[0].split(",", 1)[0]
                else:
                    entries = [e for value in values for e in value.split(",") if e.strip()]
                    entry = self._sample.choice(entries) if entries else ""
                parsed = self._parse(entry)
                if isinstance(parsed, str):
                    raise BadRequest(f"invalid {name} header: {parsed}")
                return parsed
        return None

    def _parse(self, value: str) -> Endpoint | str:
        """``parse_endpoint`` of a header's first entry, or why it is invalid; remembered, since
        every request repeats one of a few values."""
        parsed = self._parsed.get(value)
        if parsed is None:
            try:
                parsed = parse_endpoint(value)
            except ValueError as exc:
                parsed = str(exc)
            self._parsed.put(value, parsed)
        return parsed

    def engine_leg(self, client: CIMultiDictProxy[str], engine_id: str) -> CIMultiDict[str]:
        """Headers for a prefill or decode leg: the client's end-to-end ones, the request's
        engine id (``engine_request_id``) as ``x-request-id``, JSON."""
        headers = _without(client, self._leg_dropped)
        headers[REQUEST_ID_HEADER] = engine_id
        headers["content-type"] = "application/json"
        return headers

    def passthrough(self, client: CIMultiDictProxy[str]) -> CIMultiDict[str]:
        """Headers for a request relayed to the decode engine: the client's, less what frames
        its body (the sidecar frames the bytes it sends)."""
        return _without(client, self._passthrough_dropped)


def client_response_headers(engine: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Engine answer headers a client may see (the relay sets framing itself)."""
    return _without(engine, HOP_BY_HOP | {"content-length"})


def engine_request_id(request_id: str) -> str:
    """The id the engines get for one generation request: the client's id, a dash and 16 random
    hex digits (64 bits from ``os.urandom``).

    Engines key a request's KV by its id (vLLM's NIXL push mode matches a decode's registration
    to the prefill staged under the same id; vLLM before its internal random suffix refused a
    second request under an id still running), so requests that share a client's
    ``x-request-id`` must not share it on the engine legs. It begins with the client's id: a
    search of the engines' logs for that id still finds it (docs/protocol.md)."""
    return f"{request_id}-{os.urandom(8).hex()}"


def request_id_from(client: CIMultiDictProxy[str]) -> str:
    """The client's ``x-request-id`` when it is 1–128 printable ASCII characters, else a new one:
    32 random hex digits (128 bits from ``os.urandom``, as many as a ``uuid4``'s 122 and
    without building a ``UUID``)."""
    value = client.get(REQUEST_ID_HEADER)
    if value is not None and 0 < len(value) <= MAX_REQUEST_ID and _PRINTABLE.fullmatch(value):
        return value
    return os.urandom(16).hex()

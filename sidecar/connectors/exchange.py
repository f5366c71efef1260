"""What a connector is given for one request, and the outcomes its parts return.

The pipeline builds an ``Exchange`` (the client's request, where it prefills, the deadlines) and
hands it to ``connector.run``; the connector's parts report their progress through ``Progress``
(which only the pipeline implements, so only the pipeline writes the lifecycle record) and return
outcomes, never aiohttp objects:

- a prefill call ends ``Prefilled`` (KV staged, its instructions), ``Refused`` (the engine's own
  4xx, for the client) or ``sidecar.connectors.prefill.Failed`` (another attempt, or the fallback);
- ``connector.run`` ends with an ``Answer`` to relay (the decode engine's status line is in and
  its first body byte too) or a ``Refused`` to send as is; or it raises a ``SidecarError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from multidict import CIMultiDict

from sidecar.body import NO_MEMBERS, Members, Wire, encode
from sidecar.engines.upstream import EngineAnswer
from sidecar.errors import REQUEST_ID_HEADER
from sidecar.fleet.endpoints import Endpoint
from sidecar.observability.metrics import ROUTES
from sidecar.observability.tracing import NO_TRACE, RequestTrace
from sidecar.scheduling.exact import PromptLookup
from sidecar.scheduling.placement import Placement

Body = dict[str, Any]


class Progress(Protocol):
    """Milestones of one request, as the connector's parts reach them."""

    def prefill_sent(self, placement: Placement, attempt: int) -> None:
        """Attempt number ``attempt`` went to ``placement``'s endpoint (a retry's placement
        after the first)."""
        ...

    def prefill_ended(self) -> None: ...

    def fell_back(self, reason: str, *, local: bool) -> None:
        """The prefill finally failed (``reason``: the fallbacks metric's label); ``local``:
        the request decodes locally, else it fails."""
        ...

    def decode_sent(self) -> None: ...

    def first_byte(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Exchange:
    """One generation request as the connector sees it."""

    request_id: str
    """The client's id (``x-request-id``, or the one the sidecar made): its answer, logs, record
    and task names carry it."""
    path: str
    body: Body
    """The client's body, parsed and sanitized; never mutated."""
    raw: bytes | None
    """The client's bytes when they equal ``body`` (nothing was removed): sent as they are on
    an unchanged leg, no re-serialization."""
    headers: CIMultiDict[str]
    """Headers for every engine leg, ``x-request-id`` the request's engine id."""
    placement: Placement
    deadline: float | None
    """Loop time by which the whole request must be done (None: no limit)."""
    progress: Progress
    trace: RequestTrace = NO_TRACE
    """The request's spans (``NO_TRACE``: tracing is off); each leg's span comes from it."""
    members: Members = field(default_factory=lambda: NO_MEMBERS)
    """A large body's big members (``sidecar.body.Parsed.members``): ``encode`` sends them
    from their own buffers."""
    exact: PromptLookup | None = None
    """The placement's look-ups in the engines' exact indexes (SIDECAR_KV_EVENTS), which a
    retry of the prefill repeats (``Scheduler.place_request``); None without them. Kept here
    rather than with the placement: the exchange ends once the decode answer has started,
    the placement lives as long as the stream, and the look-ups hold the prompt's token ids."""

    def encode(self, leg: Body) -> Wire:
        """A leg's body (``body`` or one built from it) as it goes to an engine."""
        return encode(leg, self.members)

    @property
    def route(self) -> str:
        """``completions`` or ``chat_completions``."""
        return ROUTES[self.path]

    @property
    def engine_id(self) -> str:
        """The id the engines see (``sidecar.headers.engine_request_id``): unique per request,
        beginning with the client's."""
        return self.headers[REQUEST_ID_HEADER]


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prefill that staged KV on ``endpoint``; ``kv_params`` tell the decode engine where."""

    endpoint: Endpoint
    kv_params: Body
    cached_tokens: int | None
    """The prefill engine's ``usage.prompt_tokens_details.cached_tokens`` (None: not said)."""
    prompt_tokens: int | None = None
    """Its ``usage.prompt_tokens``."""


@dataclass(frozen=True, slots=True)
class Refused:
    """An engine's own client-error answer, passed to the client as it is."""

    status: int
    body: bytes
    content_type: str
    error: str
    """For the record: who refused, e.g. "prefill answered 404"."""


class Patch(Protocol):
    """A rewrite of JSON objects in the decode answer (a JSON body, or SSE events' data).

    ``marker`` must occur in the raw bytes of any object ``apply`` changes: objects without it
    are relayed untouched, unparsed.
    """

    @property
    def marker(self) -> bytes: ...

    def apply(self, answer: Any) -> bool:
        """Change ``answer`` in place; return whether anything changed."""
        ...


@dataclass(slots=True)
class Answer:
    """The decode engine's answer, started: status and headers in, the first body chunk read.

    Not frozen: the relay takes ``first`` out (``take_first``) as it writes it, so that a
    stream does not hold its first chunk for its whole life (memory per open stream,
    bench/stream_memory.py)."""

    upstream: EngineAnswer
    first: bytes
    patch: Patch | None = None

    def take_first(self) -> bytes:
        """``first``, which this answer then no longer holds (``b""`` once taken)."""
        first, self.first = self.first, b""
        return first

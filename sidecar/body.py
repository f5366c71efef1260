"""A generation request's body: read under a byte budget and an element limit, and parsed so that a
large one is held as JSON text rather than as Python objects.

What a body costs, measured (docs/benchmarks.md, ``bench/bodies.py``): parsed, a 31 MB chat of
900,000 small messages is 275 MB of Python objects and half a second of the event loop; a 31 MB
body of a few base64 images is 31 MB of strings, but each re-serialization of it is another
31 MB and tens of milliseconds. Three bounds follow:

- **a byte budget** across requests (``SIDECAR_BODY_BUDGET_BYTES``): a body is counted from its
  first byte (its whole ``Content-Length`` at once, when declared; the bytes read, if ever
  more) until the connector has the decode engine's answer — when no leg will be built from it
  again — and a body that does not fit is refused at once with 503, for the gateway to retry
  elsewhere;
- **an element limit** (``SIDECAR_MAX_BODY_ELEMENTS``): once the bytes read pass the limit, the
  JSON values of the body are counted chunk by chunk as they arrive (``ElementCount``), and the
  body is refused with 413 as soon as they exceed it, before anything is parsed;
- **one large parse at a time**: a body of ``LARGE_BODY_BYTES`` or more is parsed while no other
  large one is, with a turn of the event loop between the parse and the encoding that follows,
  and its big members (``messages``, tools, images...) are kept as their JSON text
  (``orjson.Fragment``): every leg is then written by copying bytes, and the parsed objects are
  freed before the next large body is parsed. Its strings of ``LONG_STRING_BYTES`` or more
  (base64 images) are not parsed at all (``set_aside``): their bytes are replaced by placeholders
  before the parse and put back, as the client sent them, in the members' JSON text.

A member kept as a fragment is the output of ``orjson.dumps`` of a parsed value, with string
tokens spliced back where their placeholders were: one complete JSON value either way (a string
token runs from a quote to the next unescaped one, and holds none), so it cannot add a top-level
field. The top level stays a dict, every field once (the last of duplicates, as orjson and the
engines read them), and the connectors remove the fields a client must not set from that dict.
The contents of a string set aside (UTF-8, escapes, control characters) are checked by the
engine, not here: a conforming parser ends the string where ``set_aside`` does.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import orjson
from aiohttp import web

from sidecar.errors import BadRequest, Busy, PayloadTooLarge, RequestTimeout
from sidecar.observability.metrics import Metrics

LARGE_BODY_BYTES = 1 << 20
"""From this size on, a body is parsed alone and its big members are kept as JSON text."""
ENCODED_MEMBER_CHARS = 1 << 16
"""A top-level string this long (e.g. ``prompt_embeds``) is kept as JSON text too."""
READ_BY_VALUE = frozenset({"prompt"})
"""Members the connectors and the scheduler read as values: never kept as JSON text."""
LONG_STRING_BYTES = 1 << 16
"""A string this long (quotes included) in a large body is set aside, not parsed."""
MAX_QUOTES_SCANNED = 8192
"""A large body with more quotes than this is parsed whole: looking for its long strings would
cost a step of Python per string."""
_BACKSLASH = 0x5C


class BodyBudget:
    """The bytes of request bodies held at once, across requests (``hold`` one request's)."""

    __slots__ = ("_metrics", "capacity", "used")

    def __init__(self, capacity: int, metrics: Metrics) -> None:
        self.capacity = capacity
        self.used = 0
        self._metrics = metrics
        # Read when /metrics is rendered, not set on every take and give.
        metrics.body_bytes.set_function(lambda: self.used)

    def hold(self) -> Held:
        return Held(self)

    def _take(self, size: int) -> bool:
        if self.used + size > self.capacity:
            return False
        self.used += size
        return True

    def _give(self, size: int) -> None:
        self.used -= size


class Held:
    """One request's share of the budget; returned when the ``with`` block ends, however it
    ends, or earlier by ``release()`` (idempotent)."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    def grow(self, size: int) -> None:
        """Hold ``size`` bytes more; ``Busy`` (503) when the budget cannot give them."""
        if not self._budget._take(size):
            budget = self._budget
            budget._metrics.bodies_refused.labels("budget").inc()
            raise Busy(
                f"request bodies in flight would exceed {budget.capacity} bytes "
                "(SIDECAR_BODY_BUDGET_BYTES): try again"
            )
        self.size += size

    def release(self) -> None:
        if self.size:
            self._budget._give(self.size)
            self.size = 0

    def __enter__(self) -> Held:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class ElementCount:
    """Counts the JSON values of a document fed in chunks of any size: the commas and opening
    brackets outside strings, plus one — one per array item and object member, at any depth
    (an empty array or object counts as one more).

    Each chunk costs a few passes of C code (``bytes.count``, ``replace``, ``split``), none per
    value. Escapes are dropped before strings are told apart (``\\\\`` pairs first, then ``\\"``);
    a run of backslashes at a chunk's end waits for the next chunk. Up to the first byte that is
    not JSON the count is exact, and orjson builds nothing beyond that byte: a count thrown off
    by invalid input belongs to a body that is then refused as invalid.
    """

    __slots__ = ("_carry", "_inside", "total")

    def __init__(self) -> None:
        self.total = 1
        self._inside = False
        self._carry = b""

    def feed(self, chunk: bytes | bytearray) -> int:
        """Count ``chunk``; returns the total so far."""
        data = bytes(chunk)
        if self._carry:
            data, self._carry = self._carry + data, b""
        if b"\\" in data:
            if data.endswith(b"\\"):
                kept = data.rstrip(b"\\")
                data, self._carry = kept, data[len(kept) :]
            data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        if b'"' in data:
            parts = data.split(b'"')
            data = b"".join(parts[1::2] if self._inside else parts[0::2])
            if len(parts) % 2 == 0:
                self._inside = not self._inside
        elif self._inside:
            return self.total
        self.total += data.count(b",") + data.count(b"{") + data.count(b"[")
        return self.total


@dataclass(frozen=True, slots=True)
class Parsed:
    body: dict[str, Any]
    """The top-level object; a large body's big members are ``orjson.Fragment``s."""
    raw: bytes | None
    """The client's bytes of a small body (sent on as they are when nothing is removed);
    None for a large one, whose bytes are dropped once parsed."""
    messages: bytes | None
    """The JSON text of ``messages`` when it is kept as a fragment (the scheduler's prompt
    text, the same bytes)."""
    members: Members
    """The JSON text of each fragment of ``MEMBER_PIECE_BYTES`` or more (``encode``)."""


Members = Mapping[int, bytes]
"""A large body's big members: ``id()`` of the ``orjson.Fragment`` in the body → its JSON text.
The body holds the fragments for as long as its legs are built, so an id names one of them."""
NO_MEMBERS: Members = MappingProxyType({})
MEMBER_PIECE_BYTES = 1 << 16
"""A member whose JSON text is this long is written to the engines from its own buffer
(``encode``), never copied into a leg's bytes."""
CHUNK_BYTES = 1 << 16
"""``Pieces`` are written to a socket this many bytes at a time, a turn of the loop between."""


class Pieces:
    """A leg's JSON text as buffers sent one after another (``encode``): the large members'
    texts, held once per request, between the short stretches of JSON around them."""

    __slots__ = ("buffers", "nbytes")

    def __init__(self, buffers: Sequence[bytes]) -> None:
        self.buffers = tuple(buffers)
        self.nbytes = sum(len(buffer) for buffer in self.buffers)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.buffers)

    def chunks(self) -> Iterator[memoryview]:
        """The text, ``CHUNK_BYTES`` at most at a time, copying nothing."""
        for buffer in self.buffers:
            view = memoryview(buffer)
            for start in range(0, len(view), CHUNK_BYTES):
                yield view[start : start + CHUNK_BYTES]


Wire = bytes | Pieces
"""A leg's body as it goes to an engine."""


def encode(body: Mapping[str, Any], members: Members) -> Wire:
    """``orjson.dumps(body)``, as ``Pieces`` when ``body`` holds big members of a large
    request (``Parsed.members``): measured, orjson writes a 31 MB fragment into its output in
    56–107 ms of the event loop (its buffer grows by copies), and the whole leg is copied once
    more on its way to the socket; the pieces are the members' own bytes."""
    if not members:
        return orjson.dumps(body)
    texts: list[bytes] = []
    leg: dict[str, Any] = {}
    mark = b""
    for name, value in body.items():
        text = members.get(id(value)) if isinstance(value, orjson.Fragment) else None
        if text is None:
            leg[name] = value
            continue
        if not mark:
            mark = b'"pd-sidecar-member-' + secrets.token_hex(16).encode() + b'"'
        leg[name] = orjson.Fragment(mark)
        texts.append(text)
    if not texts:
        return orjson.dumps(body)
    around = orjson.dumps(leg).split(mark)
    if len(around) != len(texts) + 1:  # the mark is random: only a bug puts it elsewhere
        raise AssertionError("a member's mark is missing from the leg's JSON")
    buffers = [around[0]]
    for text, after in zip(texts, around[1:], strict=True):
        buffers += (text, after)
    return Pieces(buffers)


class Bodies:
    """Reads and parses generation request bodies under the limits in the module docstring."""

    def __init__(
        self,
        *,
        max_bytes: int,
        max_elements: int,
        budget_bytes: int,
        timeout_s: float,
        metrics: Metrics,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_elements = max_elements
        self.timeout_s = timeout_s
        self.budget = BodyBudget(budget_bytes, metrics)
        self._metrics = metrics
        self._parsing = asyncio.Lock()

    async def read(self, request: web.Request, held: Held) -> Parsed:
        """The request's body, read into ``held`` and parsed; raises ``ClientError`` (400,
        408, 413) or ``Busy`` (503)."""
        raw = await self._read(request, held)
        if len(raw) < LARGE_BODY_BYTES:
            return Parsed(parse_object(raw), bytes(raw), None, NO_MEMBERS)
        async with self._parsing:
            found, aside = set_aside(raw), None
            if found is None:
                body = parse_object(raw)
            else:
                reduced, aside = found
                body = _parse_reduced(reduced, raw)
            del raw  # the objects, and the strings set aside, now hold what is needed
            await asyncio.sleep(0)  # a turn for the loop between the parse and the encoding
            members: dict[int, bytes] = {}
            return Parsed(body, None, _encode_members(body, aside, members), members)

    async def read_raw(self, request: web.Request, held: Held) -> bytes | bytearray:
        """The request's body as sent, read into ``held``, under the same limits as ``read``
        (passthrough reads a guarded route's body so, to check it)."""
        return await self._read(request, held)

    async def _read(self, request: web.Request, held: Held) -> bytes | bytearray:
        limit = self.max_bytes
        declared = request.content_length
        if declared is not None:
            if declared > limit:
                self._refused("size")
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            held.grow(declared)  # what cannot fit is refused before a byte is read
        content = request.content
        if content.is_eof():  # all of it is in already (a small body): nothing to wait for
            data = await content.read()
            self._check_size(len(data), held)
            if len(data) > self.max_elements:
                self._check_elements(ElementCount().feed(data))
            return data
        buffer = bytearray()
        # The budget and the element cap go by the bytes read, whatever the head declared: a
        # body no longer than the cap cannot hold more values than it, so it is counted only
        # from the chunk that takes it past the cap, its earlier bytes first.
        count: ElementCount | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async for chunk in content.iter_any():
                    size = len(buffer) + len(chunk)
                    self._check_size(size, held)
                    if count is None and size > self.max_elements:
                        count = ElementCount()
                        count.feed(buffer)
                    if count is not None:
                        self._check_elements(count.feed(chunk))
                    buffer += chunk
        except TimeoutError:
            raise RequestTimeout(f"request body not received within {self.timeout_s:g}s") from None
        return buffer

    def _check_size(self, size: int, held: Held) -> None:
        if size > self.max_bytes:
            self._refused("size")
            raise PayloadTooLarge(f"request body exceeds {self.max_bytes} bytes")
        if size > held.size:  # chunked, or past what the head declared: held as it comes
            held.grow(size - held.size)

    def _check_elements(self, elements: int) -> None:
        if elements > self.max_elements:
            self._refused("elements")
            raise PayloadTooLarge(
                f"request body has more than {self.max_elements} JSON values "
                "(SIDECAR_MAX_BODY_ELEMENTS): send fewer messages or items"
            )

    def _refused(self, reason: str) -> None:
        self._metrics.bodies_refused.labels(reason).inc()


# Types of the fields the sidecar itself reads (the engine validates everything else).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "messages": (list,),
    "prompt": (str, list),
    "stream": (bool,),
    "stream_options": (dict, type(None)),
    "n": (int,),
    "max_tokens": (int, type(None)),
    "max_completion_tokens": (int, type(None)),
    "kv_transfer_params": (dict, type(None)),
}


def parse_object(raw: bytes | bytearray) -> dict[str, Any]:
    """A JSON object whose fields the sidecar reads have the right types; else ``BadRequest``."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")  # only on this error path: orjson's wording does not say where
        except UnicodeDecodeError as bad:
            where = f"byte {bad.start} (0x{raw[bad.start]:02x})"
            raise BadRequest(f"request body is not valid UTF-8: {where}") from None
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for name, types in _FIELD_TYPES.items():
        if name in body:
            value = body[name]
            bad_bool = isinstance(value, bool) and bool not in types
            if bad_bool or not isinstance(value, types):
                expected = " or ".join(_TYPE_NAMES[t] for t in types)
                raise BadRequest(f"'{name}' must be {expected}")
    return body


_TYPE_NAMES = {
    list: "an array",
    str: "a string",
    bool: "a boolean",
    dict: "an object",
    int: "an integer",
    type(None): "null",
}


def _encode_members(
    body: dict[str, Any], aside: SetAside | None, members: dict[int, bytes]
) -> bytes | None:
    """Replace, in place, the big members of ``body`` by their JSON text (the strings set
    aside put back), and note the long ones' in ``members``; returns that of ``messages``.
    Raises ``orjson.JSONEncodeError`` for a member too deep to write again."""
    if aside is not None:
        aside.restore_names_and_values(body)
    messages = None
    for name, value in body.items():
        if name in READ_BY_VALUE:
            continue
        if isinstance(value, list | dict) or (
            isinstance(value, str)
            and (len(value) >= ENCODED_MEMBER_CHARS or (aside is not None and aside.holds(value)))
        ):
            text = orjson.dumps(value)
            if aside is not None:
                text = aside.splice(text)
            fragment = body[name] = orjson.Fragment(text)
            if len(text) >= MEMBER_PIECE_BYTES:
                members[id(fragment)] = text
            if name == "messages":
                messages = text
    return messages


class SetAside:
    """The long strings of a body, taken out before it is parsed (``set_aside``): each one's
    bytes, quotes included, under its placeholder (a string with a random part no client can
    know)."""

    __slots__ = ("_head", "_prefix", "_strings")

    def __init__(self, prefix: bytes, strings: dict[bytes, memoryview]) -> None:
        self._prefix = prefix
        self._head = prefix[1:].decode()
        self._strings = strings

    def holds(self, value: str) -> bool:
        return value.startswith(self._head)

    def splice(self, text: bytes) -> bytes:
        """``text``, JSON written from the parsed body, with the strings put back."""
        pieces: list[bytes | memoryview] = []
        last = 0
        while (start := text.find(self._prefix, last)) >= 0:
            end = text.index(b'"', start + 1) + 1
            pieces += (text[last:start], self._strings[text[start:end]])
            last = end
        if not pieces:
            return text
        pieces.append(text[last:])
        return b"".join(pieces)

    def restore_names_and_values(self, body: dict[str, Any]) -> None:
        """Parse back what is read as a value: top-level field names, and ``READ_BY_VALUE``."""
        for name in [name for name in body if self.holds(name)]:
            body[self._parsed(name)] = body.pop(name)
        for name in READ_BY_VALUE:
            if name in body:
                body[name] = self._value(body[name])

    def _value(self, node: Any) -> Any:
        if isinstance(node, str):
            return self._parsed(node) if self.holds(node) else node
        if isinstance(node, list):
            return [self._value(item) for item in node]
        if isinstance(node, dict):
            return {self._value(key): self._value(item) for key, item in node.items()}
        return node

    def _parsed(self, placeholder: str) -> Any:
        try:
            return orjson.loads(self._strings[b'"%s"' % placeholder.encode()])
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None


def set_aside(raw: bytes | bytearray) -> tuple[bytes, SetAside] | None:
    """``raw`` with its strings of ``LONG_STRING_BYTES`` or more replaced by placeholders, and
    those strings; None when there is none, when ``raw`` has more than ``MAX_QUOTES_SCANNED``
    quotes, or a string that does not end.

    A step of Python per quote, ``bytes.find`` between them (no ``bytes.count`` first: it reads
    a byte at a time, 13 ms for 31 MB against 3 ms for ``find``): a quote preceded by an odd run
    of backslashes is escaped. Outside strings, a valid document has quotes only where strings
    start.
    """
    spans: list[tuple[int, int]] = []
    position = 0
    quotes = 0
    while (start := raw.find(b'"', position)) >= 0:
        end = start
        quotes += 1  # every quote of the document is met once: here, or as a candidate end
        while True:
            end = raw.find(b'"', end + 1)
            if end < 0:
                return None  # does not end: the parse says where
            quotes += 1
            if quotes > MAX_QUOTES_SCANNED:
                return None
            run = 0
            while raw[end - 1 - run] == _BACKSLASH:
                run += 1
            if run % 2 == 0:
                break
        position = end + 1
        if position - start >= LONG_STRING_BYTES:
            spans.append((start, position))
    if not spans:
        return None
    prefix = b'"pd-sidecar-' + secrets.token_hex(16).encode() + b"-"
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    strings: dict[bytes, memoryview] = {}
    last = 0
    for index, (start, end) in enumerate(spans):
        placeholder = prefix + b'%d"' % index
        pieces += (view[last:start], placeholder)
        strings[placeholder] = view[start:end]
        last = end
    pieces.append(view[last:])
    return b"".join(pieces), SetAside(prefix, strings)


def _parse_reduced(reduced: bytes, raw: bytes | bytearray) -> dict[str, Any]:
    """``parse_object`` of a body whose long strings were set aside; when it fails, the whole
    body's error (its message names offsets in the client's bytes)."""
    try:
        return parse_object(reduced)
    except BadRequest:
        parse_object(raw)
        raise

"""SGLang's prefill/decode rendezvous on a bootstrap room, emulated.

Both legs carry the same ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``. The prefill
server computes the prompt, stages the room's KV and waits until a decode claims the room (or
``bootstrap_timeout_s``); the decode server claims the room at the prefill's bootstrap server (the
emulator's side channel) and waits until the room's KV is ready (or ``waiting_timeout_s``)::

    POST http://{bootstrap_host}:{bootstrap_port}/sglang/claim
    {"room": int, "timeout_s": float}

    200 {"status": "ok", "blocks": N}     the room was staged (or got staged while waiting)
    408 {"status": "timeout"}             no room staged within timeout_s
    404 {"status": "not_prefill"}         this emulator is not an SGLang prefill server

A claim whose caller goes away is dropped at once. A prefill that fails or is cancelled drops its
room; a decode waiting for that room keeps waiting until its own timeout, as in SGLang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from sidecar.emulator.kv import Clock, PullStatus
from sidecar.emulator.waiters import Waiters

log = logging.getLogger("sidecar.emulator.sglang")

CLAIM_PATH = "/sglang/claim"
MAX_ROOM = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """The bootstrap fields of one request; ``room`` is the one of the prompt served."""

    host: str
    port: int
    room: int

    @property
    def claim_url(self) -> str:
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        return f"http://{host}:{self.port}{CLAIM_PATH}"


def _first(value: object, name: str, kind: type, lengths: frozenset[int]) -> Any:
    """A scalar, or a list with one value per prompt (or per sample); the first one is used."""
    if isinstance(value, list):
        if len(value) not in lengths:
            expected = " or ".join(str(n) for n in sorted(lengths))
            raise ValueError(f"{name} has {len(value)} entries, expected {expected}")
        items = value
    else:
        items = [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, kind):
            raise ValueError(f"{name} must be a {kind.__name__} or a list of them")
    return items[0]


def parse_bootstrap(body: Mapping[str, Any], prompts: int, n: int) -> Bootstrap | None:
    """None when the request carries no bootstrap field; ValueError names a bad or missing one.

    A list holds one value per prompt of an array prompt, or, for a single prompt, one per
    sample (``n``; SGLang's router sends that for chat). The first prompt's room is the one used.
    """
    lengths = frozenset({prompts, n} if prompts == 1 else {prompts})
    names = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    present = [name for name in names if body.get(name) is not None]
    if not present:
        return None
    missing = [name for name in names if name not in present]
    if missing:
        raise ValueError(f"{', '.join(missing)} required with {', '.join(present)}")
    host = _first(body["bootstrap_host"], "bootstrap_host", str, lengths)
    port = _first(body["bootstrap_port"], "bootstrap_port", int, lengths)
    rooms = body["bootstrap_room"]
    room = _first(rooms, "bootstrap_room", int, lengths)
    for value in rooms if isinstance(rooms, list) else [rooms]:
        if not 0 <= value <= MAX_ROOM:
            raise ValueError(f"bootstrap_room must be in [0, 2^63-1], got {value}")
    if not host:
        raise ValueError("bootstrap_host must not be empty")
    if not 0 < port < 65536:
        raise ValueError("bootstrap_port must be a TCP port number")
    return Bootstrap(host, port, room)


def parse_rid(body: Mapping[str, Any]) -> str | None:
    rid = body.get("rid")
    if isinstance(rid, list) and rid and isinstance(rid[0], str):
        return rid[0]
    return rid if isinstance(rid, str) else None


@dataclass(slots=True)
class _Room:
    request_id: str
    blocks: int
    staged_at: float
    claimed: asyncio.Future[bool] = field(  # True: claimed; False: replaced by a later prefill
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass(frozen=True, slots=True)
class RoomView:
    room: int
    request_id: str
    blocks: int
    age_s: float


class RoomBoard:
    """Prefill side: rooms computed and not yet claimed, and claims waiting for a room."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._rooms: dict[int, _Room] = {}
        self._claims: Waiters[int, int] = Waiters()
        self.claimed_total = 0
        self.timed_out_total = 0

    @property
    def claims_waiting(self) -> int:
        return self._claims.count()

    def snapshot(self) -> list[RoomView]:
        now = self._clock()
        return [
            RoomView(room, r.request_id, r.blocks, round(now - r.staged_at, 6))
            for room, r in self._rooms.items()
        ]

    async def serve(self, room: int, request_id: str, blocks: int, timeout_s: float) -> bool:
        """Stage the room and wait until a decode claims it; False (room dropped) on timeout or
        when a later prefill staged the same room. Cancellation drops the room too."""
        entry = _Room(request_id, blocks, self._clock())
        if self._hand_to_waiting_claim(room, blocks):
            return True
        previous = self._rooms.get(room)
        if previous is not None and not previous.claimed.done():
            previous.claimed.set_result(False)  # a re-used room replaces the old one, which fails
        self._rooms[room] = entry
        try:
            async with asyncio.timeout(timeout_s):
                return await entry.claimed
        except TimeoutError:
            self.timed_out_total += 1
            return False
        finally:
            if self._rooms.get(room) is entry:
                del self._rooms[room]

    def _hand_to_waiting_claim(self, room: int, blocks: int) -> bool:
        future = self._claims.first(room)
        if future is None:
            return False
        future.set_result(blocks)
        self.claimed_total += 1
        return True

    async def claim(self, room: int, timeout_s: float) -> int | None:
        """Blocks of the room once it is staged; None after ``timeout_s``."""
        entry = self._rooms.get(room)
        if entry is not None and not entry.claimed.done():
            entry.claimed.set_result(True)
            del self._rooms[room]
            self.claimed_total += 1
            return entry.blocks
        return await self._claims.wait(room, timeout_s)


ROOM_BOARD = web.AppKey("room_board", RoomBoard)


def _answer(status: PullStatus, http_status: int, message: str, blocks: int = 0) -> web.Response:
    body = {"status": status.value, "message": message, "blocks": blocks}
    return web.Response(
        status=http_status, body=orjson.dumps(body), content_type="application/json"
    )


async def handle_claim(request: web.Request) -> web.Response:
    board = request.app.get(ROOM_BOARD)
    if board is None:
        return _answer(PullStatus.NOT_PREFILL, 404, "this engine is not an SGLang prefill server")
    try:
        body = orjson.loads(await request.read())
        if not isinstance(body, Mapping):
            raise TypeError("body must be an object")
        room, timeout_s = body["room"], body["timeout_s"]
        if isinstance(room, bool) or not isinstance(room, int):
            raise TypeError("room must be an integer")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise TypeError("timeout_s must be a positive number")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return web.json_response({"status": "bad_request", "message": str(exc)}, status=400)
    blocks = await board.claim(room, float(timeout_s))
    if blocks is None:
        return _answer(PullStatus.TIMEOUT, 408, f"room {room} got no KV within {timeout_s}s")
    return _answer(PullStatus.OK, 200, "claimed", blocks)


def add_bootstrap_routes(app: web.Application, board: RoomBoard | None) -> None:
    """The claim route; ``board`` is None on a server that is not an SGLang prefill server."""
    if board is not None:
        app[ROOM_BOARD] = board
    app.router.add_post(CLAIM_PATH, handle_claim)

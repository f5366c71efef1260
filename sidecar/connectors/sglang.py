"""SGLang PD disaggregation: both legs at once, meeting in a bootstrap room.

Wire facts from ../shared/reference/protocol.md §4 (sources: SGLang's mini load balancer, its Rust
router, ``io_struct.py``): the prefill and the decode server get the same body, plus
``bootstrap_host`` (the prefill server's host), ``bootstrap_port`` (its bootstrap server) and
``bootstrap_room``; the decode server claims the room there and waits for the KV
(``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 300 s by default). The client gets the decode's answer.

The choreography::

    prefill call (retries) ─┬─ same body, a fresh room per attempt ─┐
    decode send ────────────┘  (restarted with each prefill attempt) ┘
    prefill refused / failed ──▶ abort the decode, answer with the prefill's error
    decode failed first ───────▶ abort the prefill, answer with the decode's failure
    decode answered first ─────▶ the prefill's own answer is read in the background
    client left ───────────────▶ abort both

A decode server cannot prefill a prompt itself, so every request disaggregates (the scheduler's
decider is told so; ``SIDECAR_PREFILL_FALLBACK=local`` is refused at start) and a request with no
prefill endpoint is a 503. Nothing is left waiting: a decode whose prefill will not come would
hold its slot until SGLang's timeout (the bug class of sglang #31206), and a prefill whose decode
is gone would hold its KV until the bootstrap timeout. An aborted leg is a closed connection, which
SGLang turns into an abort of the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from typing import Any

from sidecar.body import Wire
from sidecar.connectors.nixl import KV_TRANSFER_PARAMS
from sidecar.connectors.parts import Parts
from sidecar.endpoints import Endpoint
from sidecar.errors import BadRequest, PrefillFailed
from sidecar.exchange import Answer, Exchange, Fallback, Prefilled, Refused
from sidecar.tracking import task_name

logger = logging.getLogger("sidecar.connectors.sglang")

BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
ROOM_LIMIT = 2**63
"""Rooms are integers in [0, 2^63 - 1] (SGLang stores them as int64)."""
MAX_ROOMS_PER_REQUEST = 2**32
"""Far beyond any engine's limit; keeps ``room + i`` in range with a room drawn from 2^63 - 2^32."""
CLIENT_FIELDS = (
    BOOTSTRAP_HOST,
    BOOTSTRAP_PORT,
    BOOTSTRAP_ROOM,
    "bootstrap_pair_key",
    KV_TRANSFER_PARAMS,
)
"""Fields a client must not set: the rendezvous would pair a decode with a room of the client's
choosing; NIXL's instructions mean nothing to SGLang."""


class SglangConnector:
    name = "sglang"

    def __init__(self, parts: Parts, *, bootstrap_port: int) -> None:
        self.parts = parts
        self.bootstrap_port = bootstrap_port

    async def run(self, ex: Exchange) -> Answer | Refused:
        if ex.placement.endpoint is None:
            raise PrefillFailed(
                "no healthy prefill endpoint, and an SGLang decode server cannot prefill itself "
                f"({ex.placement.decision.reason})"
            )
        legs = _Legs(self, ex)
        prefill = asyncio.create_task(
            self.parts.prefill.run(
                legs.ex,
                body_for=legs.start,
                accept=_accept,
                orphaned=_nothing_staged,
                json=False,
                abort_on_disconnect=True,
            ),
            name=task_name(ex.request_id, "prefill-leg"),
        )
        prefill.add_done_callback(_retrieve)  # however the race ends, its end is seen
        try:
            return await legs.race(prefill)
        except BaseException:
            legs.abort(prefill)
            raise

    # --- the wire ------------------------------------------------------------------------

    def unsupported(self, body: dict[str, Any]) -> str | None:
        return None  # a batch of prompts gets a room per prompt

    def sanitize(self, body: dict[str, Any]) -> bool:
        removed = False
        for name in CLIENT_FIELDS:
            if name in body:
                del body[name]
                removed = True
        return removed

    def leg_body(
        self, body: dict[str, Any], endpoint: Endpoint, room: int | list[int]
    ) -> dict[str, Any]:
        """What both legs get: the client's body and the rendezvous."""
        port = endpoint.bootstrap_port or self.bootstrap_port
        return {**body, BOOTSTRAP_HOST: endpoint.host, BOOTSTRAP_PORT: port, BOOTSTRAP_ROOM: room}


def new_room(body: dict[str, Any]) -> int | list[int]:
    """A fresh room from the CSPRNG: one per prompt of a batch, else one.

    With ``n`` > 1 a single room, batch or not: SGLang gives its ``i``-th request (prompt ×
    sample) the room ``room + i`` itself, and refuses a list of rooms when ``n`` > 1
    (``io_struct.py``), so the room is drawn low enough to leave them all in range.
    """
    prompt = body.get("prompt")
    prompts = 1
    if isinstance(prompt, list) and len(prompt) > 0 and not isinstance(prompt[0], int):
        prompts = len(prompt)
    n = body.get("n")
    samples = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    if samples == 1 and prompts > 1:
        return [secrets.randbelow(ROOM_LIMIT) for _ in range(prompts)]
    requests = prompts * samples
    if requests > MAX_ROOMS_PER_REQUEST:
        raise BadRequest(f"'n' is too large: at most {MAX_ROOMS_PER_REQUEST} samples in all")
    return secrets.randbelow(ROOM_LIMIT - requests + 1)


class _Legs:
    """One request's two legs: the prefill call's task, and the decode send of its attempt.

    Also the prefill call's ``Progress`` (passing every milestone on): it knows whether a
    prefill attempt is under way, so that a decode leg that failed with its attempt is not
    taken for a decode failure while the call retries.
    """

    __slots__ = ("_connector", "_progress", "attempting", "decode", "ex", "restarted", "settled")

    def __init__(self, connector: SglangConnector, ex: Exchange) -> None:
        self._connector = connector
        self._progress = ex.progress
        self.ex = dataclasses.replace(ex, progress=self)
        self.decode: asyncio.Task[Answer] | None = None
        self.restarted = asyncio.get_running_loop().create_future()
        """Done when ``start`` sent a new decode leg, for ``race`` to wait on that one."""
        self.attempting = False
        self.settled = False
        """The decode answered: no further attempt may start a leg."""

    # Progress, passed on until the decode answered (the request may be over by then)
    def prefill_sent(self, endpoint: Endpoint, attempt: int) -> None:
        self.attempting = True
        if not self.settled:
            self._progress.prefill_sent(endpoint, attempt)

    def prefill_ended(self) -> None:
        self.attempting = False
        if not self.settled:
            self._progress.prefill_ended()

    def fell_back(self, reason: str, *, local: bool) -> None:
        if not self.settled:
            self._progress.fell_back(reason, local=local)

    def decode_sent(self) -> None:
        self._progress.decode_sent()

    def first_byte(self) -> None:
        self._progress.first_byte()

    # the legs
    def start(self, endpoint: Endpoint) -> Wire:
        """The prefill attempt's body; starts the decode leg of the same room (any earlier
        attempt's decode leg waits for a room that will not come: it is aborted)."""
        if self.settled or self._decoded():
            raise _Settled
        self._abort_decode()
        ex = self.ex
        body = self._connector.leg_body(ex.body, endpoint, new_room(ex.body))
        data = ex.encode(body)
        self.decode = asyncio.create_task(
            self._connector.parts.decode.send(ex, data), name=task_name(ex.request_id, "decode")
        )
        if not self.restarted.done():
            self.restarted.set_result(None)
        return data

    async def race(self, prefill: asyncio.Task[Prefilled | Refused | Fallback]) -> Answer | Refused:
        loop = asyncio.get_running_loop()
        while True:
            if self.restarted.done():
                self.restarted = loop.create_future()
            decode = self.decode
            waiting: set[asyncio.Future[Any]] = {prefill, self.restarted}
            if decode is not None and not decode.done():
                waiting.add(decode)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if self._decoded():
                break
            if prefill.done():
                outcome = prefill.result()  # PrefillFailed and the like: raised, decode aborted
                if isinstance(outcome, Refused):
                    self._abort_decode()
                    return outcome
                if isinstance(outcome, Fallback):  # refused at start; never local here
                    self._abort_decode()
                    raise PrefillFailed(f"the prefill failed ({outcome.reason})")
                assert self.decode is not None
                return await self.decode
            if decode is None or decode is not self.decode or not decode.done():
                continue  # a retry started another decode leg
            if decode.cancelled():
                continue
            if self.attempting:
                # The decode failed while its prefill runs: that prefill would wait for it in
                # vain. (A decode that failed with its attempt is the retry's business.)
                self._cancel(prefill)
                return decode.result()  # its refusal, or the exception it raised
        # The decode has the KV: the prefill's own answer is only read to its end, and the
        # record counts the prefill done now (its answer may come after the request ended).
        if self.attempting:
            self._progress.prefill_ended()
        self.settled = True
        if not prefill.done() and not self._connector.parts.aftercare.adopt(prefill):
            self._cancel(prefill)
        assert self.decode is not None
        return self.decode.result()

    def _decoded(self) -> bool:
        """The current decode leg answered (not with an error status): it has the KV."""
        decode = self.decode
        return (
            decode is not None
            and decode.done()
            and not decode.cancelled()
            and decode.exception() is None
            and decode.result().upstream.status < 400
        )

    def abort(self, prefill: asyncio.Task[Any]) -> None:
        """Cancel whatever still runs (the client left, or something raised)."""
        self._cancel(prefill)
        self._abort_decode()

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        if not task.done():
            task.cancel()
            self._connector.parts.aftercare.watch(task)

    def _abort_decode(self) -> None:
        decode = self.decode
        if decode is None:
            return
        if decode.done():
            if not decode.cancelled() and decode.exception() is None:
                decode.result().upstream.close()
            return
        self._cancel(decode)


class _Settled(Exception):
    """A prefill retry after the decode had answered: not started."""


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A prefill read to its end after the decode answered: how it ended changes nothing."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("prefill after its decode answered: %r", task.exception())


def _accept(answer: object, endpoint: Endpoint) -> Prefilled:
    """Any 2xx answer: the prefill server sent the room's KV (its one token is dropped)."""
    return Prefilled(endpoint, {}, None)


def _nothing_staged(prefilled: Prefilled) -> None:
    """A prefill server that answered has handed its KV to the decode: nothing to release."""

"""SGLang PD disaggregation: both legs at once, meeting in a bootstrap room.

Wire facts from ../shared/reference/protocol.md §4 (sources: SGLang's mini load balancer, its Rust
router, ``io_struct.py``): the prefill and the decode server get the same body, plus
``bootstrap_host`` (the prefill server's host), ``bootstrap_port`` (its bootstrap server) and
``bootstrap_room``; the decode server claims the room there and waits for the KV
(``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 300 s by default). The client gets the decode's answer.

The choreography::

    each prefill attempt: ─┬─ prefill call ─┐ same body, a fresh room per attempt
                           └─ decode send ──┘
    prefill refused ───────▶ abort the decode, answer with the prefill's error
    prefill failed ────────▶ abort the decode; the next attempt (or 503 when none is left)
    decode failed first ───▶ abort the prefill, answer with the decode's failure
    decode answered first ─▶ the prefill's own answer is read in the background
    client left ───────────▶ abort both

A decode server cannot prefill a prompt itself, so every request disaggregates (the scheduler's
decider is told so; ``SIDECAR_PREFILL_FALLBACK=local`` is refused at start) and a request with no
prefill endpoint is a 503. Nothing is left waiting: a decode whose prefill will not come would
hold its slot until SGLang's timeout (the bug class of sglang #31206), and a prefill whose decode
is gone would hold its KV until the bootstrap timeout. An aborted leg is a closed connection, which
SGLang turns into an abort of the request.
"""

from __future__ import annotations

import asyncio
import secrets
from asyncio import FIRST_COMPLETED
from typing import Any

from sidecar.body import Wire
from sidecar.connectors.exchange import Answer, Exchange, Prefilled, Refused
from sidecar.connectors.parts import Parts
from sidecar.connectors.prefill import drained
from sidecar.errors import BadRequest, PrefillFailed
from sidecar.fleet.endpoints import Endpoint
from sidecar.observability.tracking import task_name
from sidecar.sanitize import BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM, strip_client_fields

ROOM_LIMIT = 2**63
"""Rooms are integers in [0, 2^63 - 1] (SGLang stores them as int64)."""
MAX_ROOMS_PER_REQUEST = 2**32
"""Far beyond any engine's limit; keeps ``room + i`` in range with a room drawn from 2^63 - 2^32."""


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
        async for attempt in self.parts.prefill.attempts(ex):
            # The prefill server sends the KV to the decode leg in the room: nothing is left
            # staged for a release, but both legs end with the attempt.
            with attempt.staged(release=None) as kv:
                data = ex.encode(self.leg_body(ex.body, attempt.endpoint, new_room(ex.body)))
                with _DecodeLeg(self.parts, ex, data) as decode:
                    prefill = kv.start(data, _accept, read=drained)
                    await asyncio.wait({prefill, decode.task}, return_when=FIRST_COMPLETED)
                    if decode.answered():
                        # The decode has the KV: the prefill's own answer is only read to its
                        # end, in the background (the record counts the prefill done now).
                        kv.taken()
                        kv.hand_over(prefill)
                        return decode.keep()
                    if not prefill.done():
                        # The decode failed while its prefill runs, which would wait for it in
                        # vain (the exit aborts it): its refusal, or the exception it raised.
                        return decode.keep()
                    outcome = prefill.result()
                    if isinstance(outcome, Prefilled):
                        await asyncio.wait({decode.task})
                        return decode.keep()
                    if isinstance(outcome, Refused):
                        return outcome  # the exit aborts the decode
                # Failed: the decode waits for a room that will not come; the next attempt, if
                # any, starts both legs again in a new room.
        # Only SIDECAR_PREFILL_FALLBACK=local ends the attempts without a prefill: refused at
        # start with this connector.
        raise PrefillFailed("the prefill failed, and an SGLang decode server cannot prefill")

    # --- the wire ------------------------------------------------------------------------

    def unsupported(self, body: dict[str, Any]) -> str | None:
        return None  # a batch of prompts gets a room per prompt

    def sanitize(self, body: dict[str, Any]) -> bool:
        # The rendezvous would pair a decode with a room of the client's choosing (or a prefill
        # rank, a KV layout); NIXL's instructions mean nothing to SGLang.
        return strip_client_fields(body)

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


class _DecodeLeg:
    """An attempt's decode leg, sent at once in a task of its own; on exit, aborted unless its
    answer was kept (a running leg is cancelled, a started answer closed)."""

    __slots__ = ("_parts", "kept", "task")

    def __init__(self, parts: Parts, ex: Exchange, data: Wire) -> None:
        self._parts = parts
        self.task = asyncio.create_task(
            parts.decode.send(ex, data), name=task_name(ex.request_id, "decode")
        )
        self.kept = False

    def answered(self) -> bool:
        """It answered, not with an error status: it has the KV."""
        task = self.task
        return (
            task.done()
            and not task.cancelled()
            and task.exception() is None
            and task.result().upstream.status < 400
        )

    def keep(self) -> Answer:
        """Its answer, for the client (raises what the leg raised)."""
        self.kept = True
        return self.task.result()

    def __enter__(self) -> _DecodeLeg:
        return self

    def __exit__(self, *exc: object) -> None:
        task = self.task
        if not task.done():
            self._parts.background.abort(task)
        elif not self.kept and not task.cancelled() and task.exception() is None:
            task.result().upstream.close()


def _accept(answer: object, endpoint: Endpoint) -> Prefilled:
    """Any 2xx answer: the prefill server sent the room's KV (its one token is dropped)."""
    return Prefilled(endpoint, {}, None)

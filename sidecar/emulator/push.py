"""vLLM's NixlPushConnector, emulated: the decode registers its own request id with the prefill's
side channel, and the prefill pushes the KV staged under that same id.

Prefill side (side channel)::

    POST http://{remote_host}:{remote_port}/nixl/register
    {"engine_id": str, "request_id": <the decode's own response id>, "timeout_s": float}

    200 {"status": "ok", "blocks": N}    the entry staged under that id was taken (pulled_total +1)
    409 {"status": "engine_mismatch"}    not this emulator's engine id, or not a push-mode engine
    408 {"status": "timeout"}            nothing was staged under that id within timeout_s

A registration that finds nothing staged waits (the prefill may still be computing) until an entry
with its id is staged or its timeout passes; one whose caller goes away is dropped at once. The
match is exact on the response id (``cmpl-`` / ``chatcmpl-`` + ``x-request-id``): both legs must
carry the same ``x-request-id`` on the same endpoint, as with vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import orjson
from aiohttp import web

from sidecar.emulator.kv import KvStore, PullStatus, StagedKv
from sidecar.emulator.waiters import Waiters

log = logging.getLogger("sidecar.emulator.push")

REGISTER_PATH = "/nixl/register"
TRANSFER_MODE = "push"


class PushBoard:
    """Prefill side: registrations waiting for KV staged under their request id."""

    def __init__(self, kv: KvStore) -> None:
        self._kv = kv
        self._waiting: Waiters[str, StagedKv] = Waiters()
        kv.add_stage_listener(self._on_stage)

    @property
    def waiting(self) -> int:
        return self._waiting.count()

    async def register(self, request_id: str, timeout_s: float) -> StagedKv | None:
        """The staged entry for this id, once there is one; None after ``timeout_s``."""
        staged = self._kv.take(request_id)
        if staged is not None:
            return staged
        return await self._waiting.wait(request_id, timeout_s)

    def _on_stage(self, request_id: str) -> None:
        future = self._waiting.first(request_id)
        if future is not None:
            staged = self._kv.take(request_id)
            if staged is not None:
                future.set_result(staged)


def _answer(status: PullStatus, http_status: int, message: str, blocks: int = 0) -> web.Response:
    body = {"status": status.value, "message": message, "blocks": blocks}
    return web.Response(
        status=http_status, body=orjson.dumps(body), content_type="application/json"
    )


PUSH_BOARD = web.AppKey("push_board", PushBoard)


async def handle_register(request: web.Request) -> web.Response:
    board = request.app.get(PUSH_BOARD)
    kv_engine_id = request.app[KV_ENGINE_ID]
    if board is None:  # vLLM: the transfer mode is in the compatibility hash, the handshake fails
        return _answer(PullStatus.ENGINE_MISMATCH, 409, "the prefill engine is not in push mode")
    try:
        body = orjson.loads(await request.read())
        if not isinstance(body, Mapping):
            raise TypeError("body must be an object")
        engine_id, request_id, timeout_s = body["engine_id"], body["request_id"], body["timeout_s"]
        if not (
            isinstance(engine_id, str)
            and isinstance(request_id, str)
            and isinstance(timeout_s, int | float)
            and timeout_s > 0
        ):
            raise TypeError("wrong field types")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return web.json_response({"status": "bad_request", "message": str(exc)}, status=400)
    if engine_id != kv_engine_id:
        return _answer(
            PullStatus.ENGINE_MISMATCH, 409, f"engine id {engine_id} is not {kv_engine_id}"
        )
    staged = await board.register(request_id, float(timeout_s))
    if staged is None:
        log.info("push registration of %s timed out after %.3fs", request_id, timeout_s)
        return _answer(
            PullStatus.TIMEOUT, 408, f"no KV staged for request {request_id} within {timeout_s}s"
        )
    return _answer(PullStatus.OK, 200, "pushed", len(staged.block_ids))


KV_ENGINE_ID = web.AppKey("kv_engine_id", str)


def add_push_routes(app: web.Application, board: PushBoard | None, engine_id: str) -> None:
    """The registration route; ``board`` is None on an engine that is not in push mode."""
    if board is not None:
        app[PUSH_BOARD] = board
    app[KV_ENGINE_ID] = engine_id
    app.router.add_post(REGISTER_PATH, handle_register)

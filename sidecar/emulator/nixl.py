"""The emulated NIXL side channel: the prefill side's listener and the decode side's puller.

Real vLLM moves KV with NIXL after a ZMQ handshake; here one HTTP call does both::

    POST http://{remote_host}:{remote_port}/nixl/pull
    {"engine_id": str, "request_id": str, "block_ids": [int, ...]}

    200 ok | 404 unknown or already pulled | 410 expired | 409 engine or block mismatch
    body: {"status": <PullStatus value>, "message": str}

The decode side then spends the modelled transfer time itself (see engine.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from sidecar.emulator.kv import KvStore, PullStatus

log = logging.getLogger("sidecar.emulator.nixl")

PULL_PATH = "/nixl/pull"
REQUIRED_PARAMS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
HTTP_STATUS = {
    PullStatus.OK: 200,
    PullStatus.UNKNOWN: 404,
    PullStatus.ALREADY_PULLED: 404,
    PullStatus.EXPIRED: 410,
    PullStatus.ENGINE_MISMATCH: 409,
    PullStatus.BLOCK_MISMATCH: 409,
}
# Failures real vLLM 0.32 does not notice: it reads whatever the blocks hold (stale KV).
SILENT_IN_LENIENT = frozenset(
    {
        PullStatus.UNKNOWN,
        PullStatus.ALREADY_PULLED,
        PullStatus.EXPIRED,
        PullStatus.BLOCK_MISMATCH,
    }
)

KV_STORE = web.AppKey("kv_store", KvStore)


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """The decode-side view of a prefill's kv_transfer_params."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int

    @property
    def pull_url(self) -> str:
        return self.url(PULL_PATH)

    def url(self, path: str) -> str:
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        return f"http://{host}:{self.port}{path}"


def _block_ids(value: object) -> tuple[int, ...]:
    """Flatten ``[[ids], ...]`` (one list per KV-cache group) or a flat ``[ids]`` list."""
    if not isinstance(value, list):
        raise ValueError("remote_block_ids must be a list")
    flat: list[int] = []
    for item in value:
        group = item if isinstance(item, list) else [item]
        for block in group:
            if isinstance(block, bool) or not isinstance(block, int):
                raise ValueError("remote_block_ids must contain integers")
            flat.append(block)
    return tuple(flat)


def parse_remote_kv(params: Mapping[str, Any], *, push: bool = False) -> RemoteKv:
    """Validate the fields vLLM's decode needs; ValueError names what is missing or wrong.

    In push mode the decode allocates its own blocks, so ``remote_block_ids`` is not needed.
    """
    required = [n for n in REQUIRED_PARAMS if not (push and n == "remote_block_ids")]
    missing = [name for name in required if params.get(name) is None]
    if missing:
        raise ValueError(f"kv_transfer_params is missing {', '.join(missing)}")
    engine_id = params["remote_engine_id"]
    request_id = params["remote_request_id"]
    host = params["remote_host"]
    port = params["remote_port"]
    if not isinstance(engine_id, str) or not isinstance(request_id, str):
        raise ValueError("remote_engine_id and remote_request_id must be strings")
    if not isinstance(host, str) or not host:
        raise ValueError("remote_host must be a non-empty string")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError("remote_port must be a TCP port number")
    blocks = _block_ids(params["remote_block_ids"]) if params.get("remote_block_ids") else ()
    return RemoteKv(engine_id, request_id, blocks, host, port)


@dataclass(frozen=True, slots=True)
class PullOutcome:
    status: PullStatus
    message: str
    elapsed_s: float
    blocks: int = 0  # push registrations and sglang claims: blocks handed over


# A side channel that waits (push registration, sglang claim) answers by the timeout the caller
# sent; the caller's own deadline is later by this margin, for an answer that is on its way.
WAIT_MARGIN_S = 5.0


class KvPuller:
    """Decode side: asks a prefill emulator's side channel for KV (pull, push, sglang claim)."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self._session = session
        self._timeout_s = timeout_s

    async def pull(self, remote: RemoteKv) -> PullOutcome:
        payload = {
            "engine_id": remote.engine_id,
            "request_id": remote.request_id,
            "block_ids": list(remote.block_ids),
        }
        return await self.call(remote.pull_url, payload, self._timeout_s)

    async def call(self, url: str, payload: Mapping[str, Any], timeout_s: float) -> PullOutcome:
        """POST to a side channel; never raises for network trouble (status UNREACHABLE)."""
        started = time.perf_counter()
        try:
            async with self._session.post(
                url,
                data=orjson.dumps(payload),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                headers={"Content-Type": "application/json"},
            ) as resp:
                raw = await resp.read()
                http_status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            message = f"side channel {url} unreachable: {exc!r}"
            return PullOutcome(PullStatus.UNREACHABLE, message, time.perf_counter() - started)
        status, message, blocks = _decode_answer(http_status, raw)
        return PullOutcome(status, message, time.perf_counter() - started, blocks)


def _decode_answer(http_status: int, raw: bytes) -> tuple[PullStatus, str, int]:
    try:
        body = orjson.loads(raw)
        status = PullStatus(body["status"])
        message = str(body.get("message", ""))
        blocks = body.get("blocks", 0)
        if isinstance(blocks, bool) or not isinstance(blocks, int):
            raise TypeError("blocks must be an integer")
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        message = f"side channel answered {http_status} without a pull status"
        return PullStatus.UNREACHABLE, message, 0
    return status, message, blocks


async def _handle_pull(request: web.Request) -> web.Response:
    kv = request.app[KV_STORE]
    try:
        body = orjson.loads(await request.read())
        engine_id = body["engine_id"]
        request_id = body["request_id"]
        block_ids = body["block_ids"]
        if not (
            isinstance(engine_id, str)
            and isinstance(request_id, str)
            and isinstance(block_ids, list)
            and all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids)
        ):
            raise TypeError("wrong field types")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return web.json_response({"status": "bad_request", "message": str(exc)}, status=400)
    status = kv.pull(engine_id, request_id, block_ids)
    messages = {
        PullStatus.OK: "pulled",
        PullStatus.UNKNOWN: f"no staged KV for request {request_id}",
        PullStatus.ALREADY_PULLED: f"KV of request {request_id} was already pulled",
        PullStatus.EXPIRED: f"KV of request {request_id} expired",
        PullStatus.ENGINE_MISMATCH: f"engine id {engine_id} is not {kv.engine_id}",
        PullStatus.BLOCK_MISMATCH: f"block ids do not match the staged KV of {request_id}",
    }
    message = messages.get(status, status.value)
    if status is not PullStatus.OK:
        log.info("side channel refused pull: %s", message)
    return web.Response(
        status=HTTP_STATUS.get(status, 500),
        body=orjson.dumps({"status": status.value, "message": message}),
        content_type="application/json",
    )


def create_side_channel_app(kv: KvStore) -> web.Application:
    """The pull route; push.py and sglang.py add theirs to the same app."""
    app = web.Application()
    app[KV_STORE] = kv
    app.router.add_post(PULL_PATH, _handle_pull)
    return app

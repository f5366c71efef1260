"""An engine that frames requests as vLLM's and SGLang's server does: a small ASGI app under
uvicorn (h11 or httptools), in this process, on a loopback port.

It answers as a FastAPI engine would where framing matters: a route that does not take the
method (``POST /v1/models``) or a path it does not know is answered 405 or 404 without its body
being read, so whatever the sender left of a body on the connection is read as what follows.
Every request it parsed is recorded, with its body, in arrival order.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MODEL = "emulated-model"
_GENERATION = frozenset({"/v1/completions", "/v1/chat/completions"})
_READ = _GENERATION | {"/v1/responses", "/v1/echo"}


@dataclass(slots=True)
class Seen:
    """One request as the engine's parser framed it."""

    method: str
    path: str
    headers: dict[str, str]
    raw_headers: list[tuple[str, str]]
    body: bytes | None
    """The body, or None when the route answered without reading it."""


@dataclass(slots=True)
class UvicornEngine:
    """The ASGI app and what it saw (``start_uvicorn_engine``)."""

    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        method, path = scope["method"], scope["path"]
        raw = [
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]
        ]
        seen = Seen(method, path, dict(raw), raw, None)
        self.seen.append(seen)
        if path in _READ and method == "POST":
            seen.body = await _body(receive)
            await _json(send, 200, _answer(path, seen.body))
        elif path in ("/health", "/metrics") and method == "GET":
            await _json(send, 200, {})
        elif path == "/v1/models":
            if method != "GET":  # Starlette: 405 for a route that exists, body unread
                await _json(send, 405, {"detail": "Method Not Allowed"})
            else:
                await _json(send, 200, {"object": "list", "data": [{"id": MODEL}]})
        else:
            await _json(send, 404, {"detail": "Not Found"})

    def requests_to(self, *paths: str) -> list[Seen]:
        """What it saw, less the sidecar's health and metrics polls."""
        return [seen for seen in self.seen if not paths or seen.path in paths]

    def served(self) -> list[Seen]:
        return [seen for seen in self.seen if seen.path not in ("/health", "/metrics")]


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _answer(path: str, body: bytes) -> dict[str, Any]:
    if path not in _GENERATION:
        return {"object": "response", "received": len(body)}
    return {
        "id": "cmpl-uvicorn",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


async def _json(send: Send, status: int, payload: object) -> None:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


@dataclass(slots=True)
class RunningUvicorn:
    engine: UvicornEngine
    server: uvicorn.Server
    sock: socket.socket

    @property
    def url(self) -> str:
        return self.engine.url

    async def close(self) -> None:
        """uvicorn's ``shutdown`` less its fixed 0.1 s waits: stop listening, end every
        connection (the sidecar in front has closed its own by now)."""
        for server in self.server.servers:
            server.close()
        self.sock.close()
        for connection in list(self.server.server_state.connections):
            connection.shutdown()
        for server in self.server.servers:
            await server.wait_closed()


async def start_uvicorn_engine(http: str) -> RunningUvicorn:
    """The engine under uvicorn with its ``http`` implementation (``h11`` or ``httptools``).

    Started by uvicorn's own ``startup``, without ``serve``'s loop, which looks for the end
    every 0.1 s and installs signal handlers."""
    engine = UvicornEngine()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    engine.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(
        engine, http=http, lifespan="off", log_level="critical", access_log=False
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    return RunningUvicorn(engine, server, sock)

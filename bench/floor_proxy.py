"""The aiohttp floor: the smallest two-leg P/D proxy on the sidecar's own stack.

    python -m bench.floor_proxy --port 8000 --decode-url http://127.0.0.1:8200

aiohttp server and client, uvloop, orjson, and nothing else: for each ``POST /v1/...`` it reads
the body, sends the prefill leg (one token, not streamed, ``kv_transfer_params`` asking to keep
the KV for a remote decode) to the server named in ``x-prefiller-host-port``, sends the client's
body with the prefill's ``kv_transfer_params`` to the decode engine, and relays the answer chunk by
chunk. No validation, no retries, no timeouts, no records, no metrics, no logging. What this stack
costs at best, for bench/overhead.py to set the sidecar against; never imported by the package.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

import aiohttp
import orjson
import uvloop
from aiohttp import web

PREFILL_HEADER = "x-prefiller-host-port"
_JSON = {"content-type": "application/json"}
# What a P/D proxy asks of the prefill engine (sidecar/connectors/nixl.py); the load generator
# sends the same when it plays the floor.
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
SESSION = web.AppKey("session", aiohttp.ClientSession)
DECODE_URL = web.AppKey("decode_url", str)


async def generate(request: web.Request) -> web.StreamResponse:
    session, path = request.app[SESSION], request.path
    body = orjson.loads(await request.read())
    leg = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    prefill_url = f"http://{request.headers[PREFILL_HEADER]}{path}"
    async with session.post(prefill_url, data=orjson.dumps(leg), headers=_JSON) as prefilled:
        answer = orjson.loads(await prefilled.read())
    body["kv_transfer_params"] = answer["kv_transfer_params"]
    decode_url = request.app[DECODE_URL] + path
    async with session.post(decode_url, data=orjson.dumps(body), headers=_JSON) as decoded:
        headers = {"content-type": decoded.headers.get("content-type", "application/json")}
        out = web.StreamResponse(status=decoded.status, headers=headers)
        await out.prepare(request)
        async for chunk in decoded.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def serve(host: str, port: int, decode_url: str) -> None:
    app = web.Application()
    app[DECODE_URL] = decode_url.rstrip("/")
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    # No connection cap: aiohttp's default of 100 would queue requests at concurrency 256. Idle
    # connections kept 4 s, below the engines' 5 s (the sidecar's SIDECAR_ENGINE_KEEPALIVE_S):
    # aiohttp's 15 s would reuse connections the engine is closing.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        app[SESSION] = session
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=2048).start()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        print(f"aiohttp floor on http://{host}:{port}, decode {decode_url}", flush=True)
        await stop.wait()
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.floor_proxy", description="the aiohttp floor proxy (overhead)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--decode-url", required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port, args.decode_url))


if __name__ == "__main__":
    main()

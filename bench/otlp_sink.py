"""A do-nothing OTLP/HTTP receiver: answers ``POST /v1/traces`` with 200 and counts what it got.

For measuring the sidecar's tracing cost without export errors (retries, logged failures)
distorting it (docs/benchmarks.md, "Tracing's cost")::

    python -m bench.otlp_sink --port 4318 &
    python -m bench overhead --variants sidecar --sidecar-env SIDECAR_TRACING=true \\
        --sidecar-env OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 ...

The request bodies are read and dropped (not decoded: the cost under test is the sidecar's).
``GET /stats`` returns ``{"exports": N, "bytes": M}``. Runs until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse

from aiohttp import web


def make_app() -> web.Application:
    counts = {"exports": 0, "bytes": 0}

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        counts["exports"] += 1
        counts["bytes"] += len(body)
        # An empty ExportTraceServiceResponse is zero bytes of protobuf.
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counts)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/stats", stats)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.otlp_sink",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    web.run_app(make_app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()

"""Idle connections to an engine: the sidecar stops reusing one before the engine closes it.

An engine closes a connection that has been idle for its keep-alive timeout (vLLM and SGLang: 5 s).
A request the sidecar writes into that connection just then is never read: the engine's close is
already on its way back, and the sidecar sees the connection closed without an answer. On loopback
the window is a few microseconds wide; behind a slow link (``devkit/slowlink.py``) it is the link's
delay, so a test can open it on purpose. The e2e suite on real vLLM hit it: a KV release sent over
its 0.5 s slow link was lost ("closed without an answer"), and the KV it was to free stayed held
until the prefill engine's lease ran out.
"""

from __future__ import annotations

import asyncio

import pytest

from devkit.slowlink import SlowLink
from tests.conftest import StartEmulator, StartSidecar, completion, eventually

ENGINE_KEEPALIVE_S = 1.2
"""The engine closes a connection idle this long (``--keepalive-timeout-s``); a new connection
too, if no request has come in by then."""
LINK_DELAY_S = 0.8
"""Every byte towards the engine takes this long: enough for a request on a connection idle for
more than ENGINE_KEEPALIVE_S - LINK_DELAY_S to reach an engine that has closed it, short enough for
a request on a new connection to arrive in time."""
IDLE_S = 0.6
"""Between the two requests: over the 0.4 s after which a reused connection is lost, under the
engine's timeout (the close comes 0.6 s after the send: margin for a slow machine), and over the
sidecar's own setting in the passing case."""


@pytest.mark.parametrize(
    ("sidecar_keepalive_s", "lost"),
    [(0.3, False), (30.0, True)],
    ids=["under-the-engines-timeout", "over-it-as-before"],
)
async def test_no_request_goes_out_on_a_connection_the_engine_is_closing(
    http, start_engine: StartEmulator, start_sidecar_with: StartSidecar,
    sidecar_keepalive_s: float, lost: bool,
) -> None:  # fmt: skip
    """With ``SIDECAR_ENGINE_KEEPALIVE_S`` under the engine's timeout, the second request takes a
    new connection and succeeds. Over it (30 s, the sidecar's setting before), it reuses the idle
    one, which the engine closes before the request arrives: 503, closed without an answer."""
    engine = await start_engine(keepalive_timeout_s=ENGINE_KEEPALIVE_S)
    async with SlowLink("127.0.0.1", engine.port, LINK_DELAY_S) as link:
        sidecar = await start_sidecar_with(
            decode_url=link.url,
            engine_keepalive_s=sidecar_keepalive_s,
            ready_interval_s=2 * LINK_DELAY_S,  # a health poll may take that long (the link)
        )

        async def ready() -> bool:
            async with http.get(sidecar.url + "/ready") as response:
                return response.status == 200

        await eventually(ready, within=3 * LINK_DELAY_S)
        async with http.post(sidecar.url + "/v1/completions", json=completion()) as first:
            assert first.status == 200, await first.text()
            await first.read()
        await asyncio.sleep(IDLE_S)  # the idle time is what is under test
        async with http.post(sidecar.url + "/v1/completions", json=completion()) as second:
            answer = await second.json()

    if lost:
        assert second.status == 503, answer
        assert "closed without an answer" in answer["error"]["message"], answer
    else:
        assert second.status == 200, answer
        assert answer["choices"][0]["text"], answer

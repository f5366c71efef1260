"""``python -m sidecar`` as a real process: uvloop, follows its engine, exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import signal

from tests.conftest import completion
from tests.processes import sidecar_process


async def test_process_serves_and_stops_on_sigterm(http, decode) -> None:
    async with sidecar_process(
        capture_log=True,
        until="/ready",
        decode_url=decode.url,
        ready_interval_s="0.05",
        log_requests="true",
        typo="1",  # SIDECAR_TYPO: unknown, warned about
    ) as sidecar:
        async with http.post(
            sidecar.url + "/v1/completions", json=completion(), headers={"x-request-id": "proc-1"}
        ) as response:
            assert response.status == 200
            await response.read()
        sidecar.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(sidecar.process.wait(), 15) == 0
        log = await sidecar.log()
    assert "unknown variable SIDECAR_TYPO" in log
    assert "proc-1 /v1/completions decision=local" in log
    assert "uvloop" in log

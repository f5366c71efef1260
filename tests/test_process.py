"""``python -m sidecar`` as a real process: uvloop, follows its engine, exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

from tests.conftest import completion, eventually


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_process_serves_and_stops_on_sigterm(http, decode) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env.update(
        SIDECAR_HOST="127.0.0.1",
        SIDECAR_PORT=str(port),
        SIDECAR_DECODE_URL=decode.url,
        SIDECAR_READY_INTERVAL_S="0.05",
        SIDECAR_LOG_REQUESTS="true",
        SIDECAR_TYPO="1",
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", env=env, stderr=asyncio.subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:

        async def ready() -> bool:
            try:
                async with http.get(url + "/ready") as response:
                    return response.status == 200
            except OSError:
                return False

        await eventually(ready, within=15)
        async with http.post(
            url + "/v1/completions", json=completion(), headers={"x-request-id": "proc-1"}
        ) as response:
            assert response.status == 200
            await response.read()
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stderr is not None
    log = (await process.stderr.read()).decode()
    assert "unknown variable SIDECAR_TYPO" in log
    assert "proc-1 /v1/completions decision=local" in log
    assert "uvloop" in log

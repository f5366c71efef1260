"""``python -m sidecar`` as a real process: uvloop, follows its engine, exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time

import aiohttp
import pytest

from tests.conftest import completion, eventually, get_json, inject
from tests.processes import sidecar_process


@pytest.mark.system
async def test_process_serves_and_stops_on_sigterm(http, decode) -> None:
    async with sidecar_process(
        capture_log=True,
        until="/ready",
        decode_url=decode.url,
        ready_interval_s="0.05",
        log_requests="true",
        typo="1",  # SIDECAR_TYPO: unknown, warned about
        prefill_urls="127.0.0.9:1",  # another proxy's name: warned about, naming ours
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
    assert "SIDECAR_PREFILL_URLS: did you mean SIDECAR_PREFILL_ENDPOINTS?" in log
    assert "proc-1 /v1/completions decision=local" in log
    assert "uvloop" in log


DRAIN_S = 2.0


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_shutdown_is_one_budget(http, start_engine) -> None:
    """SIGTERM with a slow stream in flight and a prefill that will never finish: the process
    exits within SIDECAR_DRAIN_TIMEOUT_S + 1 s, and its log counts what was cut. (aiohttp's own
    shutdown waits the timeout twice, and the finishing prefill would get another timeout.)"""
    decode = await start_engine(decode_s_per_token=0.2)
    prefill = await start_engine(side_channel_port=0)
    # The prefill answers its status line, then holds its body: cut then, it is finished in
    # the background (the status line is in), where only the shutdown budget stops it.
    await inject(http, prefill, kind="stall", after_chunks=1, role="prefill")
    async with sidecar_process(
        capture_log=True,
        until="/ready",
        decode_url=decode.url,
        ready_interval_s="0.05",
        drain_timeout_s=str(DRAIN_S),
        prefill_timeout_s="120",
    ) as sidecar:
        url = sidecar.url + "/v1/completions"
        async with http.post(url, json=completion(stream=True, max_tokens=100)) as stream:
            assert stream.status == 200
            await stream.content.readuntil(b"\n\n")  # about 20 s of tokens to go
            stalled = asyncio.ensure_future(
                http.post(
                    url, json=completion(), headers={"x-prefiller-host-port": prefill.endpoint}
                )
            )

            async def prefill_held() -> bool:
                return int((await get_json(http, prefill.url + "/emulator/faults"))["held"]) == 1

            await eventually(prefill_held)
            sidecar.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            status = await asyncio.wait_for(sidecar.process.wait(), 15)
            took = time.monotonic() - signalled
            with contextlib.suppress(aiohttp.ClientError):
                await (await stalled).read()
        log = await sidecar.log()
    assert status == 0, log
    assert DRAIN_S - 0.1 <= took <= DRAIN_S + 1, (took, log)
    assert "drained: 0 request(s) finished, 2 cancelled at the drain timeout" in log
    assert "shutdown: 1 KV release(s) or finishing prefill(s) cut" in log


@pytest.mark.system
@pytest.mark.parametrize("variable", ["SIDECAR_PORT", "SIDECAR_ADMIN_PORT"])
async def test_a_busy_port_is_one_line_and_exit_1(variable: str) -> None:
    # Something listens where SIDECAR_DECODE_URL says the engine does: the line is the bind
    # error alone (with nothing there, it goes on with the likely cause: tests/test_cli.py).
    with socket.socket() as taken, socket.socket() as engine:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine.bind(("127.0.0.1", 0))
        engine.listen()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
        env.update(SIDECAR_HOST="127.0.0.1", SIDECAR_PORT="0", PYTHONDEVMODE="1")
        env["SIDECAR_DECODE_URL"] = f"http://127.0.0.1:{engine.getsockname()[1]}"
        env[variable] = str(port)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", env=env, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(process.communicate(), 30)
    log = err.decode()
    assert process.returncode == 1, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert errors == [
        f"{errors[0][: errors[0].index(' ERROR ')]} ERROR sidecar: cannot listen on "
        f"127.0.0.1:{port} ({variable}): address already in use"
    ], log
    # Nothing else: no traceback, nothing left open (dev mode warns about unclosed resources).
    assert "Traceback" not in log
    assert "nclosed" not in log

"""``python -m sidecar.emulator`` as a process: starts, serves, exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import aiohttp


async def test_module_runs_and_stops_on_sigterm(session: aiohttp.ClientSession) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.emulator",
        "--port",
        "0",
        "--model",
        "cli-model",
        "--fault",
        "status:503:1",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        async with asyncio.timeout(10):
            line = (await process.stderr.readline()).decode()
        match = re.search(r"at (http://\S+) \(side channel \S+:(\d+)", line)
        assert match, line
        url = match.group(1)
        body = {"model": "cli-model", "prompt": "hi", "max_tokens": 1}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 503  # the fault armed on the command line
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()

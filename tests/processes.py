"""Real processes for tests: ``python -m sidecar`` and ``redis-server`` on free loopback ports."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import aiohttp
import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _wait_until(check, within: float) -> None:
    async with asyncio.timeout(within):
        while not await check():  # noqa: ASYNC110 - the condition is another process's state
            await asyncio.sleep(0.02)


class SidecarProcess:
    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def log(self) -> str:
        """Everything the process wrote to stderr (once it exited; needs ``capture_log``)."""
        assert self.process.stderr is not None
        return (await self.process.stderr.read()).decode()

    def kill(self) -> None:
        """SIGKILL: no shutdown sequence, nothing released — a crashed pod."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)


@asynccontextmanager
async def sidecar_process(
    settings: Mapping[str, str] | None = None,
    /,
    *,
    capture_log: bool = False,
    until: str = "/health",
    **more: str,
) -> AsyncIterator[SidecarProcess]:
    """A sidecar process configured by ``SIDECAR_*`` variables (names without the prefix, from
    ``settings`` and ``more``), yielded once ``until`` answers 200."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env.update({"SIDECAR_HOST": "127.0.0.1", "SIDECAR_PORT": str(port)})
    variables = {**(settings or {}), **more}
    env.update({f"SIDECAR_{name.upper()}": value for name, value in variables.items()})
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        env=env,
        stderr=asyncio.subprocess.PIPE if capture_log else asyncio.subprocess.DEVNULL,
    )
    sidecar = SidecarProcess(process, port)
    try:
        async with aiohttp.ClientSession() as http:

            async def serving() -> bool:
                if process.returncode is not None:
                    raise RuntimeError(f"sidecar exited with {process.returncode}")
                try:
                    async with http.get(sidecar.url + until) as response:
                        return response.status == 200
                except OSError:
                    return False

            await _wait_until(serving, 15)
        yield sidecar
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (.ci/run installs it)")
        self.process = await asyncio.create_subprocess_exec(
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--enable-debug-command",
            "local",  # DEBUG SLEEP plays a slow Redis
            stdout=asyncio.subprocess.DEVNULL,
        )

        async def answering() -> bool:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                return False
            writer.close()
            await writer.wait_closed()
            return True

        await _wait_until(answering, 10)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        self.process = None


class EmulatorProcess:
    """``python -m sidecar.emulator`` on a fixed port, so it can be killed and started again
    where its clients expect it."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = f"127.0.0.1:{self.port}"
        self._flags = flags
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sidecar.emulator",
            "--port",
            str(self.port),
            *self._flags,
            stderr=asyncio.subprocess.DEVNULL,
        )
        async with aiohttp.ClientSession() as http:

            async def healthy() -> bool:
                try:
                    async with http.get(self.url + "/health") as response:
                        return response.status == 200
                except OSError:
                    return False

            await _wait_until(healthy, 15)

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        if self.process is not None:
            self.kill()
            await self.process.wait()
            self.process = None

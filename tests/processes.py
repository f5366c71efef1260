"""Real processes for tests: ``python -m sidecar``, the emulator, ``redis-server`` and a Redis
Cluster on free loopback ports, on the shared launcher (devkit/processes.py): each in its own
process group, its output in a log file, killed with the test run whatever happens."""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import devkit.rediscluster
from devkit.processes import Child, Launcher, Ready, environment, free_port, tcp_open
from tests.tools import program

START_TIMEOUT_S = 30.0
"""How long a sidecar or emulator may take to answer: seconds on an idle machine, over 15 on a
starved CI (the interpreter's imports alone)."""

__all__ = [
    "EmulatorProcess",
    "RedisCluster",
    "RedisServer",
    "SidecarProcess",
    "free_port",
    "sidecar_process",
]


class SidecarProcess:
    def __init__(self, process: Child, port: int) -> None:
        self.process = process
        """The running process: ``returncode``, ``await wait()``, ``send_signal()``."""
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def log(self) -> str:
        """Everything the process wrote (stderr and stdout) so far; all of it once it exited."""
        return self.process.log()

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
    until: Ready = "/health",
    environ: Mapping[str, str] | None = None,
    **more: str,
) -> AsyncIterator[SidecarProcess]:
    """A sidecar process configured by ``SIDECAR_*`` variables (names without the prefix, from
    ``settings`` and ``more``), yielded once ``until`` answers 200 (or, a check, holds);
    SIGTERM (then SIGKILL after 10 s) when the block ends. Its log is always kept, until then
    (``capture_log`` is accepted for older callers). ``environ``: other variables it gets
    (``OTEL_*``); this process's ``OTEL_*`` never reach it."""
    del capture_log
    port = free_port()
    variables = {**(settings or {}), **more}
    env = environment(
        {
            "SIDECAR_HOST": "127.0.0.1",
            "SIDECAR_PORT": str(port),
            **{f"SIDECAR_{name.upper()}": value for name, value in variables.items()},
            **(environ or {}),
        },
        drop=["SIDECAR_", "OTEL_"],
    )
    async with Launcher(prefix="pd-sidecar-test-") as launcher:
        process = await launcher.start(
            "sidecar",
            [sys.executable, "-m", "sidecar"],
            env=env,
            url=f"http://127.0.0.1:{port}",
            ready=until,
            timeout_s=START_TIMEOUT_S,
        )
        yield SidecarProcess(process, port)


class RedisServer:
    def __init__(self, port: int, *flags: str) -> None:
        """``flags``: more of ``redis-server``'s options (``--requirepass``, ``--unixsocket``)."""
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: Child | None = None
        self._flags = flags
        self._launcher = Launcher(prefix="pd-sidecar-redis-")

    async def start(self) -> None:
        binary = program("redis-server", "redis-server")
        argv = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", *self._flags,
        ]  # fmt: skip
        self.process = await self._launcher.start(
            "redis", argv, ready=lambda: tcp_open("127.0.0.1", self.port), timeout_s=10
        )

    async def stop(self) -> None:
        """SIGKILL: Redis is gone at once, as in a crash."""
        if self.process is not None:
            self.process.kill()
            await self.process.wait()
            await self._launcher.close()
        self.process = None


class EmulatorProcess:
    """``python -m sidecar.emulator`` on a fixed port, so it can be killed and started again
    where its clients expect it."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = f"127.0.0.1:{self.port}"
        self._flags = flags
        self.process: Child | None = None
        self._launcher = Launcher(prefix="pd-sidecar-emulator-")

    async def start(self) -> None:
        argv = [sys.executable, "-m", "sidecar.emulator", "--port", str(self.port), *self._flags]
        self.process = await self._launcher.start(
            "emulator", argv, url=self.url, ready="/health", timeout_s=START_TIMEOUT_S
        )

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    async def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            await self.process.wait()
            await self._launcher.close()
            self.process = None


class RedisCluster(devkit.rediscluster.RedisCluster):
    """devkit's cluster, its programs found as the tests find theirs (skipped when missing)."""

    def __init__(self, masters: int = 3, *, node_timeout_ms: int = 2000) -> None:
        super().__init__(masters, node_timeout_ms=node_timeout_ms, find=program)

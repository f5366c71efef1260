"""Child processes on loopback: start any command line, wait until it answers, stop it and
whatever it forked, keep its output.

Every child

- runs in a session (process group) of its own: stopping it reaches what it forked (a vLLM
  server forks an engine core and a worker), and a Ctrl-C in the terminal reaches the parent
  only, which then stops its children in order;
- gets SIGKILL when the thread that started it ends, even by SIGKILL (``PR_SET_PDEATHSIG``).
  The kernel ties this to the starting *thread*: start children from the thread that outlives
  them (the event loop's), never from a short-lived worker thread;
- writes stdout and stderr to one log file, appended to, so that a restart under the same name
  keeps the history; a failure to start or to get ready raises :class:`LaunchError` ending with
  the log's tail;
- is stopped by SIGTERM to its group, then SIGKILL to the group after a grace period. An
  ``atexit`` hook kills every group still alive when the interpreter exits.

Waiting for an exit needs no thread and no polling: a pidfd becomes readable when the child
exits. Readiness is polled, because it lives in another process, seen only over HTTP or TCP.

:class:`Launcher` starts and stops a set of children together, with their logs in one folder.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import aiohttp

READY_TIMEOUT_S = 30.0
"""How long a child may take to answer, by default."""
STOP_GRACE_S = 10.0
"""How long a child may take to exit after SIGTERM, by default, before SIGKILL."""
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1

Ready = str | Callable[[], Awaitable[bool]]
"""When a child is ready: a path under its URL (or a whole URL) answering 200, or a check."""

# Every process group started here and not yet stopped, for the atexit hook.
_LIVE_GROUPS: set[int] = set()


def free_port() -> int:
    """A loopback TCP port free right now (the child binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


QUIET_PORTS = (10000, 32768)
"""Where ``quiet_port`` looks when the kernel's ephemeral range cannot be read (Linux's default
range starts at 32768)."""
_HANDED: set[int] = set()


def quiet_port() -> int:
    """A loopback TCP port free right now and outside the kernel's ephemeral range, for a child
    that binds it only after seconds of start-up (vLLM: its API and NIXL side-channel ports, some
    30 s later). ``free_port`` hands out an ephemeral port, which an outgoing connection of any
    process may take meanwhile: once here, a vLLM engine's side channel found its port taken
    ("Address already in use") and the engine never started. Never the same port twice in one
    process."""
    low, high = QUIET_PORTS
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        high = min(high, ephemeral_low)
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _HANDED:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    return free_port()


class LaunchError(RuntimeError):
    """A child did not start, did not get ready in time, or died; the message ends with its
    log's tail."""


def _die_with_parent() -> None:
    """In the child, between fork and exec: SIGKILL when the starting thread dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Child:
    """One command line run as a child process; see the module's docstring for its contract.

    ``env`` is the child's whole environment (None: this process's), ``cwd`` its working
    directory (None: this process's). ``url`` is where it serves, for readiness paths and reports
    (None: it serves nothing the caller needs to name).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        url: str | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = None if env is None else dict(env)
        self.cwd = cwd
        self._url = url
        self._popen: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        pid = self._popen.pid if self._popen else None
        return f"<Child {self.name} pid={pid} returncode={self.returncode}>"

    @property
    def url(self) -> str:
        """Where it serves, e.g. ``http://127.0.0.1:8000``."""
        if self._url is None:
            raise RuntimeError(f"{self.name} was given no URL")
        return self._url

    @property
    def endpoint(self) -> str:
        """``host:port`` of :attr:`url`."""
        return self.url.split("://", 1)[-1].split("/", 1)[0]

    def start(self) -> Self:
        """Start the process (once); returns at once, see :meth:`wait_ready`."""
        if self._popen is not None:
            raise RuntimeError(f"{self.name} was started already")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            try:
                self._popen = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                raise LaunchError(f"{self.name}: cannot run {self.argv[0]}: {exc}") from exc
        _LIVE_GROUPS.add(self._popen.pid)
        return self

    @property
    def started(self) -> bool:
        return self._popen is not None

    @property
    def pid(self) -> int:
        """The process id, which is also its process group id."""
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: the signal that ended it), else None."""
        return None if self._popen is None else self._popen.poll()

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    @property
    def _process(self) -> subprocess.Popen[bytes]:
        if self._popen is None:
            raise RuntimeError(f"{self.name} was not started")
        return self._popen

    def send_signal(self, sig: int) -> None:
        """Signal the process itself (not its group); nothing once it exited."""
        self._process.send_signal(sig)

    def signal_group(self, sig: int) -> bool:
        """Signal every process of its group; False when none is left."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL to the whole group: no shutdown sequence, a crashed pod."""
        if self._popen is not None:
            self.signal_group(signal.SIGKILL)

    async def wait(self) -> int:
        """Its exit status, once it exited."""
        process = self._process
        if (code := process.poll()) is not None:
            return code
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()
        # Opened while the process is known unreaped (only we reap it): the right process.
        pidfd = os.pidfd_open(process.pid)

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        try:
            loop.add_reader(pidfd, readable)
            try:
                await exited
            finally:
                loop.remove_reader(pidfd)
        finally:
            os.close(pidfd)
        code = process.wait()
        if not self.signal_group(0):  # nothing of its group is left to kill at exit
            _LIVE_GROUPS.discard(process.pid)
        return code

    async def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the group, SIGKILL to what is left after ``grace_s``; idempotent.

        Returns the exit status (None: never started). What the process forked and left behind
        when it exited is killed with it."""
        if self._popen is None:
            return None
        if self.running:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wait(), grace_s)
        self.signal_group(signal.SIGKILL)  # whatever it forked and left behind
        code = await self.wait()
        _LIVE_GROUPS.discard(self.pid)
        return code

    async def wait_ready(self, ready: Ready, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Return once ``ready`` holds: a path under :attr:`url` or a whole URL answering 200,
        or a check of the caller's. Raises :class:`LaunchError` when the process exits first or
        ``timeout_s`` passes."""
        if isinstance(ready, str):
            url = ready if "://" in ready else f"{self.url}{ready}"
            async with aiohttp.ClientSession() as http:
                await self._until(lambda: http_ok(http, url), timeout_s, f"{url} answering 200")
        else:
            await self._until(ready, timeout_s, "ready")

    async def _until(
        self, check: Callable[[], Awaitable[bool]], timeout_s: float, what: str
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.running:
                raise LaunchError(
                    f"{self.name} exited with status {self.returncode} before {what};"
                    f" log {self.log_path}:\n{self.log_tail()}"
                )
            if await check():
                return
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{self.name}: not {what} within {timeout_s:g} s;"
                    f" log {self.log_path}:\n{self.log_tail()}"
                )
            # The condition lives in another process: there is no event to await.
            await asyncio.sleep(_POLL_S)

    def log(self) -> str:
        """Everything it wrote so far (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:]) or "(empty log)"


async def http_ok(http: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``GET url`` answers 200 now (False when nothing answers)."""
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            return response.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def tcp_open(host: str, port: int) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` now."""
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class Launcher:
    """Children started together, their logs in one folder, stopped together.

    ``log_dir`` None: a new folder under the system's temp dir, named with ``prefix``, removed
    when the launcher closes unless ``keep_logs``. A given folder is never removed. Each child
    logs to ``<log_dir>/<name>.log``.
    """

    def __init__(
        self,
        log_dir: Path | None = None,
        *,
        prefix: str = "pd-sidecar-",
        keep_logs: bool = False,
        grace_s: float = STOP_GRACE_S,
    ) -> None:
        self._own_dir = log_dir is None
        self.log_dir = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix=prefix))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.keep_logs = keep_logs or not self._own_dir
        self.grace_s = grace_s
        self.children: list[Child] = []

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        url: str | None = None,
    ) -> Child:
        """Start ``argv`` as the child ``name``; returns at once."""
        log_path = self.log_dir / f"{name}.log"
        child = Child(name, argv, log_path=log_path, env=env, cwd=cwd, url=url)
        self.children.append(child)
        return child.start()

    async def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        url: str | None = None,
        ready: Ready | None = None,
        timeout_s: float = READY_TIMEOUT_S,
    ) -> Child:
        """Start ``argv`` as the child ``name`` and return once ``ready`` holds (see
        :meth:`Child.wait_ready`; None: at once)."""
        child = self.spawn(name, argv, env=env, cwd=cwd, url=url)
        if ready is not None:
            await child.wait_ready(ready, timeout_s)
        return child

    async def stop(self) -> None:
        """Stop every child, all at once (each: SIGTERM, SIGKILL after the grace period)."""
        await asyncio.gather(*(child.stop(self.grace_s) for child in self.children))

    async def close(self) -> None:
        try:
            await self.stop()
        finally:
            if not self.keep_logs:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def environment(overrides: Mapping[str, str], *, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment without the variables starting with any of ``drop``, plus
    ``overrides``: what a child gets, with nothing of ours leaking into its settings."""
    env = {k: v for k, v in os.environ.items() if not (drop and k.startswith(tuple(drop)))}
    env.update(overrides)
    return env


@atexit.register
def _kill_leftovers() -> None:
    for group in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    _LIVE_GROUPS.clear()

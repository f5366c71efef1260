"""The benchmarks' processes, on the shared launcher (devkit/processes.py).

:class:`BenchLauncher` is devkit's :class:`~devkit.processes.Launcher` (each child in its own
process group with its output in a log file, stopped by SIGTERM then SIGKILL, an ``atexit`` hook
and ``PR_SET_PDEATHSIG`` as the last resorts: no emulator survives the benchmark that started it)
that also knows how to start the project's own programs: an emulator, a prefill and a decode
emulator together, and a sidecar, as subprocesses of ``sys.executable`` on free loopback ports;
each is ready when it answers (``/health`` for the emulators, ``/ready`` for the sidecar, which
waits for its decode engine). A command line to run them under (``taskset -c 1`` to pin a core)
may be put in front. The load, soak, bodies, prefill-answer, overhead and calibration benchmarks
start theirs here; bench/connections.py (a sidecar with no reachable engine, under ``prlimit``)
and bench/instructions.py (a sidecar under callgrind) start theirs their own way.

:class:`Cluster` is the load benchmarks' set: one prefill emulator, one decode emulator and one
sidecar, started on entering its ``async with`` block. Leaving it, by any route (an error,
Ctrl-C, a SIGTERM turned into a cancellation by :func:`run`), stops them all. It also holds what
the benchmarks judge the idle sidecar by: its sockets, its logs, the slack allowed above the
baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
import sys
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import orjson

from bench.readings import Metrics, SidecarReading, read_proc, tcp_sockets
from devkit.processes import Child, Launcher, environment, free_port
from sidecar.engines.upstream import POLL_CONNECTIONS_PER_ENGINE

STOP_GRACE_S = 5.0


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class BenchLauncher(Launcher):
    """A :class:`~devkit.processes.Launcher` that keeps its logs and starts our programs.

    ``under``, where a method takes it, is a command line the program runs under, in front of
    its own (``taskset -c 1``: pinned to CPU 1); it execs the program, so the child's pid is the
    program's.
    """

    def __init__(
        self,
        log_dir: Path | None = None,
        *,
        prefix: str = "pd-sidecar-bench-",
        grace_s: float = STOP_GRACE_S,
    ) -> None:
        super().__init__(log_dir, prefix=prefix, keep_logs=True, grace_s=grace_s)

    def spawn_emulator(
        self, name: str, flags: Sequence[str] = (), *, under: Sequence[str] = ()
    ) -> Child:
        """``python -m sidecar.emulator`` on free ports (API, side channel); returns at once."""
        port = free_port()
        argv = [
            *under, sys.executable, "-m", "sidecar.emulator", "--port", str(port),
            "--side-channel-port", str(free_port()), *flags,
        ]  # fmt: skip
        return self.spawn(name, argv, url=f"http://127.0.0.1:{port}")

    async def start_emulators(
        self,
        *,
        prefill_flags: Sequence[str] = (),
        decode_flags: Sequence[str] = (),
        under: Sequence[str] = (),
    ) -> tuple[Child, Child]:
        """A prefill and a decode emulator, started together; returns once both answer."""
        prefill = self.spawn_emulator("prefill", prefill_flags, under=under)
        decode = self.spawn_emulator("decode", decode_flags, under=under)
        for child in (prefill, decode):
            await child.wait_ready("/health")
        return prefill, decode

    def spawn_sidecar(
        self,
        name: str = "sidecar",
        *,
        decode_url: str,
        settings: Mapping[str, str] | None = None,
        under: Sequence[str] = (),
        checkout: Path | None = None,
    ) -> Child:
        """``python -m sidecar`` on a free loopback port with ``decode_url`` as its engine and
        ``settings`` (``SIDECAR_*`` variables) on top; none of this process's ``SIDECAR_*``
        variables reach it. Returns at once; it is ready when ``/ready`` answers (once its decode
        engine does).

        ``checkout``: run the sidecar of that checkout instead (started in its directory, so
        that ``-m sidecar`` imports its code; with its ``.venv``'s Python when it has one)."""
        port = free_port()
        python, cwd = sys.executable, None
        if checkout is not None:
            own = checkout / ".venv" / "bin" / "python"
            python, cwd = str(own) if own.exists() else sys.executable, checkout
        env = {
            "SIDECAR_HOST": "127.0.0.1",
            "SIDECAR_PORT": str(port),
            "SIDECAR_DECODE_URL": decode_url,
            **(settings or {}),
        }
        return self.spawn(
            name,
            [*under, python, "-m", "sidecar"],
            env=environment(env, drop=["SIDECAR_"]),
            cwd=cwd,
            url=f"http://127.0.0.1:{port}",
        )


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The three processes of a benchmark. Emulator delays are in seconds (see emulator.md)."""

    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.2
    emulator_args: tuple[str, ...] = ()
    """Extra flags for both emulators, e.g. ``("--jitter", "0.1")``."""
    sidecar_env: Mapping[str, str] = field(default_factory=dict)
    """Extra ``SIDECAR_*`` variables, on top of host, port and decode URL."""
    log_dir: Path | None = None
    """Where the children's logs go; None: a new directory under the system temp dir."""
    prefill_pool: bool = False
    """The prefill emulator in the sidecar's pool (``SIDECAR_PREFILL_ENDPOINTS``) too: only a
    pool endpoint has a prefill prefix index (a header naming one still picks it)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, decode_s_per_token: float) -> ClusterConfig:
        """What the flags of :func:`add_cluster_arguments` ask for."""
        return cls(
            prefill_s_per_token=args.prefill_s_per_token,
            decode_s_per_token=decode_s_per_token,
            emulator_args=tuple(args.emulator_arg),
            sidecar_env=dict(item.split("=", 1) for item in args.sidecar_env),
            log_dir=args.log_dir,
        )


class Cluster(BenchLauncher):
    """Prefill emulator, decode emulator and sidecar, started and stopped together."""

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config.log_dir)
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    @property
    def prefill(self) -> Child:
        return self.children[0]

    @property
    def decode(self) -> Child:
        return self.children[1]

    @property
    def sidecar(self) -> Child:
        return self.children[2]

    @property
    def session(self) -> aiohttp.ClientSession:
        """A small session for control traffic (health, metrics, KV state)."""
        assert self._session is not None
        return self._session

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def _start(self) -> None:
        config = self.config
        _, decode = await self.start_emulators(
            prefill_flags=(
                "--prefill-s-per-token", str(config.prefill_s_per_token), *config.emulator_args
            ),
            decode_flags=(
                "--decode-s-per-token", str(config.decode_s_per_token), *config.emulator_args
            ),
        )  # fmt: skip
        pool = {"SIDECAR_PREFILL_ENDPOINTS": self.prefill.endpoint} if config.prefill_pool else {}
        sidecar = self.spawn_sidecar(
            decode_url=decode.url,
            settings={"SIDECAR_LOG_LEVEL": "WARNING", **pool, **config.sidecar_env},
        )
        await sidecar.wait_ready("/ready")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await super().close()

    async def get_json(self, url: str) -> Any:
        async with self.session.get(url) as response:
            response.raise_for_status()
            return orjson.loads(await response.read())

    async def sidecar_metrics(self) -> Metrics:
        async with self.session.get(self.sidecar.url + "/metrics") as response:
            response.raise_for_status()
            return Metrics.parse(await response.text())

    async def read_sidecar(self) -> SidecarReading:
        """The sidecar's process readings plus its own task and in-flight gauges."""
        metrics = await self.sidecar_metrics()
        return SidecarReading(
            read_proc(self.sidecar.pid),
            metrics.value("pd_sidecar_asyncio_tasks"),
            metrics.value("pd_sidecar_inflight_requests"),
        )

    async def prefix_index_blocks(self) -> int:
        """Blocks in the scheduler's local prefix-cache estimate (an LRU bounded by
        ``SIDECAR_PREFIX_CACHE_BLOCKS``): the sidecar's largest structure that grows with
        distinct prompts until it is full."""
        view = await self.get_json(self.sidecar.url + "/debug/scheduler")
        return int(view["local"]["prefix_index_blocks"])

    def prefix_index_capacity(self) -> int:
        return int(self.config.sidecar_env.get("SIDECAR_PREFIX_CACHE_BLOCKS", 65536))

    async def kv_state(self) -> dict[str, Any]:
        """The prefill emulator's ``/emulator/kv`` (staged blocks, pulls, expiries)."""
        state: dict[str, Any] = await self.get_json(self.prefill.url + "/emulator/kv")
        return state

    async def debug_inflight(self) -> list[Any]:
        records: dict[str, Any] = await self.get_json(self.sidecar.url + "/debug/requests")
        inflight: list[Any] = records["inflight"]
        return inflight

    def sidecar_sockets(self) -> Counter[str]:
        """The sidecar's TCP sockets by peer (prefill, decode, sidecar clients) and state."""
        names = {}
        for child in self.children:
            names[int(child.url.rsplit(":", 1)[1])] = child.name
        return tcp_sockets(self.sidecar.pid, names)

    def decode_pool_bound(self) -> int:
        """How many idle connections to the decode engine the sidecar may keep for good: the
        poll pool's cap, ``sidecar.engines.upstream.POLL_CONNECTIONS_PER_ENGINE`` (2).

        Its readiness ``/health`` (every ``SIDECAR_READY_INTERVAL_S``) and its scheduler's
        ``/metrics`` scrape (every ``SIDECAR_SCRAPE_INTERVAL_S``) go through that pool and keep
        its connections alive; request traffic has a pool of its own, whose idle connections
        close 30-60 s after their last use (keep-alive 30 s, swept every 30 s), whatever the
        poll rate. Before the pools were split, the polls kept ~45 of those alive for good
        (docs/benchmarks.md): the check exists to catch that again.
        """
        return POLL_CONNECTIONS_PER_ENGINE

    def idle_socket_problems(self, sockets: Counter[str]) -> list[str]:
        """What is wrong with the idle sidecar's sockets (after more than 2 x keep-alive)."""
        problems = []
        bound = self.decode_pool_bound()
        for key, count in sorted(sockets.items()):
            peer, _, state = key.rpartition(" ")
            polled = peer == "decode" or (peer == "prefill" and self.config.prefill_pool)
            if polled and state == "ESTABLISHED":  # a pool's prefill endpoint is polled too
                if count > bound:
                    problems.append(f"{count} idle {peer} connections (at most {bound} expected)")
            elif peer == "sidecar clients" and state in ("LISTEN", "ESTABLISHED"):
                if state == "ESTABLISHED" and count > 1:  # 1: the benchmark's control session
                    problems.append(f"{count} client connections open")
            else:
                problems.append(f"{count} sockets {key}")
        return problems

    def log_problems(self) -> dict[str, int]:
        """Per child, how many log lines are warnings, errors or tracebacks."""
        problems = {}
        for child in self.children:
            text = child.log()
            count = sum(
                1
                for line in text.splitlines()
                if " WARNING " in line or " ERROR " in line or line.startswith("Traceback")
            )
            problems[child.name] = count
        return problems


def run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """``asyncio.run(main())`` on uvloop when available; SIGTERM cancels like Ctrl-C does."""

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await main()

    try:
        import uvloop

        return uvloop.run(guarded())
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(guarded())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\ninterrupted; child processes stopped", file=sys.stderr)
        return 130


TASK_SLACK = 3
"""Asyncio tasks the idle sidecar may have above its baseline (periodic pollers come and go)."""
FD_SLACK = 5
"""Open fds the idle sidecar may have above its baseline, besides idle decode connections."""


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every load benchmark shares: the emulated cluster and where its logs go."""
    parser.add_argument(
        "--prefill-s-per-token", type=float, default=0.0002, help="prefill emulator delay"
    )
    parser.add_argument(
        "--emulator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for both emulators (repeatable; e.g. --emulator-arg=--jitter=0.1)",
    )
    add_launcher_arguments(parser)


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every benchmark that starts a sidecar: its settings and where logs go."""
    parser.add_argument(
        "--sidecar-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra sidecar variable (repeatable)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="children's logs")

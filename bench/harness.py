"""What the load and soak benchmarks share: child processes, process readings, and the client.

Processes. :class:`Cluster` starts one prefill emulator, one decode emulator and one sidecar as
subprocesses of ``sys.executable`` on free loopback ports, each in its own session (process group)
with its output in a log file, and waits until each one answers (`/health` for the emulators,
`/ready` for the sidecar, which waits for its decode engine). Leaving the ``async with`` block, by
any route (an error, Ctrl-C, a SIGTERM turned into a cancellation by :func:`run`), sends SIGTERM to
every process group, then SIGKILL to whatever is left after a grace period. An ``atexit`` hook and
``PR_SET_PDEATHSIG`` are the last resorts: no emulator survives the benchmark that started it.

Readings. RSS, peak RSS (``VmHWM``), open fds, TCP sockets and CPU seconds come from
``/proc/<pid>``; the sidecar's own view (asyncio tasks, in-flight records, counters) from its
``/metrics``; the machine's CPU pressure from ``/proc/pressure/cpu``.

Client. :func:`stream_one` sends one streaming completion or chat completion and checks the whole
answer: status 200, an event stream, the expected number of token events, no error event, and
``data: [DONE]`` last. :class:`ClientStats` counts what is open at any moment, the peaks and the
errors by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp
import orjson

PREFILL_HEADER = "x-prefiller-host-port"
MODEL = "emulated-model"
READY_TIMEOUT_S = 30.0
SIDECAR_KEEPALIVE_S = 30.0
"""Keep-alive of the sidecar's idle engine connections (sidecar/upstream.py)."""
STOP_GRACE_S = 5.0
_TICKS = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1
_DONE = b"data: [DONE]"

# Every process group started here, so that the atexit hook can reach the ones a crash left.
_LIVE_GROUPS: set[int] = set()


# --------------------------------------------------------------------------- processes


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def free_port() -> int:
    """A loopback port free right now (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the benchmark dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(slots=True)
class Child:
    """One subprocess: its name in reports, its base URL and where its output goes."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def endpoint(self) -> str:
        return self.url.removeprefix("http://")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def spawn(
    name: str, argv: Sequence[str], *, url: str, log_dir: Path, env: Mapping[str, str] | None
) -> Child:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
            start_new_session=True,  # its own process group: Ctrl-C reaches us, not it
            preexec_fn=_die_with_parent,
        )
    _LIVE_GROUPS.add(process.pid)
    return Child(name, process, url, log_path)


def stop_children(children: Sequence[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process group, wait up to ``grace_s``, SIGKILL the rest. Blocking."""
    for child in children:
        if child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.process.wait()
        _LIVE_GROUPS.discard(child.pid)


@atexit.register
def _kill_leftovers() -> None:
    for group in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    _LIVE_GROUPS.clear()


async def wait_ready(session: aiohttp.ClientSession, child: Child, path: str) -> None:
    """Poll ``path`` until it answers 200; fail early when the child exits."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if child.process.poll() is not None:
            raise RuntimeError(
                f"{child.name} exited with status {child.process.returncode}:\n{child.log_tail()}"
            )
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(
                child.url + path, timeout=aiohttp.ClientTimeout(total=2)
            ) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not ready after {READY_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.1)


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


class Cluster:
    """Prefill emulator, decode emulator and sidecar, started and stopped together."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="pd-sidecar-bench-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
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

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _start(self) -> None:
        config = self.config
        python = sys.executable
        for name, delays in (
            ("prefill", ("--prefill-s-per-token", str(config.prefill_s_per_token))),
            ("decode", ("--decode-s-per-token", str(config.decode_s_per_token))),
        ):
            port = free_port()
            argv = [
                python, "-m", "sidecar.emulator", "--port", str(port),
                "--side-channel-port", str(free_port()), *delays, *config.emulator_args,
            ]  # fmt: skip
            self.children.append(
                spawn(name, argv, url=f"http://127.0.0.1:{port}", log_dir=self.log_dir, env=None)
            )
        for child in self.children:
            await wait_ready(self.session, child, "/health")
        port = free_port()
        env = {
            "SIDECAR_HOST": "127.0.0.1",
            "SIDECAR_PORT": str(port),
            "SIDECAR_DECODE_URL": self.decode.url,
            "SIDECAR_LOG_LEVEL": "WARNING",
            **config.sidecar_env,
        }
        self.children.append(
            spawn(
                "sidecar",
                [python, "-m", "sidecar"],
                url=f"http://127.0.0.1:{port}",
                log_dir=self.log_dir,
                env=env,
            )
        )
        await wait_ready(self.session, self.sidecar, "/ready")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        # Blocking, but short and the last thing the benchmark does; a thread would be lost
        # if the loop is being torn down by Ctrl-C.
        stop_children(self.children)

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
        """How many idle connections to the decode engine the sidecar may keep for good.

        aiohttp's pool hands out the least recently used idle connection (FIFO), and the
        sidecar's periodic calls to the decode engine (readiness ``/health`` every
        ``SIDECAR_READY_INTERVAL_S``, scheduler scrape of ``/metrics`` every
        ``SIDECAR_SCRAPE_INTERVAL_S``) share the pool with requests: each poll takes the oldest
        idle connection and makes it new again, so about polls-per-second x keep-alive (30 s)
        idle connections are refreshed before they expire, indefinitely (docs/benchmarks.md).
        """
        env = self.config.sidecar_env
        ready_s = float(env.get("SIDECAR_READY_INTERVAL_S", 2))
        scrape_s = float(env.get("SIDECAR_SCRAPE_INTERVAL_S", 1))
        return math.ceil(SIDECAR_KEEPALIVE_S * (1 / ready_s + 1 / scrape_s)) + 1

    def idle_socket_problems(self, sockets: Counter[str]) -> list[str]:
        """What is wrong with the idle sidecar's sockets (after more than 2 x keep-alive)."""
        problems = []
        bound = self.decode_pool_bound()
        for key, count in sorted(sockets.items()):
            peer, _, state = key.rpartition(" ")
            if peer == "decode" and state == "ESTABLISHED":
                if count > bound:
                    problems.append(f"{count} idle decode connections (at most {bound} expected)")
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
            try:
                text = child.log_path.read_text(errors="replace")
            except OSError:
                continue
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


# --------------------------------------------------------------------------- readings


@dataclass(frozen=True, slots=True)
class ProcReading:
    """One process at one moment, from /proc."""

    rss: int
    """Resident set size, bytes."""
    hwm: int
    """Peak resident set size since start (``VmHWM``), bytes."""
    fds: int
    cpu_s: float
    """User + system CPU seconds since start."""


def read_proc(pid: int) -> ProcReading:
    status: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024
    with open(f"/proc/{pid}/stat") as file:
        # Fields after the command name, which is in parentheses and may contain spaces.
        fields = file.read().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / _TICKS
    return ProcReading(
        rss=status.get("VmRSS", 0),
        hwm=status.get("VmHWM", 0),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        cpu_s=cpu_s,
    )


@dataclass(frozen=True, slots=True)
class SidecarReading:
    proc: ProcReading
    tasks: float
    """``pd_sidecar_asyncio_tasks``"""
    inflight: float
    """``pd_sidecar_inflight_requests``"""


_TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
    "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
    "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}  # fmt: skip


def tcp_sockets(pid: int, names: Mapping[int, str]) -> Counter[str]:
    """The TCP sockets ``pid`` holds, counted by "peer state": the peer is the name in
    ``names`` of the remote port (or of the local port, for accepted connections), else
    "other"; e.g. ``{"decode ESTABLISHED": 3, "client CLOSE_WAIT": 1}``."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    counts: Counter[str] = Counter()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as file:
            next(file)
            for line in file:
                fields = line.split()
                if fields[9] not in inodes:
                    continue
                local = int(fields[1].rsplit(":", 1)[1], 16)
                remote = int(fields[2].rsplit(":", 1)[1], 16)
                peer = names.get(remote) or (
                    f"{names[local]} clients" if local in names else "other"
                )
                counts[f"{peer} {_TCP_STATES.get(fields[3], fields[3])}"] += 1
    return counts


def cpu_pressure_us() -> float | None:
    """Total microseconds during which some runnable task waited for a CPU (Linux PSI)."""
    try:
        with open("/proc/pressure/cpu") as file:
            for line in file:
                if line.startswith("some"):
                    return float(line.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        pass
    return None


@dataclass(slots=True)
class Contention:
    """How starved the machine and this process were between :meth:`start` and :meth:`stop`:
    the CPU pressure (share of the time some task waited for a CPU) and the worst lateness of
    this event loop. On a shared 2-core machine, latency figures only mean something when
    both are low."""

    max_loop_lag_s: float = 0.0
    pressure_pct: float | None = None
    _task: asyncio.Task[None] | None = None
    _psi: float | None = None
    _start: float = 0.0

    def start(self) -> None:
        self._psi, self._start = cpu_pressure_us(), time.monotonic()
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        psi = cpu_pressure_us()
        elapsed = time.monotonic() - self._start
        if psi is not None and self._psi is not None and elapsed > 0:
            self.pressure_pct = 100 * (psi - self._psi) / 1e6 / elapsed

    async def _watch(self, period_s: float = 0.05) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(period_s)
            self.max_loop_lag_s = max(self.max_loop_lag_s, time.monotonic() - before - period_s)

    def describe(self) -> str:
        pressure = "n/a" if self.pressure_pct is None else f"{self.pressure_pct:.0f}%"
        return (
            f"CPU pressure (PSI some) {pressure} of the time;"
            f" client event-loop lag max {self.max_loop_lag_s * 1000:.0f} ms"
        )


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Metrics:
    """Samples of a Prometheus text page, keyed by name and labels."""

    def __init__(self, samples: dict[str, list[tuple[dict[str, str], float]]]) -> None:
        self._samples = samples

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            name, _, rest = head.partition("{")
            labels: dict[str, str] = {}
            if rest:
                for pair in rest.rstrip("}").split(","):
                    if "=" in pair:
                        key, _, raw = pair.partition("=")
                        labels[key.strip()] = raw.strip().strip('"')
            samples.setdefault(name, []).append((labels, float(value)))
        return cls(samples)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(
            value
            for sample_labels, value in self._samples.get(name, [])
            if all(sample_labels.get(key) == want for key, want in labels.items())
        )

    def by_label(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        result: dict[tuple[str, ...], float] = {}
        for labels, value in self._samples.get(name, []):
            key = tuple(labels.get(k, "") for k in keys)
            result[key] = result.get(key, 0.0) + value
        return result


# --------------------------------------------------------------------------- client


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended, as the client saw it."""

    ok: bool
    error: str | None
    """None, or the kind of failure (``status 503``, ``timeout``, ``broken``, ``no [DONE]``...)."""
    ttft_s: float | None
    """Time from sending to the first byte of the answer body."""
    total_s: float
    aborted: bool = False
    """The client left on purpose before the end (soak disconnects)."""


@dataclass(slots=True)
class ClientStats:
    """Live counts of the load generator; mutated by :func:`stream_one` only."""

    started: int = 0
    finished: int = 0
    ok: int = 0
    aborted: int = 0
    inflight: int = 0
    """Requests sent and not finished."""
    open_streams: int = 0
    """Answers whose headers arrived and whose body is still being read."""
    max_inflight: int = 0
    max_open_streams: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: dict[str, str] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    events: int = 0

    def record(self, outcome: Outcome, detail: str = "") -> None:
        self.finished += 1
        if outcome.aborted:
            self.aborted += 1
        elif outcome.ok:
            self.ok += 1
            self.durations.append(outcome.total_s)
            if outcome.ttft_s is not None:
                self.ttfts.append(outcome.ttft_s)
        else:
            assert outcome.error is not None
            self.errors[outcome.error] += 1
            self.error_examples.setdefault(outcome.error, detail[:300])

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the workload."""

    index: int
    chat: bool
    output_tokens: int
    prompt_tokens: int
    prefill: str | None
    """``host:port`` for the prefill header, or None for a local-only request."""
    timeout_s: float
    abort_after_s: float | None = None
    """Disconnect this long after sending (None: read to the end)."""


def request_body(spec: RequestSpec) -> bytes:
    # A distinct prompt per request, about prompt_tokens tokens (the emulator counts 4 chars).
    words = max(1, spec.prompt_tokens * 4 // 6 - 4)
    text = f"request {spec.index} " + " ".join(["words"] * words)
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": spec.output_tokens,
        "stream": True,
    }
    if spec.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return orjson.dumps(body)


def check_stream(body: bytes, spec: RequestSpec) -> str | None:
    """None when ``body`` is a complete, well-formed answer; else the kind of failure."""
    if not body.rstrip().endswith(_DONE):
        return "error event" if b'"error"' in body else "no [DONE]"
    events = [e for e in body.split(b"\n\n") if e.strip()]
    tokens = 0
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            return "malformed event"
        try:
            chunk = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return "malformed event"
        if "error" in chunk:
            return "error event"
        choices = chunk.get("choices") or []
        if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
            tokens += 1
    if tokens != spec.output_tokens:
        return f"{tokens}/{spec.output_tokens} tokens"
    return None


async def stream_one(
    session: aiohttp.ClientSession, base_url: str, spec: RequestSpec, stats: ClientStats
) -> Outcome:
    """Send ``spec``, read and check the whole stream, count it in ``stats``."""
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    headers = {"content-type": "application/json", "x-request-id": f"bench-{spec.index}"}
    if spec.prefill is not None:
        headers[PREFILL_HEADER] = spec.prefill
    stats.started += 1
    stats.inflight += 1
    stats.max_inflight = max(stats.max_inflight, stats.inflight)
    start = time.monotonic()
    ttft: float | None = None
    streaming = False
    parts: list[bytes] = []
    abort = spec.abort_after_s is not None and spec.abort_after_s < spec.timeout_s
    limit = spec.abort_after_s if abort and spec.abort_after_s is not None else spec.timeout_s
    outcome: Outcome
    detail = ""
    try:
        async with asyncio.timeout(limit):
            async with session.post(
                base_url + path, data=request_body(spec), headers=headers
            ) as response:
                if response.status != 200:
                    detail = (await response.read()).decode(errors="replace")
                    outcome = Outcome(False, f"status {response.status}", None, _since(start))
                else:
                    streaming = True
                    stats.open_streams += 1
                    stats.max_open_streams = max(stats.max_open_streams, stats.open_streams)
                    async for chunk in response.content.iter_any():
                        if ttft is None:
                            ttft = _since(start)
                        parts.append(chunk)
                    body = b"".join(parts)
                    problem = check_stream(body, spec)
                    detail = body[-300:].decode(errors="replace")
                    stats.events += body.count(b"data: ")
                    outcome = Outcome(problem is None, problem, ttft, _since(start))
    except TimeoutError:
        if abort:
            outcome = Outcome(True, None, ttft, _since(start), aborted=True)
        else:
            outcome = Outcome(False, "timeout", ttft, _since(start))
    except aiohttp.ClientPayloadError as exc:
        outcome, detail = Outcome(False, "broken stream", ttft, _since(start)), repr(exc)
    except aiohttp.ClientError as exc:
        kind = "broken stream" if streaming else f"connection: {type(exc).__name__}"
        outcome, detail = Outcome(False, kind, ttft, _since(start)), repr(exc)
    finally:
        stats.inflight -= 1
        if streaming:
            stats.open_streams -= 1
    stats.record(outcome, detail)
    return outcome


def _since(start: float) -> float:
    return time.monotonic() - start


async def run_workers(
    concurrency: int,
    ramp_s: float,
    next_spec: Callable[[], RequestSpec | None],
    send: Callable[[RequestSpec], Awaitable[Outcome]],
) -> None:
    """``concurrency`` loops, started evenly over ``ramp_s``, each sending ``next_spec()`` one
    after the other until it returns None."""

    async def worker(delay: float) -> None:
        await asyncio.sleep(delay)
        while (spec := next_spec()) is not None:
            await send(spec)

    step = ramp_s / concurrency if concurrency else 0.0
    async with asyncio.TaskGroup() as group:
        for i in range(concurrency):
            group.create_task(worker(i * step))


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    """Poll ``check`` every 0.2 s until it is true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.2)
    return True


def client_session() -> aiohttp.ClientSession:
    """The load generator's session: no connection cap, no aiohttp timeout (each request has
    its own)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
    )


# --------------------------------------------------------------------------- formatting


def mib(value: float) -> str:
    return f"{value / (1 << 20):.1f} MiB"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.0f} ms"


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


TASK_SLACK = 3
"""Asyncio tasks the idle sidecar may have above its baseline (periodic pollers come and go)."""
FD_SLACK = 5
"""Open fds the idle sidecar may have above its baseline, besides idle decode connections."""


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every benchmark shares: the emulated cluster and where its logs go."""
    parser.add_argument(
        "--prefill-s-per-token", type=float, default=0.0002, help="prefill emulator delay"
    )
    parser.add_argument(
        "--sidecar-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra sidecar variable (repeatable)",
    )
    parser.add_argument(
        "--emulator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for both emulators (repeatable; e.g. --emulator-arg=--jitter=0.1)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="children's logs")

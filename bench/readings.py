"""Readings of the benchmark's processes and of the machine.

RSS, peak RSS (``VmHWM``), open fds, TCP sockets and CPU seconds come from ``/proc/<pid>``; the
sidecar's own view (asyncio tasks, in-flight records, counters) from its ``/metrics``
(:class:`Metrics`); the machine's CPU pressure from ``/proc/pressure/cpu`` and this process's
event-loop lag (:class:`Contention`). Also the units the reports print them in.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")


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


def io_syscalls(pid: int) -> tuple[int, int]:
    """Read-type and write-type system calls ``pid`` made so far (``syscr``, ``syscw`` of
    ``/proc/<pid>/io``: libuv's ``read``/``write``/``writev`` on sockets count, ``recvmsg`` and
    ``sendmsg`` do not); (0, 0) when unreadable."""
    counts = {"syscr": 0, "syscw": 0}
    try:
        with open(f"/proc/{pid}/io") as file:
            for line in file:
                key, _, value = line.partition(":")
                if key in counts:
                    counts[key] = int(value)
    except OSError:
        pass
    return counts["syscr"], counts["syscw"]


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


def mib(value: float) -> str:
    return f"{value / (1 << 20):.1f} MiB"


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.0f} ms"


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"

"""Real vLLM engines (and the sidecar) as local processes, for the end-to-end suite and the demo.

Standard library only: this module runs under the sidecar's interpreter and starts the engines
with the interpreter of the separate vLLM environment that ``e2e/setup_vllm.sh`` builds. Facts
behind every flag and variable: ../shared/reference/real-vllm-on-cpu.md and docs/e2e.md.

Every process starts in a session of its own, so that ``stop()`` can signal the whole group (a
vLLM server forks an engine-core and a worker process) and nothing outlives a failed test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SERVED_MODEL = "tiny-llama"
MAX_MODEL_LEN = 4096
KV_CACHE_BYTES = 128 * 1024 * 1024
"""KV cache per engine: 131072 tokens of the tiny model (1 KiB each), 1024 blocks of 128."""

Role = Literal["prefill", "decode"]
_KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}

_OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# UCX would also listen on the machine's external interface; NIXL's side channel (the handshake the
# decode engine makes with the prefill engine) defaults to localhost resolution otherwise.
_NIXL_ENV = {
    "UCX_TLS": "self,sm,tcp",
    "UCX_NET_DEVICES": "lo",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}


class EngineError(RuntimeError):
    """An engine (or the sidecar) did not start, or died; the message ends with its log's tail."""


@dataclass(frozen=True, slots=True)
class VllmHome:
    """Where ``e2e/setup_vllm.sh`` put the vLLM environment and the tiny model."""

    root: Path

    @classmethod
    def locate(cls) -> VllmHome:
        default = Path.home() / ".cache" / "pd-sidecar" / "vllm"
        return cls(Path(os.environ.get("PD_SIDECAR_VLLM_HOME") or default))

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / "model"

    def missing(self) -> str | None:
        """Why the environment is not usable, or None when it is."""
        if not self.python.exists() or not (self.model / "config.json").exists():
            return (
                f"no vLLM environment in {self.root}: run `make e2e-vllm-setup` "
                "(e2e/setup_vllm.sh) first"
            )
        return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass(slots=True, eq=False)
class Process:
    """A child process in its own session, logging to a file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; idempotent."""
        if self.popen is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader exited; its children (engine core, worker) may still be going down.
            if not _group_alive(self.popen.pid):
                break
        if self.popen.poll() is None:
            self.popen.wait()

    def wait_until(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise EngineError(
                    f"{self.name} exited ({self.popen.returncode if self.popen else '?'}) "
                    f"before {what}; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if check():
                return
            time.sleep(0.25)
        raise EngineError(
            f"{self.name}: no {what} within {timeout_s:.0f} s; log {self.log_path}:\n"
            f"{log_tail(self.log_path)}"
        )


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def engine_cores() -> tuple[int | None, int | None]:
    """A core for the prefill engine and another for the decode engine (see ``VllmEngine.argv``),
    or no pinning at all when there are fewer than two cores or no ``taskset``."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return None, None
    return cores[0], cores[1]


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The status of ``GET url``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, TimeoutError):
        return None


@dataclass(slots=True, eq=False)
class VllmEngine:
    """One real vLLM OpenAI server with NixlConnector on CPU memory."""

    role: Role
    home: VllmHome
    log_dir: Path
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    cpu: int | None = None
    """The one core for all of the engine's processes (see ``argv``), None: any core."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Overrides of the engine's environment (e.g. UCX_LOG_LEVEL when debugging a transfer)."""
    process: Process | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        """``host:port`` as the gateway names a prefill server (x-prefiller-host-port)."""
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        """The server's command line, under ``taskset`` when the engine has a core of its own.

        Why pin every process and thread of the engine, not only its compute threads: each engine
        has busy-polling threads (the engine core and the worker spin on a shared-memory queue,
        UCX polls). Spread over a 2-core machine, they starve the other engine; KV pulls of
        concurrent requests then stalled until the prefill engine's 30 s lease expired (the decode
        read freed blocks; the prefill counted them expired) — with or without the sidecar. With
        each engine on a core of its own, 32 concurrent P/D requests take about a second.
        """
        kv_config = {
            "kv_connector": "NixlConnector",
            "kv_role": _KV_ROLES[self.role],
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {},
        }
        pin = ["taskset", "-c", str(self.cpu)] if self.cpu is not None else []
        return [
            *pin,
            str(self.home.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.home.model),  # the same path on both: NIXL's compatibility hash includes it
            "--served-model-name",
            SERVED_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-num-seqs",
            "16",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(kv_config),
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "UCX_"))}
        env.update(_OFFLINE_ENV)
        env.update(_NIXL_ENV)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        self.process = Process(
            f"vLLM {self.role} engine",
            self.argv(),
            self.environment(),
            self.log_dir / f"vllm-{self.role}-{self.port}.log",
        )
        self.process.start()

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        assert self.process is not None, "start() first"
        self.process.wait_until(
            lambda: http_status(self.url + "/health") == 200, timeout_s, "/health answering 200"
        )

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    @property
    def log_path(self) -> Path | None:
        return self.process.log_path if self.process else None


@dataclass(slots=True, eq=False)
class SidecarProcess:
    """``python -m sidecar`` from the sidecar's own environment, as in production."""

    decode_url: str
    log_dir: Path
    port: int = field(default_factory=free_port)
    python: str = sys.executable
    process: Process | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
        env.update(
            SIDECAR_HOST="127.0.0.1",
            SIDECAR_PORT=str(self.port),
            SIDECAR_DECODE_URL=self.decode_url,
            SIDECAR_READY_INTERVAL_S="0.5",
            SIDECAR_LOG_REQUESTS="true",
        )
        self.process = Process(
            "sidecar",
            [self.python, "-m", "sidecar"],
            env,
            self.log_dir / f"sidecar-{self.port}.log",
        )
        self.process.start()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        assert self.process is not None, "start() first"
        self.process.wait_until(
            lambda: http_status(self.url + "/ready") == 200, timeout_s, "/ready answering 200"
        )

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def metric_value(exposition: str, name: str) -> float:
    """The sum of every sample named ``name`` (over all label sets) in a Prometheus text page;
    0 when absent (vLLM creates some series only with their first observation)."""
    total = 0.0
    for line in exposition.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name:
            total += float(match.group(2))
    return total

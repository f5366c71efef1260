"""Real vLLM engines (and the sidecar) as local processes, for the end-to-end suite and the demo.

This module runs under the sidecar's interpreter and starts the engines with the interpreter of
the separate vLLM environment that ``e2e/setup_vllm.sh`` builds. Facts behind every flag and
variable: ../shared/reference/real-vllm-on-cpu.md and docs/e2e.md.

Every process runs on the shared launcher (devkit/processes.py): in a session of its own, so
that ``stop()`` signals the whole group (a vLLM server forks an engine-core and a worker
process), killed with the interpreter that started it, its output in a log file. Start them
from the event loop's thread: a child dies with the thread that started it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from devkit.processes import Child, LaunchError, environment, free_port, quiet_port

SERVED_MODEL = "tiny-llama"
MAX_MODEL_LEN = 4096
KV_CACHE_BYTES = 128 * 1024 * 1024
"""KV cache per engine: 131072 tokens of the tiny model (1 KiB each), 1024 blocks of 128."""

Role = Literal["prefill", "decode"]
_KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}

KvConnector = Literal["NixlConnector", "NixlPushConnector", "ExampleConnector"]
"""vLLM's KV connectors the suite runs: NIXL pull (the decode reads the prefill's blocks), NIXL
push (the prefill writes into blocks the decode registered), and the shared-storage example
(KV saved to files in a directory both engines see, keyed by the prompt's tokens)."""

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
# vLLM's CPU attention uses AMX without asking Linux for it; on a machine with AMX the decode
# engine's first step after a KV pull died of SIGILL. vllm_site/sitecustomize.py asks first.
_AMX_SITE = str(Path(__file__).resolve().parent / "vllm_site")


EngineError = LaunchError
"""An engine (or the sidecar) did not start, or died; the message ends with its log's tail."""

STOP_GRACE_S = 20.0
"""A vLLM server's shutdown (engine core, worker, NIXL agent) before SIGKILL."""


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


def engine_cores() -> tuple[int | None, int | None]:
    """A core for the prefill engine and another for the decode engine (see ``VllmEngine.argv``),
    or no pinning at all when there are fewer than two cores or no ``taskset``."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return None, None
    return cores[0], cores[1]


@dataclass(slots=True, eq=False)
class VllmEngine:
    """One real vLLM OpenAI server with a KV connector (NixlConnector by default) on CPU memory."""

    role: Role
    home: VllmHome
    log_dir: Path
    kv_connector: KvConnector = "NixlConnector"
    shared_storage_path: Path | None = None
    """ExampleConnector only: the directory both engines of the pair save KV to and load it from."""
    # Bound some 30 s after they are chosen: outside the ephemeral range (``quiet_port``).
    port: int = field(default_factory=quiet_port)
    side_channel_port: int = field(default_factory=quiet_port)
    cpu: int | None = None
    """The one core for all of the engine's processes (see ``argv``), None: any core."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Overrides of the engine's environment (e.g. UCX_LOG_LEVEL when debugging a transfer)."""
    extra_args: list[str] = field(default_factory=list)
    """More server arguments (e.g. ``--otlp-traces-endpoint``)."""
    kv_events_config: dict[str, object] | None = None
    """vLLM's ``--kv-events-config`` (publish KV-cache events over ZMQ), None: no events."""
    process: Child | None = field(default=None, repr=False)

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
        kv_config = self.kv_transfer_config()
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
            *self.events_args(),
            *self.extra_args,
        ]

    def events_args(self) -> list[str]:
        if self.kv_events_config is None:
            return []
        return ["--kv-events-config", json.dumps(self.kv_events_config)]

    def kv_transfer_config(self) -> dict[str, object]:
        """``--kv-transfer-config``: NIXL (pull or push) with a producer and a consumer on CPU
        memory; ExampleConnector with ``kv_both`` on both engines (any engine whose prompt misses
        the store saves its KV there) and the pair's directory."""
        if self.kv_connector == "ExampleConnector":
            assert self.shared_storage_path is not None, "ExampleConnector needs a directory"
            return {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(self.shared_storage_path)},
            }
        return {
            "kv_connector": self.kv_connector,
            "kv_role": _KV_ROLES[self.role],
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {},
        }

    def environment(self) -> dict[str, str]:
        env = {**_OFFLINE_ENV, **_NIXL_ENV, "PYTHONPATH": _AMX_SITE}
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        env.update(self.extra_env)
        return environment(env, drop=["VLLM_", "UCX_"])

    def start(self) -> None:
        self.process = Child(
            f"vLLM {self.role} engine",
            self.argv(),
            log_path=self.log_dir / f"vllm-{self.role}-{self.kv_connector}-{self.port}.log",
            env=self.environment(),
            url=self.url,
        ).start()

    async def wait_ready(self, timeout_s: float = 240.0) -> None:
        assert self.process is not None, "start() first"
        await self.process.wait_ready("/health", timeout_s)

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop(STOP_GRACE_S)

    @property
    def log_path(self) -> Path | None:
        return self.process.log_path if self.process else None


@dataclass(slots=True, eq=False)
class SidecarProcess:
    """``python -m sidecar`` from the sidecar's own environment, as in production."""

    decode_url: str
    log_dir: Path
    connector: str = "nixl"
    """``SIDECAR_CONNECTOR``: the protocol the sidecar speaks to the pair's engines."""
    port: int = field(default_factory=free_port)
    python: str = sys.executable
    extra_env: dict[str, str] = field(default_factory=dict)
    """More of the sidecar's environment (e.g. ``SIDECAR_TRACING`` and the ``OTEL_*`` it reads)."""
    process: Child | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {
            "SIDECAR_HOST": "127.0.0.1",
            "SIDECAR_PORT": str(self.port),
            "SIDECAR_DECODE_URL": self.decode_url,
            "SIDECAR_READY_INTERVAL_S": "0.5",
            "SIDECAR_LOG_REQUESTS": "true",
            "SIDECAR_CONNECTOR": self.connector,
            **self.extra_env,
        }
        self.process = Child(
            "sidecar",
            [self.python, "-m", "sidecar"],
            log_path=self.log_dir / f"sidecar-{self.port}.log",
            env=environment(env, drop=["SIDECAR_"]),
            url=self.url,
        ).start()

    @property
    def log_path(self) -> Path | None:
        return self.process.log_path if self.process else None

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        assert self.process is not None, "start() first"
        await self.process.wait_ready("/ready", timeout_s)

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop(STOP_GRACE_S)


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

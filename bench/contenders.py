"""The overhead benchmark's processes: the emulators and each proxy under test, pinned to cores.

All of them are started on the benchmarks' launcher (bench/cluster.py, :class:`BenchLauncher`).
The two zero-latency emulators (prefill, decode) share the client's core; the proxy under test
gets the other core to itself (``taskset -c``), so that its CPU seconds and its latency are its
own. Proxies are started one at a time, on the same emulators:

- ``sidecar``: ``python -m sidecar`` with its defaults, the decode emulator as its engine; the
  client names the prefill emulator in ``x-prefiller-host-port``;
- ``aiohttp-floor``: ``bench/floor_proxy.py``, the smallest two-leg proxy on the same stack;
- ``vllm-router``: the Rust router from PyPI (``vllm-router==0.1.17``) with
  ``--vllm-pd-disaggregation``, its one prefill and one decode URL set to the emulators and
  ``--policy round_robin`` (with one endpoint each, every policy picks the same two; its default,
  ``cache_aware``, also sends ``POST /v1/completions/render`` to both engines first, to tokenize
  the prompt: four calls per request instead of the sidecar's two). It is
  found on ``--vllm-router``, in ``~/.cache/pd-sidecar/vllm-router`` (installed there into a venv
  of its own on first use) or on ``PATH``; without it the benchmark goes on without that
  variant, saying why.

Also what is checked at run time in a proxy process: aiohttp's C HTTP parser and uvloop loaded.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.client import DirectTarget, ProxyTarget, Target
from bench.cluster import BenchLauncher
from devkit.processes import Child, free_port

ROUTER_VERSION = "0.1.17"
ROUTER_VENV = Path.home() / ".cache" / "pd-sidecar" / "vllm-router"
ROUTER_INSTALL_TIMEOUT_S = 300.0
REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("floor", "sidecar", "aiohttp-floor", "vllm-router")
BASELINE_VARIANT = "sidecar-base"
"""The sidecar of another checkout (``--baseline``): not in the default matrix."""
"""Every variant, in the order they run and are reported."""


@dataclass(frozen=True, slots=True)
class Pinning:
    """Which core the client and emulators use, and which the proxy (None: not pinned)."""

    client: int | None
    proxy: int | None
    note: str

    @classmethod
    def choose(cls, enabled: bool) -> Pinning:
        cpus = sorted(os.sched_getaffinity(0))
        if not enabled:
            return cls(None, None, "not pinned (--no-pin)")
        if len(cpus) < 2 or shutil.which("taskset") is None:
            return cls(None, None, "not pinned (needs 2 cores and taskset)")
        return cls(
            cpus[0], cpus[1], f"client and emulators on CPU {cpus[0]}, proxy on CPU {cpus[1]}"
        )

    def taskset(self, cpu: int | None) -> list[str]:
        """The command line that runs a program on ``cpu`` (None: nothing, not pinned)."""
        return [] if cpu is None else ["taskset", "-c", str(cpu)]

    def pin_self(self) -> None:
        """The benchmark process is the client: on the client's core."""
        if self.client is not None:
            os.sched_setaffinity(0, {self.client})


async def start_emulators(launcher: BenchLauncher, pinning: Pinning) -> tuple[Child, Child]:
    """Prefill and decode emulators with no delays, on the client's core."""
    return await launcher.start_emulators(under=pinning.taskset(pinning.client))


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


async def locate_router(explicit: Path | None, install: bool) -> tuple[Path | None, str]:
    """The ``vllm-router`` program and a note on where it came from (None: unavailable, the
    note says why)."""
    if explicit is not None:
        if _executable(explicit):
            return explicit, f"vllm-router {explicit}"
        return None, f"vllm-router skipped: {explicit} is not an executable file"
    cached = ROUTER_VENV / "bin" / "vllm-router"
    if _executable(cached):
        return cached, f"vllm-router {ROUTER_VERSION} from {ROUTER_VENV}"
    found = shutil.which("vllm-router")
    if found is not None:
        return Path(found), f"vllm-router from PATH ({found})"
    if not install:
        return None, "vllm-router skipped: not installed (--no-install-router)"
    print(f"installing vllm-router=={ROUTER_VERSION} into {ROUTER_VENV} (once)...", flush=True)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(ROUTER_VENV)],
        [str(ROUTER_VENV / "bin" / "pip"), "install", "--quiet", f"vllm-router=={ROUTER_VERSION}"],
    ]
    for argv in steps:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            async with asyncio.timeout(ROUTER_INSTALL_TIMEOUT_S):
                output, _ = await process.communicate()
        except TimeoutError:
            process.kill()
            await process.wait()
            return None, f"vllm-router skipped: {argv[0]} took over {ROUTER_INSTALL_TIMEOUT_S:g} s"
        if process.returncode != 0:
            tail = output.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            shutil.rmtree(ROUTER_VENV, ignore_errors=True)
            return None, f"vllm-router skipped: cannot install it ({tail[0]})"
    return cached, f"vllm-router {ROUTER_VERSION} installed into {ROUTER_VENV}"


async def start_proxy(
    launcher: BenchLauncher,
    variant: str,
    *,
    pinning: Pinning,
    prefill: Child,
    decode: Child,
    router: Path | None,
    sidecar_env: dict[str, str],
    router_policy: str = "round_robin",
    baseline: Path | None = None,
) -> tuple[Child | None, Target]:
    """Start ``variant`` on the proxy's core; the process (None for the floor) and how the
    client reaches it. ``router_policy``: vllm-router's ``--policy`` (its default,
    ``cache_aware``, renders every prompt on both engines first: two more calls per request).
    ``baseline``: the checkout whose sidecar the ``sidecar-base`` variant runs, to compare two
    versions in one run."""
    if variant == "floor":
        return None, DirectTarget(prefill.url, decode.url)
    under = pinning.taskset(pinning.proxy)
    if variant in ("sidecar", BASELINE_VARIANT):
        if variant == BASELINE_VARIANT and baseline is None:
            raise ValueError(f"{BASELINE_VARIANT} needs a baseline checkout")
        child = launcher.spawn_sidecar(
            variant,
            decode_url=decode.url,
            settings=sidecar_env,
            under=under,
            checkout=baseline if variant == BASELINE_VARIANT else None,
        )
        await child.wait_ready("/ready", timeout_s=60)
        return child, ProxyTarget(variant, child.url, prefill.endpoint)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if variant == "aiohttp-floor":
        argv = [sys.executable, "-m", "bench.floor_proxy", "--port", str(port)]
        argv += ["--decode-url", decode.url]
        target: str | None = prefill.endpoint
    elif variant == "vllm-router":
        assert router is not None
        argv = [
            str(router), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
            "--prefill", prefill.url, "--decode", decode.url,
            "--prometheus-port", str(free_port()), "--policy", router_policy,
        ]  # fmt: skip
        target = None
    else:
        raise ValueError(f"unknown variant {variant!r}")
    child = await launcher.start(
        variant, [*under, *argv], cwd=REPO, url=url, ready="/health", timeout_s=60
    )
    return child, ProxyTarget(variant, url, target)


PYTHON_PROXIES = ("sidecar", "aiohttp-floor", BASELINE_VARIANT)
"""The variants whose stack is aiohttp on uvloop, checked at run time."""


def runtime_checks(child: Child) -> dict[str, bool]:
    """Whether aiohttp's C HTTP parser and uvloop are loaded in ``child`` (their extension
    modules mapped into its memory, aiohttp's not disabled by ``AIOHTTP_NO_EXTENSIONS``), and
    for the sidecar whether its start-up line says it runs on uvloop."""
    try:
        maps = Path(f"/proc/{child.pid}/maps").read_text()
    except OSError:
        maps = ""
    env = child.env if child.env is not None else os.environ
    checks = {
        "aiohttp C parser": "aiohttp/_http_parser" in maps and not env.get("AIOHTTP_NO_EXTENSIONS"),
        "uvloop": "uvloop/loop" in maps,
    }
    log = child.log()
    if "(event loop: " in log:  # the sidecar's start-up line, at INFO
        checks["uvloop"] = checks["uvloop"] and "(event loop: uvloop)" in log
    return checks

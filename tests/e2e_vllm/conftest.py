"""Real vLLM prefill and decode engines and the sidecar process.

The NixlConnector pair of test_prefix_placement.py and test_real_engines.py (``cluster``) starts
once per session; every other module starts a pair of its own (``start_cluster``). One pair runs
at a time: starting a pair stops any other (two engines per core would starve each other), and
the modules run in ``MODULE_ORDER``, the NixlConnector ones first.

Needs the environment ``e2e/setup_vllm.sh`` builds (``make e2e-vllm`` runs it first). Engine and
sidecar logs go to a temporary directory named in every startup failure, or to ``E2E_VLLM_LOG_DIR``
when set (CI can keep them).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import aiohttp
import orjson
import pytest
import pytest_asyncio

from e2e.engines import (
    KV_CACHE_BYTES,
    SERVED_MODEL,
    KvConnector,
    Role,
    SidecarProcess,
    VllmEngine,
    VllmHome,
    engine_cores,
    metric_value,
)

Route = Literal["completions", "chat"]
PATHS: dict[Route, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
"""Decode engine: KV transfers done (one per request whose KV it pulled)."""
XFER_BYTES = "vllm:nixl_bytes_transferred_sum"
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"
"""Decode engine: transfers that failed."""
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
"""Prefill engine: requests whose KV nobody pulled before the lease ran out."""
PREFILLS_SERVED = "vllm:request_success_total"

BLOCK_TOKENS = 128
"""vLLM's KV block size on CPU."""
KV_BYTES_PER_TOKEN = 2 * 2 * 4 * 32 * 2
"""Tiny model (e2e/make_tiny_model.py): K and V × 2 layers × 4 KV heads × head size 32 × bf16."""
LEASE_S = 30.0
"""How long a prefill engine keeps unpulled KV (vLLM's default kv_lease_duration)."""
KV_USAGE = "vllm:kv_cache_usage_perc"
"""Engine: share of KV blocks in use, 0 to 1 (blocks cached for prefix reuse but free count as
free)."""
KV_BLOCKS = KV_CACHE_BYTES // (BLOCK_TOKENS * KV_BYTES_PER_TOKEN)
"""Blocks in each engine's KV cache (1024); the gauge counts all but vLLM's reserved null block."""


PREFIX_PLACEMENT = "test_prefix_placement.py"
"""The module whose prefill pool is the session's pair and a spare prefill engine."""

MODULE_ORDER = (
    "test_kv_release.py",
    PREFIX_PLACEMENT,
    "test_real_engines.py",
    "test_nixl_push.py",
    "test_shared_storage.py",
    "test_tracing.py",
    "test_kv_events.py",
)
"""The order modules run in. Each starts a pair of its own, which stops the one before; the
session's NixlConnector pair (``cluster``) is test_prefix_placement.py's (with a second prefill
engine of that module's own, stopped when it ends) and then test_real_engines.py's."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run this directory's modules in ``MODULE_ORDER`` (file order within each), in the places
    its tests already hold among the session's items."""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if item.path.parent == here]

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)

    ordered = sorted((items[i] for i in places), key=rank)  # stable: file order within a module
    for place, item in zip(places, ordered, strict=True):
        items[place] = item


class WithSidecar(Protocol):
    """Anything the sidecar helpers below read from: a pair, or a sidecar of a module's own."""

    @property
    def sidecar(self) -> SidecarProcess: ...


@dataclass(slots=True, eq=False)
class Cluster:
    """Processes under test; tests that stop an engine say so, restore what later ones need."""

    home: VllmHome
    log_dir: Path
    prefill: VllmEngine
    decode: VllmEngine
    sidecar: SidecarProcess
    shared_storage_path: Path | None = None
    """ExampleConnector pairs: the directory both engines save KV to and load it from."""
    stranded_since: float | None = None
    """Monotonic time of the last prefill whose KV was (deliberately) never pulled."""
    expected_expiries: int = 0
    """Prefills the tests stranded on purpose: what the prefill engine must count as expired."""
    restarting: asyncio.Task[None] | None = None
    spare: VllmEngine | None = None
    """A second prefill engine (same connector, on the prefill engine's core) started with the
    pair for test_prefix_placement.py, which stops it when it ends; None otherwise."""

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop every process of the pair (idempotent)."""
        if self.restarting is not None:
            await asyncio.gather(self.restarting, return_exceptions=True)
        await self.sidecar.stop()
        await asyncio.gather(self.decode.stop(), self.prefill.stop(), self.stop_spare())
        if self in _RUNNING:
            _RUNNING.remove(self)

    async def stop_spare(self) -> None:
        """Stop the second prefill engine, if there is one (about 10 s, like any engine)."""
        spare, self.spare = self.spare, None
        if spare is not None:
            await spare.stop()

    async def restart_decode(self) -> None:
        """A fresh decode engine on the same ports: the sidecar's decode URL stays valid."""
        await self.decode.stop()
        self.decode = VllmEngine(
            "decode",
            self.home,
            self.log_dir,
            kv_connector=self.decode.kv_connector,
            shared_storage_path=self.decode.shared_storage_path,
            port=self.decode.port,
            side_channel_port=self.decode.side_channel_port,
            cpu=self.decode.cpu,
            extra_env=self.decode.extra_env,
            extra_args=self.decode.extra_args,
        )
        self.decode.start()
        await self.decode.wait_ready()


_RUNNING: list[Cluster] = []
"""Pairs started and not yet stopped: at most one (see ``start_cluster``)."""


async def stop_pairs() -> None:
    """Stop every pair still running (a module that starts engines of its own calls it first)."""
    for other in list(_RUNNING):
        await other.stop()


def log_dir_for(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(os.environ.get("E2E_VLLM_LOG_DIR") or tmp_path_factory.mktemp("e2e-vllm-logs"))


async def start_cluster(
    log_dir: Path,
    *,
    kv_connector: KvConnector = "NixlConnector",
    sidecar_connector: str = "nixl",
    shared_storage_path: Path | None = None,
    engine_args: list[str] | None = None,
    engine_env: dict[str, str] | None = None,
    sidecar_env: dict[str, str] | None = None,
    spare: bool = False,
) -> Cluster:
    """A prefill engine, a decode engine with ``kv_connector`` and a sidecar speaking
    ``sidecar_connector`` to them, ready; ``engine_args``/``engine_env`` go to both engines,
    ``sidecar_env`` to the sidecar. Any other pair still running is stopped first: each engine
    has a core of its own (docs/e2e.md), so two pairs on two cores would starve. ``spare``: a
    second prefill engine too (``Cluster.spare``), on the prefill engine's core, started with
    the others (starting it later, alone, would add its whole start time)."""
    home = VllmHome.locate()
    if (problem := home.missing()) is not None:
        pytest.fail(problem, pytrace=False)
    await stop_pairs()
    prefill_cpu, decode_cpu = engine_cores()
    roles: tuple[tuple[Role, int | None], ...] = (("prefill", prefill_cpu), ("decode", decode_cpu))
    prefill, decode = (
        VllmEngine(
            role,
            home,
            log_dir,
            kv_connector=kv_connector,
            shared_storage_path=shared_storage_path,
            cpu=cpu,
            extra_env=dict(engine_env or {}),
            extra_args=list(engine_args or []),
        )
        for role, cpu in roles
    )
    sidecar = SidecarProcess(
        decode.url, log_dir, connector=sidecar_connector, extra_env=dict(sidecar_env or {})
    )
    running = Cluster(home, log_dir, prefill, decode, sidecar, shared_storage_path)
    if spare:
        running.spare = VllmEngine(
            "prefill",
            home,
            log_dir,
            kv_connector=kv_connector,
            shared_storage_path=shared_storage_path,
            cpu=prefill_cpu,
            extra_env=dict(engine_env or {}),
            extra_args=list(engine_args or []),
        )
    processes: list[VllmEngine | SidecarProcess] = [prefill, decode, sidecar]
    if running.spare is not None:
        processes.append(running.spare)
    _RUNNING.append(running)
    try:
        for process in processes:
            process.start()
        for process in processes:  # started together, they get ready together
            await process.wait_ready()
    except BaseException:
        await running.stop()
        raise
    return running


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Cluster]:
    """The NixlConnector (pull) pair of test_prefix_placement.py and test_real_engines.py, with
    the spare prefill engine the first needs when it runs (it stops the spare when it ends)."""
    spare = any(item.path.name == PREFIX_PLACEMENT for item in request.session.items)
    async with await start_cluster(log_dir_for(tmp_path_factory), spare=spare) as running:
        yield running


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        yield session


# --- requests ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Generation:
    status: int
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    body: Any
    """The JSON answer (non-streaming), the list of SSE payloads (streaming), or the error body."""


def request_body(
    route: Route, prompt: str, *, stream: bool, max_tokens: int = 24
) -> dict[str, Any]:
    """A greedy request; streamed ones ask for the usage chunk too."""
    body: dict[str, Any] = {"model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def generate(
    http: aiohttp.ClientSession,
    base_url: str,
    route: Route,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Generation:
    async with http.post(base_url + PATHS[route], json=body, headers=headers) as response:
        raw = await response.read()
        if response.status != 200:
            return Generation(response.status, "", None, None, orjson.loads(raw))
        if body.get("stream"):
            return _from_events(response.status, route, raw)
        answer = orjson.loads(raw)
        choice = answer["choices"][0]
        text = choice["text"] if route == "completions" else choice["message"]["content"]
        return Generation(response.status, text, choice["finish_reason"], answer["usage"], answer)


def _from_events(status: int, route: Route, raw: bytes) -> Generation:
    payloads = [
        line[len(b"data: ") :]
        for line in raw.split(b"\n")
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"
    ]
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    events = [orjson.loads(payload) for payload in payloads]
    text, finish, usage = [], None, None
    for event in events:
        assert "error" not in event, event
        for choice in event.get("choices") or []:
            piece = choice.get("text") if route == "completions" else choice["delta"].get("content")
            text.append(piece or "")
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
    return Generation(status, "".join(text), finish, usage, events)


def prefill_header(cluster: Cluster, request_id: str) -> dict[str, str]:
    return {"x-prefiller-host-port": cluster.prefill.endpoint, "x-request-id": request_id}


FILLER = (
    "the prefill engine computes the cache of every prompt token and the decode engine "
    "pulls those blocks over the side channel before it samples the first new token"
)


def unique_prompt(tag: str, words: int = 30) -> str:
    """A prompt no engine has seen: a fresh prefix, then filler text of about ``words`` words.

    Unseen prompts matter twice: vLLM's prefix cache would let a decode engine skip pulling blocks
    it already holds, and would let a reference run reuse KV that came over NIXL.
    """
    filler = FILLER.split()
    body = " ".join(filler[i % len(filler)] for i in range(words))
    return f"Request {tag} at {time.time_ns()}: {body}."


async def reference(
    http: aiohttp.ClientSession, cluster: Cluster, route: Route, body: dict[str, Any]
) -> Generation:
    """The same request answered by the decode engine alone (no KV transfer).

    A ``cache_salt`` of its own keeps it from reusing prefix blocks that an earlier P/D run of the
    same prompt pulled over NIXL: the reference computes every prompt token itself.
    """
    salted = {**body, "cache_salt": f"reference-{time.time_ns()}"}
    return await generate(http, cluster.decode.url, route, salted)


# --- engine metrics and sidecar records ----------------------------------------------------------


async def metric(http: aiohttp.ClientSession, engine: VllmEngine, name: str) -> float:
    async with http.get(engine.url + "/metrics") as response:
        assert response.status == 200
        return metric_value(await response.text(), name)


_EXPIRY = re.compile(
    r"Releasing expired KV blocks for request (\S+) which were retrieved by (\d+) remote"
)


def expired_in_log(engine: VllmEngine) -> list[str]:
    """The requests whose KV lease ran out on prefill ``engine``, read from its log: vLLM logs
    each with a warning that names it and how many decode workers had read its KV."""
    path = engine.log_path
    if path is None or not path.exists():
        return []
    text = path.read_text(errors="replace")
    return [f"{found[1]} (read by {found[2]})" for found in _EXPIRY.finditer(text)]


def engine_trouble(engine: VllmEngine, limit: int = 40) -> list[str]:
    """The last ``limit`` warnings and errors of ``engine``'s log (tracebacks included): what a
    test that failed on an engine's behaviour should show, as CI keeps no engine logs."""
    return _trouble(engine.log_path, limit)


def sidecar_trouble(sidecar: SidecarProcess, limit: int = 40) -> list[str]:
    """The same of the sidecar's log."""
    return _trouble(sidecar.log_path, limit)


def _trouble(path: Path | None, limit: int) -> list[str]:
    if path is None or not path.exists():
        return []
    found = [
        line
        for line in path.read_text(errors="replace").splitlines()
        if " WARNING " in line or " ERROR " in line or "Error" in line or "Traceback" in line
    ]
    return found[-limit:]


async def engine_queues(http: aiohttp.ClientSession, engine: VllmEngine) -> dict[str, float]:
    """The engine's scheduler queues right now (``vllm:num_requests_running`` and ``_waiting``):
    a request the engine holds without answering shows in one of them."""
    return {
        name: await metric(http, engine, f"vllm:num_requests_{name}")
        for name in ("running", "waiting")
    }


async def settled_metric(
    http: aiohttp.ClientSession, engine: VllmEngine, name: str, at_least: float, within: float = 5
) -> float:
    """The metric once it reaches ``at_least`` (engines publish stats a step later), or its value
    after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = await metric(http, engine, name)
        if value >= at_least or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)


async def record(
    http: aiohttp.ClientSession, cluster: WithSidecar, request_id: str
) -> dict[str, Any]:
    async with http.get(f"{cluster.sidecar.url}/debug/requests/{request_id}") as response:
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


PD_PHASES = ("prefill_sent", "prefill_done", "decode_sent", "first_byte", "done")


def assert_pd_record(entry: dict[str, Any], cluster: Cluster) -> None:
    """A completed P/D request: the real prefill, then the real decode, in order."""
    assert entry["decision"] == "remote", entry
    assert entry["fallback_reason"] is None, entry
    assert entry["prefill_endpoint"] == cluster.prefill.endpoint, entry
    assert entry["state"] == "completed", entry
    assert entry["status"] == 200, entry
    phases = entry["phases"]
    assert list(PD_PHASES) == [name for name in PD_PHASES if name in phases], entry
    times = [phases[name] for name in PD_PHASES]
    assert times == sorted(times), entry
    # A real prefill of the engine takes measurable time; a skipped one would not.
    assert entry["durations_ms"]["prefill"] > 0, entry


def kv_bytes(prompt_tokens: int) -> int:
    """Bytes of KV a decode engine pulls for a prompt: every block the prompt touches."""
    return math.ceil(prompt_tokens / BLOCK_TOKENS) * BLOCK_TOKENS * KV_BYTES_PER_TOKEN


async def until(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    # The condition lives in another process, seen only over HTTP: there is no event to await.
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.2)


# --- KV held on the prefill engine ---------------------------------------------------------------


async def prefill_kv_blocks(http: aiohttp.ClientSession, cluster: Cluster) -> int:
    """KV blocks the prefill engine holds now, read so that the reading is fresh.

    A plain one-token request (no KV transfer, a prompt of its own) goes straight to the prefill
    engine first: the engine publishes ``vllm:kv_cache_usage_perc`` only from its steps, and the
    request makes it step at least once; its own blocks are free again (cached, not held) before
    that step's stats are taken. docs/e2e.md, "KV held on the prefill engine", says why.
    """
    poke = request_body("completions", unique_prompt("kv-reading", words=3), stream=False)
    poke["max_tokens"] = 1
    answer = await generate(http, cluster.prefill.url, "completions", poke)
    assert answer.status == 200, answer.body
    return round(await metric(http, cluster.prefill, KV_USAGE) * (KV_BLOCKS - 1))


async def settled_prefill_kv_blocks(
    http: aiohttp.ClientSession, cluster: Cluster, at_most: int, within: float
) -> tuple[int, float]:
    """Blocks held on the prefill engine once they are down to ``at_most``, or after ``within``
    seconds; and the seconds it took."""
    started = time.monotonic()
    while True:
        blocks = await prefill_kv_blocks(http, cluster)
        took = time.monotonic() - started
        if blocks <= at_most or took > within:
            return blocks, took
        await asyncio.sleep(0.1)


async def warm_pair(http: aiohttp.ClientSession, cluster: Cluster, tag: str) -> None:
    """One ordinary P/D request through the sidecar, so that the decode engine has made its NIXL
    handshake with the prefill engine. On a pair that never transferred, vLLM's own cleanup of a
    decode request refused or aborted before it was scheduled waits for that handshake and then
    for the decode engine's next step, which an idle engine does not take (docs/e2e.md)."""
    request_id = f"warm-{tag}"
    body = request_body("completions", unique_prompt(request_id), stream=False, max_tokens=2)
    answer = await generate(
        http, cluster.sidecar.url, "completions", body, prefill_header(cluster, request_id)
    )
    assert answer.status == 200, answer.body


_LABELLED = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\s+(\S+)")


async def sidecar_metric(
    http: aiohttp.ClientSession, cluster: WithSidecar, name: str, **labels: str
) -> float:
    """The sidecar's ``name`` summed over the samples whose labels include ``labels``."""
    async with http.get(cluster.sidecar.url + "/metrics") as response:
        assert response.status == 200, await response.text()
        text = await response.text()
    if not labels:
        return metric_value(text, name)
    wanted = {f'{key}="{value}"' for key, value in labels.items()}
    total = 0.0
    for line in text.splitlines():
        match = _LABELLED.match(line)
        if match and match.group(1) == name and wanted <= set(match.group(2).split(",")):
            total += float(match.group(3))
    return total


async def settled_sidecar_metric(
    http: aiohttp.ClientSession,
    cluster: WithSidecar,
    name: str,
    at_least: float,
    within: float = 5,
    **labels: str,
) -> float:
    """The sidecar's metric once it reaches ``at_least`` (some of its work runs in the
    background), or its value after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = await sidecar_metric(http, cluster, name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)

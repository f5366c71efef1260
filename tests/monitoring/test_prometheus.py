"""The dashboard and the alerts against a real Prometheus scraping a real sidecar process.

Two prefill emulators and a decode emulator (in this process), the sidecar (its own process,
scheduling over both prefill endpoints, its Redis unreachable) and ``prometheus`` (the Debian
package; scraping every second, loading the PrometheusRule's rules). Load that produces every
series the manifests use: local and remote placements, retries, an ejection, a fallback, KV
releases sent and failed, a prefill whose client left, state-backend errors. Then every metric
selector of every dashboard query and of every rule must return series through Prometheus's HTTP
API, every full expression must evaluate without error, and every rule must evaluate healthy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from devkit.processes import Launcher, free_port
from sidecar.emulator import (
    EmulatorConfig,
    FaultKind,
    FaultRole,
    FaultSpec,
    RunningEmulator,
    start_emulator,
)
from tests.conftest import chat, completion, eventually, get_json
from tests.monitoring.assets import (
    JOB,
    Query,
    binary,
    dashboard_queries,
    rule_queries,
    selectors,
    write_rules_file,
)
from tests.processes import SidecarProcess, sidecar_process

LONG = "Retrieved context for a retrieval-augmented answer. " * 45  # ~600 tokens: remote
TARGET_LABELS = {"namespace": "monitoring-test", "pod": "decode-0"}
"""What the PodMonitor's target labels would be in a cluster."""
UNREACHABLE_REDIS = "redis://127.0.0.9:1/0"


class Prometheus:
    def __init__(self, url: str, http: aiohttp.ClientSession) -> None:
        self.url = url
        self._http = http

    async def query(self, expr: str) -> dict[str, Any]:
        """``/api/v1/query`` at the current time: the whole answer, errors included."""
        async with self._http.get(self.url + "/api/v1/query", params={"query": expr}) as answer:
            body: dict[str, Any] = await answer.json()
            return body

    async def series(self, expr: str) -> list[dict[str, Any]]:
        answer = await self.query(expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    async def rules(self) -> list[dict[str, Any]]:
        body = await get_json(self._http, self.url + "/api/v1/rules")
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]


@pytest.fixture
async def engines() -> AsyncIterator[tuple[RunningEmulator, RunningEmulator, RunningEmulator]]:
    """Two prefill engines, in the order round robin takes them (by name), and a decode one."""
    started = [await start_emulator(EmulatorConfig(port=0)) for _ in range(3)]
    try:
        first, second = sorted(started[:2], key=lambda engine: engine.endpoint)
        yield first, second, started[2]
    finally:
        for engine in started:
            await engine.close()


async def _start_prometheus(launcher: Launcher, folder: Path, sidecar_port: int) -> str:
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(write_rules_file(folder / "rules.yaml"))],
        "scrape_configs": [
            {
                "job_name": JOB,
                "static_configs": [
                    {"targets": [f"127.0.0.1:{sidecar_port}"], "labels": TARGET_LABELS}
                ],
            }
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    argv = [
        binary("prometheus"),
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    url = f"http://127.0.0.1:{port}"
    await launcher.start("prometheus", argv, url=url, ready="/-/ready")
    return url


async def _post(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> int:
    async with http.post(url, json=body, headers=headers) as response:
        await response.read()
        return response.status


async def _sidecar_metric(http: aiohttp.ClientSession, sidecar: SidecarProcess, name: str) -> float:
    async with http.get(sidecar.url + "/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
    )


async def _load(
    http: aiohttp.ClientSession,
    sidecar: SidecarProcess,
    flaky: RunningEmulator,
    good: RunningEmulator,
    decode: RunningEmulator,
) -> None:
    """Traffic that makes every series of the dashboard and the rules exist."""
    url = sidecar.url + "/v1/completions"
    via_good = {"x-prefiller-host-port": good.endpoint}
    # Local placements (short prompts), both routes, a passthrough and a client error.
    assert await _post(http, url, completion("a short question")) == 200
    assert await _post(http, sidecar.url + "/v1/chat/completions", chat()) == 200
    async with http.get(sidecar.url + "/v1/models") as response:
        assert response.status == 200
    async with http.post(url, data=b"not json") as response:
        assert response.status == 400

    # Remote placements over the pool; the flaky endpoint's two 503s are retried on the good
    # one, and eject it.
    flaky.faults.add(FaultSpec(FaultKind.STATUS, status=503, count=2, role=FaultRole.PREFILL))
    ejections = f'pd_sidecar_prefill_endpoint_ejections_total{{endpoint="{flaky.endpoint}"}}'
    for index in range(10):
        assert await _post(http, url, completion(f"{index} {LONG}")) == 200
        if await _sidecar_metric(http, sidecar, ejections) == 1:
            break
    else:
        raise AssertionError("the flaky prefill endpoint was never ejected")

    # A prefill error that is not retried: a fallback to a local decode.
    good.faults.add(FaultSpec(FaultKind.STATUS, status=500, role=FaultRole.PREFILL))
    assert await _post(http, url, completion(f"fallback {LONG}"), **via_good) == 200

    # The decode engine refuses after a good prefill: the staged KV is released (sent)...
    decode.faults.add(FaultSpec(FaultKind.STATUS, status=500, role=FaultRole.DECODE))
    assert await _post(http, url, completion("release sent"), **via_good) == 500
    # ... and again, refusing the release too (failed).
    decode.faults.add(FaultSpec(FaultKind.STATUS, status=500, count=2, role=FaultRole.DECODE))
    assert await _post(http, url, completion("release failed"), **via_good) == 500

    # A client that leaves while its prefill runs.
    good.faults.add(FaultSpec(FaultKind.HANG, role=FaultRole.PREFILL))
    async with aiohttp.ClientSession() as own:
        leaving = asyncio.create_task(_post(own, url, completion("leaving"), **via_good))
        await eventually(lambda: _held(http, good))
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
    await eventually(lambda: _metric_is_positive(http, sidecar, "pd_sidecar_prefill_disconnects"))
    async with http.post(good.url + "/emulator/release") as response:
        assert response.status == 200

    await eventually(lambda: _releases_settled(http, sidecar))
    for name, at_least in [
        ("pd_sidecar_prefill_retries_total", 2),
        ('pd_sidecar_fallbacks_total{reason="prefill_error"}', 1),
        ('pd_sidecar_kv_releases_total{outcome="failed"}', 1),
        ('pd_sidecar_state_backend_errors_total{kind="connection"}', 1),
    ]:
        assert await _sidecar_metric(http, sidecar, name) >= at_least, name


async def _held(http: aiohttp.ClientSession, engine: RunningEmulator) -> bool:
    return bool((await get_json(http, engine.url + "/emulator/faults"))["held"])


async def _metric_is_positive(
    http: aiohttp.ClientSession, sidecar: SidecarProcess, family: str
) -> bool:
    async with http.get(sidecar.url + "/metrics") as response:
        text = await response.text()
    return any(
        line.startswith(family + "_total") and float(line.rsplit(" ", 1)[1]) > 0
        for line in text.splitlines()
    )


async def _releases_settled(http: aiohttp.ClientSession, sidecar: SidecarProcess) -> bool:
    """Both background releases and the finished prefill's release (when ``finish``) ended."""
    sent = await _sidecar_metric(http, sidecar, 'pd_sidecar_kv_releases_total{outcome="sent"}')
    failed = await _sidecar_metric(http, sidecar, 'pd_sidecar_kv_releases_total{outcome="failed"}')
    return sent >= 1 and failed >= 1


async def _scraped_since(prometheus: Prometheus, unix: float) -> bool:
    """Whether a scrape that started after ``unix`` is stored, and every rule was evaluated."""
    found = await prometheus.series(f'timestamp(up{{job="{JOB}"}})')
    if not found or float(found[0]["value"][1]) <= unix:
        return False
    rules = await prometheus.rules()
    return bool(rules) and all(rule["health"] != "unknown" for rule in rules)


@pytest.mark.system
@pytest.mark.timeout(90)
async def test_every_selector_of_the_dashboard_and_the_rules_returns_series(
    tmp_path: Path, engines: tuple[RunningEmulator, RunningEmulator, RunningEmulator]
) -> None:
    flaky, good, decode = engines
    binary("prometheus")  # fail (CI) or skip before starting anything
    settings = {
        "decode_url": decode.url,
        "prefill_endpoints": f"{flaky.endpoint},{good.endpoint}",
        "scheduler_policy": "round_robin",
        "eject_after_failures": "2",
        "eject_base_s": "60",  # ejected for the rest of the test
        "ready_interval_s": "0.2",
        "state_backend": "redis",
        "redis_url": UNREACHABLE_REDIS,
        "shared_scrapes": "true",  # unreadable too: its errors have a series
        "log_level": "WARNING",
    }
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http,
        sidecar_process(settings, until="/ready") as sidecar,
        Launcher(tmp_path / "logs") as launcher,
    ):
        prometheus = Prometheus(await _start_prometheus(launcher, tmp_path, sidecar.port), http)
        await _load(http, sidecar, flaky, good, decode)
        loaded = time.time()
        await eventually(lambda: _scraped_since(prometheus, loaded), within=20)

        queries: list[Query] = dashboard_queries() + rule_queries()
        failures = []
        checked: set[str] = set()
        for query in queries:
            answer = await prometheus.query(query.expr)
            if answer["status"] != "success":
                failures.append(f"{query.where}: {answer.get('error')}: {query.expr}")
            for selector in selectors(query.expr):
                if selector not in checked and not await prometheus.series(selector):
                    failures.append(f"{query.where}: no series for {selector}")
                checked.add(selector)
        assert not failures, "\n".join(failures)
        assert len(checked) >= 25  # every panel, variable and rule contributes

        unhealthy = [
            f"{rule['name']}: {rule.get('lastError')}"
            for rule in await prometheus.rules()
            if rule["health"] != "ok"
        ]
        assert not unhealthy, unhealthy
        # The ejection the load caused is what Prometheus sees too.
        healthy = await prometheus.series(
            f'pd_sidecar_prefill_endpoint_healthy{{endpoint="{flaky.endpoint}"}}'
        )
        assert [sample["value"][1] for sample in healthy] == ["0"]

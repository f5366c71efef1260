"""The prefill allowlist that follows an InferencePool (``SIDECAR_INFERENCE_POOL``), against the
fake Kubernetes API of ``tests/kubefake.py`` (list and watch, resource versions, 410, bookmarks,
bearer tokens, HTTPS). The pods' addresses are loopback addresses where emulated prefill engines
listen (127.0.0.2, ...), so that an allowed target is really called; a refused one never is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from sidecar.server.runner import RunningSidecar
from tests.conftest import StartEmulator, StartSidecar, chat, eventually, metric
from tests.k8s import validate
from tests.kubefake import NAMESPACE, V1, V1ALPHA2, FakeKubernetes, fake_kubernetes
from tests.tlsfiles import Pki

POOL = f"{NAMESPACE}/pd-llm"
LABELS = {"app.kubernetes.io/part-of": "pd-llm"}
HEADER = "x-prefiller-host-port"
REFUSED = "127.0.0.9:1"
"""A loopback address no pod has, where nothing listens."""

StartPoolSidecar = Callable[..., Awaitable[RunningSidecar]]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
async def kube(pki: Pki) -> AsyncIterator[FakeKubernetes]:
    async with fake_kubernetes(pki) as fake:
        fake.set_pool("pd-llm", LABELS)
        yield fake


@pytest.fixture
def token_file(tmp_path: Path, kube: FakeKubernetes) -> Path:
    path = tmp_path / "token"
    path.write_text(kube.token + "\n")
    return path


@pytest.fixture
def start_pool_sidecar(
    kube: FakeKubernetes, pki: Pki, token_file: Path, start_sidecar_with: StartSidecar
) -> StartPoolSidecar:
    """Sidecars following the fake's pool; set up after the fake, so they are closed before it
    (a server shut down under its clients' open TLS connections leaves them unclosed)."""

    async def start(**overrides: Any) -> RunningSidecar:
        values: dict[str, Any] = {
            "inference_pool": POOL,
            "kube_api_url": kube.url,
            "kube_token_file": str(token_file),
            "kube_ca_file": pki.ca_file,
            "kube_retry_base_s": 0.02,
            "kube_retry_max_s": 0.2,
        }
        values.update(overrides)
        return await start_sidecar_with(**values)

    return start


async def prefill_at(start_engine: StartEmulator, address: str) -> str:
    """An emulated prefill engine listening on ``address``; its ``host:port``."""
    engine = await start_engine(host=address)
    return str(engine.endpoint)


async def send(http: aiohttp.ClientSession, sidecar: RunningSidecar, target: str) -> Any:
    """Status, error message (or None) and decision of one request naming ``target``."""
    async with http.post(
        sidecar.url + "/v1/chat/completions", json=chat(max_tokens=2), headers={HEADER: target}
    ) as response:
        body = await response.json()
    if response.status != 200:
        return response.status, body["error"]["message"]
    async with http.get(sidecar.admin_url + "/debug/requests?limit=1") as answer:
        record = (await answer.json())["recent"][0]
    return 200, record["decision"]


async def section(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> dict[str, Any]:
    async with http.get(sidecar.admin_url + "/debug/scheduler") as response:
        return dict((await response.json())["inference_pool"])


def allows(http: aiohttp.ClientSession, sidecar: RunningSidecar, *addresses: str) -> Any:
    async def check() -> bool:
        return sorted(addresses) == (await section(http, sidecar))["addresses"]

    return check


async def ready(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> tuple[int, str]:
    async with http.get(sidecar.url + "/ready") as response:
        return response.status, await response.text()


async def test_pods_added_removed_and_readdressed_are_followed_at_once(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes, start_engine
) -> None:
    first = await prefill_at(start_engine, "127.0.0.2")
    second = await prefill_at(start_engine, "127.0.0.3")
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    kube.add_pod("other-app", "127.0.0.3", {"app": "other"})  # not selected
    sidecar = await start_pool_sidecar()
    await eventually(allows(http, sidecar, "127.0.0.2"))
    assert await send(http, sidecar, first) == (200, "remote")
    status, message = await send(http, sidecar, second)
    assert status == 403
    assert "not a pod of the InferencePool llm/pd-llm" in message

    kube.add_pod("prefill-1", "127.0.0.3", LABELS)  # added
    await eventually(allows(http, sidecar, "127.0.0.2", "127.0.0.3"))
    assert await send(http, sidecar, second) == (200, "remote")

    kube.modify_pod("prefill-0", ip="127.0.0.4")  # its address changed
    await eventually(allows(http, sidecar, "127.0.0.3", "127.0.0.4"))
    assert (await send(http, sidecar, first))[0] == 403

    kube.delete_pod("prefill-1")  # removed
    await eventually(allows(http, sidecar, "127.0.0.4"))
    assert (await send(http, sidecar, second))[0] == 403
    assert (await send(http, sidecar, REFUSED))[0] == 403
    assert await metric(http, sidecar.url, "pd_sidecar_inference_pool_addresses") == 1


async def test_only_running_pods_not_being_deleted_are_allowed(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes
) -> None:
    kube.add_pod("pending", "127.0.0.2", LABELS, phase="Pending")
    kube.add_pod("running", "127.0.0.3", LABELS)
    kube.add_pod("finished", "127.0.0.4", LABELS, phase="Succeeded")
    sidecar = await start_pool_sidecar()
    await eventually(allows(http, sidecar, "127.0.0.3"))
    kube.modify_pod("pending", phase="Running")
    await eventually(allows(http, sidecar, "127.0.0.2", "127.0.0.3"))
    kube.modify_pod("running", deleting=True)  # terminating: out at once
    await eventually(allows(http, sidecar, "127.0.0.2"))
    kube.modify_pod("pending", labels={"app": "relabelled"})  # no longer selected
    await eventually(allows(http, sidecar))


async def test_until_the_first_list_header_targets_are_refused_and_ready_says_why(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes, start_engine
) -> None:
    target = await prefill_at(start_engine, "127.0.0.2")
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    await kube.down()
    sidecar = await start_pool_sidecar()

    async def failed_once() -> bool:
        return (await section(http, sidecar))["errors"] > 0

    await eventually(failed_once)
    status, body = await ready(http, sidecar)
    assert status == 503
    assert "the InferencePool llm/pd-llm has not been listed yet" in body
    assert "connection refused" in body
    status, message = await send(http, sidecar, target)
    assert status == 403
    assert "has not been listed yet" in message
    assert "until then it allows no target" in message

    await kube.up()
    await eventually(allows(http, sidecar, "127.0.0.2"))

    async def is_ready() -> bool:
        return (await ready(http, sidecar))[0] == 200

    await eventually(is_ready)
    assert await send(http, sidecar, target) == (200, "remote")


async def test_the_api_down_later_keeps_the_last_good_set_and_ready(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes, start_engine
) -> None:
    target = await prefill_at(start_engine, "127.0.0.2")
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    sidecar = await start_pool_sidecar()
    await eventually(allows(http, sidecar, "127.0.0.2"))
    await kube.down()

    async def failing() -> bool:
        view = await section(http, sidecar)
        return view["errors"] >= 2 and view["last_error"] is not None

    await eventually(failing)
    assert (await section(http, sidecar))["addresses"] == ["127.0.0.2"]
    assert await send(http, sidecar, target) == (200, "remote")
    assert (await ready(http, sidecar))[0] == 200
    errors = 'pd_sidecar_inference_pool_errors_total{kind="unreachable"}'
    assert await metric(http, sidecar.url, errors) >= 2

    kube.delete_pod("prefill-0")  # while the sidecar cannot see it
    await kube.up()
    await eventually(allows(http, sidecar))  # resumed from its version: the deletion arrives


async def test_a_dropped_watch_resumes_from_its_version_without_a_list(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes
) -> None:
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    sidecar = await start_pool_sidecar()
    await eventually(allows(http, sidecar, "127.0.0.2"))
    lists = dict(kube.lists)
    watched = kube.watches["pods"]

    async def watching() -> bool:
        return kube.watching("pods") == 1

    await eventually(watching)  # (a bookmark goes to the watches open at that moment)
    # A change the pods' watch does not see moves the version on; a bookmark tells it so.
    kube.add_pod("other-app", "127.0.0.9", {"app": "other"})
    kube.bookmark()
    bookmark = str(kube.resource_version)

    async def bookmarked() -> bool:
        return (await section(http, sidecar))["resource_versions"]["pods"] == bookmark

    await eventually(bookmarked)
    before = len(kube.watched_from)
    kube.drop_watches()  # cut, mid-stream
    kube.add_pod("prefill-1", "127.0.0.3", LABELS)
    await eventually(allows(http, sidecar, "127.0.0.2", "127.0.0.3"))
    assert kube.lists == lists  # nothing listed again
    assert kube.watches["pods"] > watched
    assert ("pods", bookmark) in kube.watched_from[before:]  # resumed where it was


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_lists_again(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes, as_status: bool
) -> None:
    kube.gone_as_status = as_status
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    sidecar = await start_pool_sidecar()
    await eventually(allows(http, sidecar, "127.0.0.2"))
    assert kube.lists["pods"] == 1
    await kube.down()
    kube.add_pod("prefill-1", "127.0.0.3", LABELS)
    kube.compact()  # the sidecar's version is gone from the history
    await kube.up()
    await eventually(allows(http, sidecar, "127.0.0.2", "127.0.0.3"))
    assert kube.lists["pods"] == 2
    expired = 'pd_sidecar_inference_pool_errors_total{kind="expired"}'
    assert await metric(http, sidecar.url, expired) >= 1


@pytest.mark.parametrize(
    ("apis", "pool_in"),
    [((V1, V1ALPHA2), V1), ((V1ALPHA2,), V1ALPHA2), ((V1, V1ALPHA2), V1ALPHA2)],
    ids=["v1", "v1alpha2-only-api", "v1alpha2-pool-beside-v1-api"],
)
async def test_both_api_groups(
    http,
    start_sidecar_with: StartSidecar,
    pki: Pki,
    tmp_path: Path,
    apis: tuple[str, ...],
    pool_in: str,
) -> None:
    async with fake_kubernetes(pki, apis=apis) as kube:
        kube.set_pool("pd-llm", {"role": "prefill"}, api=pool_in)
        kube.add_pod("prefill-0", "127.0.0.2", {"role": "prefill"})
        token = tmp_path / "token"
        token.write_text(kube.token)
        sidecar = await start_sidecar_with(
            inference_pool=POOL,
            kube_api_url=kube.url,
            kube_token_file=str(token),
            kube_ca_file=pki.ca_file,
            kube_retry_base_s=0.02,
        )
        await eventually(allows(http, sidecar, "127.0.0.2"))
        view = await section(http, sidecar)
        assert view["api"] == pool_in
        assert view["selector"] == {"role": "prefill"}
        kube.set_pool("pd-llm", {"role": "other"}, api=pool_in)  # watched in its own group
        await eventually(allows(http, sidecar))
        await sidecar.close()


@pytest.mark.parametrize(
    ("group", "pool_in"), [("", V1), ("inference.networking.x-k8s.io", V1ALPHA2)]
)
async def test_the_group_chooses_the_api(
    http,
    start_sidecar_with: StartSidecar,
    pki: Pki,
    tmp_path: Path,
    group: str,
    pool_in: str,
) -> None:
    """A pool of that name in both groups, selecting other pods: SIDECAR_INFERENCE_POOL_GROUP
    (llm-d's --pool-group) says which one is followed."""
    async with fake_kubernetes(pki) as kube:
        kube.set_pool("pd-llm", {"role": "v1"}, api=V1)
        kube.set_pool("pd-llm", {"role": "v1alpha2"}, api=V1ALPHA2)
        kube.add_pod("prefill-v1", "127.0.0.2", {"role": "v1"})
        kube.add_pod("prefill-v1alpha2", "127.0.0.3", {"role": "v1alpha2"})
        token = tmp_path / "token"
        token.write_text(kube.token)
        sidecar = await start_sidecar_with(
            inference_pool=POOL,
            inference_pool_group=group,
            kube_api_url=kube.url,
            kube_token_file=str(token),
            kube_ca_file=pki.ca_file,
            kube_retry_base_s=0.02,
        )
        await eventually(allows(http, sidecar, "127.0.0.2" if pool_in == V1 else "127.0.0.3"))
        assert (await section(http, sidecar))["api"] == pool_in
        await sidecar.close()


async def test_a_new_selector_lists_the_pods_it_selects(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes
) -> None:
    kube.add_pod("decode-0", "127.0.0.2", {**LABELS, "llm-d.ai/role": "decode"})
    kube.add_pod("prefill-0", "127.0.0.3", {**LABELS, "llm-d.ai/role": "prefill"})
    sidecar = await start_pool_sidecar()
    await eventually(allows(http, sidecar, "127.0.0.2", "127.0.0.3"))
    kube.set_pool("pd-llm", {**LABELS, "llm-d.ai/role": "prefill"})
    await eventually(allows(http, sidecar, "127.0.0.3"))
    kube.add_pod("prefill-1", "127.0.0.4", {**LABELS, "llm-d.ai/role": "prefill"})
    kube.add_pod("decode-1", "127.0.0.5", {**LABELS, "llm-d.ai/role": "decode"})
    await eventually(allows(http, sidecar, "127.0.0.3", "127.0.0.4"))
    assert (await section(http, sidecar))["selector"] == {
        **LABELS,
        "llm-d.ai/role": "prefill",
    }


async def test_a_deleted_pool_allows_nothing_until_it_returns(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes
) -> None:
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    sidecar = await start_pool_sidecar()
    await eventually(allows(http, sidecar, "127.0.0.2"))
    kube.delete_pool("pd-llm")
    await eventually(allows(http, sidecar))
    assert (await section(http, sidecar))["exists"] is False
    assert (await ready(http, sidecar))[0] == 200  # listed once: not an outage of the sidecar
    kube.set_pool("pd-llm", LABELS)
    await eventually(allows(http, sidecar, "127.0.0.2"))


async def test_a_pool_that_does_not_exist_keeps_ready_503(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes
) -> None:
    kube.delete_pool("pd-llm")
    sidecar = await start_pool_sidecar()

    async def says_so() -> bool:
        status, body = await ready(http, sidecar)
        return status == 503 and "does not exist" in body

    await eventually(says_so)
    kube.set_pool("pd-llm", LABELS)

    async def is_ready() -> bool:
        return (await ready(http, sidecar))[0] == 200

    await eventually(is_ready)


async def test_the_pool_adds_to_the_cidrs_it_does_not_replace_them(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes, start_engine
) -> None:
    by_cidr = await prefill_at(start_engine, "127.0.0.5")
    by_pool = await prefill_at(start_engine, "127.0.0.2")
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    await kube.down()
    sidecar = await start_pool_sidecar(prefill_allowed_cidrs="127.0.0.5/32")
    assert await send(http, sidecar, by_cidr) == (200, "remote")  # before the pool is known
    assert (await send(http, sidecar, by_pool))[0] == 403
    await kube.up()
    await eventually(allows(http, sidecar, "127.0.0.2"))
    assert await send(http, sidecar, by_pool) == (200, "remote")
    assert await send(http, sidecar, by_cidr) == (200, "remote")
    assert (await send(http, sidecar, REFUSED))[0] == 403


async def test_a_rotated_token_is_read_again(
    http, start_pool_sidecar: StartPoolSidecar, kube: FakeKubernetes, token_file: Path
) -> None:
    sidecar = await start_pool_sidecar()
    await eventually(allows(http, sidecar))
    kube.token = "token-2"
    await asyncio.to_thread(token_file.write_text, "token-2\n")
    kube.drop_watches()  # the next watch is refused with the old token (401), then re-read
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    await eventually(allows(http, sidecar, "127.0.0.2"))


async def test_the_debug_scheduler_section(
    http, start_pool_sidecar: StartPoolSidecar, start_sidecar_with: StartSidecar, kube
) -> None:
    kube.add_pod("prefill-0", "127.0.0.2", LABELS)
    sidecar = await start_pool_sidecar(admin_port=0)
    await eventually(allows(http, sidecar, "127.0.0.2"))
    async with http.get(sidecar.admin_url + "/debug/scheduler") as response:
        view = (await response.json())["inference_pool"]
    assert view["pool"] == POOL
    assert view["api"] == V1
    assert view["synced"] is True
    assert view["pods"] == 1
    assert view["last_sync"] > 0
    assert view["resource_versions"]["pods"]
    assert set(view) >= {"last_error", "last_error_at", "errors", "last_event", "exists"}
    async with http.get(sidecar.admin_url + "/ready") as response:
        assert response.status == 200
    plain = await start_sidecar_with()
    async with http.get(plain.url + "/debug/scheduler") as response:
        assert (await response.json())["inference_pool"] is None


async def test_outside_a_pod_without_an_api_url_ready_says_so(
    http, start_sidecar_with: StartSidecar
) -> None:
    sidecar = await start_sidecar_with(inference_pool=POOL)  # no KUBERNETES_SERVICE_HOST here
    status, body = await ready(http, sidecar)
    assert status == 503
    assert "no Kubernetes API" in body


async def test_the_fake_serves_objects_of_the_real_shapes(pki: Pki) -> None:
    """The pools (both APIs, against their vendored CRDs) and pods (Kubernetes' own schema)
    that the fake serves are valid objects of their kinds."""
    async with fake_kubernetes(pki) as kube:
        kube.set_pool("pd-llm", LABELS, api=V1)
        kube.set_pool("pd-llm-old", LABELS, api=V1ALPHA2)
        kube.add_pod("prefill-0", "127.0.0.2", LABELS)
        kube.modify_pod("prefill-0", deleting=True)
        validate(yaml.safe_dump_all(kube.objects()))

"""The LoRA adapter a request is looked up as is the engine's own: a name one engine's events
give as an adapter changes that engine's index only. Emulators as prefill engines on loopback
addresses of their own, a hostile publisher on another's events port, a sidecar in front."""

from __future__ import annotations

import aiohttp

from sidecar.app import KV_FLEET
from sidecar.kvevents.events import BlockStored, EventBatch
from sidecar.kvevents.wire import encode_message
from tests.conftest import StartSidecar, get_json

from .helpers import HOSTS, Pool, RawPublisher, publisher
from .test_wiring import complete_on_ids, in_sync, kv_view

MODEL = "emulated-model"
"""The model every emulator serves, and the name the hostile publisher gives its adapter."""


async def test_an_adapter_named_as_the_served_model_changes_only_its_engine(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    honest = await pool.add()
    member = await pool.add(events=False)  # the hostile member's HTTP side
    hostile = RawPublisher(HOSTS[1], pool.port)  # and its events port
    try:
        sidecar = await start_sidecar_with(**pool.settings())
        fleet = sidecar.app[KV_FLEET]
        await publisher(honest).wait_subscriptions(1)
        await hostile.wait_subscribed()
        ids = list(range(1000, 1000 + 40 * 16))
        await complete_on_ids(http, honest, ids)
        await in_sync(http, sidecar, honest.endpoint)

        def predicted(key: str) -> int | None:
            hit = fleet.lookup(key, fleet.prompt_keys(ids, {"model": MODEL}))
            return None if hit is None else hit.gpu

        before = predicted(honest.endpoint)
        assert before is not None
        assert before >= 38 * 16
        # One block stored under an adapter named as the served model, on the hostile port.
        poison = BlockStored((1,), None, tuple(ids[:16]), 16, lora_name=MODEL)
        hostile.send(encode_message(EventBatch(seq=0, ts=1.0, events=(poison,))))
        await in_sync(http, sidecar, member.endpoint)

        assert predicted(honest.endpoint) == before  # it was 0: keyed as the adapter's
        # The hostile engine's own index keys the model as its adapter, and holds the block.
        assert predicted(member.endpoint) == 16
        view = (await kv_view(http, sidecar))["endpoints"]
        assert (view[honest.endpoint]["adapters"], view[member.endpoint]["adapters"]) == (0, 1)

        # And the request through the sidecar goes where the honest engine's events say.
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
        async with http.post(
            sidecar.url + "/v1/completions", json=body, headers={"x-request-id": "poisoned"}
        ) as response:
            assert response.status == 200, await response.text()
        record = await get_json(http, sidecar.url + "/debug/requests/poisoned")
        assert record["prefill_endpoint"] == honest.endpoint
        assert record["prefill_predicted_cached_tokens"] == before
        assert record["cached_source"] == "events"
    finally:
        hostile.close()

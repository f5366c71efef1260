"""The KV-lifecycle contract every connector keeps, run on each connector.

Real sockets: a prefill emulator (the sidecar's whole prefill pool, so placements reserve), a decode
emulator, the sidecar in front. Each case ends by checking that nothing is left behind: no KV block
staged on the prefill engine, no request running on either engine, no task in the sidecar's request
path, no reservation held, no record in flight.

A connector joins by adding a ``Spec`` to ``SPECS``: its settings, its engines' KV protocol, what
its legs must carry and how it frees KV that a failed decode did not take. What "left behind"
means is the same for all: no NIXL block staged, no SGLang room computed and unclaimed, no decode
waiting for a room or a push registration, no prefill waiting for its decode.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from sidecar.connectors.nixl import PREFILL_REQUEST_PARAMS
from sidecar.emulator import RunningEmulator
from sidecar.sanitize import BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM, CLIENT_FIELDS
from sidecar.server.runner import RunningSidecar
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    awaiting,
    chat,
    completion,
    engine_requests,
    eventually,
    get_json,
    inject,
    metric,
    sse_events,
    staged_blocks,
    tasks_in_request_code,
)
from tests.otlp import Receiver, traced, traceparent

SGLANG_FIELDS = (BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM)
PREFILL_DROPPED = (
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
    # only the decode leg's answer reports these (docs/protocol.md, "Prefill leg")
    "echo",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "return_token_ids",
)
LONG_PROMPT = "A passage long enough that a prefill of it is predicted to take a while. " * 400
"""About 7,000 tokens: at the scheduler's prior speed, predicted past ``auto``'s finish window."""


def _nixl_legs(
    client: dict[str, Any], route: str, prefill_leg: dict[str, Any], decode_leg: dict[str, Any]
) -> None:
    expected = {k: v for k, v in client.items() if k not in PREFILL_DROPPED}
    expected.update(stream=False, max_tokens=1, kv_transfer_params=PREFILL_REQUEST_PARAMS)
    if route == "chat_completions":
        expected["max_completion_tokens"] = 1
    if "n" in client:
        expected["n"] = 1
    assert prefill_leg == expected
    params = decode_leg.pop("kv_transfer_params")
    assert decode_leg == client
    assert params["do_remote_prefill"] is True
    assert params["remote_block_ids"]
    assert params["remote_request_id"]


def _push_legs(
    client: dict[str, Any], route: str, prefill_leg: dict[str, Any], decode_leg: dict[str, Any]
) -> None:
    assert decode_leg["kv_transfer_params"]["transfer_mode"] == "push"
    _nixl_legs(client, route, prefill_leg, decode_leg)


def _sglang_legs(
    client: dict[str, Any], route: str, prefill_leg: dict[str, Any], decode_leg: dict[str, Any]
) -> None:
    assert prefill_leg == decode_leg  # the same body, to both at once
    rendezvous = {name: decode_leg.pop(name) for name in SGLANG_FIELDS}
    assert decode_leg == client
    assert rendezvous[BOOTSTRAP_HOST] == "127.0.0.1"
    assert isinstance(rendezvous[BOOTSTRAP_PORT], int)
    room = rendezvous[BOOTSTRAP_ROOM]
    assert isinstance(room, int)
    assert 0 <= room < 2**63


def _storage_legs(
    client: dict[str, Any], route: str, prefill_leg: dict[str, Any], decode_leg: dict[str, Any]
) -> None:
    expected = {k: v for k, v in client.items() if k not in PREFILL_DROPPED}
    expected.update(stream=False, max_tokens=1)
    if route == "chat_completions":
        expected["max_completion_tokens"] = 1
    if "n" in client:
        expected["n"] = 1
    assert prefill_leg == expected
    assert decode_leg == client  # unchanged: the KV is found in the store


@dataclass(frozen=True)
class Spec:
    name: str
    check_legs: Callable[[dict[str, Any], str, dict[str, Any], dict[str, Any]], None] = _nixl_legs
    prefill: dict[str, Any] = field(default_factory=dict)
    """The prefill emulator's config (its KV protocol)."""
    decode: dict[str, Any] = field(default_factory=dict)
    release: str | None = "own_id"
    """How KV a failed decode did not take is freed: a release under the request's id with
    ``-release`` (``own_id``) or under the request's own id (``same_id``); None: nothing is ever
    staged for one request."""
    concurrent: bool = False
    """Both legs are sent at once (the decode engine always sees a leg)."""
    shared_store: bool = False
    """Both engines use one KV store directory."""

    @property
    def settings(self) -> dict[str, Any]:
        return {"connector": self.name}


SPECS = [
    Spec("nixl"),
    Spec(
        "nixl-push",
        _push_legs,
        prefill={"kv_protocol": "nixl-push"},
        decode={"kv_protocol": "nixl-push"},
        release="same_id",
    ),
    Spec(
        "sglang",
        _sglang_legs,
        prefill={"kv_protocol": "sglang", "disaggregation_mode": "prefill"},
        decode={"kv_protocol": "sglang", "disaggregation_mode": "decode"},
        release=None,
        concurrent=True,
    ),
    Spec(
        "shared-storage",
        _storage_legs,
        prefill={"kv_protocol": "shared-storage"},
        decode={"kv_protocol": "shared-storage"},
        release=None,
        shared_store=True,
    ),
]


@dataclass
class Rig:
    http: aiohttp.ClientSession
    prefill: RunningEmulator
    decode: RunningEmulator
    sidecar: RunningSidecar
    spec: Spec

    async def inject(self, engine: RunningEmulator, **fault: Any) -> None:
        """A fault on ``engine``. Its ``role`` picks the leg; a shared-storage request has no
        role (every request is plain), and on its own engine "any" picks the same leg."""
        if self.spec.shared_store:
            fault["role"] = "any"
        await inject(self.http, engine, **fault)

    async def post(
        self, body: dict[str, Any], path: str = "/v1/completions", **headers: str
    ) -> tuple[int, bytes]:
        async with self.http.post(
            self.sidecar.url + path,
            json=body,
            headers={"x-prefiller-host-port": self.prefill.endpoint, **headers},
        ) as response:
            return response.status, await response.read()

    def leave_later(self, body: dict[str, Any], read_first: bool = False) -> asyncio.Task[None]:
        """A client on a connection of its own, cancelled by the test when it likes."""

        async def client() -> None:
            async with (
                aiohttp.ClientSession() as own,
                own.post(
                    self.sidecar.url + "/v1/completions",
                    json=body,
                    headers={"x-prefiller-host-port": self.prefill.endpoint},
                ) as response,
            ):
                if read_first:
                    await response.content.readany()
                    await asyncio.Event().wait()  # then stays until cancelled
                await response.read()

        return asyncio.create_task(client())

    async def record(self) -> dict[str, Any]:
        return (await get_json(self.http, self.sidecar.url + "/debug/requests"))["recent"][0]

    async def releases(self, outcome: str) -> float:
        return await metric(
            self.http, self.sidecar.url, f'pd_sidecar_kv_releases_total{{outcome="{outcome}"}}'
        )

    async def held(self, engine: RunningEmulator) -> int:
        return int((await get_json(self.http, engine.url + "/emulator/faults"))["held"])

    async def release_held(self) -> None:
        for engine in (self.prefill, self.decode):
            async with self.http.post(engine.url + "/emulator/release") as response:
                assert response.status == 200

    async def kv(self, engine: RunningEmulator) -> dict[str, Any]:
        return await get_json(self.http, engine.url + "/emulator/kv")

    async def state(self) -> dict[str, Any]:
        debug = await get_json(self.http, self.sidecar.url + "/debug/requests")
        scheduler = await get_json(self.http, self.sidecar.url + "/debug/scheduler")
        [endpoint] = scheduler["endpoints"]
        running = [
            await metric(self.http, e.url, "vllm:num_requests_running")
            for e in (self.prefill, self.decode)
        ]
        prefill_kv, decode_kv = await self.kv(self.prefill), await self.kv(self.decode)
        return {
            "inflight": len(debug["inflight"]),
            "staged": prefill_kv["staged_blocks"],  # NIXL blocks, or SGLang rooms unclaimed
            "running": running,
            "waiting": {  # for KV: a push registration, a room, or a prefill for its claim
                "registrations": decode_kv["registrations_waiting"],
                "rooms": decode_kv["rooms_waiting"],
                "claims": prefill_kv["claims_waiting"],
            },
            "reserved": (endpoint["reserved_requests"], endpoint["inflight_here"]),
            "tasks": tasks_in_request_code(),
        }

    async def settled(self, within: float = 5.0) -> None:
        """Nothing left behind (the module docstring), within ``within`` seconds."""
        clean = {
            "inflight": 0,
            "staged": 0,
            "running": [0, 0],
            "waiting": {"registrations": 0, "rooms": 0, "claims": 0},
            "reserved": (0, 0),
            "tasks": [],
        }
        seen: dict[str, Any] = {}

        async def check() -> bool:
            seen.update(await self.state())
            return seen == clean

        try:
            await eventually(check, within)
        except TimeoutError:
            pytest.fail(f"left behind: {seen}")


@pytest.fixture(params=SPECS, ids=lambda spec: spec.name)
def spec(request: pytest.FixtureRequest) -> Spec:
    return request.param


RigFactory = Callable[..., Awaitable[Rig]]


@pytest.fixture
async def rig_with(
    http: aiohttp.ClientSession,
    spec: Spec,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
    tmp_path: Path,
) -> RigFactory:
    async def make(
        decode: dict[str, Any] | None = None, prefill: dict[str, Any] | None = None, **settings: Any
    ) -> Rig:
        store = {"kv_store": str(tmp_path / "kv")} if spec.shared_store else {}
        prefill_engine = await start_engine(**{**spec.prefill, **store, **(prefill or {})})
        decode_engine = await start_engine(**{**spec.decode, **store, **(decode or {})})
        if spec.name == "sglang":  # header targets use the setting
            settings.setdefault("sglang_bootstrap_port", prefill_engine.bootstrap_port)
        sidecar = await start_sidecar_with(
            decode_url=decode_engine.url,
            prefill_endpoints=prefill_engine.endpoint,
            **{**spec.settings, **settings},
        )
        return Rig(http, prefill_engine, decode_engine, sidecar, spec)

    return make


@pytest.fixture
async def rig(rig_with: RigFactory) -> Rig:
    return await rig_with()


async def _cancel(client: asyncio.Task[None]) -> None:
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client


async def _in_state(rig: Rig, state: str) -> None:
    async def there() -> bool:
        inflight = (await get_json(rig.http, rig.sidecar.url + "/debug/requests"))["inflight"]
        return [r["state"] for r in inflight] == [state]

    await eventually(there)


# --- the legs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["completions", "chat_completions"])
async def test_bodies_on_each_leg(rig: Rig, spec: Spec, route: str) -> None:
    if route == "completions":
        body, path = completion(max_tokens=5, min_tokens=2, temperature=0), "/v1/completions"
    else:
        body, path = chat(max_tokens=5, n=1), "/v1/chat/completions"
    status, _ = await rig.post(body, path)
    assert status == 200
    [prefill_leg] = await engine_requests(rig.http, rig.prefill)
    [decode_leg] = await engine_requests(rig.http, rig.decode)
    assert prefill_leg["path"] == decode_leg["path"] == path
    spec.check_legs(body, route, prefill_leg["body"], decode_leg["body"])
    await rig.settled()


async def test_each_leg_carries_the_trace_context_of_its_own_span(
    otlp: Receiver, rig_with: RigFactory, spec: Spec
) -> None:
    """With tracing on, the prefill leg names the prefill-attempt span and the decode leg the
    decode span, both in the gateway's trace (sent at once or one after the other)."""
    rig = await rig_with(tracing=traced(otlp))
    trace_id, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    status, _ = await rig.post(
        completion(),
        **{"traceparent": traceparent(trace_id, client_span), "x-request-id": "traced"},
    )
    assert status == 200
    trace = await otlp.trace_of("traced", spans=5)
    assert (trace.request.trace_id, trace.request.parent_id) == (trace_id, client_span)
    attempt, decode = trace.one("prefill"), trace.one("decode")
    assert attempt.attributes["pd_sidecar.outcome"] == "success"
    assert attempt.attributes["pd_sidecar.prefill.endpoint"] == rig.prefill.endpoint
    assert attempt.parent_id == decode.parent_id == trace.request.span_id
    [prefill_leg] = await engine_requests(rig.http, rig.prefill)
    [decode_leg] = await engine_requests(rig.http, rig.decode)
    assert prefill_leg["trace"]["trace_id"] == decode_leg["trace"]["trace_id"] == trace_id
    assert prefill_leg["trace"]["parent_id"] == attempt.span_id
    assert decode_leg["trace"]["parent_id"] == decode.span_id
    await rig.settled()


async def test_streaming(rig: Rig) -> None:
    status, raw = await rig.post(completion(stream=True, max_tokens=6))
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    assert len(events) >= 6
    [decode_leg] = await engine_requests(rig.http, rig.decode)
    assert decode_leg["body"]["stream"] is True
    await rig.settled()


# --- the client's KV fields -------------------------------------------------------------------

CLIENT_CHOSEN = "CLIENT-CHOSEN"
_EVERY_SGLANG_FIELD = {
    "bootstrap_host": "127.0.0.9",
    "bootstrap_port": 1,
    "bootstrap_room": 7,
    "bootstrap_pair_key": CLIENT_CHOSEN,
    "decode_tp_size": 3,
    "disagg_prefill_dp_rank": 5,
}
CLIENT_KV_PLACES: dict[str, dict[str, Any]] = {
    # vLLM: chat and completions copy it into SamplingParams.extra_args.
    "kv_transfer_params": {
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.9"}
    },
    # vLLM: chat and completions take vllm_xargs as SamplingParams.extra_args.
    "vllm_xargs": {"vllm_xargs": {"kv_transfer_params": CLIENT_CHOSEN, "kept": 1}},
    # vLLM: the tokens-in route takes its sampling_params' extra_args as they are.
    "sampling_params.extra_args": {
        "sampling_params": {"extra_args": {"kv_transfer_params": CLIENT_CHOSEN, "kept": 1}}
    },
    # SGLang: chat, completions and /generate copy them into GenerateReqInput.
    "bootstrap": {
        "bootstrap_host": "127.0.0.9",
        "bootstrap_port": 1,
        "bootstrap_room": 7,
        "disagg_prefill_dp_rank": 5,
    },
    # SGLang: /generate's GenerateReqInput alone.
    "generate_only": {"bootstrap_pair_key": CLIENT_CHOSEN, "decode_tp_size": 3},
    # SGLang: /vertex_generate spreads parameters into GenerateReqInput.
    "parameters": {"parameters": {**_EVERY_SGLANG_FIELD, "kept": 1}},
}
"""One entry per place docs/protocol.md lists ("Client KV fields"): what a client sets there."""


def _client_values(
    node: dict[str, Any], path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, value)`` of every client KV field in ``node`` (a ``CLIENT_KV_PLACES`` entry)."""
    found = []
    for key, value in node.items():
        if key in CLIENT_FIELDS:
            found.append(((*path, key), value))
        elif isinstance(value, dict):
            found += _client_values(value, (*path, key))
    return found


def _at(body: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(body, dict) or key not in body:
            return KeyError
        body = body[key]
    return body


def _without_client_fields(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    return {k: _without_client_fields(v) for k, v in node.items() if k not in CLIENT_FIELDS}


@pytest.mark.parametrize("place", sorted(CLIENT_KV_PLACES))
async def test_no_leg_carries_a_client_kv_field(rig: Rig, spec: Spec, place: str) -> None:
    """Whatever the leg — prefill, decode with the KV, a fallback's or a local decode —
    an engine never sees the client's value where it would read it; the rest is kept."""
    fields = CLIENT_KV_PLACES[place]
    body = completion(max_tokens=3, **fields)
    status, _ = await rig.post(body)  # prefill and decode
    assert status == 200
    sent = 2
    if not spec.concurrent:  # an SGLang decode server cannot decode alone
        await rig.inject(rig.prefill, kind="status", status=500, role="prefill")
        status, _ = await rig.post(body)  # its prefill fails: a local decode
        assert status == 200
        assert (await rig.record())["fallback_reason"] == "prefill_error"
        async with rig.http.post(rig.sidecar.url + "/v1/completions", json=body) as response:
            assert response.status == 200  # no header, a short prompt: a local decode
        assert (await rig.record())["decision"] == "local"
        sent = 5  # a failed prefill and its decode, then a decode alone
    legs = await engine_requests(rig.http, rig.prefill) + await engine_requests(
        rig.http, rig.decode
    )
    assert len(legs) == sent
    client_values = _client_values(fields)
    assert client_values
    for leg in legs:
        for path, value in client_values:
            # At the top level the connector may set a field of its own, never the client's.
            seen = _at(leg["body"], path)
            assert seen is KeyError if len(path) > 1 else seen != value, (leg["body"], path)
        for name, value in fields.items():  # what else the client sent there is kept
            if name not in CLIENT_FIELDS:
                assert leg["body"][name] == _without_client_fields(value)
    await rig.settled()


# --- prefill failures -------------------------------------------------------------------------


async def test_prefill_4xx_goes_to_the_client(rig: Rig, spec: Spec) -> None:
    status, raw = await rig.post(completion(model="no-such-model"))
    assert status == 404
    assert orjson.loads(raw)["error"]["code"] == 404
    if not spec.concurrent:
        assert await engine_requests(rig.http, rig.decode) == []
    record = await rig.record()
    assert (record["state"], record["status"]) == ("failed", 404)
    await rig.settled()


@pytest.mark.parametrize("failure", ["5xx", "timeout", "unreachable"])
@pytest.mark.parametrize("fallback", ["local", "fail"])
async def test_prefill_failure_follows_the_fallback_policy(
    rig_with: RigFactory, spec: Spec, failure: str, fallback: str
) -> None:
    if spec.name == "sglang" and fallback == "local":
        pytest.skip("an SGLang decode server cannot prefill: refused at start (test_config)")
    rig = await rig_with(prefill_fallback=fallback, prefill_timeout_s=0.3)
    if failure == "5xx":
        await rig.inject(rig.prefill, kind="status", status=500, role="prefill")
    elif failure == "timeout":
        await rig.inject(rig.prefill, kind="hang", role="prefill", count=2)
    status, raw = await (
        _post_to_closed_prefill(rig) if failure == "unreachable" else rig.post(completion())
    )
    reason = {"5xx": "prefill_error", "timeout": "prefill_timeout"}.get(
        failure, "prefill_unreachable"
    )
    record = await rig.record()
    assert record["fallback_reason"] == reason
    if fallback == "local":
        assert status == 200
        [decode_leg] = await engine_requests(rig.http, rig.decode)
        assert "kv_transfer_params" not in decode_leg["body"]
        assert record["decision"] == "local"
    else:
        assert status == 503
        assert orjson.loads(raw)["error"]["type"] == "ServiceUnavailableError"
        if spec.concurrent:  # every attempt's decode leg was aborted
            assert await _decode_legs_waiting(rig) == 0
        else:
            assert await engine_requests(rig.http, rig.decode) == []
    if failure != "unreachable":  # (the prefill engine is gone: nothing to check there)
        await rig.release_held()
        await rig.settled()


async def _decode_legs_waiting(rig: Rig) -> int:
    async def gone() -> bool:
        return await metric(rig.http, rig.decode.url, "vllm:num_requests_waiting") == 0

    await eventually(gone)
    return int((await rig.kv(rig.decode))["rooms_waiting"])


async def _post_to_closed_prefill(rig: Rig) -> tuple[int, bytes]:
    await rig.prefill.close()
    async with rig.http.post(
        rig.sidecar.url + "/v1/completions",
        json=completion(),
        headers={"x-prefiller-host-port": rig.prefill.endpoint},
    ) as response:
        return response.status, await response.read()


# --- decode failures after a good prefill ---------------------------------------------------------


@pytest.mark.parametrize("refusal", ["4xx", "5xx", "closed"])
async def test_decode_refusal_releases_the_kv_at_once(
    rig_with: RigFactory, spec: Spec, refusal: str
) -> None:
    rig = await rig_with(decode={"max_model_len": 512})
    body = completion(max_tokens=64)
    if refusal == "4xx":
        body["max_tokens"] = 5000  # over the decode engine's context; the prefill leg asks for 1
    elif refusal == "5xx":
        await rig.inject(rig.decode, kind="status", status=500, role="decode")
    else:  # read the request, then closed the connection without a word
        await rig.inject(rig.decode, kind="reset", role="decode")
    status, raw = await rig.post(body, **{"x-request-id": "refused"})
    assert status == {"4xx": 400, "5xx": 500, "closed": 503}[refusal]
    assert orjson.loads(raw)["error"]["code"] == status
    assert len(await engine_requests(rig.http, rig.prefill)) == 1
    await rig.settled()  # SGLang: the prefill waiting for this decode was aborted
    if spec.release is None:
        assert await rig.releases("sent") == 0
        return
    assert await rig.releases("sent") == 1
    # The release has a prefix-cache salt of its own: whatever it reads (the engine may have
    # freed and reused the blocks) can never serve another request. NIXL pull: an id of its
    # own too; push: the prefill leg's id, the only one its engine hands the KV to.
    decode_leg, release = await engine_requests(rig.http, rig.decode)
    engine_id = (await rig.record())["engine_id"]  # the client's id and a suffix of its own
    assert engine_id.startswith("refused-")
    assert decode_leg["headers"]["x-request-id"] == engine_id
    own_id = f"{engine_id}-release" if spec.release == "own_id" else engine_id
    assert release["headers"]["x-request-id"] == own_id
    assert release["path"] == decode_leg["path"]
    assert release["body"]["max_tokens"] == 1
    assert release["body"]["kv_transfer_params"] == decode_leg["body"]["kv_transfer_params"]
    assert release["body"]["cache_salt"].startswith("pd-sidecar-release-")
    assert "cache_salt" not in decode_leg["body"]


@pytest.mark.parametrize("route", ["completions", "chat_completions"])
async def test_a_prompt_over_the_context_is_refused_in_the_clients_own_figures(
    rig_with: RigFactory, spec: Spec, start_engine: StartEmulator, route: str
) -> None:
    """A prompt that fills the context is refused by the prefill engine, whose leg asks for one
    token: the client reads what one engine would have answered its own request (the leg's
    "1 in the completion" stays in the record and the log)."""
    rig = await rig_with(prefill={"max_model_len": 64}, decode={"max_model_len": 64})
    prompt = "a prompt far longer than this tiny model's context " * 20
    if route == "completions":
        body, path = completion(prompt, max_tokens=2), "/v1/completions"
    else:
        body, path = chat(prompt, max_completion_tokens=2), "/v1/chat/completions"
    status, raw = await rig.post(body, path, **{"x-request-id": "too-long"})
    one_engine = await start_engine(max_model_len=64)
    async with rig.http.post(one_engine.url + path, json=body) as direct:
        assert (status, orjson.loads(raw)) == (direct.status, await direct.json())
    assert status == 400
    assert "2 in the completion" in orjson.loads(raw)["error"]["message"]
    [prefill_leg] = await engine_requests(rig.http, rig.prefill)
    record = await rig.record()
    assert (record["id"], record["status"], record["state"]) == ("too-long", 400, "failed")
    if spec.check_legs is not _sglang_legs:  # the one-token leg: its figures, kept for people
        assert prefill_leg["body"]["max_tokens"] == 1
        assert "1 in the completion" in record["error"]
    await rig.settled()


async def test_a_body_that_cannot_be_forwarded_is_400_and_reserves_nothing(rig: Rig) -> None:
    # Parsed (up to 1024 levels) but too deep to serialize again (orjson writes up to 254).
    nested: Any = []
    for _ in range(300):
        nested = [nested]
    status, raw = await rig.post(completion(logit_bias_notes=nested))
    assert status == 400
    assert "cannot be forwarded" in orjson.loads(raw)["error"]["message"]
    assert await engine_requests(rig.http, rig.prefill) == []
    await rig.settled()


async def test_a_refused_release_is_counted_failed(rig: Rig, spec: Spec) -> None:
    if spec.release is None:
        pytest.skip(f"{spec.name} never releases")
    # The decode engine refuses the decode leg, then the release too.
    await rig.inject(rig.decode, kind="status", status=503, role="decode", count=2)
    status, _ = await rig.post(completion())
    assert status == 503

    async def counted() -> bool:
        return await rig.releases("failed") == 1

    await eventually(counted)
    assert await rig.releases("sent") == 0
    assert await staged_blocks(rig.http, rig.prefill) > 0  # left to the engine's expiry


# --- the client gone at every moment ------------------------------------------------------------


async def test_client_gone_before_the_prefill(rig: Rig) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", rig.sidecar.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-prefiller-host-port: " + rig.prefill.endpoint.encode() + b"\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    await writer.drain()
    await _in_state(rig, "received")
    writer.close()
    await writer.wait_closed()
    await rig.settled()
    assert await engine_requests(rig.http, rig.prefill) == []
    assert (await rig.record())["state"] == "cancelled"


@pytest.mark.parametrize("mode", ["auto", "abort", "finish"])
async def test_client_gone_during_a_short_prefill(
    rig_with: RigFactory, spec: Spec, mode: str
) -> None:
    rig = await rig_with(prefill_on_disconnect=mode)
    await rig.inject(rig.prefill, kind="hang", role="prefill")
    client = rig.leave_later(completion())
    await _in_state(rig, "prefilling")
    await eventually(lambda: _held_is(rig, rig.prefill, 1))
    await _cancel(client)
    # auto: predicted to end soon. SGLang: always abort, its decode is aborted too.
    action = "abort" if mode == "abort" or spec.concurrent else "finish"
    await eventually(lambda: _disconnects_are(rig, action, 1))
    if action == "abort":  # the engine dropped it at once
        await eventually(lambda: _held_is(rig, rig.prefill, 0))
    else:  # still running; once it ends, its KV is released
        assert await rig.held(rig.prefill) == 1
        await rig.release_held()
        if spec.release is not None:
            await eventually(lambda: _releases_are(rig, "sent", 1))
    await rig.settled()
    if spec.release is None:
        assert await rig.releases("sent") == 0
    if not spec.concurrent:
        assert await engine_requests(rig.http, rig.decode) == [] or action == "finish"


async def test_auto_aborts_a_prefill_far_from_done(rig: Rig) -> None:
    await rig.inject(rig.prefill, kind="hang", role="prefill")
    client = rig.leave_later(completion(LONG_PROMPT))
    await _in_state(rig, "prefilling")
    await eventually(lambda: _held_is(rig, rig.prefill, 1))
    await _cancel(client)
    await eventually(lambda: _disconnects_are(rig, "abort", 1))
    await eventually(lambda: _held_is(rig, rig.prefill, 0))
    await rig.settled()
    assert await rig.releases("sent") == 0


async def test_auto_aborts_a_queued_prefill(rig_with: RigFactory) -> None:
    """The engine says requests are waiting, and the work reserved ahead of this prefill would
    not have drained yet: it is queued, and aborting it saves the engine's compute."""
    rig = await rig_with(prefill={"max_num_seqs": 1}, scrape_interval_s=0.05)
    await rig.inject(rig.prefill, kind="hang", role="prefill")
    ahead = rig.leave_later(completion(LONG_PROMPT * 3))  # ~21,000 tokens: ~2 s predicted
    await eventually(lambda: _held_is(rig, rig.prefill, 1))
    queued = rig.leave_later(completion())
    await eventually(lambda: _scraped_waiting_is(rig, 1))
    await _cancel(queued)
    await eventually(lambda: _disconnects_are(rig, "abort", 1))
    await eventually(lambda: _engine_waiting_is(rig, 0))  # the engine dropped it from its queue
    await _cancel(ahead)  # auto aborts this one too: far from done
    await eventually(lambda: _disconnects_are(rig, "abort", 2))
    await rig.settled()
    assert len(await engine_requests(rig.http, rig.prefill)) == 2


async def _scraped_waiting_is(rig: Rig, count: int) -> bool:
    scheduler = await get_json(rig.http, rig.sidecar.url + "/debug/scheduler")
    scraped = scheduler["endpoints"][0]["scraped"]
    return scraped is not None and scraped.get("waiting") == count


async def _engine_waiting_is(rig: Rig, count: int) -> bool:
    return await metric(rig.http, rig.prefill.url, "vllm:num_requests_waiting") == count


async def test_client_gone_as_the_prefill_answer_arrives(rig_with: RigFactory, spec: Spec) -> None:
    # Even with abort: the status line is in, so the engine is done and its KV staged.
    if spec.concurrent:
        pytest.skip("an SGLang prefill answers once its decode has the KV: nothing to free")
    rig = await rig_with(prefill_on_disconnect="abort")
    await rig.inject(rig.prefill, kind="stall", role="prefill", after_chunks=1)
    client = rig.leave_later(completion())
    await eventually(lambda: _held_is(rig, rig.prefill, 1))
    if spec.release is not None:
        assert await staged_blocks(rig.http, rig.prefill) > 0
    await _cancel(client)
    await eventually(lambda: _disconnects_are(rig, "finish", 1))
    await rig.release_held()
    await rig.settled()
    assert await rig.releases("sent") == (0 if spec.release is None else 1)


@pytest.mark.parametrize(
    "moment",
    [
        "between_legs",  # the decode engine took the request, no status line yet
        "before_first_byte",  # its status line is in, no body byte yet
    ],
)
async def test_client_gone_before_the_decode_answer(
    rig_with: RigFactory, spec: Spec, moment: str
) -> None:
    if spec.concurrent and moment == "between_legs":
        pytest.skip("SGLang has no moment between legs: test_cancelled_twice covers a hung decode")
    # nixl-push: a release after the decode took the KV waits for a push that will not come,
    # until the release's timeout (the first-byte timeout).
    rig = await rig_with(decode_first_byte_timeout_s=2.0)
    if moment == "between_legs":
        await rig.inject(rig.decode, kind="hang", role="decode")
    else:
        await rig.inject(rig.decode, kind="stall", role="decode", after_chunks=1)
    client = rig.leave_later(completion())
    await _in_state(rig, "decoding")
    await eventually(lambda: _held_is(rig, rig.decode, 1))
    await _cancel(client)
    if spec.release is None:  # nothing staged for this request alone
        pass
    elif moment == "between_legs":  # not pulled: the release frees it
        await eventually(lambda: _releases_are(rig, "sent", 1))
    else:  # the emulator pulled before it stalled: the release fails, harmlessly
        await eventually(lambda: _releases_are(rig, "failed", 1))
    await rig.release_held()
    await rig.settled()
    assert (await rig.record())["state"] == "cancelled"
    if spec.release is None:
        assert await rig.releases("sent") == await rig.releases("failed") == 0


async def test_client_gone_mid_stream(rig: Rig) -> None:
    await rig.inject(rig.decode, kind="stall", role="decode", after_chunks=2)
    client = rig.leave_later(completion(stream=True, max_tokens=20), read_first=True)
    await eventually(lambda: _held_is(rig, rig.decode, 1))
    await _cancel(client)
    await rig.release_held()
    await rig.settled()
    assert await rig.releases("sent") == 0  # the decode engine pulled the KV itself
    assert (await rig.record())["state"] == "cancelled"


@pytest.mark.parametrize("moment", ["prefilling", "decoding"])
async def test_cancelled_twice(rig_with: RigFactory, spec: Spec, moment: str) -> None:
    """A second cancellation (a drain after the client left, say) skips nothing."""
    rig = await rig_with(prefill_on_disconnect="abort")
    engine = rig.prefill if moment == "prefilling" else rig.decode
    await rig.inject(engine, kind="hang", role="prefill" if engine is rig.prefill else "decode")
    client = rig.leave_later(completion())
    # SGLang: a hung decode never claims its room, so the prefill never ends.
    await _in_state(rig, "prefilling" if spec.concurrent else moment)
    await eventually(lambda: _held_is(rig, engine, 1))
    [handler] = [t for t in asyncio.all_tasks() if _serving(t)]
    handler.cancel()
    await asyncio.sleep(0)  # the first cancellation is being handled
    handler.cancel()
    await _cancel(client)
    await eventually(lambda: _held_is(rig, engine, 0))
    if moment == "decoding" and spec.release is not None:
        await eventually(lambda: _releases_are(rig, "sent", 1))
    await rig.settled()


def _serving(task: asyncio.Task[Any]) -> bool:
    return any(where.endswith("pipeline.py:handle") for where in awaiting(task))


async def _held_is(rig: Rig, engine: RunningEmulator, count: int) -> bool:
    return await rig.held(engine) == count


async def _releases_are(rig: Rig, outcome: str, count: int) -> bool:
    return await rig.releases(outcome) == count


async def _disconnects_are(rig: Rig, action: str, count: int) -> bool:
    sample = f'pd_sidecar_prefill_disconnects_total{{action="{action}"}}'
    return await metric(rig.http, rig.sidecar.url, sample) == count


# --- request ids ------------------------------------------------------------------------------


async def test_requests_sharing_a_client_id_have_ids_of_their_own_on_the_engines(
    rig: Rig,
) -> None:
    """Engines key a request's KV by its id: concurrent requests that reuse one ``x-request-id``
    each carry an engine id of their own (the client's and a random suffix) on their legs, and
    all succeed; the answers and the records keep the client's id, the records the engine's."""
    count = 24

    async def one(index: int) -> tuple[int, str]:
        body = completion(f"Request {index} of a batch that shares one id. " * 8, max_tokens=3)
        async with rig.http.post(
            rig.sidecar.url + "/v1/completions",
            json=body,
            headers={"x-prefiller-host-port": rig.prefill.endpoint, "x-request-id": "shared"},
        ) as response:
            await response.read()
            return response.status, response.headers["x-request-id"]

    answers = await asyncio.gather(*(one(index) for index in range(count)))
    assert answers == [(200, "shared")] * count
    prefill_ids = [
        leg["headers"]["x-request-id"] for leg in await engine_requests(rig.http, rig.prefill)
    ]
    decode_ids = [
        leg["headers"]["x-request-id"] for leg in await engine_requests(rig.http, rig.decode)
    ]
    assert len(set(prefill_ids)) == len(prefill_ids) == count
    assert set(decode_ids) == set(prefill_ids)  # each request's legs share its engine id
    assert all(engine_id.startswith("shared-") for engine_id in prefill_ids)
    recent = (await get_json(rig.http, rig.sidecar.url + "/debug/requests"))["recent"]
    assert [record["id"] for record in recent] == ["shared"] * count
    assert {record["engine_id"] for record in recent} == set(prefill_ids)
    # /debug/requests/<engine id> finds its record (a vLLM log line names the engine id)
    found = await get_json(rig.http, f"{rig.sidecar.url}/debug/requests/{prefill_ids[0]}")
    assert (found["id"], found["engine_id"]) == ("shared", prefill_ids[0])
    await rig.settled()


# --- fields only the decode leg's answer reports ------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", completion(max_tokens=3, logprobs=2)),
        ("/v1/completions", completion(max_tokens=3, echo=True, return_token_ids=True)),
        ("/v1/chat/completions", chat(max_tokens=3, logprobs=True, top_logprobs=2)),
        ("/v1/chat/completions", chat(max_tokens=3, echo=True, top_logprobs=None)),
    ],
    ids=["logprobs", "echo", "chat-top-logprobs", "chat-echo-without-logprobs"],
)
async def test_answer_fields_stay_off_the_prefill_leg(
    rig: Rig, spec: Spec, path: str, body: dict[str, Any]
) -> None:
    """``echo``, ``logprobs``, ``top_logprobs``, ``return_token_ids``: the decode leg's answer
    reports them; on a one-token prefill leg they only grow the answer (echo: the prompt again).
    SGLang hands the prefill's first token with its logprobs to the decode: the same body."""
    status, _ = await rig.post(body, path)
    assert status == 200
    [prefill_leg] = await engine_requests(rig.http, rig.prefill)
    [decode_leg] = await engine_requests(rig.http, rig.decode)
    route = "chat_completions" if "messages" in body else "completions"
    spec.check_legs(body, route, prefill_leg["body"], decode_leg["body"])
    if spec.name != "sglang":
        assert not {"echo", "logprobs", "top_logprobs", "return_token_ids"} & set(
            prefill_leg["body"]
        )
    assert (await rig.record())["decision"] == "remote"
    await rig.settled()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", completion(max_tokens=3, prompt_logprobs=1)),
        ("/v1/completions", completion(max_tokens=3, echo=True, logprobs=0)),
        ("/v1/chat/completions", chat(max_tokens=3, echo=True)),
        ("/v1/chat/completions", chat(max_tokens=3, prompt_logprobs=0)),
    ],
    ids=["prompt-logprobs", "echo-with-logprobs", "chat-echo", "chat-prompt-logprobs"],
)
async def test_prompt_logprobs_are_served_where_the_prompt_is_computed(
    rig: Rig, spec: Spec, path: str, body: dict[str, Any]
) -> None:
    """A decode engine that loads the prompt's KV computes only its last token, so it cannot
    report the prompt's logprobs (vLLM: ``prompt_logprobs``, or ``echo`` with ``logprobs`` /
    chat's ``top_logprobs``, 0 by default). NIXL and shared storage serve such a request on the
    decode engine alone, the client's body unchanged; SGLang cannot (its decode server never
    prefills): both legs get the client's fields."""
    status, _ = await rig.post(body, path)
    assert status == 200
    record = await rig.record()
    decode_legs = await engine_requests(rig.http, rig.decode)
    if spec.name == "sglang":
        assert record["decision"] == "remote"
        [prefill_leg] = await engine_requests(rig.http, rig.prefill)
        route = "chat_completions" if "messages" in body else "completions"
        spec.check_legs(body, route, prefill_leg["body"], decode_legs[0]["body"])
    else:
        assert (record["decision"], record["reason"]) == ("local", "prompt_logprobs")
        assert await engine_requests(rig.http, rig.prefill) == []
        assert [leg["body"] for leg in decode_legs] == [body]
    await rig.settled()


# --- the prefill's answer -----------------------------------------------------------------------

PADDING = 64 * 1024 * 1024
ANSWER_LIMIT = 4 * 1024 * 1024
"""SIDECAR_MAX_PREFILL_ANSWER_BYTES's default."""


async def _padding_sent(rig: Rig) -> int:
    return int((await get_json(rig.http, rig.prefill.url + "/emulator/faults"))["padding_sent"])


@pytest.mark.parametrize("fallback", ["local", "fail"])
async def test_a_prefill_answer_too_long_is_dropped_unread(
    rig_with: RigFactory, spec: Spec, fallback: str
) -> None:
    """A prefill target that answers 64 MiB (chunked: no Content-Length says so) is read up to
    SIDECAR_MAX_PREFILL_ANSWER_BYTES and no further: a failed prefill, not a transient one, which
    the fallback policy handles. SGLang needs nothing of its prefill's 2xx answer: read to its
    end, never kept."""
    if spec.name == "sglang" and fallback == "local":
        pytest.skip("an SGLang decode server cannot prefill: refused at start (test_config)")
    rig = await rig_with(prefill={"kv_expiry_s": 0.5}, prefill_fallback=fallback)
    await rig.inject(rig.prefill, kind="bloat", size=PADDING, role="prefill")
    status, raw = await rig.post(completion(max_tokens=3))
    if spec.name == "sglang":
        assert status == 200
        await eventually(lambda: _padding_is(rig, PADDING), within=30)
        await rig.settled()
        return
    record = await rig.record()
    assert record["fallback_reason"] == "prefill_too_large"
    # What the emulator could write: the limit, plus what the sockets' buffers took.
    assert await _padding_sent(rig) < ANSWER_LIMIT + 16 * 1024 * 1024
    if fallback == "local":
        assert (status, record["decision"]) == (200, "local")
    else:
        error = orjson.loads(raw)["error"]
        assert (status, error["type"]) == (503, "ServiceUnavailableError")
        assert f"answered more than {ANSWER_LIMIT} bytes" in error["message"]
        assert "SIDECAR_MAX_PREFILL_ANSWER_BYTES" in error["message"]
    sample = 'pd_sidecar_fallbacks_total{reason="prefill_too_large"}'
    assert await metric(rig.http, rig.sidecar.url, sample) == 1
    # KV the target staged (its parameters unread) is left to its expiry: 0.5 s here.
    await rig.settled()


async def _padding_is(rig: Rig, size: int) -> bool:
    return await _padding_sent(rig) == size

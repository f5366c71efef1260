"""Property-based: random bodies and header values never crash the sidecar or leak a record."""

from __future__ import annotations

import json

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import get_json


def _dumps(value: object) -> bytes:
    return json.dumps(value).encode()  # the standard library writes integers of any size


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "n",
        "kv_transfer_params",
        "temperature",
    ]
)
_BODIES = (
    st.dictionaries(_FIELDS, _JSON, max_size=6).map(_dumps)
    | _JSON.map(_dumps)
    | st.binary(max_size=64)
)
# Header values aiohttp's client will send (no CR/LF); anything else is refused before the wire.
_HEADER_VALUES = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80
) | st.sampled_from(["", ",", "[::1]", "http://", "[fd00::1]:99999", "a:1,b:2", "localhost:0"])
_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@_SETTINGS
@given(
    body=_BODIES,
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    target=st.none() | st.just("the prefill engine") | _HEADER_VALUES,
    request_id=_HEADER_VALUES,
)
async def test_random_requests(http, sidecar, prefill, body, path, target, request_id):
    headers = {"x-request-id": request_id}
    if target is not None:
        real = target == "the prefill engine"
        headers["x-prefiller-host-port"] = prefill.endpoint if real else target
    async with http.post(sidecar.url + path, data=body, headers=headers) as response:
        assert response.status < 500 or response.status in (502, 503, 504), response.status
        assert response.headers["x-request-id"]
        raw = await response.read()
    if response.status >= 400 and response.headers.get("content-type", "").startswith(
        "application/json"
    ):
        assert "error" in orjson.loads(raw)
    debug = await get_json(http, sidecar.url + "/debug/requests?limit=1")
    assert debug["inflight"] == []

"""KV that a prefill staged for a decode that will not take it: freed at once, not at expiry.

On a NixlConnector pair of this module's own, started for its first test and stopped after its
last (``cluster`` below overrides the session's). Once, on CI, with this module sharing the
session's pair, the lease check of test_real_engines.py counted 37 expiries more than the one
request stranded on purpose: as many as that module's own healthy requests, all pulled, so the
prefill engine never learnt that they were read. Not reproduced here (three whole runs, and this
module's disconnect scenario three times in a row followed by healthy requests, whose KV was
freed within 1.5 s each time). Here, once, a KV release of the disconnect scenario was lost to
the keep-alive race that SIDECAR_ENGINE_KEEPALIVE_S now prevents, and its KV expired inside that
count too. Whatever these scenarios leave in the engines, the lease count is no longer theirs to
disturb; that check names the expired requests when it fails.

"KV held on the prefill engine" is read as docs/e2e.md explains: a
plain one-token request straight to the prefill engine, then its ``vllm:kv_cache_usage_perc``,
compared with a reading taken the same way before the scenario. Both tests first make one ordinary
P/D request, so that the decode engine has its NIXL handshake with the prefill engine before the
scenario starts (on a pair that never transferred, vLLM's own cleanup of a refused decode request
waits for the decode engine's next step: the result would depend on test order).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson
import pytest
import pytest_asyncio

from devkit.slowlink import SlowLink
from e2e.engines import MAX_MODEL_LEN, SidecarProcess
from tests.e2e_vllm.conftest import (
    PATHS,
    Cluster,
    Route,
    engine_queues,
    engine_trouble,
    generate,
    log_dir_for,
    metric,
    prefill_header,
    prefill_kv_blocks,
    record,
    request_body,
    settled_prefill_kv_blocks,
    settled_sidecar_metric,
    sidecar_metric,
    sidecar_trouble,
    start_cluster,
    unique_prompt,
    until,
    warm_pair,
)

pytestmark = [pytest.mark.e2e_vllm, pytest.mark.asyncio(loop_scope="session")]

KV_FREED_WITHIN_S = 10.0
""""Within a few seconds": far below the prefill engine's 30 s lease, far above a release's
round trip (about 0.1 s measured)."""
RELEASES = "pd_sidecar_kv_releases_total"

# --- random client disconnects -------------------------------------------------------------------

SEED = 20261201
REQUESTS = 48
CLIENT_TIMEOUT_S = 60
"""Each request's limit, in the client (the slowest takes about 3 s here)."""
DECODE_LINK_DELAY_S = 0.5
"""The scenario's sidecar reaches the decode engine over a slow link (devkit/slowlink.py): every
decode leg waits this long before the engine sees it, so the window between the legs is at least
this wide on any machine. Only the legs wait: the sidecar's ``/health`` polls (GETs, on a pool of
their own) cross the link at once, and it judges the engine at its production defaults (``HEALTH``).
Delayed too, with e2e's 1 s poll timeout, three polls in a row timed out on a loaded CI machine: the
engine counted as down, and every later request got 503 before any leg. Without the link the window
is the decode engine's time to a first token after a KV pull, a few milliseconds for the tiny model:
a client leaving "between the legs" (its clock started when the record shows ``prefill_done``, read
over HTTP) found its answer already complete (CI, 12 of 12)."""
HEALTH = {"SIDECAR_READY_INTERVAL_S": "2", "SIDECAR_ENGINE_KEEPALIVE_S": "2"}
"""The scenario's sidecar polls the decode engine's ``/health`` at the default interval (its
timeout the same 2 s; 3 failed polls in a row, 6 s, before it counts as down), not e2e's 0.5 s:
48 concurrent requests on two CPU engines leave their API servers slow to answer.

It reuses an idle connection to the decode engine for 2 s at most, not the default 4 s: a request
reaches the engine ``DECODE_LINK_DELAY_S`` after the sidecar sent it, later on a loaded machine,
and vLLM closes a connection idle for 5 s. With 4 s, a decode leg sent on the connection the
warm-up left idle for nearly that long could arrive after the engine had closed it (a 503 with
nothing of the engine's; once on CI, one request of the 12 that never left)."""
MAX_RECONNECTS = 2
CONNECTIONS_CLOSED = "pd_sidecar_client_connections_closed_total"
CONNECTIONS_REFUSED = "pd_sidecar_client_connections_refused_total"
Cancel = Literal["prefill", "between", "midstream", "never"]
"""When the client leaves: a random moment after the sidecar's record shows the request arrived
(mostly during the prefill leg), a random moment after it shows the prefill done, after a random
number of streamed events, or never. Both timed cancellations start their clock at an event the
record shows, not at the send: on a loaded CI machine a timer started at the send can fire before
the sidecar has read the request."""
Window = Literal["before arrival", "prefill", "between legs", "decode answer", "never"]
"""Where a cancellation really landed, from the sidecar's record (its phases against the client's
clock): before the sidecar saw the request, before ``prefill_done``, between ``prefill_done``
and ``first_byte``, after ``first_byte``."""


@dataclass(slots=True)
class Plan:
    request_id: str
    route: Route
    stream: bool
    cancel: Cancel
    start_after_s: float
    prompt_words: int
    max_tokens: int
    cancel_after_s: float
    """prefill: after the record shows the request; between: after it shows the prefill done."""
    cancel_after_events: int
    """midstream: SSE events read before leaving."""
    status: int | None = None
    text: str = ""
    cancelled_at: float | None = None
    """Wall-clock time the client left (the sidecar's ``started_at`` is wall-clock too)."""
    reconnects: int = 0
    """Times the request was sent again because its connection closed before it was written
    (``_send``)."""
    events: int = 0
    """SSE data events read (``[DONE]`` aside)."""
    finish: str | None = None
    """The last ``finish_reason`` the answer gave."""
    errors: list[str] = dataclasses.field(default_factory=list)
    """Error events in the stream (the first 200 bytes of each): a stream whose status line said
    200 reports a failure this way."""
    timed_out: bool = False
    """The client's own limit (``CLIENT_TIMEOUT_S``) ended the request: the test fails, after
    reading the sidecar's record of it (once, on CI, one request took longer; which phase it
    was in went with the exception)."""


def plans(rng: random.Random) -> list[Plan]:
    kinds: list[Cancel] = ["prefill", "between", "midstream", "never"] * (REQUESTS // 4)
    rng.shuffle(kinds)
    routes: list[Route] = ["completions", "chat"]
    chosen = []
    for i, kind in enumerate(kinds):
        chosen.append(
            Plan(
                request_id=f"disconnect-{i}-{kind}",
                route=rng.choice(routes),
                stream=kind == "midstream" or rng.random() < 0.5,
                cancel=kind,
                start_after_s=rng.uniform(0, 0.5),
                # Longer prompts widen the prefill window for the early cancellations. The prefill
                # engine computes about 600 prompt tokens a second on its one core (2 a word).
                prompt_words=rng.randint(60, 150) if kind == "prefill" else rng.randint(10, 60),
                max_tokens=rng.randint(16, 40),
                cancel_after_s=rng.uniform(0, 0.05) if kind == "prefill" else rng.uniform(0, 0.02),
                cancel_after_events=rng.randint(1, 8),
            )
        )
    return chosen


async def _send(
    session: aiohttp.ClientSession, http: aiohttp.ClientSession, cluster: Cluster, plan: Plan
) -> None:
    body = request_body(
        plan.route,
        unique_prompt(plan.request_id, words=plan.prompt_words),
        stream=plan.stream,
        max_tokens=plan.max_tokens,
    )
    while True:
        try:
            await _exchange(session, cluster, plan, body)
            return
        except aiohttp.ClientOSError:
            # The connection was closed before the request could be written (once on CI: "Can
            # not write request body", the transport closing as the head was sent). A request
            # the sidecar never saw is sent again, as HTTP clients do; the test then checks
            # that the sidecar's listener closed and refused no connection, so that the
            # listener is not what closed it. One the sidecar saw fails the test.
            if plan.reconnects >= MAX_RECONNECTS or await _recorded(
                http, cluster, plan.request_id, None
            ):
                raise
            plan.reconnects += 1


async def _exchange(
    session: aiohttp.ClientSession, cluster: Cluster, plan: Plan, body: dict[str, Any]
) -> None:
    async with session.post(
        cluster.sidecar.url + PATHS[plan.route],
        json=body,
        headers=prefill_header(cluster, plan.request_id),
    ) as response:
        plan.status = response.status
        if not plan.stream or response.status != 200:
            raw = await response.read()
            if response.status == 200:
                choice = orjson.loads(raw)["choices"][0]
                plan.text = choice.get("text") or choice.get("message", {}).get("content") or ""
                plan.finish = choice.get("finish_reason")
            return
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            plan.events += 1
            event = orjson.loads(line[len(b"data: ") :])
            if "error" in event:
                plan.errors.append(line[len(b"data: ") :][:200].decode(errors="replace"))
            for choice in event.get("choices") or []:
                plan.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                plan.finish = choice.get("finish_reason") or plan.finish
            if plan.cancel == "midstream" and plan.events >= plan.cancel_after_events:
                plan.cancelled_at = time.time()
                response.close()  # the client leaves mid-stream
                return


async def _recorded(
    http: aiohttp.ClientSession, cluster: Cluster, request_id: str, phase: str | None
) -> bool:
    """The sidecar's record of the request exists (and, given a phase, shows it)."""
    async with http.get(f"{cluster.sidecar.url}/debug/requests/{request_id}") as response:
        if response.status != 200:  # not arrived yet
            return False
        return phase is None or phase in (await response.json())["phases"]


async def _run(
    session: aiohttp.ClientSession, http: aiohttp.ClientSession, cluster: Cluster, plan: Plan
) -> None:
    await asyncio.sleep(plan.start_after_s)
    call = asyncio.ensure_future(_send(session, http, cluster, plan))
    if plan.cancel in ("prefill", "between"):
        phase = "prefill_done" if plan.cancel == "between" else None
        # The record lives in the sidecar, seen only over HTTP: there is no event to await.
        while True:
            if call.done() or await _recorded(http, cluster, plan.request_id, phase):
                break
            await asyncio.sleep(0.01)
        await asyncio.wait({call}, timeout=plan.cancel_after_s)
    if plan.cancel in ("prefill", "between") and not call.done():
        plan.cancelled_at = time.time()
        call.cancel()  # the client leaves: its connection closes (force_close below)
    try:
        await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # not the client leaving: the test is stopped
            raise
    except TimeoutError:
        plan.timed_out = True


async def _entry(
    http: aiohttp.ClientSession, cluster: Cluster, request_id: str
) -> dict[str, Any] | None:
    """The sidecar's record of the request (None: it has none)."""
    async with http.get(f"{cluster.sidecar.url}/debug/requests/{request_id}") as response:
        return await response.json() if response.status == 200 else None


def window(plan: Plan, entry: dict[str, Any] | None) -> Window:
    if plan.cancelled_at is None:
        return "never"
    if entry is None:
        return "before arrival"
    left = plan.cancelled_at - entry["started_at"]
    phases = entry["phases"]
    if "prefill_done" not in phases or left < phases["prefill_done"]:
        return "prefill"
    if "first_byte" not in phases or left < phases["first_byte"]:
        return "between legs"
    return "decode answer"


_RELEASED_UNKNOWN = "Potentially invalid KV blocks for unrecognized request"
_STARTUP_NOISE = ("LD_PRELOAD", "Triton", "oneDNN", "KVConnectorBase_V1")
"""Warnings every CPU engine logs as it starts (vLLM 0.32 on this image): nothing about a stall."""


async def _stalled(http: aiohttp.ClientSession, cluster: Cluster, slow: list[Plan]) -> str:
    """Why requests ran past the client's limit, most telling first and short enough for a CI log
    that keeps a failure's first lines only: each one's sidecar record (state, phases, status), the
    engines' queues and KV use now, then their last warnings and errors. Twice on CI the decode
    engine sent nothing for 60 s to a few requests of the first wave; CI keeps no engine logs."""
    lines = [f"{len(slow)} request(s) over {CLIENT_TIMEOUT_S} s:"]
    for plan in slow[:10]:
        lines.append("  " + _described(plan, await _entry(http, cluster, plan.request_id)))
    if len(slow) > 10:
        lines.append(f"  ... and {len(slow) - 10} more")
    for role, engine in (("decode", cluster.decode), ("prefill", cluster.prefill)):
        queues = await engine_queues(http, engine)
        usage = await metric(http, engine, "vllm:kv_cache_usage_perc")
        lines.append(f"{role} engine now: {queues}, kv_cache_usage_perc {usage:g}")
    for role, engine in (("decode", cluster.decode), ("prefill", cluster.prefill)):
        trouble = engine_trouble(engine, limit=1000)
        # A release's pull of KV its engine had freed already: expected, once per release.
        unknown = [line for line in trouble if _RELEASED_UNKNOWN in line]
        others = [
            line
            for line in trouble
            if _RELEASED_UNKNOWN not in line and not any(part in line for part in _STARTUP_NOISE)
        ]
        lines.append(
            f"{role} engine's last warnings and errors ({len(unknown)} '{_RELEASED_UNKNOWN}' "
            "left out):"
        )
        lines.extend(f"  {line[:240]}" for line in others[-12:])
    return "\n".join(lines)


def _described(plan: Plan, entry: dict[str, Any] | None) -> str:
    """One request as the client saw it and as the sidecar recorded it."""
    entry = entry or {}
    phases = {name: round(at, 2) for name, at in (entry.get("phases") or {}).items()}
    return (
        f"{plan.request_id} {plan.route} stream={plan.stream} status={plan.status} "
        f"events={plan.events} finish={plan.finish} text={plan.text[:40]!r} "
        f"errors={plan.errors[:2]}: sidecar {entry.get('state')} {entry.get('status')} {phases} "
        f"error={entry.get('error')!r}"
    )


async def _unanswered(http: aiohttp.ClientSession, cluster: Cluster, plans: list[Plan]) -> str:
    """Why requests whose client never left did not get their answer, short enough for a CI log
    that keeps a failure's first lines only: each one as the client saw it (events, error events)
    and as the sidecar recorded it (its error says which leg failed and how), then the sidecar's
    and the decode engine's own warnings and errors. CI keeps neither log."""
    lines = [f"{len(plans)} request(s) whose client never left got no answer:"]
    for plan in plans[:10]:
        lines.append("  " + _described(plan, await _entry(http, cluster, plan.request_id)))
    lines.append("the sidecar's last warnings and errors:")
    lines.extend(f"  {line[:240]}" for line in sidecar_trouble(cluster.sidecar)[-12:])
    trouble = engine_trouble(cluster.decode, limit=1000)
    lines.append("the decode engine's last warnings and errors:")
    lines.extend(
        f"  {line[:240]}"
        for line in [
            line
            for line in trouble
            if _RELEASED_UNKNOWN not in line and not any(part in line for part in _STARTUP_NOISE)
        ][-12:]
    )
    return "\n".join(lines)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    """This module's own NixlConnector pair (the module docstring says why)."""
    async with await start_cluster(log_dir_for(tmp_path_factory)) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def slow_decode(cluster: Cluster) -> AsyncIterator[Cluster]:
    """The pair, with a sidecar of its own that reaches the decode engine over a slow link."""
    link = SlowLink(
        "127.0.0.1",
        cluster.decode.port,
        DECODE_LINK_DELAY_S,
        undelayed=lambda head: head.startswith(b"GET "),
    )
    async with link:
        sidecar = SidecarProcess(link.url, cluster.log_dir, extra_env=dict(HEALTH))
        sidecar.start()
        try:
            await sidecar.wait_ready()
            yield dataclasses.replace(cluster, sidecar=sidecar)
        finally:
            await sidecar.stop()


@pytest.mark.timeout(300)  # the first test also starts the engines
async def test_random_client_disconnects_leave_no_kv_held(slow_decode: Cluster, http) -> None:
    """48 concurrent P/D requests, streamed and not, both routes; each client leaves at its own
    random moment (seeded): during the prefill leg, between the legs, mid-stream, or never.
    Afterwards the prefill engine holds no more KV than before, within seconds (no waiting for
    the 30 s lease), and no record is left in flight. The sidecar reaches the decode engine over
    a slow link (``DECODE_LINK_DELAY_S``), so that "between the legs" is a window a client can
    leave in."""
    cluster = slow_decode
    await warm_pair(http, cluster, "disconnects")
    held_before = await prefill_kv_blocks(http, cluster)
    released_before = await sidecar_metric(http, cluster, RELEASES, outcome="sent")
    chosen = plans(random.Random(SEED))

    # One connection per request, closed when its client leaves: the sidecar sees a disconnect.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S, sock_connect=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(_run(session, http, cluster, plan) for plan in chosen))
    slow = [plan for plan in chosen if plan.timed_out]
    if slow:
        pytest.fail(await _stalled(http, cluster, slow))
    # Before anything else is judged, so that a later check's failure does not hide why.
    # A stream the client meant to leave mid-way but that ended first counts as never left: its
    # text must be there too.
    unanswered = [p for p in chosen if p.cancelled_at is None and not (p.status == 200 and p.text)]
    if unanswered:
        pytest.fail(await _unanswered(http, cluster, unanswered))

    async def none_in_flight() -> bool:
        async with http.get(cluster.sidecar.url + "/debug/requests?limit=1000") as response:
            listed = await response.json()
        return not listed["inflight"]

    await until(none_in_flight, KV_FREED_WITHIN_S, "every request record leaves inflight")
    entries: dict[str, dict[str, Any] | None] = {}
    for plan in chosen:
        entries[plan.request_id] = await _entry(http, cluster, plan.request_id)
    windows = Counter(window(plan, entries[plan.request_id]) for plan in chosen)
    held, took = await settled_prefill_kv_blocks(
        http, cluster, at_most=held_before, within=KV_FREED_WITHIN_S
    )
    released = await sidecar_metric(http, cluster, RELEASES, outcome="sent") - released_before
    failed = await sidecar_metric(http, cluster, RELEASES, outcome="failed")
    reconnects = sum(plan.reconnects for plan in chosen)
    closed = await sidecar_metric(http, cluster, CONNECTIONS_CLOSED, listener="api")
    refused = await sidecar_metric(http, cluster, CONNECTIONS_REFUSED, listener="api")
    summary = (
        f"seed {SEED}; where clients left: {dict(windows)}; prefill KV blocks held "
        f"{held_before} before, {held} after {took:.1f} s; releases sent {released:g}, "
        f"failed (total) {failed:g}; sent again after a closed connection: {reconnects}; "
        f"connections the sidecar closed {closed:g}, refused {refused:g}"
    )
    print(summary)
    # Nothing here is slow, idle or over the cap: the sidecar's listener closes nothing.
    assert (closed, refused) == (0, 0), summary

    for plan in chosen:
        entry = entries[plan.request_id]
        if plan.cancelled_at is None:
            assert plan.status == 200, (plan, entry)
            assert plan.text, plan
            assert entry is not None, plan
            assert entry["state"] == "completed", (plan, entry)
        elif entry is not None:
            assert entry["state"] in ("completed", "failed", "cancelled"), entry
    # The scenario did what it claims: clients left in each window.
    for where in ("prefill", "between legs", "decode answer", "never"):
        assert windows[where] > 0, summary
    assert held <= held_before, summary


# --- the decode engine refuses after a good prefill ----------------------------------------------

REFUSED_MAX_TOKENS = 5000
"""Over the engines' --max-model-len: the decode engine answers 400 before admitting the request;
the prefill leg, which the sidecar sends with max_tokens 1, succeeds."""
assert REFUSED_MAX_TOKENS > MAX_MODEL_LEN


@pytest.mark.timeout(300)  # also starts the engines when run alone
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_decode_refusal_releases_the_prefill_kv(cluster: Cluster, http, stream: bool) -> None:
    """The prefill leg succeeds, then the decode engine refuses the request (400, max_tokens over
    its context): the client gets that 400, and the sidecar releases the KV the prefill staged
    (one release sent) instead of leaving it to the prefill engine's lease.

    On a warmed pair vLLM 0.32's decode engine also frees a refused request's KV by itself
    (docs/e2e.md): the release counter is what proves the sidecar's part; the KV reading proves
    that nothing is left held, whoever freed it.
    """
    await warm_pair(http, cluster, f"refusal-{stream}")
    held_before = await prefill_kv_blocks(http, cluster)
    released_before = await sidecar_metric(http, cluster, RELEASES, outcome="sent")
    request_id = f"decode-refuses-{'stream' if stream else 'json'}"
    body = request_body(
        "completions",
        unique_prompt(request_id, words=250),  # about 500 tokens: 4 blocks of KV
        stream=stream,
        max_tokens=REFUSED_MAX_TOKENS,
    )

    answer = await generate(
        http, cluster.sidecar.url, "completions", body, prefill_header(cluster, request_id)
    )

    assert answer.status == 400, answer.body
    entry = await record(http, cluster, request_id)
    assert entry["decision"] == "remote", entry
    assert "prefill_done" in entry["phases"], entry  # the prefill leg did stage KV
    assert (entry["state"], entry["status"]) == ("failed", 400), entry
    held, took = await settled_prefill_kv_blocks(
        http, cluster, at_most=held_before, within=KV_FREED_WITHIN_S
    )
    released = await settled_sidecar_metric(
        http, cluster, RELEASES, released_before + 1, outcome="sent"
    )
    # The decode engine's own refusal of the same body; asked only now, as it makes that engine
    # step (which would flush a cleanup vLLM still had queued).
    plain = await generate(http, cluster.decode.url, "completions", body)

    assert (plain.status, answer.body) == (400, plain.body), "not the decode engine's answer"
    assert held <= held_before, f"{held} blocks held after {took:.1f} s, {held_before} before"
    assert released == released_before + 1, (
        f"{RELEASES}{{outcome=sent}} went from {released_before:g} to {released:g}: "
        "the sidecar did not release the KV staged for the refused decode"
    )

"""Prefix-aware prefill placement on real vLLM engines: the prefill engine holding a prompt's
prefix gets it, and the sidecar predicts the hit the engine reports.

Two vLLM prefill engines and one decode engine, all NixlConnector: the session's pair and its
spare prefill engine (started with the pair, on the prefill engine's core; the decode engine
keeps its own), stopped when this module ends. Three engines fit these machines: about 1.6 GiB
each, started together in 90 to 110 s, so no prefill server is the emulator (docs/e2e.md,
"Prefix-aware placement: three engines"). A sidecar of the module's own has both prefill engines
in its pool (``SIDECAR_PREFILL_ENDPOINTS``) and no gateway header names one: the scheduler places
every request.

The prompts share a prefix of exactly 1,024 tokens (the engine's own count, ``/tokenize``: eight
of vLLM's 128-token blocks on CPU, so that the engine's cache granularity does not blur the
comparison) followed by a unique part of about 160 tokens, the shape of the simulator's
shared-system-prompt workload. The text is words of the tiny model's vocabulary with two-digit
numbers mixed in so that it has about 4 characters per token, the sidecar's estimate: the index
predicts a hit as its share of the prompt's text times the engine's token count, so what matters
is that the prefix and the rest have the same density, and that a 64-token block of the index
(256 characters) stays small against the prefix.

**Why the first test forces disaggregation.** The decider chooses between prefilling on the local
decode engine and on a prefill server before the policy chooses which server, and on this setup
it rightly chooses local, measured on these engines (2026-12-03): the decode engine holds the
shared prefix after the first request (it pulled that KV), so the next requests have about 160
uncached tokens, under ``SIDECAR_DISAGG_MIN_TOKENS`` (512): decided ``prefix_cached``, local, the
decode engine's prefix cache serving 1,024 tokens of each (the second test proves it). With
unique parts over 512 tokens the decider then found the pool saturated (``pool_saturated``): the
tiny model's prefill is all overhead, the decode engine's own time to first byte 0.19–0.32 s,
predicted remote times over twice that. Neither is what this module asks about — *which*
prefill server — so the first test's sidecar runs with ``SIDECAR_DISAGG_MIN_TOKENS=0`` and
``SIDECAR_DISAGG_TTFT_RATIO=1000`` (every request goes remote); every other setting is the
default (policy ``qoe``, prefix index on, 64-token blocks, trust 1, re-test every 15 s).

**Why the pool is warmed first.** An endpoint the sidecar has not observed is predicted at the
prior speed (10,000 tokens/s, 20 ms), faster than these engines answer through HTTP; an observed
holder then loses to a stranger that must compute the whole prompt (measured: the third request
of a cold run went to the other engine, which then held the prefix too). A pool in service has
been observed, so the test first sends two requests to each prefill engine, named by the
gateway's header, with prompts of the same size.

A re-test (``SIDECAR_SCHEDULER_RETEST_S``, 15 s) sends one request to the engine that does not
hold the prefix once it has had none for that long: the target is 90 %, and every request that did
not go to the holder must be a re-test. The ten take about 5 s when only the engine that
prefilled is read after each (an idle engine's ``/metrics``, its core shared, takes about 1 s).
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from e2e.engines import SERVED_MODEL, SidecarProcess, VllmEngine
from e2e.make_tiny_model import WORDS
from tests.e2e_vllm.conftest import (
    Cluster,
    generate,
    metric,
    record,
    request_body,
    settled_metric,
    settled_sidecar_metric,
    sidecar_metric,
)

pytestmark = [pytest.mark.e2e_vllm, pytest.mark.asyncio(loop_scope="session")]

PREFIX_TOKENS = 1024
"""The shared prefix, in the engine's tokens: eight whole blocks of 128 (vLLM on CPU)."""
SUFFIX_PIECES = 130
"""Words and numbers of each request's unique part: about 160 tokens, 650 characters."""
FOLLOWERS = 10
"""Requests after the first that share its prefix."""
SHARE = 0.9
"""The target: at least this share of them goes to the engine that holds the prefix."""
TOLERANCE = 0.1
"""The target: the sidecar's predicted hit is within this share of the engine's
cached_tokens."""

HITS = "vllm:prefix_cache_hits_total"
"""Engine: prompt tokens its own prefix cache served."""
PREDICTED, REPORTED = "predicted", "reported"
CACHED_TOKENS = "pd_sidecar_prefill_cached_tokens_total"
"""Sidecar: per prefill answer, what the index predicted the engine held (in the engine's tokens)
and what the engine reported, summed; one request at a time, each answer's own is a difference."""
ANSWERS = "pd_sidecar_prefill_prefix_error_tokens_count"
"""Sidecar: prefill answers compared with the index's prediction."""

FORCE_REMOTE = {"SIDECAR_DISAGG_MIN_TOKENS": "0", "SIDECAR_DISAGG_TTFT_RATIO": "1000"}
"""Every request goes to a prefill server (module docstring: why)."""

CHARS_PER_TOKEN = 4.03
"""The text's target density; a little over the sidecar's 4, so that 1,024 tokens cover 16 whole
blocks of the index (4,096 characters) rather than falling just short of the 16th."""


# --- prompts -------------------------------------------------------------------------------------


def shaped_pieces(rng: random.Random, count: int) -> list[str]:
    """Words of the tiny model's vocabulary (one token each, with their space: about 5.7
    characters) and two-digit numbers (two tokens, 3 characters), mixed so that the text stays
    near ``CHARS_PER_TOKEN`` all along: prefix and unique part alike."""
    pieces: list[str] = []
    chars = tokens = 0
    for _ in range(count):
        if chars >= CHARS_PER_TOKEN * tokens:
            pieces.append(str(rng.randrange(10, 100)))
            chars, tokens = chars + 3, tokens + 2
        else:
            word = rng.choice(WORDS)
            pieces.append(word)
            chars, tokens = chars + len(word) + 1, tokens + 1
    return pieces


async def token_count(http: aiohttp.ClientSession, engine: VllmEngine, text: str) -> int:
    """The prompt's tokens as the engine counts a completion's (its special tokens included)."""
    body = {"model": SERVED_MODEL, "prompt": text}
    async with http.post(engine.url + "/tokenize", json=body) as response:
        assert response.status == 200, await response.text()
        count: int = (await response.json())["count"]
        return count


async def shared_prefix(http: aiohttp.ClientSession, engine: VllmEngine, rng: random.Random) -> str:
    """A text of exactly ``PREFIX_TOKENS`` tokens, new to every engine: the fewest pieces that
    reach it (a number is two tokens: one over is fixed by making the last piece a word)."""
    pieces = shaped_pieces(rng, 2 * PREFIX_TOKENS)
    low, high = 1, len(pieces)
    while low < high:
        middle = (low + high) // 2
        if await token_count(http, engine, " ".join(pieces[:middle])) >= PREFIX_TOKENS:
            high = middle
        else:
            low = middle + 1
    pieces = pieces[:low]
    if await token_count(http, engine, " ".join(pieces)) > PREFIX_TOKENS:
        pieces[-1] = rng.choice(WORDS)
    prefix = " ".join(pieces)
    assert await token_count(http, engine, prefix) == PREFIX_TOKENS, prefix
    return prefix


def unique_part(rng: random.Random) -> str:
    """A request's own text after the shared prefix. It starts with a space: the tokenizer splits
    before a space, so the prefix's tokens are the same in every prompt."""
    return " " + " ".join(shaped_pieces(rng, SUFFIX_PIECES))


# --- the pool ------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class PrefillPool:
    """The session's pair and a second prefill engine: the prefill pool of this module's
    sidecars."""

    pair: Cluster
    second: VllmEngine

    @property
    def prefills(self) -> tuple[VllmEngine, VllmEngine]:
        return self.pair.prefill, self.second

    @property
    def decode(self) -> VllmEngine:
        return self.pair.decode

    def by_endpoint(self, endpoint: str) -> VllmEngine:
        for engine in self.prefills:
            if engine.endpoint == endpoint:
                return engine
        raise AssertionError(f"{endpoint} is not a prefill engine of the pool")


@dataclass(slots=True, eq=False)
class PoolSidecar:
    """A sidecar whose prefill pool is both prefill engines (``WithSidecar`` for the helpers)."""

    sidecar: SidecarProcess


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pool(cluster: Cluster) -> AsyncIterator[PrefillPool]:
    """The session's pair and its spare prefill engine (started with the pair when this module
    was collected; here otherwise), which is stopped when the module ends: the modules after this
    one run on the pair alone."""
    if cluster.spare is None:
        cluster.spare = VllmEngine(
            "prefill", cluster.home, cluster.log_dir, cpu=cluster.prefill.cpu
        )
        cluster.spare.start()
    try:
        await cluster.spare.wait_ready()
        yield PrefillPool(cluster, cluster.spare)
    finally:
        await cluster.stop_spare()


@asynccontextmanager
async def pool_sidecar(pool: PrefillPool, env: dict[str, str]) -> AsyncIterator[PoolSidecar]:
    """A sidecar of its own (scheduler and prefix index fresh) with both prefill engines in its
    pool and ``env`` on top."""
    endpoints = ",".join(engine.endpoint for engine in pool.prefills)
    sidecar = SidecarProcess(
        pool.decode.url,
        pool.pair.log_dir,
        extra_env={"SIDECAR_PREFILL_ENDPOINTS": endpoints, **env},
    )
    try:
        sidecar.start()
        await sidecar.wait_ready()
        yield PoolSidecar(sidecar)
    finally:
        await sidecar.stop()


async def complete(
    http: aiohttp.ClientSession,
    sidecar: PoolSidecar,
    prompt: str,
    request_id: str,
    headers: dict[str, str] | None = None,
) -> int:
    """One greedy completion through ``sidecar``; returns the prefill's ``cached_tokens`` as the
    client got it (the sidecar writes the prefill's figure over the decode engine's)."""
    body = request_body("completions", prompt, stream=False, max_tokens=2)
    answer = await generate(
        http,
        sidecar.sidecar.url,
        "completions",
        body,
        {"x-request-id": request_id, **(headers or {})},
    )
    assert answer.status == 200, answer.body
    assert answer.usage is not None
    cached: int = answer.usage["prompt_tokens_details"]["cached_tokens"]
    return cached


async def warm(
    http: aiohttp.ClientSession, sidecar: PoolSidecar, pool: PrefillPool, rng: random.Random
) -> None:
    """Two requests to each prefill engine, named by the gateway's header, with prompts of the
    measured size: the sidecar observes every endpoint before it chooses (module docstring)."""
    for turn, engine in enumerate((*pool.prefills, *pool.prefills)):
        prompt = " ".join(shaped_pieces(rng, 950))  # about as long as the measured prompts
        header = {"x-prefiller-host-port": engine.endpoint}
        await complete(http, sidecar, prompt, f"warm-{turn}", header)


@dataclass(frozen=True, slots=True)
class Placed:
    """One request of the measured sequence, as the sidecar placed it and the engines saw it."""

    request_id: str
    endpoint: str | None
    reason: str
    cached_tokens: int
    """What the prefill engine reported (the client's ``usage``)."""
    predicted_tokens: float
    """What the sidecar's index predicted that engine held, in the engine's tokens."""
    hits: dict[str, float]
    """Each prefill engine's ``vllm:prefix_cache_hits_total`` rise during the request."""
    seconds: float
    """The request's own time (its answer), and with the readings around it."""
    measured_s: float


@dataclass(frozen=True, slots=True)
class Readings:
    """The counters a request is measured by, read between two requests."""

    answers: float
    predicted: float
    hits: dict[str, float]


async def readings(
    http: aiohttp.ClientSession, sidecar: PoolSidecar, pool: PrefillPool
) -> Readings:
    return Readings(
        await sidecar_metric(http, sidecar, ANSWERS),
        await sidecar_metric(http, sidecar, CACHED_TOKENS, source=PREDICTED),
        {engine.endpoint: await metric(http, engine, HITS) for engine in pool.prefills},
    )


async def placed_request(
    http: aiohttp.ClientSession,
    sidecar: PoolSidecar,
    pool: PrefillPool,
    prompt: str,
    request_id: str,
    before: Readings,
) -> tuple[Placed, Readings]:
    """Send one request and read what it did: the sidecar's decision, its prediction against the
    engine's answer (the sidecar's own figures, compared once that answer is counted), and each
    prefill engine's prefix-cache hits (settled: engines publish stats a step later). ``before``:
    the readings taken after the previous request; returns this one's, for the next."""
    sent = time.monotonic()
    cached = await complete(http, sidecar, prompt, request_id)
    answered = time.monotonic()

    entry = await record(http, sidecar, request_id)
    assert entry["state"] == "completed", entry
    assert entry["fallback_reason"] is None, entry
    endpoint = entry["prefill_endpoint"]
    counted = await settled_sidecar_metric(http, sidecar, ANSWERS, before.answers + 1)
    assert counted == before.answers + 1, "the prefill answer was not compared with a prediction"
    hits = dict(before.hits)
    if endpoint is not None:
        # Only the engine that prefilled can have hits. The other is not read: an idle engine's
        # API server, sharing its core with the busy one, takes about a second to answer.
        engine = pool.by_endpoint(endpoint)
        hits[endpoint] = await settled_metric(http, engine, HITS, hits[endpoint] + cached)
    after = Readings(
        await sidecar_metric(http, sidecar, ANSWERS),
        await sidecar_metric(http, sidecar, CACHED_TOKENS, source=PREDICTED),
        hits,
    )
    placed = Placed(
        request_id,
        endpoint,
        entry["reason"],
        cached,
        after.predicted - before.predicted,
        {key: after.hits[key] - before.hits[key] for key in before.hits},
        answered - sent,
        time.monotonic() - sent,
    )
    return placed, after


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(480)  # the first test also starts the session's pair and the second engine
async def test_a_shared_prefix_goes_to_the_prefill_engine_that_holds_it(
    pool: PrefillPool, http: aiohttp.ClientSession
) -> None:
    rng = random.Random(time.time_ns())
    prefix = await shared_prefix(http, pool.prefills[0], rng)
    async with pool_sidecar(pool, FORCE_REMOTE) as sidecar:
        await warm(http, sidecar, pool, rng)

        now = await readings(http, sidecar, pool)
        first, now = await placed_request(
            http, sidecar, pool, prefix + unique_part(rng), "shared-0", now
        )
        assert first.endpoint is not None, first
        assert first.cached_tokens == 0, first  # a prefix no engine has seen
        holder = first.endpoint
        started = time.monotonic()
        followers = []
        for i in range(1, FOLLOWERS + 1):
            placed, now = await placed_request(
                http, sidecar, pool, prefix + unique_part(rng), f"shared-{i}", now
            )
            followers.append(placed)
        took = time.monotonic() - started
        async with http.get(sidecar.sidecar.url + "/debug/scheduler") as response:
            index = (await response.json())["prefill_prefixes"]
        # Every hit of either engine was seen on the request that made it.
        assert (await readings(http, sidecar, pool)).hits == now.hits

    table = "\n".join(
        f"{p.request_id}: {p.endpoint} ({p.reason}) cached {p.cached_tokens} "
        f"predicted {p.predicted_tokens:.1f} hits {p.hits} "
        f"in {p.seconds:.2f} s ({p.measured_s:.2f} s measured)"
        for p in (first, *followers)
    )
    print(f"holder {holder}; {FOLLOWERS} followers in {took:.1f} s\n{table}\n{index}")
    # At least 90 % went to the engine that prefilled the first; any other is a re-test.
    at_holder = [p for p in followers if p.endpoint == holder]
    assert len(at_holder) >= SHARE * FOLLOWERS, table
    assert all(p.reason == "retest" for p in followers if p.endpoint != holder), table
    for p in at_holder:
        # The engine found the whole shared prefix in its cache, and said so.
        assert p.hits[holder] == PREFIX_TOKENS, table
        assert p.cached_tokens == PREFIX_TOKENS, table
        # The sidecar's prediction (estimated from text) against the engine's count.
        assert abs(p.predicted_tokens - p.cached_tokens) <= TOLERANCE * p.cached_tokens, table
    # The index's own error figures say the same.
    held = index["endpoints"][holder]
    assert index["feedback"] == "closed", index
    assert held["held_less_than_predicted"] == 0, index
    assert held["mean_abs_error_tokens"] <= TOLERANCE * PREFIX_TOKENS, index


@pytest.mark.timeout(120)
async def test_by_default_the_decode_engine_prefills_the_prefix_it_holds(
    pool: PrefillPool, http: aiohttp.ClientSession
) -> None:
    """The decider's default (``SIDECAR_DISAGG_MIN_TOKENS`` 512): after the first request the
    decode engine holds the shared prefix (computed or pulled), so the followers' ~160 uncached
    tokens are prefilled locally (``prefix_cached``), the decode engine's prefix cache serving the
    1,024 shared tokens; no prefill engine is asked."""
    rng = random.Random(time.time_ns())
    prefix = await shared_prefix(http, pool.prefills[0], rng)
    async with pool_sidecar(pool, {}) as sidecar:
        await complete(http, sidecar, prefix + unique_part(rng), "default-0")
        for i in range(1, 4):
            request_id = f"default-{i}"
            hits = await metric(http, pool.decode, HITS)
            prefills = [await metric(http, engine, HITS) for engine in pool.prefills]

            cached = await complete(http, sidecar, prefix + unique_part(rng), request_id)

            entry = await record(http, sidecar, request_id)
            assert (entry["decision"], entry["reason"]) == ("local", "prefix_cached"), entry
            assert cached == PREFIX_TOKENS
            now = await settled_metric(http, pool.decode, HITS, hits + PREFIX_TOKENS)
            assert now - hits == PREFIX_TOKENS
            assert [await metric(http, engine, HITS) for engine in pool.prefills] == prefills

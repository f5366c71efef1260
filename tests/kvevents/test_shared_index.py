"""The shared KV index prototype (``sidecar/kvevents/shared_index.py``) on a real redis-server,
and on a real 3-master Redis Cluster: what one process's owner writes from an engine's events,
another process (another instance with the same pool secret) finds by a prompt's tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import pathlib
import random
import shutil
import subprocess
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from sidecar.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from sidecar.kvevents.shared_index import (
    DENSE_BLOCKS,
    MASTERS,
    SHARDS,
    SPACING,
    EngineOwner,
    ShardLayout,
    SharedKVIndex,
    sample_positions,
)
from tests.processes import RedisCluster, RedisServer, free_port

SECRET = b"a pool secret of 32 bytes, test!"
BLOCK = 16


def _tokens(blocks: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 150_000) for _ in range(blocks * BLOCK)]


def _stored(tokens: list[int], first: int, count: int, hash_base: int = 1000) -> EventBatch:
    """The engine stored blocks ``first`` .. ``first + count - 1`` of ``tokens``, its hashes
    ``hash_base + position``."""
    event = BlockStored(
        block_hashes=tuple(hash_base + i for i in range(first, first + count)),
        parent_block_hash=None if first == 0 else hash_base + first - 1,
        token_ids=tuple(tokens[first * BLOCK : (first + count) * BLOCK]),
        block_size=BLOCK,
    )
    return EventBatch(seq=0, ts=0.0, events=(event,))


def _removed(*hashes: int) -> EventBatch:
    return EventBatch(seq=0, ts=0.0, events=(BlockRemoved(block_hashes=hashes),))


@pytest.fixture
async def made() -> AsyncIterator[list[SharedKVIndex]]:
    indexes: list[SharedKVIndex] = []
    yield indexes
    for index in indexes:
        await index.close()


async def _index(
    made: list[SharedKVIndex], url: str, *, secret: bytes = SECRET, **options: object
) -> SharedKVIndex:
    index = SharedKVIndex(url, pool="pool", secret=secret, **options)  # type: ignore[arg-type]
    await index.start(flusher=False)
    made.append(index)
    return index


async def _owner(index: SharedKVIndex, endpoint: str, *batches: EventBatch) -> EngineOwner:
    owner = await index.owner(endpoint)
    for batch in batches:
        owner.apply(batch)
    await index.flush()
    return owner


async def _ask(index: SharedKVIndex, tokens: list[int]) -> dict[str, int]:
    await index.refresh_endpoints()
    return await index.query(tokens)


async def test_blocks_one_process_stored_are_found_by_another_with_the_same_secret(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url)
    tokens = _tokens(6)
    await _owner(writer, "127.0.0.1:8000", _stored(tokens, 0, 3), _stored(tokens, 3, 3))
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    # Six blocks held; the prompt's last token is always computed: 95 of 96 tokens can hit.
    assert await _ask(reader, tokens) == {"127.0.0.1:8000": 5 * BLOCK}
    assert await _ask(reader, [*tokens, 7]) == {"127.0.0.1:8000": 6 * BLOCK}
    # A prompt that differs from block 2 on shares its first two blocks.
    other = tokens[: 2 * BLOCK] + _tokens(4, seed=2)
    assert await _ask(reader, other) == {"127.0.0.1:8000": 2 * BLOCK}
    assert await _ask(reader, _tokens(6, seed=3)) == {}
    # Another pool secret keys the same tokens elsewhere: nothing found.
    stranger = await _index(made, redis_server.url, secret=b"another secret of 32 bytes, ok!!")
    assert await _ask(stranger, [*tokens, 7]) == {}
    # Redis holds digests: no key or value carries the prompt's token ids.
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        packed = tokens[0].to_bytes(4, "little") + tokens[1].to_bytes(4, "little")
        keys = [k for k in await client.keys("*") if b".kv." not in k]
        assert len(keys) == 6
        values = [await client.get(key) or b"" for key in keys]
        assert not any(
            packed in key or packed in value for key, value in zip(keys, values, strict=True)
        )
    finally:
        await client.aclose()


async def test_a_removal_clears_that_endpoints_bit_alone(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url)
    tokens = _tokens(8)
    a = await _owner(writer, "a:1", _stored(tokens, 0, 8))
    await _owner(writer, "b:1", _stored(tokens, 0, 8, hash_base=5000))
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    assert await _ask(reader, [*tokens, 1]) == {"a:1": 8 * BLOCK, "b:1": 8 * BLOCK}
    a.apply(_removed(1000 + 3))  # a's block 3 evicted
    await writer.flush()
    assert await _ask(reader, [*tokens, 1]) == {"a:1": 3 * BLOCK, "b:1": 8 * BLOCK}


async def test_a_copy_stored_again_is_held_until_its_last_removal(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url)
    tokens = _tokens(4)
    # Block 3 computed again under the same hash (a full hit recomputes its last block).
    owner = await _owner(writer, "a:1", _stored(tokens, 0, 4), _stored(tokens, 3, 1))
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    owner.apply(_removed(1003))
    await writer.flush()
    assert await _ask(reader, [*tokens, 1]) == {"a:1": 4 * BLOCK}
    owner.apply(_removed(1003))
    await writer.flush()
    assert await _ask(reader, [*tokens, 1]) == {"a:1": 3 * BLOCK}


async def test_all_blocks_cleared_clears_that_endpoint(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url)
    tokens = _tokens(4)
    a = await _owner(writer, "a:1", _stored(tokens, 0, 4))
    await _owner(writer, "b:1", _stored(tokens, 0, 4, hash_base=5000))
    a.apply(EventBatch(seq=1, ts=0.0, events=(AllBlocksCleared(),)))
    await writer.flush()
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    assert await _ask(reader, [*tokens, 1]) == {"b:1": 4 * BLOCK}
    assert len(a) == 0


async def test_a_store_naming_its_lora_by_id_only_is_no_hit_for_the_base_model(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url)
    tokens = _tokens(4)
    event = _stored(tokens, 0, 4).events[0]
    assert isinstance(event, BlockStored)
    adapter = dataclasses.replace(event, lora_id=7, lora_name=None)
    await _owner(writer, "a:1", EventBatch(seq=0, ts=0.0, events=(adapter,)))
    named = dataclasses.replace(event, lora_id=7, lora_name="sql", block_hashes=(1, 2, 3, 4))
    await _owner(writer, "b:1", EventBatch(seq=0, ts=0.0, events=(named,)))
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    assert await _ask(reader, [*tokens, 1]) == {}
    await reader.refresh_endpoints()
    assert await reader.query([*tokens, 1], lora="sql") == {"b:1": 4 * BLOCK}


async def test_the_cap_forgets_the_block_stored_longest_ago_not_a_hot_prefix(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url)
    tokens = _tokens(4)
    owner = await writer.owner("a:1", max_blocks=4)
    owner.apply(_stored(tokens, 0, 4))
    owner.apply(_stored(tokens, 0, 1))  # a new request computes the prefix's block 0 again
    owner.apply(_stored(_tokens(1, seed=2), 0, 1, hash_base=9000))  # a fifth block
    await writer.flush()
    assert owner.stats.dropped == 1
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    assert await _ask(reader, [*tokens, 1]) == {"a:1": 1 * BLOCK}  # block 1 went, not 0


async def test_a_reset_bigger_than_the_queue_clears_every_block_over_several_flushes(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url, max_pending=100)
    tokens = _tokens(300)
    a = await writer.owner("a:1")
    for first in range(0, 300, 50):
        a.apply(_stored(tokens, first, 50))
        await writer.flush()
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    assert await _ask(reader, tokens) == {"a:1": 299 * BLOCK}
    # The engine restarts: 300 clears for a queue of 100; it stores its first 10 blocks again
    # before they are all sent.
    a.apply(EventBatch(seq=1, ts=0.0, events=(AllBlocksCleared(),)))
    a.apply(_stored(tokens, 0, 10))
    flushes = 0
    while a.clearing or writer.pending:
        await writer.flush()
        flushes += 1
        assert flushes <= 5
    assert flushes >= 3
    assert writer.counters.dropped_ops == 0
    assert await _ask(reader, tokens) == {"a:1": 10 * BLOCK}


async def test_every_key_expires_within_the_retention(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    now = [100.0]
    writer = await _index(made, redis_server.url, retention_s=30.0, clock=lambda: now[0])
    tokens = _tokens(5)
    owner = await _owner(writer, "a:1", _stored(tokens, 0, 5))
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        keys = [k for k in await client.keys("*") if b".kv." not in k]
        assert len(keys) == 5
        ttls = [await client.pttl(key) for key in keys]
        assert all(0 < ttl <= 30_000 for ttl in ttls), ttls
        # Held half a retention, the blocks are written again, so they outlive it; once the
        # engine drops them, nobody does.
        now[0] += 14.0
        assert owner.sweep(now[0], 100) == 0
        now[0] += 2.0
        assert owner.sweep(now[0], 100) == 5
        await writer.flush()
        # Block 4's key expired (deleted here) before the engine removed it: the removal's
        # SETBIT 0 makes the key again, and it expires too.
        last = writer.layout.key(writer.hasher.prompt([*tokens, 1], BLOCK, lora=None, salt=None)[4])
        assert last in keys
        assert await client.delete(last) == 1
        owner.apply(_removed(1004))
        await writer.flush()
        ttls = [await client.pttl(key) for key in keys]
        assert all(0 < ttl <= 30_000 for ttl in ttls), ttls
        assert owner.sweep(now[0] + 16.0, 100) == 4
    finally:
        await client.aclose()


async def test_a_sweep_with_no_room_in_the_queue_leaves_its_blocks_due(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    now = [100.0]
    writer = await _index(
        made, redis_server.url, retention_s=30.0, clock=lambda: now[0], max_pending=2
    )
    tokens = _tokens(4)
    owner = await _owner(writer, "a:1", _stored(tokens, 0, 2))
    now[0] += 16.0
    owner.apply(_stored(tokens, 2, 2))  # the queue is full
    assert writer.pending == 2
    assert owner.sweep(now[0], 100) == 0
    assert writer.counters.dropped_ops == 0
    await writer.flush()
    assert owner.sweep(now[0], 100) == 2  # still due: written now
    await writer.flush()
    assert owner.sweep(now[0], 100) == 0


def test_a_query_samples_34_blocks_of_a_16k_prompt() -> None:
    for count in (1, 15, 16, 17, 100, 512, 1024, 8192):
        positions = sample_positions(count)
        assert positions[: min(count, DENSE_BLOCKS)] == list(range(min(count, DENSE_BLOCKS)))
        assert positions[-1] == count - 1
        assert positions == sorted(set(positions))
        for before, after in itertools.pairwise(positions[DENSE_BLOCKS:]):
            assert after <= before * SPACING + 1
    assert len(sample_positions(8191 // BLOCK)) == 31  # an 8k-token prompt
    assert len(sample_positions(16383 // BLOCK)) == 34  # 16k tokens


async def test_a_sampled_hit_under_estimates_by_less_than_the_gap(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url)
    tokens = _tokens(200)
    held = 100  # blocks
    await _owner(writer, "a:1", _stored(tokens, 0, held))
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    hit = (await _ask(reader, tokens))["a:1"]
    positions = sample_positions(199)
    after = next(p for p in positions if p >= held)  # the first sampled position not held
    before = max(p for p in positions if p < held)
    assert hit < held * BLOCK  # 100 blocks held, and block 99 is not sampled
    assert hit == (before + 1) * BLOCK
    assert held * BLOCK - hit < (after - before) * BLOCK
    assert hit >= held * BLOCK / SPACING - BLOCK
    # A prompt that differs only at a block no query samples (18) is not credited past it: the
    # digests after it are chained from it.
    changed = tokens[: 18 * BLOCK] + _tokens(1, seed=9) + tokens[19 * BLOCK :]
    assert 18 not in positions
    last = max(p for p in positions if p < 18)
    assert (await _ask(reader, changed))["a:1"] == (last + 1) * BLOCK
    # Up to the dense part's end, exact.
    await _owner(writer, "b:1", _stored(tokens, 0, 11, hash_base=9000))
    assert (await _ask(reader, tokens))["b:1"] == 11 * BLOCK


async def test_a_hostile_value_is_skipped_and_counted(
    redis_server: RedisServer, made: list[SharedKVIndex]
) -> None:
    writer = await _index(made, redis_server.url)
    tokens = _tokens(8)
    await _owner(writer, "a:1", _stored(tokens, 0, 8))
    reader = await _index(made, redis_server.url, timeout_s=1.0)
    # Whoever can write the keys overwrites block 5's bitmap with a value no bitmap of ours is.
    digest = reader.hasher.prompt([*tokens, 1], BLOCK, lora=None, salt=None)[5]
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.set(reader.layout.key(digest), b"\xff" * 4096)
    finally:
        await client.aclose()
    assert await _ask(reader, [*tokens, 1]) == {"a:1": 5 * BLOCK}
    assert reader.counters.skipped_values == 1


async def test_a_redis_that_does_not_answer_gives_no_hits_within_the_timeout(
    made: list[SharedKVIndex],
) -> None:
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    now = [0.0]
    try:
        index = await _index(
            made, f"redis://127.0.0.1:{port}/0", timeout_s=0.05, clock=lambda: now[0]
        )
        for failed in (1, 2, 3):
            began = time.perf_counter()
            assert await index.query(_tokens(4)) == {}
            assert time.perf_counter() - began < 0.5
            assert index.counters.failed == failed
        # Three in a row: the next queries answer at once without asking, for the backoff.
        assert await index.query(_tokens(4)) == {}
        assert index.counters.backoff == 1
        assert index.counters.failed == 3
        now[0] += 0.6
        assert await index.query(_tokens(4)) == {}
        assert index.counters.failed == 4
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    # Nothing listening at all: refused at once, no hits, no exception.
    dead = await _index(made, "redis://127.0.0.9:1/0", timeout_s=0.05)
    assert await dead.query(_tokens(4)) == {}
    assert dead.counters.failed == 1


@pytest.fixture
def certificate(tmp_path: pathlib.Path) -> pathlib.Path:
    """A self-signed certificate for 127.0.0.1 (its key beside it, ``key.pem``)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"),
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=20,
    )  # fmt: skip
    return tmp_path / "cert.pem"


async def test_over_tls_the_index_writes_and_finds_blocks(
    made: list[SharedKVIndex], certificate: pathlib.Path
) -> None:
    tls_port = free_port()
    server = RedisServer(
        free_port(), "--requirepass", "a password", "--tls-port", str(tls_port),
        "--tls-cert-file", str(certificate), "--tls-key-file", str(certificate.parent / "key.pem"),
        "--tls-ca-cert-file", str(certificate), "--tls-auth-clients", "no",
    )  # fmt: skip
    await server.start()
    try:
        url = f"rediss://:a%20password@127.0.0.1:{tls_port}/0?ssl_ca_certs={certificate}"
        writer = await _index(made, url)
        tokens = _tokens(4)
        await _owner(writer, "a:1", _stored(tokens, 0, 4))
        reader = await _index(made, url, timeout_s=1.0)
        assert await _ask(reader, [*tokens, 1]) == {"a:1": 4 * BLOCK}
        # Without the URL's CA the server's certificate is not trusted: the query fails on it
        # (before AUTH is sent), answering no hits.
        untrusted = await _index(made, url.split("?")[0], timeout_s=1.0)
        assert await untrusted.query([*tokens, 1]) == {}
        assert untrusted.counters.failed == 1
        assert "CERTIFICATE_VERIFY_FAILED" in (untrusted.counters.last_error or "")
    finally:
        await server.stop()


def test_a_unix_socket_url_is_refused() -> None:
    with pytest.raises(ValueError, match="redis:// or rediss:// URLs only"):
        SharedKVIndex("unix:///tmp/redis.sock", pool="pool", secret=SECRET)


def test_the_shards_spread_evenly_over_a_default_three_master_cluster() -> None:
    layout = ShardLayout("pool")
    # redis-cli --cluster create splits the slots evenly: 0-5460, 5461-10922, 10923-16383.
    bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
    masters = [
        next(m for m, (low, high) in enumerate(bounds) if low <= key_slot(prefix) <= high)
        for prefix in layout.prefixes
    ]
    assert [masters.count(m) for m in range(MASTERS)] == [SHARDS // MASTERS] * MASTERS
    assert len({key_slot(prefix) for prefix in layout.prefixes}) == SHARDS
    # Digests spread over the shards.
    rng = random.Random(4)
    shards = [layout.shard(rng.randbytes(8)) for _ in range(12_000)]
    assert min(shards.count(s) for s in range(SHARDS)) > 800


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_on_a_cluster_one_process_finds_what_another_stored(
    made: list[SharedKVIndex],
) -> None:
    nodes = RedisCluster(3)
    try:
        await nodes.start()
        url = nodes.url(nodes.ports[0])
        writer = await _index(made, url, cluster=True)
        tokens = _tokens(64)
        await _owner(writer, "a:1", _stored(tokens, 0, 40))
        await _owner(writer, "b:1", _stored(tokens, 0, 64, hash_base=5000))
        reader = await _index(made, url, cluster=True, timeout_s=1.0)
        hits = await _ask(reader, [*tokens, 1])
        assert hits["b:1"] == 64 * BLOCK
        assert 40 * BLOCK / SPACING - BLOCK <= hits["a:1"] <= 40 * BLOCK
        # The blocks are spread over the three masters.
        masters = [n["port"] for n in await nodes.nodes(nodes.ports[0]) if "master" in n["flags"]]
        sizes = [int(await nodes.command(port, "DBSIZE")) for port in masters]
        assert all(size > 0 for size in sizes), sizes
    finally:
        await nodes.stop()


async def _topology_reads(nodes: RedisCluster) -> int:
    """How many times the cluster's nodes were asked for its slots."""
    total = 0
    for port in nodes.ports:
        stats = await nodes.command(port, "INFO", "commandstats")
        for name in ("cmdstat_cluster|slots", "cmdstat_cluster|shards", "cmdstat_cluster|nodes"):
            total += int(stats.get(name, {}).get("calls", 0))
    return total


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_on_a_cluster_a_query_that_times_out_leaves_the_next_ones_answering(
    made: list[SharedKVIndex],
) -> None:
    nodes = RedisCluster(3)
    try:
        await nodes.start()
        index = await _index(made, nodes.url(nodes.ports[0]), cluster=True, timeout_s=1.0)
        tokens = _tokens(40)
        owner = await _owner(index, "a:1", _stored(tokens, 0, 16))
        await index.refresh_endpoints()
        assert await index.query([*tokens, 1]) == {"a:1": 16 * BLOCK}
        reads = await _topology_reads(nodes)
        assert reads > 0
        # A flush under way on the same connections...
        owner.apply(_stored(_tokens(3000, seed=5), 0, 3000, hash_base=100_000))
        flushing = asyncio.create_task(index.flush())
        for _ in range(3):
            await asyncio.sleep(0)  # lets it write its pipelines
        # ... and a query that times out: a slow round, nothing moved.
        index.timeout_s = 0.0
        assert await index.query([*tokens, 1]) == {}
        assert index.counters.failed == 1
        assert not flushing.done()
        index.timeout_s = 1.0
        for _ in range(3):
            assert await index.query([*tokens, 1]) == {"a:1": 16 * BLOCK}
        await flushing  # its connections were kept: nothing lost
        assert index.counters.dropped_ops == 0
        assert await _topology_reads(nodes) == reads  # a timeout re-reads no topology
        # The whole cluster gone: a flush fails and counts its operations lost; the next one
        # cannot read the topology, and keeps its operations queued.
        for port in nodes.ports:
            nodes.kill(port)
        owner.apply(_stored(tokens, 16, 4))
        with pytest.raises((RedisError, OSError)):
            await index.flush()
        assert index.counters.dropped_ops == 4
        owner.apply(_stored(tokens, 20, 4))
        with pytest.raises((RedisError, RedisClusterException, OSError)):
            await index.flush()
        assert index.pending == 4
        assert index.counters.dropped_ops == 4
    finally:
        await nodes.stop()

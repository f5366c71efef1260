"""The emulated engine: admission, the latency model, the prompt phase (local compute or KV pull)
and staging a prefill's KV for a remote decode.

Latency model (all delays asyncio sleeps, never blocking the loop)::

    prefill  = (a * n + b * ((c + n)**2 - c**2)) * factor
               a = prefill_s_per_token, b = a / prefill_crossover_tokens (0: b = 0),
               n = uncached prompt tokens, c = cached ones (attention over them is paid too)
    transfer = kv_transfer_s_per_block * pulled_blocks                 (decode side, per pull)
    decode   = decode_s_per_token   * factor, before each output token after the first
    factor   = 1 + concurrency_slowdown * (running - 1)
    each delay is then multiplied by a uniform draw from [1 - jitter, 1 + jitter]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

from sidecar.emulator.config import EmulatorConfig
from sidecar.emulator.errors import EmulatorError
from sidecar.emulator.events import KvEventSink
from sidecar.emulator.kv import KvStore, PrefixCache, PullStatus, chain_hashes
from sidecar.emulator.metrics import EmulatorMetrics
from sidecar.emulator.nixl import (
    SILENT_IN_LENIENT,
    WAIT_MARGIN_S,
    KvPuller,
    PullOutcome,
    RemoteKv,
    parse_remote_kv,
)
from sidecar.emulator.parse import GenerationRequest
from sidecar.emulator.push import REGISTER_PATH, TRANSFER_MODE
from sidecar.emulator.responses import Usage
from sidecar.emulator.sglang import Bootstrap, RoomBoard
from sidecar.emulator.storage import SharedKvStore
from sidecar.emulator.text import Prompt
from sidecar.kvevents.events import MEDIUM_GPU, BlockStored

log = logging.getLogger("sidecar.emulator.engine")


class LatencyModel:
    def __init__(self, config: EmulatorConfig) -> None:
        self._config = config
        self._rng = random.Random(config.seed)

    def _jittered(self, seconds: float) -> float:
        jitter = self._config.jitter
        if seconds <= 0 or jitter == 0:
            return max(0.0, seconds)
        return seconds * self._rng.uniform(1 - jitter, 1 + jitter)

    def _factor(self, running: int) -> float:
        return 1 + self._config.concurrency_slowdown * max(0, running - 1)

    def prefill(self, uncached_tokens: int, running: int, cached_tokens: int = 0) -> float:
        return self._jittered(
            prefill_seconds(
                self._config.prefill_s_per_token,
                self._config.prefill_crossover_tokens,
                uncached_tokens,
                cached_tokens,
            )
            * self._factor(running)
        )

    def decode(self, running: int) -> float:
        return self._jittered(self._config.decode_s_per_token * self._factor(running))

    def transfer(self, blocks: int) -> float:
        return self._jittered(self._config.kv_transfer_s_per_block * blocks)


def prefill_seconds(
    s_per_token: float, crossover_tokens: int, uncached_tokens: int, cached_tokens: int = 0
) -> float:
    """``a·n + b·((c + n)² − c²)``: the linear part (weights: projections, MLP) for the ``n``
    tokens computed, and attention, whose cost per token grows with its position, for the same
    tokens after ``c`` cached ones. ``b = a / crossover_tokens``; a crossover of 0 is linear."""
    linear = s_per_token * uncached_tokens
    if crossover_tokens <= 0 or uncached_tokens <= 0:
        return linear
    end = cached_tokens + uncached_tokens
    return linear + s_per_token / crossover_tokens * (end * end - cached_tokens * cached_tokens)


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


class Engine:
    """Per-instance engine state; one per API app, used only from the event loop."""

    def __init__(
        self,
        config: EmulatorConfig,
        *,
        kv: KvStore,
        metrics: EmulatorMetrics,
        puller: KvPuller,
        side_channel_port: int,
        rooms: RoomBoard | None = None,
        store: SharedKvStore | None = None,
        events: KvEventSink | None = None,
    ) -> None:
        """``rooms``: an sglang prefill server's room board; ``store``: the shared-storage store;
        ``events``: where the prefix cache's changes are published (KV events)."""
        self.config = config
        self.kv = kv
        self.metrics = metrics
        self.prefix_cache = PrefixCache(config.num_gpu_blocks)
        self.latency = LatencyModel(config)
        self._puller = puller
        self._side_channel_port = side_channel_port
        self._slots = asyncio.Semaphore(config.max_num_seqs) if config.max_num_seqs else None
        self.running = 0
        self.waiting = 0
        self.in_use_blocks = 0
        self.failed_pulls_total = 0
        self.rooms = rooms
        self.store = store
        self.rooms_waiting = 0  # sglang decode: requests waiting for their room's KV
        self.events = events or KvEventSink()
        self._by_rid: dict[str, set[asyncio.Task[Any]]] = {}

    @contextlib.asynccontextmanager
    async def admit(self, request: GenerationRequest) -> AsyncIterator[None]:
        """Hold a running slot (waiting for one if max_num_seqs is reached) and its KV blocks."""
        if self._slots is not None:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
        tokens = request.prompt.num_tokens + request.n * request.output_tokens
        blocks = self.kv.blocks_for(tokens)
        self.running += 1
        self.in_use_blocks += blocks
        try:
            yield
        finally:
            self.running -= 1
            self.in_use_blocks -= blocks
            if self._slots is not None:
                self._slots.release()

    @contextlib.contextmanager
    def abortable(self, rid: str | None) -> Iterator[None]:
        """Make the current handler cancellable by ``POST /abort_request {"rid": rid}``."""
        task = asyncio.current_task()
        if rid is None or task is None:
            yield
            return
        tasks = self._by_rid.setdefault(rid, set())
        tasks.add(task)
        try:
            yield
        finally:
            tasks.discard(task)
            if not tasks:
                self._by_rid.pop(rid, None)

    def abort(self, rid: str) -> int:
        """Cancel every running request with this rid; returns how many."""
        tasks = list(self._by_rid.get(rid, ()))
        for task in tasks:
            task.cancel()
        return len(tasks)

    @contextlib.contextmanager
    def waiting_for_kv(self) -> Iterator[None]:
        """A request waiting for remote KV counts as waiting, not running, as in vLLM's
        WAITING_FOR_REMOTE_KVS (it keeps its max_num_seqs slot and its blocks)."""
        self.running -= 1
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1
            self.running += 1

    def resolve_remote(self, request: GenerationRequest) -> RemoteKv | None:
        """The pull instructions of a decode request; None means compute the prompt locally.

        Incomplete params are a 400 in strict mode; lenient mode, like vLLM, logs and recomputes.
        """
        if not request.is_decode or request.kv_params is None:
            return None
        try:
            return parse_remote_kv(request.kv_params, push=self.config.kv_protocol == "nixl-push")
        except ValueError as exc:
            if self.config.mode == "strict":
                raise EmulatorError(400, f"strict mode: invalid kv_transfer_params: {exc}") from exc
            log.warning(
                "Got invalid KVTransferParams for %s (%s); recomputing the prompt locally",
                request.request_id,
                exc,
            )
            return None

    async def load_prompt(self, request: GenerationRequest, remote: RemoteKv | None) -> int:
        """Make the prompt's KV available (pull or compute); returns the tokens reported cached."""
        prompt = request.prompt
        block_size = self.config.block_size
        hashes = chain_hashes(prompt.full_blocks(block_size))
        # Like vLLM, at least the last prompt token is always computed, so a fully cached prompt
        # still misses on the block holding its last token.
        matchable = (prompt.num_tokens - 1) // block_size
        local_cached = self.prefix_cache.match(hashes[:matchable]) * block_size
        self.metrics.prefix_queries.inc(prompt.num_tokens)
        self.metrics.prefix_hits.inc(local_cached)
        if request.bootstrap is not None and request.is_decode:
            await self._claim_room(request, request.bootstrap)
            self._cache(prompt, hashes)
            return prompt.num_tokens  # KV received from the prefill counts as cached
        if remote is not None and await self._pull(request, remote):
            self._cache(prompt, hashes)
            return prompt.num_tokens  # vLLM reports pulled KV as cached
        cached = local_cached
        if self.store is not None:
            stored = await asyncio.to_thread(self.store.lookup, hashes[:matchable]) * block_size
            if stored > cached:
                await _sleep(self.latency.transfer((stored - cached) // block_size))
                cached = stored
        await _sleep(self.latency.prefill(prompt.num_tokens - cached, self.running, cached))
        self._cache(prompt, hashes)
        if self.store is not None:
            await asyncio.to_thread(self.store.save, hashes)
        return cached

    def _cache(self, prompt: Prompt, hashes: list[bytes]) -> None:
        """Cache the prompt's full blocks and publish the change: one BlockStored per run of new
        blocks (chained after the block before it), then the evicted blocks."""
        change = self.prefix_cache.insert(hashes)
        if not change.stored and not change.evicted:
            return
        size = self.config.block_size
        runs: list[BlockStored] = []
        stored = change.stored
        start = 0
        for end in range(1, len(stored) + 1):
            if end < len(stored) and stored[end] == stored[end - 1] + 1:
                continue
            first, last = stored[start], stored[end - 1]
            runs.append(
                BlockStored(
                    block_hashes=tuple(hashes[first : last + 1]),
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=tuple(prompt.token_ids_between(first * size, (last + 1) * size)),
                    block_size=size,
                    medium=MEDIUM_GPU,
                )
            )
            start = end
        self.events.stored(runs, change.evicted)

    def reset_prefix_cache(self) -> None:
        self.prefix_cache.clear()
        self.events.cleared()

    async def _claim_room(self, request: GenerationRequest, bootstrap: Bootstrap) -> None:
        """SGLang decode: wait at the prefill's bootstrap server for the room's KV."""
        timeout_s = self.config.waiting_timeout_s
        payload = {"room": bootstrap.room, "timeout_s": timeout_s}
        self.rooms_waiting += 1
        try:
            with self.waiting_for_kv():
                outcome = await self._puller.call(
                    bootstrap.claim_url, payload, timeout_s + WAIT_MARGIN_S
                )
        finally:
            self.rooms_waiting -= 1
        if outcome.status is PullStatus.OK:
            await self._transferred(outcome)
            return
        self._count_failure(request, outcome)
        if outcome.status is PullStatus.TIMEOUT:
            message = (
                f"Request {request.request_id} timed out after {timeout_s}s in "
                f"KVPoll.WaitingForInput (bootstrap room {bootstrap.room})"
            )
        else:
            message = f"KV transfer for bootstrap room {bootstrap.room} failed: {outcome.message}"
        raise EmulatorError(500, message)

    async def serve_room(self, request: GenerationRequest) -> None:
        """SGLang prefill: stage the room's KV and wait until a decode claims it (500 if none)."""
        if self.rooms is None or request.bootstrap is None:
            return
        room = request.bootstrap.room
        blocks = self.kv.blocks_for(request.prompt.num_tokens)
        timeout_s = self.config.bootstrap_timeout_s
        if not await self.rooms.serve(room, request.response_id, blocks, timeout_s):
            raise EmulatorError(
                500,
                f"Request {request.request_id}: no decode claimed bootstrap room {room} "
                f"within {timeout_s}s (bootstrap timeout) or another prefill took the room; "
                "its KV was dropped",
            )

    async def _transferred(self, outcome: PullOutcome) -> None:
        transfer = self.latency.transfer(outcome.blocks)
        await _sleep(transfer)
        self.metrics.xfer_time.observe(outcome.elapsed_s + transfer)

    def _count_failure(self, request: GenerationRequest, outcome: PullOutcome) -> None:
        self.failed_pulls_total += 1
        self.metrics.failed_transfers.inc()
        log.warning("KV transfer for %s failed: %s", request.request_id, outcome.message)

    async def _register_push(self, request: GenerationRequest, remote: RemoteKv) -> bool:
        """NIXL push: register under this request's own id; the prefill pushes what it staged
        under the same id. Raises a 500 when nothing matched within the registration timeout."""
        incompatible = (request.kv_params or {}).get("transfer_mode", TRANSFER_MODE)
        if incompatible != TRANSFER_MODE:
            raise EmulatorError(
                500, f"NIXL push decode cannot pair with a {incompatible!r} mode prefill"
            )
        timeout_s = self.config.push_registration_timeout_s
        payload = {
            "engine_id": remote.engine_id,
            "request_id": request.response_id,
            "timeout_s": timeout_s,
        }
        with self.waiting_for_kv():
            outcome = await self._puller.call(
                remote.url(REGISTER_PATH), payload, timeout_s + WAIT_MARGIN_S
            )
        if outcome.status is PullStatus.OK:
            await self._transferred(outcome)
            return True
        self._count_failure(request, outcome)
        raise EmulatorError(
            500,
            f"KV push from {remote.engine_id} for {request.response_id} failed "
            f"({outcome.status}): {outcome.message}",
        )

    async def _pull(self, request: GenerationRequest, remote: RemoteKv) -> bool:
        """True when the KV arrived; False when lenient mode recomputes; raises a 500 otherwise."""
        if self.config.kv_protocol == "nixl-push":
            return await self._register_push(request, remote)
        if (request.kv_params or {}).get("transfer_mode") == TRANSFER_MODE:
            # transfer_mode is part of vLLM's NIXL compatibility hash: the handshake fails.
            self.failed_pulls_total += 1
            self.metrics.failed_transfers.inc()
            raise EmulatorError(500, "NIXL pull decode cannot pair with a 'push' mode prefill")
        outcome = await self._puller.pull(remote)
        if outcome.status is PullStatus.OK:
            transfer = self.latency.transfer(len(remote.block_ids))
            await _sleep(transfer)
            self.metrics.xfer_time.observe(outcome.elapsed_s + transfer)
            return True
        if self.config.mode == "lenient" and outcome.status in SILENT_IN_LENIENT:
            log.warning(
                "KV pull for %s failed unnoticed (%s); serving with recomputed KV like vLLM 0.32",
                request.request_id,
                outcome.message,
            )
            return False
        self.failed_pulls_total += 1
        self.metrics.failed_transfers.inc()
        log.warning("KV pull for %s failed: %s", request.request_id, outcome.message)
        raise EmulatorError(
            500, f"KV transfer from {remote.engine_id} failed ({outcome.status}): {outcome.message}"
        )

    async def decode_step(self) -> None:
        """One output token after the first: its delay is the time since the previous one
        (vLLM's inter-token latency)."""
        delay = self.latency.decode(self.running)
        await _sleep(delay)
        self.metrics.inter_token.observe(delay)

    def finish(self, request: GenerationRequest) -> dict[str, Any] | None:
        """Stage a prefill's blocks; returns the kv_transfer_params for its response, if any.

        A streamed prefill (lenient mode) stages but returns nothing, as vLLM 0.32 does.
        """
        if not request.is_prefill or self.config.kv_protocol not in ("nixl", "nixl-push"):
            return None
        staged = self.kv.stage(request.response_id, request.prompt.num_tokens)
        if request.stream:
            return None
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(staged.block_ids)],  # one list per KV-cache group
            "remote_engine_id": self.kv.engine_id,
            "remote_request_id": request.response_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self._side_channel_port,
            "tp_size": 1,
        }
        if self.config.kv_protocol == "nixl-push":
            params["transfer_mode"] = TRANSFER_MODE
        return params

    def usage(self, request: GenerationRequest, cached_tokens: int) -> Usage:
        details = cached_tokens if self.config.prompt_tokens_details else None
        return Usage(request.prompt.num_tokens, request.n * request.output_tokens, details)

    def refresh_metrics(self) -> None:
        rooms = self.rooms.snapshot() if self.rooms is not None else []
        self.metrics.refresh(
            self.kv,
            room_requests=len(rooms),
            room_blocks=sum(r.blocks for r in rooms),
            running=self.running,
            waiting=self.waiting,
            in_use_blocks=self.in_use_blocks,
            num_gpu_blocks=self.config.num_gpu_blocks,
        )

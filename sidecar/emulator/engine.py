"""The emulated engine: admission, the latency model, the prompt phase (local compute or KV pull)
and staging a prefill's KV for a remote decode.

Latency model (all delays asyncio sleeps, never blocking the loop)::

    prefill  = prefill_s_per_token  * uncached_prompt_tokens * factor
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
from collections.abc import AsyncIterator
from typing import Any

from sidecar.emulator.config import EmulatorConfig
from sidecar.emulator.errors import EmulatorError
from sidecar.emulator.kv import KvStore, PrefixCache, PullStatus, chain_hashes
from sidecar.emulator.metrics import EmulatorMetrics
from sidecar.emulator.nixl import SILENT_IN_LENIENT, KvPuller, RemoteKv, parse_remote_kv
from sidecar.emulator.parse import GenerationRequest
from sidecar.emulator.responses import Usage

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

    def prefill(self, uncached_tokens: int, running: int) -> float:
        base = self._config.prefill_s_per_token * uncached_tokens
        return self._jittered(base * self._factor(running))

    def decode(self, running: int) -> float:
        return self._jittered(self._config.decode_s_per_token * self._factor(running))

    def transfer(self, blocks: int) -> float:
        return self._jittered(self._config.kv_transfer_s_per_block * blocks)


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
    ) -> None:
        self.config = config
        self.kv = kv
        self.metrics = metrics
        self.prefix_cache = PrefixCache()
        self.latency = LatencyModel(config)
        self._puller = puller
        self._side_channel_port = side_channel_port
        self._slots = asyncio.Semaphore(config.max_num_seqs) if config.max_num_seqs else None
        self.running = 0
        self.waiting = 0
        self.in_use_blocks = 0
        self.failed_pulls_total = 0

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

    def resolve_remote(self, request: GenerationRequest) -> RemoteKv | None:
        """The pull instructions of a decode request; None means compute the prompt locally.

        Incomplete params are a 400 in strict mode; lenient mode, like vLLM, logs and recomputes.
        """
        if not request.is_decode or request.kv_params is None:
            return None
        try:
            return parse_remote_kv(request.kv_params)
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
        if remote is not None and await self._pull(request, remote):
            self.prefix_cache.insert(hashes)
            return prompt.num_tokens  # vLLM reports pulled KV as cached
        await _sleep(self.latency.prefill(prompt.num_tokens - local_cached, self.running))
        self.prefix_cache.insert(hashes)
        return local_cached

    async def _pull(self, request: GenerationRequest, remote: RemoteKv) -> bool:
        """True when the KV arrived; False when lenient mode recomputes; raises a 500 otherwise."""
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
        await _sleep(self.latency.decode(self.running))

    def finish(self, request: GenerationRequest) -> dict[str, Any] | None:
        """Stage a prefill's blocks; returns the kv_transfer_params for its response, if any.

        A streamed prefill (lenient mode) stages but returns nothing, as vLLM 0.32 does.
        """
        if not request.is_prefill:
            return None
        staged = self.kv.stage(request.response_id, request.prompt.num_tokens)
        if request.stream:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(staged.block_ids)],  # one list per KV-cache group
            "remote_engine_id": self.kv.engine_id,
            "remote_request_id": request.response_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self._side_channel_port,
            "tp_size": 1,
        }

    def usage(self, request: GenerationRequest, cached_tokens: int) -> Usage:
        details = cached_tokens if self.config.prompt_tokens_details else None
        return Usage(request.prompt.num_tokens, request.n * request.output_tokens, details)

    def refresh_metrics(self) -> None:
        self.metrics.refresh(
            self.kv,
            running=self.running,
            waiting=self.waiting,
            in_use_blocks=self.in_use_blocks,
            num_gpu_blocks=self.config.num_gpu_blocks,
        )

"""KV state of one emulator: blocks staged for remote decode, and the local prefix cache.

Pure and synchronous, with an injectable clock, so expiry is testable without sleeping.

Staging lifecycle (prefill side)::

    stage(request_id) --pull() ok--> freed, counted in pulled_total
            |
            +--- older than expiry_s at any sweep() --> freed, counted in expired_total

Every public read or write sweeps first, so a stale entry is never reported or pulled.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

Clock = Callable[[], float]

HISTORY_SIZE = 10_000  # remembered pulled/expired request ids, to tell 410 from 404


@dataclass(frozen=True, slots=True)
class StagedKv:
    request_id: str
    block_ids: tuple[int, ...]
    staged_at: float


@dataclass(frozen=True, slots=True)
class StagedView:
    request_id: str
    blocks: int
    age_s: float


class PullStatus(StrEnum):
    """Outcome of a pull as the prefill side judges it (the side channel maps it to HTTP)."""

    OK = "ok"
    UNKNOWN = "unknown"
    ALREADY_PULLED = "already_pulled"
    EXPIRED = "expired"
    ENGINE_MISMATCH = "engine_mismatch"
    BLOCK_MISMATCH = "block_mismatch"
    UNREACHABLE = "unreachable"  # decode side only: the side channel did not answer usably
    TIMEOUT = "timeout"  # push registration or sglang claim not matched in time
    NOT_PREFILL = "not_prefill"  # sglang: the bootstrap address is not a prefill server


class KvStore:
    """Blocks staged by prefill requests until a decode engine pulls them or they expire."""

    def __init__(
        self,
        *,
        engine_id: str,
        block_size: int,
        expiry_s: float,
        clock: Clock = time.monotonic,
    ) -> None:
        self.engine_id = engine_id
        self._block_size = block_size
        self._expiry_s = expiry_s
        self._clock = clock
        self._next_block_id = 1
        self._staged: OrderedDict[str, StagedKv] = OrderedDict()  # oldest first
        self._history: OrderedDict[str, PullStatus] = OrderedDict()
        self.pulled_total = 0
        self.expired_total = 0
        self.rejected_total = 0
        self._stage_listeners: list[Callable[[str], None]] = []

    def add_stage_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(request_id)`` after every stage() (push registrations wait on it)."""
        self._stage_listeners.append(listener)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self._block_size)

    def stage(self, request_id: str, num_tokens: int) -> StagedKv:
        """Hold the prompt's blocks for a remote decode; a re-used request id replaces the old."""
        self.sweep()
        self._staged.pop(request_id, None)
        count = self.blocks_for(num_tokens)
        ids = tuple(range(self._next_block_id, self._next_block_id + count))
        self._next_block_id += count
        staged = StagedKv(request_id, ids, self._clock())
        self._staged[request_id] = staged
        self._history.pop(request_id, None)
        for listener in self._stage_listeners:
            listener(request_id)
        return staged

    def take(self, request_id: str) -> StagedKv | None:
        """Push mode: hand over and free the entry staged under this id, whatever its blocks."""
        self.sweep()
        staged = self._staged.pop(request_id, None)
        if staged is not None:
            self._remember(request_id, PullStatus.ALREADY_PULLED)
            self.pulled_total += 1
        return staged

    def pull(self, engine_id: str, request_id: str, block_ids: Sequence[int]) -> PullStatus:
        """Hand the blocks over and free them; any status but OK leaves the store unchanged.

        The requested ids may be a subset of the staged ones: a decode engine that already holds
        a prefix locally only pulls the rest.
        """
        self.sweep()
        if engine_id != self.engine_id:
            status = PullStatus.ENGINE_MISMATCH
        elif (staged := self._staged.get(request_id)) is None:
            status = self._history.get(request_id, PullStatus.UNKNOWN)
        elif not set(block_ids) <= set(staged.block_ids):
            status = PullStatus.BLOCK_MISMATCH
        else:
            del self._staged[request_id]
            self._remember(request_id, PullStatus.ALREADY_PULLED)
            self.pulled_total += 1
            return PullStatus.OK
        self.rejected_total += 1
        return status

    def sweep(self) -> int:
        """Free every staged entry older than the expiry; returns how many expired now."""
        deadline = self._clock() - self._expiry_s
        expired = 0
        while self._staged:
            request_id, oldest = next(iter(self._staged.items()))
            if oldest.staged_at > deadline:
                break  # entries are in staging order, so the rest are younger
            del self._staged[request_id]
            self._remember(request_id, PullStatus.EXPIRED)
            expired += 1
        self.expired_total += expired
        return expired

    def _remember(self, request_id: str, status: PullStatus) -> None:
        self._history[request_id] = status
        self._history.move_to_end(request_id)
        while len(self._history) > HISTORY_SIZE:
            self._history.popitem(last=False)

    @property
    def staged_requests(self) -> int:
        self.sweep()
        return len(self._staged)

    @property
    def staged_blocks(self) -> int:
        self.sweep()
        return sum(len(s.block_ids) for s in self._staged.values())

    def snapshot(self) -> list[StagedView]:
        self.sweep()
        now = self._clock()
        return [
            StagedView(s.request_id, len(s.block_ids), round(now - s.staged_at, 6))
            for s in self._staged.values()
        ]


def chain_hashes(blocks: Sequence[bytes]) -> list[bytes]:
    """Hash each block together with the hash of everything before it (like vLLM's block hash)."""
    hashes: list[bytes] = []
    parent = b""
    for block in blocks:
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class CacheChange:
    """What one insert did: the indices (into its hashes) of the blocks it added, in order, and
    the hashes it evicted, least recently used first."""

    stored: tuple[int, ...]
    evicted: tuple[bytes, ...]


class PrefixCache:
    """The engine's prefix cache: chained block hashes, at most ``capacity`` blocks (the
    engine's ``--num-gpu-blocks``), evicted least recently used first.

    What it models of vLLM's (v1 ``BlockPool``): a computed block stays cached until its GPU
    block is needed for another one, and the free-block queue hands out the least recently used
    block first. A request frees its blocks in reverse order, so that a prompt's tail blocks are
    evicted before its head (``KVCacheManager.free``): here every block a request matched or
    inserted becomes recently used, its first block the most recently. A chained hash makes a
    block without its predecessors useless, so keeping heads keeps prefixes.

    What it does not model: a real engine's cache shares the ``num_gpu_blocks`` with the blocks
    of running requests and of KV staged for a remote decode, which cannot be evicted while held
    (under load the cache holds fewer blocks than the capacity), and recency is the time of the
    lookup or insert, not of the request's end. Memory: about 150 bytes per cached block.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._entries: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.evicted_total = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def match(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks present; they become the most recently used."""
        matched = 0
        for block_hash in hashes:
            if block_hash not in self._entries:
                break
            matched += 1
        self._touch(hashes[:matched])
        return matched

    def insert(self, hashes: Sequence[bytes]) -> CacheChange:
        """Cache a prompt's full blocks (the most recently used now), evicting beyond capacity:
        a prompt longer than the capacity keeps its head. Returns what changed (the engine's
        KV events)."""
        entries = self._entries
        new = tuple(i for i, block_hash in enumerate(hashes) if block_hash not in entries)
        self._touch(hashes)
        excess = max(0, len(entries) - self._capacity)
        evicted = tuple(entries.popitem(last=False)[0] for _ in range(excess))
        self.evicted_total += excess
        return CacheChange(new, evicted)

    def clear(self) -> None:
        self._entries.clear()

    def _touch(self, hashes: Sequence[bytes]) -> None:
        entries = self._entries
        for block_hash in reversed(hashes):  # the head ends up most recent, evicted last
            entries[block_hash] = None
            entries.move_to_end(block_hash)

    def __len__(self) -> int:
        return len(self._entries)

"""The decode engine's data-parallel ranks: what is known of each, and which one takes a request.

A decode pod may run vLLM with data parallelism and external load balancing: one HTTP server per
rank (``SIDECAR_DECODE_URLS``), each with its own engine and KV cache. Every request goes to one
rank, chosen here — pure and synchronous like the rest of the policy, no I/O:

- **candidates**: the ready ranks (their last ``/health`` poll answered 200); all of them when
  none is (the pod is unready then, and a request that comes anyway is placed as a single
  engine's would be: sent, and answered by the engine or with a 503);
- **prefix first, then load**: the lowest ``cost`` = the prompt's tokens not in the rank's prefix
  index (not in what its KV events say it holds, where they are in sync: ``choose``'s ``exact``)
  + its load (requests in flight there + its scraped waiting queue) × ``TOKENS_PER_REQUEST``;
  ties at random. A continuation goes back to the rank holding its history unless that rank is
  busier by more requests than the history has thousands of tokens; a prompt cached nowhere goes
  to the least loaded rank.

The sidecar is its ranks' only client, so its own in-flight count per rank is exact and fresh at
the moment of choice: the global minimum is safe here (herding comes from stale views shared by
many choosers, which is why the prefill side samples candidates instead).

Each rank has its own prefix index; together they stay within ``SIDECAR_PREFIX_CACHE_BLOCKS``
(each rank gets an equal share), and each within what its engine's KV cache holds when the scrape
says (``vllm:cache_config_info``): an index larger than the engine's cache would predict hits on
blocks the engine evicted long ago.

What a rank's engine said when last polled (ready or not, its scraped queue) is the engine
monitor's snapshot (``DecodeRank.engine``, ``sidecar.engines``), published here and read by
readiness and ``/debug/scheduler`` as it is by the choice; the rest is written by the claims.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.fleet.load import EngineLoad, describe_load
from sidecar.fleet.snapshot import NOT_POLLED, EngineHealth, EngineSnapshot
from sidecar.scheduling.policies import TOKENS_PER_WAITING
from sidecar.scheduling.prompts import PrefixIndex, TextBlocks

if TYPE_CHECKING:
    from aiohttp import web

TOKENS_PER_REQUEST = TOKENS_PER_WAITING
"""Prompt tokens one request in flight or waiting on a rank weighs against a prefix-cache hit
(the same figure the prefill side assumes per waiting request)."""
RankCache = Callable[[int, int], int]
"""A rank's index and the prompt's tokens its prefix index holds → the tokens to weigh: what
the rank's KV events say it holds where they are in sync, else the figure given
(``sidecar.kvevents.fleet.PromptLookup.rank``)."""


@dataclass(frozen=True, slots=True)
class RankView:
    """One candidate rank as the choice sees it."""

    index: int
    cached_tokens: int = 0
    """Tokens of the prompt's longest prefix in this rank's prefix index."""
    inflight: int = 0
    """This sidecar's requests on the rank now (placed and not finished)."""
    waiting: float | None = None
    """The rank's scraped ``vllm:num_requests_waiting``; None when unknown or stale."""

    def cost(self, prompt_tokens: int) -> float:
        uncached = max(0, prompt_tokens - self.cached_tokens)
        return uncached + (self.inflight + (self.waiting or 0.0)) * TOKENS_PER_REQUEST


def choose_rank(views: Sequence[RankView], prompt_tokens: int, rng: random.Random) -> RankView:
    """The lowest-cost rank of ``views`` (not empty), ties at random."""
    if len(views) == 1:
        return views[0]
    scored = [(view.cost(prompt_tokens), view) for view in views]
    best = min(score for score, _ in scored)
    return rng.choice([view for score, view in scored if score <= best])


@dataclass(slots=True, eq=False)
class DecodeRank:
    """What the sidecar knows of one rank. Each part has one writer:

    - ``engine``, what its engine said when polled: replaced by the engine monitor alone
      (``DecodeRanks.publish``), never changed in place; ``ready`` and ``load`` read it;
    - ``inflight``, ``ahead_tokens``, ``placed``: the claims of requests (``RankClaim``);
    - ``prefix``, what this sidecar placed there: grown by the claims, forgotten by
      ``DecodeRanks.lost`` on evidence that the engine's cache is gone.
    """

    index: int
    url: str
    prefix: PrefixIndex
    engine: EngineSnapshot = NOT_POLLED
    inflight: int = 0
    ahead_tokens: int = 0
    """Prompt tokens of local prefills on this rank that have not produced a first byte yet."""
    placed: int = 0
    """Requests placed on it since start (generation and passthrough)."""

    @property
    def ready(self) -> bool:
        """Its last ``/health`` poll answered 200."""
        return self.engine.ready

    @property
    def load(self) -> EngineLoad | None:
        """Its last scrape's gauges (None: none yet, or the last scrape got none)."""
        return self.engine.load


class RankClaim:
    """One request's hold on a rank: counted in its in-flight requests (and, while a local
    prefill runs there, its tokens ahead) from the choice until ``end()``. ``move`` carries the
    count — and the prompt, which the new rank will hold — to another rank when the request's
    decode leg goes there instead."""

    __slots__ = ("_ahead", "_ended", "_text", "pinned", "rank")

    def __init__(self, rank: DecodeRank, text: str | bytes = "", *, pinned: bool = False) -> None:
        self.rank = rank
        self.pinned = pinned
        """The request named its rank (it came on that rank's port, SIDECAR_RANK_PORTS): it is
        never moved to another."""
        self._text = text
        self._ahead = 0
        self._ended = False
        rank.inflight += 1
        rank.placed += 1

    @property
    def index(self) -> int:
        return self.rank.index

    @property
    def url(self) -> str:
        return self.rank.url

    def prefilling(self, tokens: int) -> None:
        """A local prefill of ``tokens`` on this rank lies ahead of the request's first byte."""
        self._ahead += tokens
        self.rank.ahead_tokens += tokens

    def prefilled(self) -> None:
        """Its local prefill is over (a first byte came, or the exchange ended without one)."""
        self.rank.ahead_tokens -= self._ahead
        self._ahead = 0

    def move(self, to: DecodeRank) -> None:
        if self._ended or to is self.rank:
            return
        self.rank.inflight -= 1
        self.rank.ahead_tokens -= self._ahead
        to.inflight += 1
        to.ahead_tokens += self._ahead
        to.placed += 1
        if self._text:
            to.prefix.insert(to.prefix.hashes(self._text))
        self.rank = to

    def end(self) -> None:
        """Idempotent."""
        if not self._ended:
            self._ended = True
            self.prefilled()
            self.rank.inflight -= 1


def _known_down(rank: DecodeRank) -> bool:
    engine = rank.engine
    return not engine.ready and engine.health in (EngineHealth.DOWN, EngineHealth.LOST)


def _cached(rank: DecodeRank, hashes: Sequence[Hashable], exact: RankCache | None) -> int:
    """The prompt's tokens ``rank`` holds: its prefix index's figure, or its events'."""
    tokens = rank.prefix.cached_tokens(hashes)
    return tokens if exact is None else exact(rank.index, tokens)


class RankPorts:
    """Which decode rank a request names by the port it arrived on (``SIDECAR_RANK_PORTS``, as
    llm-d's sidecar listens: rank *r* on ``SIDECAR_PORT`` + *r*, rank 0 on ``SIDECAR_PORT``).
    Filled by the runner once it has bound the ports; empty (no rank named) otherwise."""

    __slots__ = ("_by_port",)

    def __init__(self) -> None:
        self._by_port: dict[int, int] = {}

    def serve(self, port: int, rank: int) -> None:
        self._by_port[port] = rank

    def rank_of(self, local_port: int | None) -> int | None:
        """The rank a request that arrived on ``local_port`` goes to (None: the sidecar
        chooses)."""
        return None if local_port is None else self._by_port.get(local_port)

    def rank_for(self, request: web.BaseRequest) -> int | None:
        """``rank_of`` the local port of ``request``'s connection."""
        if not self._by_port or request.transport is None:
            return None
        sockname = request.transport.get_extra_info("sockname")
        return self.rank_of(sockname[1] if sockname else None)


class DecodeRanks:
    """Every rank of the local decode engine, in ``SIDECAR_DECODE_URLS`` order (index 0 first)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        block_tokens: int,
        capacity_blocks: int,
        stale_after_s: float,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        before_forget: Callable[[], None] = lambda: None,
    ) -> None:
        """``before_forget``: called before a rank's index is forgotten (``lost``), to insert
        what its owner has not inserted yet of the placements decided before (the scheduler
        records them after their decisions)."""
        if not urls:
            raise ValueError("a decode engine has at least one rank")
        share = capacity_blocks // len(urls)
        self._ranks = [
            DecodeRank(i, url, PrefixIndex(block_tokens=block_tokens, capacity_blocks=share))
            for i, url in enumerate(urls)
        ]
        self._hasher = self._ranks[0].prefix
        self._stale_after_s = stale_after_s
        self._rng = rng
        self._clock = clock
        self._before_forget = before_forget

    def __len__(self) -> int:
        return len(self._ranks)

    def __iter__(self) -> Iterator[DecodeRank]:
        return iter(self._ranks)

    def __getitem__(self, index: int) -> DecodeRank:
        return self._ranks[index]

    @property
    def ready(self) -> bool:
        """At least one rank is ready: the pod is."""
        return any(rank.ready for rank in self._ranks)

    def down(self, pinned: int | None = None) -> str | None:
        """Why no request can be sent to the decode engine now (each rank's reason), or None:
        every rank a request may go to — the one it named (``pinned``), else all of them — is
        known down, unready after failed ``/health`` polls. A rank not polled yet, or unready
        only for want of enough successful polls, is not known down: it is tried."""
        ranks = self._ranks if pinned is None else [self._ranks[pinned]]
        if not all(_known_down(rank) for rank in ranks):
            return None
        if len(ranks) == 1:
            return ranks[0].engine.reason
        return "; ".join(f"rank {rank.index}: {rank.engine.reason}" for rank in ranks)

    def publish(self, rank: DecodeRank, snapshot: EngineSnapshot) -> None:
        """The engine monitor's new snapshot of ``rank``'s engine (the monitor alone calls
        this). A new ``/health`` poll that says the engine's cache is gone (``LOST``: nothing
        listens, or its health check failed: a vLLM whose engine core died comes back empty)
        forgets the rank's prefix index. A poll that only timed out (``DOWN``) keeps it: a busy
        engine still holds its KV."""
        new_poll = snapshot.health_at != rank.engine.health_at
        if new_poll and snapshot.health is EngineHealth.LOST:
            self.lost(rank)
        held = snapshot.load.cache_tokens if snapshot.load is not None else None
        if held:
            rank.prefix.engine_holds(held)
        rank.engine = snapshot

    def lost(self, rank: DecodeRank) -> None:
        """``rank``'s engine lost its cache (its process is gone or its engine died): a
        ``/health`` poll said so (``publish``), or a request's connection was refused (the
        decode send). The placements decided before are inserted first (``before_forget``),
        so forgotten with the rest: one inserted after would stay in the index of a rank that
        will never hold it once the request's decode leg goes to another."""
        self._before_forget()
        rank.prefix.clear()

    def candidates(self, exclude: Sequence[DecodeRank] = ()) -> list[DecodeRank]:
        """The ready ranks (every rank when none is ready), but those in ``exclude``."""
        pool = [rank for rank in self._ranks if rank.ready] or self._ranks
        return [rank for rank in pool if rank not in exclude]

    def claim(
        self, text: str | bytes, prompt_tokens: int, pinned: int | None = None
    ) -> tuple[RankClaim, int]:
        """Place a generation request: its rank (claimed) and the tokens of its prompt that
        rank has cached. The chosen rank's index remembers the prompt, which it will hold
        whether it computes it or pulls its KV. ``pinned``: the rank the request named (by the
        port it came on), taken whatever its state."""
        return self.claim_blocks(self._hasher.hashes(text), prompt_tokens, text, pinned)

    def claim_blocks(
        self,
        hashes: Sequence[Hashable],
        prompt_tokens: int,
        text: str | bytes = "",
        pinned: int | None = None,
    ) -> tuple[RankClaim, int]:
        """``claim`` for a prompt given by its block hashes (``PrefixIndex.hashes``; the
        simulator gives stand-ins). ``text``, when given, goes with a claim that ``move``s."""
        claim, cached = self.choose(hashes, prompt_tokens, text, pinned)
        claim.rank.prefix.insert(hashes)
        return claim, cached

    def blocks(self, text: str | bytes) -> TextBlocks:
        """The prompt's block hashes for the ranks' indexes, computed as far as they are read
        (``PrefixIndex.blocks``)."""
        return self._hasher.blocks(text)

    def choose(
        self,
        hashes: Sequence[Hashable],
        prompt_tokens: int,
        text: str | bytes = "",
        pinned: int | None = None,
        exact: RankCache | None = None,
    ) -> tuple[RankClaim, int]:
        """``claim_blocks`` without remembering the prompt in the chosen rank's index: the
        caller inserts ``hashes`` there (``PrefixIndex.insert``) before the next choice reads
        it (the scheduler records a placement after its decision). ``exact``: what the ranks'
        KV events say they hold, weighed in place of their prefix indexes' figures where they
        say it (the choice's cost, and the cached tokens returned)."""
        candidates = self.candidates() if pinned is None else [self._ranks[pinned]]
        if len(candidates) == 1:
            rank = candidates[0]
            cached = _cached(rank, hashes, exact)
        else:
            views = [
                RankView(r.index, _cached(r, hashes, exact), r.inflight, self.waiting(r))
                for r in candidates
            ]
            chosen = choose_rank(views, prompt_tokens, self._rng)
            rank, cached = self._ranks[chosen.index], chosen.cached_tokens
        return RankClaim(rank, text, pinned=pinned is not None), cached

    def claim_any(self, pinned: int | None = None) -> RankClaim:
        """Place a request without a prompt to match (passthrough): the least loaded rank, or
        the one it named (``pinned``)."""
        if pinned is not None:
            return RankClaim(self._ranks[pinned], pinned=True)
        candidates = self.candidates()
        views = [RankView(r.index, 0, r.inflight, self.waiting(r)) for r in candidates]
        return RankClaim(self._ranks[choose_rank(views, 0, self._rng).index])

    def least_loaded(self, exclude: Sequence[DecodeRank] = ()) -> DecodeRank | None:
        """Where a request goes when its rank cannot be connected to: the candidate with the
        least load but those in ``exclude``, ties at random; None when none is left."""
        candidates = self.candidates(exclude)
        if not candidates:
            return None
        views = [RankView(r.index, 0, r.inflight, self.waiting(r)) for r in candidates]
        return self._ranks[choose_rank(views, 0, self._rng).index]

    def waiting(self, rank: DecodeRank) -> float | None:
        """The rank's scraped waiting queue, when fresh."""
        load = rank.load
        if load is None or load.waiting is None:
            return None
        if self._clock() - load.at > self._stale_after_s:
            return None
        return load.waiting

    def describe(self, now: float) -> list[dict[str, Any]]:
        """For /debug/scheduler: one entry per rank, in index order."""
        return [self._describe(rank, rank.engine, now) for rank in self._ranks]

    @staticmethod
    def _describe(rank: DecodeRank, engine: EngineSnapshot, now: float) -> dict[str, Any]:
        return {
            "decode_rank": rank.index,
            "decode_url": rank.url,
            "ready": engine.ready,
            "inflight": rank.inflight,
            "placed": rank.placed,
            "ahead_tokens": rank.ahead_tokens,
            "scraped": describe_load(engine.load, now),
            "prefix_index_blocks": len(rank.prefix),
        }

"""Every engine the sidecar takes KV events from: a subscriber and an exact index per prefill
pool member and per local decode rank, started and stopped with the app.

Who is subscribed to: the prefill pool's members as discovery finds them (``follow``: a
subscriber starts when an endpoint joins discovery's answer and stops when it leaves it) and the
local decode ranks (``SIDECAR_DECODE_URLS``), never an address a request names. A pool member
publishes on its address at ``SIDECAR_KV_EVENTS_PORT`` (replay: ``_REPLAY_PORT``); decode rank *r*
on its URL's host at ``SIDECAR_KV_EVENTS_DECODE_PORT`` + *r*, as vLLM offsets its ports by the
data-parallel rank.

A prefill server with ``SIDECAR_KV_EVENTS_PREFILL_DP_SIZE`` = *n* data-parallel ranks is *n*
engines: rank *r* subscribed on the member's address at the port + *r*, an index each
(``_Member``). vLLM's balancer picks a rank by load alone, so a member counts what the request
can count on whichever rank it lands on: the least any of its ranks holds. A rank whose port has
never connected is left out (with one API server per rank, external load balancing, each member
is one rank: the others' ports are not there); the member is in sync while every rank whose
port connected is.

``lookup(key, prompt)`` answers from an engine's index only while it is **in sync**: its
subscription is connected and at least one batch was applied since the index was last emptied
(a new subscription, a reset). Otherwise None, and the caller uses the approximate index for
that engine: no events from it yet, a lost connection, an unknown gap. In sync, the index may
under-predict (what an engine stored before an unreplayable gap is forgotten until stored
again), never predict a block the engine said it evicted.

The subscribers' tasks apply the events; ``lookup`` is a synchronous look-up for the request
path. This module imports ``msgpack`` (through the subscriber): the app imports it only when
``SIDECAR_KV_EVENTS=true``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from yarl import URL

from sidecar.config import Settings
from sidecar.fleet.endpoints import Endpoint
from sidecar.kvevents.events import BlockStored, EventBatch
from sidecar.kvevents.index import Hit, KVIndex, PromptKeys
from sidecar.kvevents.subscriber import ResetReason, Subscriber
from sidecar.kvevents.tokens import TokenSource, TokenSourceStats, tokenize_request
from sidecar.kvevents.wire import DropReason
from sidecar.observability.kv_metrics import (
    SOURCE_APPROXIMATE,
    SOURCE_EVENTS,
    EngineReport,
    FleetReport,
)
from sidecar.scheduling import exact
from sidecar.scheduling.placement import Placement

log = logging.getLogger("sidecar.kvevents.fleet")

MAX_ADAPTERS = 256
"""LoRA adapter names one engine's events named (``lora_name``), the most recent kept: a
request whose ``model`` is one of them is looked up in that engine's index as that adapter's."""


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """The settings the fleet uses, under their own names (``from_settings``)."""

    port: int
    replay_port: int | None
    topic: str
    decode_hosts: tuple[str, ...]
    """The host of each decode rank's URL, rank 0 first."""
    decode_port: int | None
    decode_replay_port: int | None
    cpu_weight: float
    storage_weight: float
    max_blocks: int
    prefill_dp_size: int = 1
    """Data-parallel ranks of each pool member (its events port + *r* for rank *r*)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> FleetOptions:
        return cls(
            port=settings.kv_events_port,
            replay_port=settings.kv_events_replay_port,
            topic=settings.kv_events_topic,
            decode_hosts=tuple(URL(url).host or "" for url in settings.decode_ranks),
            decode_port=settings.kv_events_decode_port,
            decode_replay_port=settings.kv_events_decode_replay_port,
            cpu_weight=settings.kv_events_cpu_weight,
            storage_weight=settings.kv_events_storage_weight,
            max_blocks=settings.kv_events_max_blocks,
            prefill_dp_size=settings.kv_events_prefill_dp_size,
        )


class RequestKeys:
    """A request's keys for every index it is looked up in: its token ids and cache salt, and
    the adapter its ``model`` names *for the engine looked up* — that engine's, if its own
    events named an adapter so, else the base model. At most two ``PromptKeys`` (the base
    model's, the adapter's), each computed once and shared by the engines that key the request
    the same way."""

    __slots__ = ("_adapter", "_base", "model", "salt", "token_ids")

    def __init__(self, token_ids: Sequence[int], model: str | None, salt: str | None) -> None:
        self.token_ids = token_ids
        self.model = model
        self.salt = salt
        self._base: PromptKeys | None = None
        self._adapter: PromptKeys | None = None

    def keys_for(self, adapters: Mapping[str, None]) -> PromptKeys:
        """The keys in the index of an engine whose adapters are ``adapters``."""
        if self.model is not None and self.model in adapters:
            if self._adapter is None:
                self._adapter = PromptKeys(self.token_ids, lora=self.model, salt=self.salt)
            return self._adapter
        if self._base is None:
            self._base = PromptKeys(self.token_ids, salt=self.salt)
        return self._base


class _Engine:
    """One engine's index, subscriber and LoRA adapters; the subscriber's consumer."""

    __slots__ = ("adapters", "batches_since_reset", "index", "name", "subscriber")

    def __init__(self, name: str, index: KVIndex) -> None:
        self.name = name
        self.index = index
        self.adapters: OrderedDict[str, None] = OrderedDict()
        """The adapters this engine's events named (``MAX_ADAPTERS``, most recent kept): kept
        across resets, so that a request for one never matches the base model's blocks."""
        self.batches_since_reset = 0
        self.subscriber: Subscriber | None = None

    def apply(self, batch: EventBatch) -> None:
        self.index.apply(batch)
        self.batches_since_reset += 1
        adapters = self.adapters
        for event in batch.events:
            if isinstance(event, BlockStored) and event.lora_name is not None:
                adapters[event.lora_name] = None
                adapters.move_to_end(event.lora_name)
                if len(adapters) > MAX_ADAPTERS:
                    adapters.popitem(last=False)

    def reset(self, reason: ResetReason) -> None:
        self.index.reset(reason.value)
        self.batches_since_reset = 0
        log.info("KV events of %s: index emptied (%s)", self.name, reason.value)

    @property
    def synced(self) -> bool:
        """Connected, a batch applied since the last reset, and not catching up (a replay being
        read, a backlog: the index lacks what the engine published)."""
        subscriber = self.subscriber
        return (
            subscriber is not None
            and subscriber.stats.connected
            and self.batches_since_reset > 0
            and not subscriber.catching_up
        )

    def lookup(self, prompt: RequestKeys) -> Hit:
        return self.index.lookup(prompt.keys_for(self.adapters))

    @property
    def ever_connected(self) -> bool:
        return self.subscriber is not None and self.subscriber.stats.connects_total > 0

    def report(self, source: str | None = None) -> EngineReport:
        """``source``: what the decision uses for it (default: its own index's state)."""
        assert self.subscriber is not None
        stats = self.subscriber.stats
        if source is None:
            source = SOURCE_EVENTS if self.synced else SOURCE_APPROXIMATE
        return EngineReport(
            engine=self.name,
            source=source,
            connected=stats.connected,
            lag_s=None if stats.lag_s is None else round(stats.lag_s, 6),
            adapters=len(self.adapters),
            behind=stats.behind,
            replaying=stats.replaying,
            blocks=len(self.index),
            events_applied=stats.events_total,
            batches_applied=stats.batches_applied_total,
            drops={reason.value: stats.drops_total[reason] for reason in DropReason},
            resets={reason.value: stats.resets_total[reason] for reason in ResetReason},
            gaps=stats.gaps_total,
            replays=stats.replays_total,
            connects=stats.connects_total,
            connect_failures=stats.connect_failures_total,
        )


class _Member:
    """A prefill pool member's engines, one per data-parallel rank (rank 0 first).

    In sync while at least one rank's subscription has connected and every such rank is in
    sync; a rank that never connected is left out (its port is not there: another pod's rank
    under external load balancing, or not up yet). ``lookup`` answers the least any counted
    rank holds, vLLM's balancer being blind to prefixes.
    """

    __slots__ = ("key", "ranks")

    def __init__(self, key: str, ranks: tuple[_Engine, ...]) -> None:
        self.key = key
        self.ranks = ranks

    def counted(self) -> list[_Engine]:
        """The ranks the prediction is made of: those whose port has connected."""
        return [engine for engine in self.ranks if engine.ever_connected]

    @property
    def synced(self) -> bool:
        ranks = self.ranks
        if len(ranks) == 1:
            return ranks[0].synced
        counted = self.counted()
        return bool(counted) and all(engine.synced for engine in counted)

    def lookup(self, prompt: RequestKeys, value: Callable[[Hit], float]) -> Hit | None:
        """What the member can be counted on to hold of ``prompt`` (the hit of least ``value``
        among its counted ranks); None when it is not in sync."""
        ranks = self.ranks
        if len(ranks) == 1:  # the common case, at the cost it had before ranks
            engine = ranks[0]
            return engine.lookup(prompt) if engine.synced else None
        if not self.synced:
            return None
        hits = [engine.lookup(prompt) for engine in self.counted()]
        return min(hits, key=value)

    def reports(self) -> list[EngineReport]:
        if len(self.ranks) == 1:
            return [self.ranks[0].report()]
        # A rank's source is the member's: the decision uses its index only then.
        synced = self.synced
        return [
            engine.report(SOURCE_EVENTS if synced and engine.ever_connected else SOURCE_APPROXIMATE)
            for engine in self.ranks
        ]

    async def close(self) -> None:
        for engine in self.ranks:
            assert engine.subscriber is not None
            await engine.subscriber.close()


class PromptLookup:
    """One request's look-ups in the exact indexes, for its decision: called with a pool
    member's key (``placement.ExactCache``), ``rank`` for each candidate decode rank
    (``ranks.RankCache``). Keeps which source each engine's cached tokens came from. ``keys``
    None: the token ids could not be had (every engine then answers from the approximate
    index). A retry of the request's prefill looks up again (``again``): the keys are kept
    while a retry can come, the prefill leg, never with the placement (a stream's life)."""

    __slots__ = ("_fleet", "keys", "seconds", "sources", "tokens")

    def __init__(
        self, fleet: KVFleet, keys: RequestKeys | None, tokens: int | None, seconds: float | None
    ) -> None:
        self._fleet = fleet
        self.keys = keys
        self.tokens = tokens
        """The prompt's token count (None: unknown)."""
        self.seconds = seconds
        """Spent getting the token ids (None: not asked of the engine)."""
        self.sources: dict[str, str] = {}

    def __call__(self, key: str) -> int | None:
        hit = None if self.keys is None else self._fleet.lookup(key, self.keys)
        self.sources[key] = SOURCE_APPROXIMATE if hit is None else SOURCE_EVENTS
        return None if hit is None else self._fleet.cached_tokens(hit)

    def rank(self, rank: int, approximate: int) -> int:
        """Decode rank ``rank``'s cached tokens: its exact index's, else ``approximate``."""
        hit = None if self.keys is None else self._fleet.lookup_rank(rank, self.keys)
        self.sources[decode_engine(rank)] = SOURCE_APPROXIMATE if hit is None else SOURCE_EVENTS
        return approximate if hit is None else self._fleet.cached_tokens(hit)

    def again(self) -> None:
        """The look-ups start over for another decision on the same prompt (a prefill's
        retry): its sources are its own, counted by its ``decided``; the first decision's
        stay as they were shown."""
        self.sources = {}


def decode_engine(rank: int) -> str:
    """The name (and metrics label) of decode rank ``rank``'s engine."""
    return f"decode:{rank}"


def prefill_engine(key: str, rank: int, ranks: int) -> str:
    """The name (and metrics label) of data-parallel rank ``rank`` of pool member ``key``:
    the key itself when the member has one rank, else ``<key>:dp<rank>``."""
    return key if ranks == 1 else f"{key}:dp{rank}"


class KVFleet:
    """See the module's docstring. ``tokens``: where a request's token ids come from (the local
    decode engine's ``/tokenize``). ``subscriber_options``: passed to every ``Subscriber``
    (tests inject the backoff and timeouts)."""

    def __init__(
        self,
        options: FleetOptions,
        *,
        tokens: TokenSource,
        subscriber_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.options = options
        self.tokens = tokens
        self._subscriber_options = dict(subscriber_options or {})
        self._prefill: dict[str, _Member] = {}
        self._ranks: list[_Engine | None] = []
        self.lookups: Counter[str] = Counter()
        """Engines whose cached tokens a decision took from each source (``decided``)."""
        self.last_decision: dict[str, Any] | None = None
        """The last decision's look-ups: the token-id time and count, the source per engine."""
        self._running = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe to the local decode ranks (the pool's members come through ``follow``)."""
        self._running = True
        port, replay = self.options.decode_port, self.options.decode_replay_port
        for rank, host in enumerate(self.options.decode_hosts):
            if port is None or not host:
                self._ranks.append(None)
                continue
            self._ranks.append(
                await self._subscribe(
                    decode_engine(rank),
                    host,
                    port + rank,
                    None if replay is None else replay + rank,
                )
            )

    async def close(self) -> None:
        self._running = False
        members = list(self._prefill.values())
        engines = [e for e in self._ranks if e is not None]
        self._prefill.clear()
        self._ranks.clear()
        for member in members:
            await member.close()
        for engine in engines:
            assert engine.subscriber is not None
            await engine.subscriber.close()

    async def follow(self, endpoints: Sequence[Endpoint]) -> None:
        """Discovery's current answer: subscribe to the endpoints that joined, stop the
        subscribers of those that left (their indexes go with them)."""
        if not self._running:
            return
        current = {str(endpoint): endpoint for endpoint in endpoints}
        for key in [key for key in self._prefill if key not in current]:
            await self._prefill.pop(key).close()
            log.info("KV events of prefill endpoint %s: unsubscribed (it left the pool)", key)
        port, replay, size = (
            self.options.port,
            self.options.replay_port,
            self.options.prefill_dp_size,
        )
        for key, endpoint in current.items():
            if key not in self._prefill:
                # vLLM offsets both ports by the rank (``offset_endpoint_port``).
                ranks = [
                    await self._subscribe(
                        prefill_engine(key, rank, size),
                        endpoint.host,
                        port + rank,
                        None if replay is None else replay + rank,
                    )
                    for rank in range(size)
                ]
                self._prefill[key] = _Member(key, tuple(ranks))

    async def _subscribe(self, name: str, host: str, port: int, replay: int | None) -> _Engine:
        engine = _Engine(name, KVIndex(max_blocks=self.options.max_blocks))
        subscriber = Subscriber(
            host=host,
            port=port,
            replay_port=replay,
            topic=self.options.topic,
            consumer=engine,
            **self._subscriber_options,
        )
        engine.subscriber = subscriber
        await subscriber.start()
        log.info("KV events of %s: subscribed to %s", name, subscriber.endpoint)
        return engine

    # -- the request path ---------------------------------------------------------------------

    def any_synced(self) -> bool:
        """Whether a pool member's or a decode rank's index is in sync: only then is a
        request's token ids worth asking for."""
        return any(member.synced for member in self._prefill.values()) or any(
            engine is not None and engine.synced for engine in self._ranks
        )

    def _rank(self, rank: int) -> _Engine | None:
        engine = self._ranks[rank] if 0 <= rank < len(self._ranks) else None
        return engine if engine is not None and engine.synced else None

    def prompt_keys(self, token_ids: Sequence[int], body: Mapping[str, Any]) -> RequestKeys:
        """The request's keys: its ``model`` (an adapter's name for each engine whose own
        events named it so) and its ``cache_salt``."""
        model = body.get("model")
        salt = body.get("cache_salt")
        return RequestKeys(
            token_ids,
            model if isinstance(model, str) else None,
            salt if isinstance(salt, str) and salt else None,
        )

    def lookup(self, key: str, prompt: RequestKeys) -> Hit | None:
        """What pool member ``key`` holds of ``prompt`` (with data-parallel ranks: the least
        any of them holds); None when it is not in sync."""
        member = self._prefill.get(key)
        return None if member is None else member.lookup(prompt, self.cached_tokens)

    def lookup_rank(self, rank: int, prompt: RequestKeys) -> Hit | None:
        """What decode rank ``rank`` holds of ``prompt``; None when its index is not in sync."""
        engine = self._rank(rank)
        return None if engine is None else engine.lookup(prompt)

    async def prompt(self, body: Mapping[str, Any], *, ask: bool) -> PromptLookup | None:
        """The look-ups of a request's decision, or None when no engine's index is in sync
        (nothing asked then). ``ask``: the token ids may be asked of the decode engine (a
        choice is to be made); otherwise only a prompt given as token ids is looked up."""
        if not self.any_synced():
            return None
        if not ask:
            request = tokenize_request(body)
            if not isinstance(request, list):
                return None
            return PromptLookup(self, self.prompt_keys(request, body), len(request), None)
        started = time.monotonic()
        ids = await self.tokens.token_ids(body)
        seconds = time.monotonic() - started
        if ids is None:
            return PromptLookup(self, None, None, seconds)
        return PromptLookup(self, self.prompt_keys(ids, body), len(ids), seconds)

    def decided(self, placement: Placement, lookup: exact.PromptLookup) -> Placement:
        """Count where the decision's cached tokens came from; the placement with its
        ``tokenize_s`` and ``cached_source``."""
        sources = lookup.sources
        self.lookups.update(sources.values())
        self.last_decision = {
            "tokenize_s": None if lookup.seconds is None else round(lookup.seconds, 6),
            "token_ids": lookup.tokens,
            "sources": sources,  # the request's own, not written after its decision
        }
        key = (
            decode_engine(placement.rank.index)
            if placement.endpoint is None
            else str(placement.endpoint)
        )
        # Positional, in the fields' order: ``dataclasses.replace`` costs twice as much.
        p = placement
        return Placement(
            p.decision,
            p.endpoint,
            p.rank,
            p.reservation,
            p.local_tokens,
            p.prefix,
            lookup.seconds,
            sources.get(key),
        )

    def cached_tokens(self, hit: Hit) -> int:
        """The tokens a hit counts for in the decision: GPU in full, the offload tiers
        weighed (``SIDECAR_KV_EVENTS_CPU_WEIGHT``, ``_STORAGE_WEIGHT``)."""
        if not (hit.cpu or hit.storage):
            return hit.gpu
        return int(hit.weighted(self.options.cpu_weight, self.options.storage_weight))

    # -- what it shows ------------------------------------------------------------------------

    def report(self) -> FleetReport:
        engines = [report for member in self._prefill.values() for report in member.reports()]
        engines.extend(e.report() for e in self._ranks if e is not None)
        return FleetReport(
            engines=tuple(engines),
            token_ids=_token_counts(self.tokens.stats),
            lookups=dict(self.lookups),
        )

    def source(self, key: str) -> str:
        member = self._prefill.get(key)
        return SOURCE_EVENTS if member is not None and member.synced else SOURCE_APPROXIMATE

    def status(self) -> dict[str, Any]:
        """For ``/debug/scheduler``'s ``kv_events`` section."""
        report = self.report()
        engines = {engine.engine: _describe(engine) for engine in report.engines}
        return {
            "enabled": True,
            "topic": self.options.topic,
            "prefill_port": self.options.port,
            "prefill_replay_port": self.options.replay_port,
            "prefill_dp_size": self.options.prefill_dp_size,
            "decode_port": self.options.decode_port,
            "decode_replay_port": self.options.decode_replay_port,
            "cpu_weight": self.options.cpu_weight,
            "storage_weight": self.options.storage_weight,
            "max_blocks": self.options.max_blocks,
            "endpoints": {
                key: self._member_status(self._prefill[key], engines)
                for key in sorted(self._prefill)
            },
            "decode_ranks": [
                engines.get(
                    decode_engine(rank), {"source": SOURCE_APPROXIMATE, "subscribed": False}
                )
                for rank in range(len(self._ranks))
            ],
            "token_ids": {
                "timeout_s": self.tokens.timeout_s,
                **report.token_ids,
            },
            "lookups": dict(report.lookups),
            "last_decision": self.last_decision,
        }

    @staticmethod
    def _member_status(member: _Member, engines: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """A pool member's view: its engine's, or with data-parallel ranks the member's source
        and each rank's (``counted``: its port connected, part of the prediction)."""
        if len(member.ranks) == 1:
            return engines[member.ranks[0].name]
        return {
            "source": SOURCE_EVENTS if member.synced else SOURCE_APPROXIMATE,
            "subscribed": True,
            "ranks": [
                {
                    "engine": engine.name,
                    "counted": engine.ever_connected,
                    "in_sync": engine.synced,
                    **engines[engine.name],
                }
                for engine in member.ranks
            ],
        }


_UNSUBSCRIBED = {"source": SOURCE_APPROXIMATE, "subscribed": False}


def _token_counts(stats: TokenSourceStats) -> dict[str, int]:
    return {
        "answered": stats.answered,
        "given": stats.given,
        "unsupported": stats.unsupported,
        "busy": stats.busy,
        "timeout": stats.timeout,
        "refused": stats.refused,
        "failed": stats.failed,
        "invalid": stats.invalid,
    }


def _describe(engine: EngineReport) -> dict[str, Any]:
    return {
        "source": engine.source,
        "subscribed": True,
        "connected": engine.connected,
        "lag_s": engine.lag_s,
        "behind": engine.behind,
        "replaying": engine.replaying,
        "adapters": engine.adapters,
        "blocks": engine.blocks,
        "events_applied": engine.events_applied,
        "batches_applied": engine.batches_applied,
        "drops": {reason: count for reason, count in engine.drops.items() if count},
        "resets": {reason: count for reason, count in engine.resets.items() if count},
        "gaps": engine.gaps,
        "replays": engine.replays,
        "connects": engine.connects,
        "connect_failures": engine.connect_failures,
    }

"""Every engine the sidecar takes KV events from: a subscriber and an exact index per prefill
pool member and per local decode rank, started and stopped with the app (issue 26).

Who is subscribed to: the prefill pool's members as discovery finds them (``follow``: a
subscriber starts when an endpoint joins discovery's answer and stops when it leaves it) and the
local decode ranks (``SIDECAR_DECODE_URLS``), never an address a request names. A pool member
publishes on its address at ``SIDECAR_KV_EVENTS_PORT`` (replay: ``_REPLAY_PORT``); decode rank *r*
on its URL's host at ``SIDECAR_KV_EVENTS_DECODE_PORT`` + *r*, as vLLM offsets its ports by the
data-parallel rank.

``lookup(key, prompt)`` answers from an engine's index only while it is **in sync**: its
subscription is connected and at least one batch was applied since the index was last emptied
(a new subscription, a reset). Otherwise None, and the caller uses the approximate index for
that engine: no events from it yet, a lost connection, an unknown gap. In sync, the index may
under-predict (what an engine stored before an unreplayable gap is forgotten until stored
again), never predict a block the engine said it evicted.

The subscribers' tasks apply the events; ``lookup`` is a synchronous look-up for the request
path. This module imports ``zmq`` (through the subscriber): the app imports it only when
``SIDECAR_KV_EVENTS=true``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from yarl import URL

from sidecar.config import Settings
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
from sidecar.scheduling.endpoints import Endpoint
from sidecar.scheduling.placement import Placement

log = logging.getLogger("sidecar.kvevents.fleet")

MAX_ADAPTERS = 256
"""LoRA adapter names remembered from the events (``lora_name``): a request whose ``model``
is one of them is looked up as that adapter's."""


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """The fleet's settings under their own names (``from_settings``)."""

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
        )


class _Engine:
    """One engine's index and subscriber; the subscriber's consumer."""

    __slots__ = ("_adapters", "batches_since_reset", "index", "name", "subscriber")

    def __init__(self, name: str, index: KVIndex, adapters: OrderedDict[str, None]) -> None:
        self.name = name
        self.index = index
        self._adapters = adapters
        self.batches_since_reset = 0
        self.subscriber: Subscriber | None = None

    def apply(self, batch: EventBatch) -> None:
        self.index.apply(batch)
        self.batches_since_reset += 1
        adapters = self._adapters
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
        subscriber = self.subscriber
        return (
            subscriber is not None and subscriber.stats.connected and self.batches_since_reset > 0
        )

    def report(self) -> EngineReport:
        assert self.subscriber is not None
        stats = self.subscriber.stats
        return EngineReport(
            engine=self.name,
            source=SOURCE_EVENTS if self.synced else SOURCE_APPROXIMATE,
            connected=stats.connected,
            lag_s=None if stats.lag_s is None else round(stats.lag_s, 6),
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


class PromptLookup:
    """One request's look-ups in the exact indexes, for its decision: called with a pool
    member's key (``placement.ExactCache``), ``rank`` for each candidate decode rank
    (``ranks.RankCache``). Keeps which source each engine's cached tokens came from. ``keys``
    None: the token ids could not be had (every engine then answers from the approximate
    index). A retry of the request's prefill looks up again (``again``): the keys are kept
    while a retry can come, the prefill leg, never with the placement (a stream's life)."""

    __slots__ = ("_fleet", "keys", "seconds", "sources", "tokens")

    def __init__(
        self, fleet: KVFleet, keys: PromptKeys | None, tokens: int | None, seconds: float | None
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
        self._adapters: OrderedDict[str, None] = OrderedDict()
        self._prefill: dict[str, _Engine] = {}
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
        engines = [*self._prefill.values(), *(e for e in self._ranks if e is not None)]
        self._prefill.clear()
        self._ranks.clear()
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
            engine = self._prefill.pop(key)
            assert engine.subscriber is not None
            await engine.subscriber.close()
            log.info("KV events of prefill endpoint %s: unsubscribed (it left the pool)", key)
        for key, endpoint in current.items():
            if key not in self._prefill:
                self._prefill[key] = await self._subscribe(
                    key, endpoint.host, self.options.port, self.options.replay_port
                )

    async def _subscribe(self, name: str, host: str, port: int, replay: int | None) -> _Engine:
        engine = _Engine(name, KVIndex(max_blocks=self.options.max_blocks), self._adapters)
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
        return any(engine.synced for engine in self._prefill.values()) or any(
            engine is not None and engine.synced for engine in self._ranks
        )

    def _rank(self, rank: int) -> _Engine | None:
        engine = self._ranks[rank] if 0 <= rank < len(self._ranks) else None
        return engine if engine is not None and engine.synced else None

    def prompt_keys(self, token_ids: Sequence[int], body: Mapping[str, Any]) -> PromptKeys:
        """The request's keys: its adapter (its ``model``, when the events named it as one)
        and its ``cache_salt``."""
        model = body.get("model")
        salt = body.get("cache_salt")
        return PromptKeys(
            token_ids,
            lora=model if isinstance(model, str) and model in self._adapters else None,
            salt=salt if isinstance(salt, str) and salt else None,
        )

    def lookup(self, key: str, prompt: PromptKeys) -> Hit | None:
        """What pool member ``key`` holds of ``prompt``; None when its index is not in sync."""
        engine = self._prefill.get(key)
        if engine is None or not engine.synced:
            return None
        return engine.index.lookup(prompt)

    def lookup_rank(self, rank: int, prompt: PromptKeys) -> Hit | None:
        """What decode rank ``rank`` holds of ``prompt``; None when its index is not in sync."""
        engine = self._rank(rank)
        return None if engine is None else engine.index.lookup(prompt)

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

    def decided(self, placement: Placement, lookup: PromptLookup) -> Placement:
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
        engines = [*self._prefill.values(), *(e for e in self._ranks if e is not None)]
        return FleetReport(
            engines=tuple(engine.report() for engine in engines),
            token_ids=_token_counts(self.tokens.stats),
            lookups=dict(self.lookups),
        )

    def source(self, key: str) -> str:
        engine = self._prefill.get(key)
        return SOURCE_EVENTS if engine is not None and engine.synced else SOURCE_APPROXIMATE

    def status(self) -> dict[str, Any]:
        """For ``/debug/scheduler``'s ``kv_events`` section."""
        report = self.report()
        engines = {engine.engine: _describe(engine) for engine in report.engines}
        return {
            "enabled": True,
            "topic": self.options.topic,
            "prefill_port": self.options.port,
            "prefill_replay_port": self.options.replay_port,
            "decode_port": self.options.decode_port,
            "decode_replay_port": self.options.decode_replay_port,
            "cpu_weight": self.options.cpu_weight,
            "storage_weight": self.options.storage_weight,
            "max_blocks": self.options.max_blocks,
            "endpoints": {key: engines[key] for key in sorted(self._prefill)},
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
            "adapters_seen": len(self._adapters),
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

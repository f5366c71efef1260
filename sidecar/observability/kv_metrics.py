"""The ``pd_sidecar_kv_events_*`` families: what each subscribed engine's KV events give.

Read at render from the fleet's report (``sidecar.kvevents.fleet``), not counted on the way:
the subscriber's counters are plain ints owned by its tasks, and a series exists exactly as long
as its subscriber (an endpoint that leaves the pool takes its series with it). The ``engine``
label is a pool member's key (``host:port``, the pool's own label, bounded by the pool) or
``decode:<rank>`` for a local decode rank. This module imports neither ``zmq`` nor the fleet:
``Metrics`` always loads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

SOURCE_EVENTS = "events"
SOURCE_APPROXIMATE = "approximate"
TOKEN_OUTCOMES = (
    "answered",
    "given",
    "unsupported",
    "busy",
    "timeout",
    "refused",
    "failed",
    "invalid",
)
"""``TokenSource``'s outcomes (``sidecar.kvevents.tokens.TokenSourceStats``'s fields)."""


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One subscribed engine as the metrics and ``/debug/scheduler`` see it."""

    engine: str
    """The pool's key of a prefill endpoint, or ``decode:<rank>``."""
    source: str
    """``events`` (its index is in sync: the decision uses it) or ``approximate``."""
    connected: bool
    lag_s: float | None
    blocks: int
    events_applied: int
    batches_applied: int
    drops: Mapping[str, int]
    resets: Mapping[str, int]
    gaps: int
    replays: int
    connects: int
    connect_failures: int
    behind: int = 0
    """Batches the engine published that its index lacks: a gap being replayed, a backlog."""
    replaying: bool = False
    adapters: int = 0
    """LoRA adapters its own events named."""


@dataclass(frozen=True, slots=True)
class FleetReport:
    engines: tuple[EngineReport, ...]
    token_ids: Mapping[str, int]
    """``TokenSource`` outcomes since start."""
    lookups: Mapping[str, int]
    """Candidates (and local ranks) whose cached tokens a decision took from each source."""


class KVEventsCollector:
    """A custom collector over ``report()`` (registered only when events are on)."""

    def __init__(self, report: Callable[[], FleetReport]) -> None:
        self._report = report

    def describe(self) -> Iterable[Metric]:
        return list(self._families(FleetReport((), {}, {})))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._report())

    @staticmethod
    def _families(report: FleetReport) -> Iterator[Metric]:
        source = GaugeMetricFamily(
            "pd_sidecar_kv_events_source",
            "1 while a subscribed engine's exact index is in sync and the decision uses it "
            "(source events), 0 while the approximate index stands in for it.",
            labels=["engine"],
        )
        connected = GaugeMetricFamily(
            "pd_sidecar_kv_events_connected",
            "1 while the subscription to an engine's KV events is connected.",
            labels=["engine"],
        )
        lag = GaugeMetricFamily(
            "pd_sidecar_kv_events_lag_seconds",
            "Now less the engine's timestamp of the last KV-event batch applied (NaN: none yet).",
            labels=["engine"],
        )
        behind = GaugeMetricFamily(
            "pd_sidecar_kv_events_behind_batches",
            "KV-event batches an engine published (as far as read) that its exact index lacks: "
            "a gap being replayed, a backlog. Its source is approximate while it is behind.",
            labels=["engine"],
        )
        blocks = GaugeMetricFamily(
            "pd_sidecar_kv_events_blocks",
            "Blocks an engine's exact index holds.",
            labels=["engine"],
        )
        applied = CounterMetricFamily(
            "pd_sidecar_kv_events_applied",
            "KV events applied to an engine's exact index (a stored or removed block, or a "
            "clear, is one event).",
            labels=["engine"],
        )
        drops = CounterMetricFamily(
            "pd_sidecar_kv_events_dropped",
            "KV-event messages of an engine not applied, by reason (frames, topic, seq, "
            "too_large, msgpack, shape, limits, queue_full).",
            labels=["engine", "reason"],
        )
        resets = CounterMetricFamily(
            "pd_sidecar_kv_events_resets",
            "Times an engine's exact index was emptied because what it missed was unknown, by "
            "reason (gap, restarted, reconnected, queue_full, consumer_error).",
            labels=["engine", "reason"],
        )
        for engine in report.engines:
            label = [engine.engine]
            source.add_metric(label, 1.0 if engine.source == SOURCE_EVENTS else 0.0)
            connected.add_metric(label, 1.0 if engine.connected else 0.0)
            lag.add_metric(label, math.nan if engine.lag_s is None else engine.lag_s)
            blocks.add_metric(label, engine.blocks)
            behind.add_metric(label, engine.behind)
            applied.add_metric(label, engine.events_applied)
            for reason, count in engine.drops.items():
                drops.add_metric([engine.engine, reason], count)
            for reason, count in engine.resets.items():
                resets.add_metric([engine.engine, reason], count)
        token_ids = CounterMetricFamily(
            "pd_sidecar_kv_events_token_ids",
            "Requests whose token ids were asked of the local decode engine's /tokenize, by "
            "outcome: answered, given (the prompt was token ids), unsupported (images, "
            "embeddings, several prompts), busy, timeout, refused, failed, invalid.",
            labels=["outcome"],
        )
        for outcome in TOKEN_OUTCOMES:
            token_ids.add_metric([outcome], report.token_ids.get(outcome, 0))
        lookups = CounterMetricFamily(
            "pd_sidecar_kv_events_lookups",
            "Engines (prefill candidates and the local rank) whose cached tokens a decision "
            "took from each source: events (the exact index) or approximate.",
            labels=["source"],
        )
        for kind in (SOURCE_EVENTS, SOURCE_APPROXIMATE):
            lookups.add_metric([kind], report.lookups.get(kind, 0))
        yield from (
            source,
            connected,
            lag,
            behind,
            blocks,
            applied,
            drops,
            resets,
            token_ids,
            lookups,
        )

"""Prometheus metrics on a registry owned by each app (several apps may live in one test process).

Label values are fixed vocabularies documented in docs/observability.md; never request ids or
raw input. The ``endpoint`` label is bounded by the pool and a few header-named targets
(``sidecar.observability.endpoint_labels``). The exposition has no ``_created`` series
(``render``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from sidecar.observability.endpoint_labels import EndpointLabels
from sidecar.observability.histograms import LoopCounter, LoopHistogram, LoopHistogramChild
from sidecar.observability.tracking import DURATIONS, Phase, RequestRecord

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
"""Paths the pipeline serves, by their ``route`` label; everything else is ``other``."""

# The fixed vocabularies of the labels below (docs/observability.md, "Label values"). Each series
# of a counter's vocabulary is exported at 0 from the start: rate() and increase() need a sample
# before the first event to count it, so an alert on a counter that appears only at its first
# increment misses that event. The phase histogram's series (phase x decision x route: 24 of 19
# lines each, most of them never used on a given pod) appear at the first request of their decision
# and route instead: a quantile misses nothing that matters without a zero sample.
GENERATION_ROUTES = ("completions", "chat_completions")
DECISIONS = ("remote", "local", "none")
REQUEST_OUTCOMES = ("success", "client_error", "server_error", "cancelled")
PHASES = ("prefill", "ttft", "decode", "total")
PHASES_BY_DECISION = {
    "remote": PHASES,
    "local": PHASES,  # a fallback's prefill attempts included
    "none": ("total",),  # rejected before a decision: no leg
}
"""The phase histogram's series a (decision, route) can have."""
PREFILL_OUTCOMES = (
    "success",
    "client_error",
    "server_error",
    "unreachable",
    "timeout",
    "bad_response",
)
FALLBACK_REASONS = (
    "prefill_unreachable",
    "prefill_timeout",
    "prefill_error",
    "prefill_bad_response",
    "prefill_too_large",
    "no_kv_params",
)
KV_RELEASE_OUTCOMES = ("sent", "failed", "skipped")
DISCONNECT_ACTIONS = ("abort", "finish")
STATE_ERROR_KINDS = ("timeout", "connection", "refused")
STATE_SKIPPED_KINDS = ("load", "speed", "ejection", "over_limit", "prefix", "wrong_type")
TLS_FILES = ("listener", "engines")
TLS_RELOAD_OUTCOMES = ("reloaded", "failed")
INFERENCE_POOL_ERROR_KINDS = ("unreachable", "refused", "expired", "invalid")
BODY_REFUSAL_REASONS = ("size", "elements", "budget")
LISTENERS = ("api", "admin")
CONNECTION_REFUSALS = ("answered", "closed")
CONNECTION_CLOSES = ("head_timeout", "evicted")

# Latencies from a few ms (loopback engines) to minutes (long prompts, long answers).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _WithoutCreated:
    """A registry's metrics without their ``_created`` samples (a third of the lines, of no use
    to a rate or a quantile). prometheus_client's own switch (``disable_created_metrics``,
    ``PROMETHEUS_DISABLE_CREATED_SERIES``) is process-wide: it would change the emulator's
    exposition too where both run in one process (tests, ``sidecar.demo``), and vLLM's keeps
    them."""

    __slots__ = ("_registry",)

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():  # fresh objects on every collect
            created = metric.name + "_created"
            metric.samples = [sample for sample in metric.samples if sample.name != created]
            yield metric


def outcome_label(record: RequestRecord) -> str:
    if record.state == "cancelled":
        return "cancelled"
    if record.state == "completed":
        return "success"
    if record.status is not None and 400 <= record.status < 500:
        return "client_error"
    return "server_error"


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = LoopCounter(
            "pd_sidecar_requests",
            "Requests answered, by route, P/D decision and outcome.",
            ["route", "decision", "outcome"],
            registry=self.registry,
        )
        self.phase_duration = LoopHistogram(
            "pd_sidecar_phase_duration_seconds",
            "Duration of request phases (prefill leg, time to first byte, decode leg, total), "
            "by P/D decision and route.",
            ["phase", "decision", "route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.prefill_requests = LoopCounter(
            "pd_sidecar_prefill_requests",
            "Prefill legs sent, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.endpoint_prefills = LoopCounter(
            "pd_sidecar_prefill_endpoint_requests",
            "Prefill legs sent, by prefill endpoint (pool members, a few header-named targets, "
            "other) and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.endpoint_prefill_duration = LoopHistogram(
            "pd_sidecar_prefill_endpoint_duration_seconds",
            "Duration of the successful prefill legs, by prefill endpoint.",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.prefill_retries = Counter(
            "pd_sidecar_prefill_retries",
            "Prefill legs retried after a transient failure.",
            registry=self.registry,
        )
        self.kv_releases = Counter(
            "pd_sidecar_kv_releases",
            "Releases of staged KV no decode leg took (client gone, decode failed or refused), "
            "by outcome: sent, failed (the engine refused or was unreachable), skipped.",
            ["outcome"],
            registry=self.registry,
        )
        self.kv_release_waits = Counter(
            "pd_sidecar_kv_release_waits",
            "KV releases that waited for a place to be sent (more than 256 under way).",
            registry=self.registry,
        )
        self.prefill_disconnects = Counter(
            "pd_sidecar_prefill_disconnects",
            "Prefill calls whose client left while they ran, by what was done: abort (the "
            "call was cancelled) or finish (left to end, its KV then released).",
            ["action"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "pd_sidecar_inflight_requests",
            "Generation requests being served now.",
            registry=self.registry,
        )
        """Set from the tracker's count when ``/metrics`` is read (``sidecar.admin``),
        not counted per request."""
        self.fallbacks = Counter(
            "pd_sidecar_fallbacks",
            "Requests decoded locally although a prefill server was chosen, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.decode_ready = Gauge(
            "pd_sidecar_decode_ready",
            "1 when the last poll of the decode engine's /health succeeded (of at least one "
            "rank's, with data-parallel ranks), else 0.",
            registry=self.registry,
        )
        self.decode_rank_ready = Gauge(
            "pd_sidecar_decode_rank_ready",
            "1 when the last poll of a decode rank's /health succeeded, else 0 (it gets no "
            "requests while another rank is ready).",
            ["rank"],
            registry=self.registry,
        )
        self.decode_rank_inflight = Gauge(
            "pd_sidecar_decode_rank_inflight_requests",
            "Requests (generation and passthrough) placed on a decode rank and not finished.",
            ["rank"],
            registry=self.registry,
        )
        self.decode_rank_requests = LoopCounter(
            "pd_sidecar_decode_rank_requests",
            "Requests (generation and passthrough) sent to a decode rank.",
            ["rank"],
            registry=self.registry,
        )
        self.body_bytes = Gauge(
            "pd_sidecar_request_body_bytes",
            "Bytes of generation request bodies held now (SIDECAR_BODY_BUDGET_BYTES bounds it).",
            registry=self.registry,
        )
        self.bodies_refused = Counter(
            "pd_sidecar_request_bodies_refused",
            "Generation request bodies refused, by reason: size (413, SIDECAR_MAX_BODY_BYTES), "
            "elements (413, SIDECAR_MAX_BODY_ELEMENTS), budget (503, SIDECAR_BODY_BUDGET_BYTES).",
            ["reason"],
            registry=self.registry,
        )

        self.asyncio_tasks = Gauge(
            "pd_sidecar_asyncio_tasks",
            "asyncio tasks alive in the sidecar's event loop (a leak shows as growth).",
            registry=self.registry,
        )
        # process_resident_memory_bytes, process_open_fds, ... and python_info.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.scheduler_decisions = LoopCounter(
            "pd_sidecar_scheduler_decisions",
            "Prefill placements, by decision (remote or local) and reason.",
            ["decision", "reason"],
            registry=self.registry,
        )
        self.endpoint_reserved_tokens = Gauge(
            "pd_sidecar_prefill_endpoint_reserved_tokens",
            "Prompt tokens reserved on a prefill endpoint (all sidecars' with a shared backend).",
            ["endpoint"],
            registry=self.registry,
        )
        self.endpoint_waiting = Gauge(
            "pd_sidecar_prefill_endpoint_waiting_requests",
            "vllm:num_requests_waiting last scraped from a prefill endpoint (NaN: unknown).",
            ["endpoint"],
            registry=self.registry,
        )
        self.endpoint_healthy = Gauge(
            "pd_sidecar_prefill_endpoint_healthy",
            "1 while a prefill endpoint may be chosen; 0 when ejected, probing or draining.",
            ["endpoint"],
            registry=self.registry,
        )
        self.endpoint_ejections = Counter(
            "pd_sidecar_prefill_endpoint_ejections",
            "Times this sidecar took a healthy prefill endpoint out of service (failures in a "
            "row); a failed probe that prolongs an ejection is not counted again.",
            ["endpoint"],
            registry=self.registry,
        )
        self.prefix_error = Histogram(
            "pd_sidecar_prefill_prefix_error_tokens",
            "Prefix-cache hit the prefill prefix index predicted for a prefill, less what the "
            "engine reported (usage.prompt_tokens_details.cached_tokens), in engine tokens: "
            "positive when the endpoint held less than predicted.",
            buckets=(-16384, -4096, -1024, -256, -64, 0, 64, 256, 1024, 4096, 16384),
            registry=self.registry,
        )
        self.prefix_cached_tokens = Counter(
            "pd_sidecar_prefill_cached_tokens",
            "Prompt tokens of remote prefills found in the prefill engine's prefix cache, as "
            "predicted by the prefill prefix index and as reported by the engine (prefills "
            "whose answer said, only).",
            ["source"],
            registry=self.registry,
        )
        self.prefix_index_blocks = Gauge(
            "pd_sidecar_prefill_prefix_index_blocks",
            "Blocks held by the prefill prefix indexes (every endpoint's together).",
            registry=self.registry,
        )
        self.state_backend_errors = Counter(
            "pd_sidecar_state_backend_errors",
            "Shared-state backend failures, by kind (timeout, connection, refused, scrapes).",
            ["kind"],
            registry=self.registry,
        )
        self.state_entries_skipped = Counter(
            "pd_sidecar_state_entries_skipped",
            "Entries read back from the shared state and left out, by kind: load, speed, "
            "ejection (did not parse, or out of range), over_limit (beyond what one sync reads), "
            "prefix, wrong_type, scrape, member.",
            ["kind"],
            registry=self.registry,
        )
        self.tls_reloads = Counter(
            "pd_sidecar_tls_reloads",
            "Changes of TLS files seen, by whose files (listener: SIDECAR_TLS_CERT_FILE and "
            "_KEY_FILE; engines: the CA bundle and client certificate) and outcome (reloaded, "
            "or failed: the previous ones stay in use).",
            ["files", "outcome"],
            registry=self.registry,
        )
        self.inference_pool_addresses = Gauge(
            "pd_sidecar_inference_pool_addresses",
            "Addresses of the SIDECAR_INFERENCE_POOL's pods allowed as prefill targets now.",
            registry=self.registry,
        )
        self.inference_pool_errors = Counter(
            "pd_sidecar_inference_pool_errors",
            "Failed lists and watches of the SIDECAR_INFERENCE_POOL and its pods, by kind "
            "(unreachable, refused, expired: a 410, listed again; invalid).",
            ["kind"],
            registry=self.registry,
        )
        self.client_connections = Gauge(
            "pd_sidecar_client_connections",
            "Client connections open now, by listener (api: SIDECAR_PORT, admin: "
            "SIDECAR_ADMIN_PORT).",
            ["listener"],
            registry=self.registry,
        )
        self.client_connections_refused = Counter(
            "pd_sidecar_client_connections_refused",
            "Client connections refused over the cap (SIDECAR_MAX_CONNECTIONS), by listener and "
            "how: answered (a request other than a probe got 503) or closed (at once, unread).",
            ["listener", "how"],
            registry=self.registry,
        )
        self.client_connections_closed = Counter(
            "pd_sidecar_client_connections_closed",
            "Client connections the sidecar closed while they waited for a request head, by "
            "listener and reason: head_timeout (SIDECAR_CLIENT_HEADER_TIMEOUT_S) or evicted (the "
            "oldest waiting one, to make room for a new connection at the cap).",
            ["listener", "reason"],
            registry=self.registry,
        )

        # The families counted on every request, by their label values (``LoopCounter.labels``:
        # one dict look-up for values it has seen).
        self.requests_by = self.requests.labels
        self._phases: dict[
            tuple[str, str], tuple[tuple[Phase | None, Phase, LoopHistogramChild], ...]
        ] = {}
        """The phase histogram's children of a (decision, route): one look-up per request."""
        self.prefill_requests_by = self.prefill_requests.labels
        self.endpoint_prefills_by = self.endpoint_prefills.labels
        self.endpoint_labels = EndpointLabels(self._forget_endpoint_calls)
        self.scheduler_decisions_by = self.scheduler_decisions.labels
        self.decode_rank_requests_by = self.decode_rank_requests.labels
        self._zero_vocabularies()

    def _zero_vocabularies(self) -> None:
        for route in GENERATION_ROUTES:
            for decision in DECISIONS:
                for outcome in REQUEST_OUTCOMES:
                    self.requests_by(route, decision, outcome)
        for outcome in PREFILL_OUTCOMES:
            self.prefill_requests_by(outcome)
        for family, values in (
            (self.fallbacks, FALLBACK_REASONS),
            (self.kv_releases, KV_RELEASE_OUTCOMES),
            (self.prefill_disconnects, DISCONNECT_ACTIONS),
            (self.state_backend_errors, STATE_ERROR_KINDS),
            (self.state_entries_skipped, STATE_SKIPPED_KINDS),
            (self.inference_pool_errors, INFERENCE_POOL_ERROR_KINDS),
            (self.bodies_refused, BODY_REFUSAL_REASONS),
            (self.prefix_cached_tokens, ("predicted", "reported")),
        ):
            for value in values:
                family.labels(value)
        for listener in LISTENERS:
            for how in CONNECTION_REFUSALS:
                self.client_connections_refused.labels(listener, how)
            for reason in CONNECTION_CLOSES:
                self.client_connections_closed.labels(listener, reason)
        for files in TLS_FILES:
            for outcome in TLS_RELOAD_OUTCOMES:
                self.tls_reloads.labels(files, outcome)

    def zero_ranks(self, count: int) -> None:
        """Every decode rank's series at 0 from the start (unready until its first poll)."""
        for index in range(count):
            rank = str(index)
            self.decode_rank_ready.labels(rank).set(0)
            self.decode_rank_inflight.labels(rank).set(0)
            self.decode_rank_requests_by(rank)

    def endpoint_joined(self, endpoint: str) -> None:
        """A prefill endpoint joined the pool: its own label, its prefill counts at 0."""
        self.endpoint_labels.joined(endpoint)
        for outcome in PREFILL_OUTCOMES:
            self.endpoint_prefills_by(endpoint, outcome)

    def forget_endpoint(self, endpoint: str) -> None:
        """Drop the series of an endpoint that left the pool."""
        self.endpoint_labels.left(endpoint)
        for family in (
            self.endpoint_reserved_tokens,
            self.endpoint_waiting,
            self.endpoint_healthy,
            self.endpoint_ejections,
        ):
            with contextlib.suppress(KeyError):
                family.remove(endpoint)
        self._forget_endpoint_calls(endpoint)

    def _forget_endpoint_calls(self, endpoint: str) -> None:
        for outcome in PREFILL_OUTCOMES:
            with contextlib.suppress(KeyError):
                self.endpoint_prefills.remove(endpoint, outcome)
        with contextlib.suppress(KeyError):
            self.endpoint_prefill_duration.remove(endpoint)

    def observe_prefill(self, endpoint: str, outcome: str, seconds: float) -> None:
        """Count a prefill call that ended with ``outcome`` after ``seconds``, in all and on its
        endpoint (``str`` of it); its duration when it succeeded."""
        self.prefill_requests_by(outcome).inc()
        label = self.endpoint_labels.label(endpoint)
        self.endpoint_prefills_by(label, outcome).inc()
        if outcome == "success":
            self.endpoint_prefill_duration.labels(label).observe(seconds)

    def observe_request(self, route: str, record: RequestRecord) -> None:
        """Count a finished generation request and its phase durations."""
        decision = record.decision or "none"
        self.requests_by(route, decision, outcome_label(record)).inc()
        phases = self._phases.get((decision, route))
        if phases is None:  # its first request: its series appear
            phases = self._phases[decision, route] = tuple(
                (*DURATIONS[phase], self.phase_duration.labels(phase, decision, route))
                for phase in PHASES_BY_DECISION[decision]
            )
        # RequestRecord.durations inlined: no dict and no call per phase on the request path.
        marks = record.phases
        for start, end, child in phases:
            seconds = marks.get(end)
            if seconds is None:
                continue
            if start is not None:
                began = marks.get(start)
                if began is None:
                    continue
                seconds -= began
            child.observe(seconds)

    def observe_passthrough(self, status: int | None, cancelled: bool) -> None:
        if cancelled:
            outcome = "cancelled"
        elif status is None or status >= 500:
            outcome = "server_error"
        elif status >= 400:
            outcome = "client_error"
        else:
            outcome = "success"
        self.requests_by("other", "none", outcome).inc()

    def render(self) -> bytes:
        self.asyncio_tasks.set(len(asyncio.all_tasks()))
        return generate_latest(_WithoutCreated(self.registry))

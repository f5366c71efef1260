"""Prometheus metrics of one emulator instance, in an owned registry (never the global one).

Names follow vLLM 0.32 where vLLM has the metric; ``emulator_*`` ones are the emulator's own.
prometheus_client appends ``_total`` to counters, so counters are declared without it.
Gauges that mirror state are refreshed by :meth:`EmulatorMetrics.refresh` just before a scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sidecar.emulator.kv import KvStore

XFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
INTER_TOKEN_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
"""vLLM's buckets for ``vllm:inter_token_latency_seconds`` (``vllm/v1/metrics/loggers.py``)."""

CONTENT_TYPE = CONTENT_TYPE_LATEST


def cache_config_labels(block_size: int, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: vLLM's ``CacheConfig.metrics_info()`` is every
    field of its cache config as a string (``vllm/config/cache.py``), plus ``engine``, the
    engine index (``PrometheusStatLogger.log_metrics_info``, ``vllm/v1/metrics/loggers.py``).
    These are a few of them, with vLLM's defaults where the emulator has no such setting; the
    ones near ``block_size`` in name are there so that a reader must match names exactly."""
    return {
        "block_size": str(block_size),
        "gpu_memory_utilization": "0.92",
        "cache_dtype": "auto",
        "num_gpu_blocks_override": "None",
        "enable_prefix_caching": "True",
        "mamba_block_size": "None",
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_cpu_blocks": "None",
        "engine": "0",
    }


class EmulatorMetrics:
    def __init__(self, model_name: str, *, block_size: int, num_gpu_blocks: int) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        label = ["model_name"]
        # vLLM emulates an Info metric with a gauge set to 1 (multiprocess mode has no Info);
        # it carries no model_name label.
        info = cache_config_labels(block_size, num_gpu_blocks)
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=reg,
        ).labels(**info).set(1)
        self.running = Gauge(
            "vllm:num_requests_running", "Requests running.", label, registry=reg
        ).labels(model_name)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting for a slot.", label, registry=reg
        ).labels(model_name)
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Share of KV blocks staged or in use (0-1).",
            label,
            registry=reg,
        ).labels(model_name)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up.", label, registry=reg
        ).labels(model_name)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found cached.", label, registry=reg
        ).labels(model_name)
        self.xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Duration of a successful KV pull (decode side).",
            label,
            buckets=XFER_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.inter_token = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between a request's consecutive output tokens.",
            label,
            buckets=INTER_TOKEN_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.failed_transfers = Counter(
            "vllm:nixl_num_failed_transfers", "Failed KV pulls (decode side).", label, registry=reg
        ).labels(model_name)
        self.kv_expired = Counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Staged requests freed unpulled (prefill side).",
            label,
            registry=reg,
        ).labels(model_name)
        self.staged_requests = Gauge(
            "emulator_kv_staged_requests", "Prefill requests holding staged blocks.", registry=reg
        )
        self.staged_blocks = Gauge(
            "emulator_kv_staged_blocks", "KV blocks staged for a pull.", registry=reg
        )
        self.pulled = Counter(
            "emulator_kv_pulled_requests", "Staged requests pulled (prefill side).", registry=reg
        )
        # Counters mirrored from the KV store are advanced by the difference since last refresh.
        self._seen_expired = 0
        self._seen_pulled = 0

    def refresh(
        self,
        kv: KvStore,
        *,
        running: int,
        waiting: int,
        in_use_blocks: int,
        num_gpu_blocks: int,
        room_requests: int = 0,
        room_blocks: int = 0,
    ) -> None:
        """Bring state-mirroring series up to date (the store sweeps expiry on read).

        ``room_*``: sglang rooms computed and not yet claimed, which count as staged.
        """
        staged_blocks = kv.staged_blocks + room_blocks
        self.staged_blocks.set(staged_blocks)
        self.staged_requests.set(kv.staged_requests + room_requests)
        self.kv_expired.inc(kv.expired_total - self._seen_expired)
        self._seen_expired = kv.expired_total
        self.pulled.inc(kv.pulled_total - self._seen_pulled)
        self._seen_pulled = kv.pulled_total
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_cache_usage.set(min(1.0, (staged_blocks + in_use_blocks) / num_gpu_blocks))

    def render(self) -> bytes:
        return generate_latest(self.registry)

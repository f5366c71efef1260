"""A histogram and a counter for the request path, used by the event loop's thread only.

prometheus_client's ``Histogram.observe`` checks the child, takes two locks and walks the
buckets one by one: a request's five observations (four phases, its prefill endpoint's) were
the bulk of its metrics' cost (docs/benchmarks.md, "Metrics"). Everything that observes these
runs on the event loop, and so does ``/metrics``: a list increment found by bisection and a float
sum are enough. The exposition is prometheus_client's own (``HistogramMetricFamily``), line for
line what a ``Histogram`` with the same buckets writes (tests/test_metrics.py compares them).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

_le: Callable[[float], str] = floatToGoString  # how prometheus_client writes a bucket's bound


Child = TypeVar("Child")


class LoopHistogramChild:
    """One series: observations per bucket (not cumulative; the last is +Inf) and their sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # The first bucket whose upper bound is >= value (Prometheus' ``le``).
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class _LoopFamily(Generic[Child]):
    """What a labelled family of these does as prometheus_client's does: ``labels`` (a child
    per label values, made by ``_new_child``) and ``remove``; registered in ``registry`` as a
    collector, which ``describe``/``collect`` of the subclass write."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def _new_child(self) -> Child:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError

    def labels(self, *values: str) -> Child:
        child = self._children.get(values)  # values already strings: the request path's case
        if child is not None:
            return child
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
        key = tuple(str(value) for value in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def remove(self, *values: str) -> None:
        """Drop a series; ``KeyError`` when there is none (as prometheus_client)."""
        del self._children[tuple(str(value) for value in values)]


class LoopHistogram(_LoopFamily[LoopHistogramChild]):
    """A labelled histogram family with ``labels`` and ``remove``, as prometheus_client's, whose
    children are ``LoopHistogramChild``; registered in ``registry`` as a collector. The
    metric's ``name`` is given without a suffix."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._bounds = tuple(float(b) for b in buckets)
        self._les = [_le(b) for b in self._bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> LoopHistogramChild:
        return LoopHistogramChild(self._bounds)

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in self._children.items():
            cumulative, buckets = 0, []
            for le, count in zip(self._les, child.counts, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(values), buckets, child.sum)
        yield family


class LoopCounterChild:
    """One series of a ``LoopCounter``."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class LoopCounter(_LoopFamily[LoopCounterChild]):
    """A labelled counter family with ``labels`` and ``remove``, as prometheus_client's, whose
    children are ``LoopCounterChild``; registered in ``registry`` as a collector and written as
    prometheus_client writes a ``Counter`` (``_total`` appended to ``name``; its ``_created``
    series, which ``Metrics`` leaves out, not written)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        registry: CollectorRegistry,
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _new_child(self) -> LoopCounterChild:
        return LoopCounterChild()

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        yield family

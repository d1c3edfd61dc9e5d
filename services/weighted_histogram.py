"""`WeightedHistogram`: a Prometheus histogram whose `observe(value, count)` records `count`
observations of one value at the cost of one.

Why not prometheus_client's Histogram: it observes one value at a time, each a bucket scan and
two locked increments, and the inter-token gaps of a serving process are many per step (one per
request, several per request when tokens arrive together). This keeps only the per-bucket counts
and the sum, and exports them through prometheus_client's own collector interface, so the series
(`_bucket{le}`, `_count`, `_sum`) are exactly a Histogram's.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from typing import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class WeightedHistogram:
    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = sorted(float(b) for b in buckets) + [math.inf]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """Record `count` observations of `value` (count >= 1)."""
        index = bisect.bisect_left(self._bounds, value)  # the first bucket with value <= its bound
        with self._lock:
            self._counts[index] += count
            self._sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = itertools.accumulate(counts)
        buckets = [(floatToGoString(bound), c) for bound, c in zip(self._bounds, cumulative)]
        yield HistogramMetricFamily(self._name, self._documentation, buckets=buckets, sum_value=total)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._documentation)

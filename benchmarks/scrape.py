"""Read a server's /metrics with prometheus_client's own parser: one scraper for benchmarks,
the load-test sweep and the tests."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str) -> Iterator[Sample]:
    """Every sample of a Prometheus text exposition."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


def scrape(url: str, timeout: float = 10.0) -> str:
    """The text of `url`/metrics."""
    response = httpx.get(f"{url}/metrics", timeout=timeout)
    response.raise_for_status()
    return response.text


def value(text: str, name: str, /, default: float | None = None, **labels: str) -> float:
    """Sum of the samples called `name` (counters end in _total) whose labels include `labels`;
    `default` when there is none, or KeyError if no default is given."""
    total, found = 0.0, False
    for sample in samples(text):
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            total += sample.value
            found = True
    if not found:
        if default is None:
            raise KeyError(f"no sample {name}{labels or ''}")
        return default
    return total


def by_label(text: str, name: str, label: str, /, **labels: str) -> dict[str, float]:
    """Samples of `name` (matching `labels`) summed per value of `label`."""
    out: dict[str, float] = {}
    for sample in samples(text):
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            key = sample.labels.get(label, "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def histogram(text: str, name: str, **labels: str) -> list[tuple[float, float]]:
    """(upper bound, count in that bucket) of histogram `name` — per bucket, not cumulative."""
    cumulative: dict[float, float] = {}
    for sample in samples(text):
        if sample.name == f"{name}_bucket" and all(
            sample.labels.get(k) == v for k, v in labels.items()
        ):
            bound = float(sample.labels["le"])
            cumulative[bound] = cumulative.get(bound, 0.0) + sample.value
    buckets, below = [], 0.0
    for bound in sorted(cumulative):
        buckets.append((bound, cumulative[bound] - below))
        below = cumulative[bound]
    return buckets


def mean(text: str, name: str, **labels: str) -> float:
    """A histogram's mean (`_sum / _count`), NaN when it has no observations."""
    count = value(text, f"{name}_count", default=0.0, **labels)
    return value(text, f"{name}_sum", default=0.0, **labels) / count if count else math.nan

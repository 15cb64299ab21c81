"""What a scrape of /metrics reads: one registry, or with `--workers` every process's values
merged from PROMETHEUS_MULTIPROC_DIR, in the format the scraper asks for; and the supervisor's
clean-up of a child's live gauges when it exits (service.runtime.metrics defines the families)."""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.exposition import choose_encoder


def exposition(registry: CollectorRegistry | None, accept: str = "") -> tuple[bytes, str]:
    """`registry` (None: every process's values merged, read afresh) as OpenMetrics, which
    carries exemplars, when the Accept header asks for it as Prometheus does; else in the
    Prometheus text format."""
    if registry is None:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    if "application/openmetrics-text" in accept:
        encoder, content_type = choose_encoder(accept)
        return encoder(registry), content_type
    return generate_latest(registry), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int, directory: str | os.PathLike[str] | None = None) -> None:
    """Drop the live* gauge values of exited process `pid` (the supervisor calls it per child);
    `directory` defaults to PROMETHEUS_MULTIPROC_DIR, read now; a no-op when neither is set."""
    directory = directory or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        multiprocess.mark_process_dead(pid, os.fspath(directory))

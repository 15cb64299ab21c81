"""Prometheus metrics (prefix `mha_`), one registry per app, plus the process collectors.

Labels stay low-cardinality: model, endpoint, protocol, HTTP status code, failure reason.
One uvicorn worker per device is the deployment model (one batcher, one copy of the weights),
so a plain per-process registry is exact; several workers would need prometheus-client's
multiprocess mode.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    gc_collector,
    generate_latest,
    platform_collector,
    process_collector,
)

# Latency buckets: a T=16 forward takes ~0.2 ms on CPU, a full batch of long sequences
# seconds; requests add queue wait and HTTP. 0.25 ms .. 20 s, about 2x apart.
LATENCY_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
)  # fmt: skip
# Codec work is smaller: JSON of a few KB to a few MB.
CODEC_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
BATCH_SEQ_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)

FAILURE_REASONS = (
    "bad_input", "not_found", "overloaded", "timeout", "inference_error", "disconnected",
    "unavailable", "unauthorized", "forbidden",
)  # fmt: skip


class Metrics:
    """All of the service's metric families; `model` is bound once, the other labels per call."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r = self.registry
        process_collector.ProcessCollector(registry=r)
        platform_collector.PlatformCollector(registry=r)
        gc_collector.GCCollector(registry=r)

        self.requests = Counter(
            "mha_requests", "HTTP requests answered, by endpoint and status code.",
            ["model", "endpoint", "status"], registry=r,
        )  # fmt: skip
        self.failures = Counter(
            "mha_request_failures", "Requests that failed, by reason.",
            ["model", "endpoint", "reason"], registry=r,
        )  # fmt: skip
        self.request_duration = Histogram(
            "mha_request_duration_seconds", "End-to-end request time inside the server.",
            ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "mha_queue_wait_seconds", "Time a request waited in the batcher queue.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_compute = Histogram(
            "mha_batch_compute_seconds", "Time of one batched forward (incl. tensor copies).",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode = Histogram(
            "mha_request_decode_seconds", "Time to parse and validate a request body.",
            ["model", "protocol"], buckets=CODEC_BUCKETS, registry=r,
        )  # fmt: skip
        self.encode = Histogram(
            "mha_request_encode_seconds", "Time to serialise a response body.",
            ["model", "protocol"], buckets=CODEC_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_sequences = Histogram(
            "mha_batch_size_sequences", "Sequences per forward.",
            ["model"], buckets=BATCH_SEQ_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_tokens = Histogram(
            "mha_batch_size_tokens", "Tokens per forward.",
            ["model"], buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.sequence_length = Histogram(
            "mha_request_sequence_length", "Query length (tokens) of each sequence received.",
            ["model"], buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.padding_ratio = Histogram(
            "mha_batch_padding_ratio",
            "Padded tokens / computed tokens per forward (the engine packs sequences, so 0).",
            ["model"], buckets=RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth_gauge = Gauge(
            "mha_queue_depth_sequences", "Sequences waiting in the batcher queue.",
            ["model"], registry=r,
        )  # fmt: skip
        self.queue_capacity = Gauge(
            "mha_queue_capacity_sequences", "The queue's bound (--max-queue).",
            ["model"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "mha_requests_in_flight", "Inference requests being handled.",
            ["model"], registry=r,
        )  # fmt: skip
        self.engine_busy = Gauge(
            "mha_engine_busy", "1 while the engine thread runs a forward.", ["model"], registry=r
        )
        self.ready = Gauge("mha_ready", "1 when ready to serve.", ["model"], registry=r)
        self.info = Info("mha_model", "The served model.", registry=r)
        self.sequences = Counter(
            "mha_sequences_processed", "Sequences computed.", ["model"], registry=r
        )
        self.tokens = Counter("mha_tokens_processed", "Tokens computed.", ["model"], registry=r)
        self.batches = Counter(
            "mha_batches", "Forwards run, by outcome.", ["model", "outcome"], registry=r
        )
        for reason in FAILURE_REASONS:
            self.failures.labels(model, "infer", reason)  # expose zeros so rate() has a series
        for outcome in ("ok", "error"):
            self.batches.labels(model, outcome)
        self.ready.labels(model).set(0)
        self.queue_depth_gauge.labels(model).set(0)
        self.in_flight.labels(model).set(0)
        self.engine_busy.labels(model).set(0)
        if torch.cuda.is_available():  # not verified on a GPU: these machines have none
            self._add_cuda_gauges()

    def _add_cuda_gauges(self) -> None:
        allocated = Gauge(
            "mha_cuda_memory_allocated_bytes", "torch.cuda.memory_allocated().",
            ["model"], registry=self.registry,
        )  # fmt: skip
        reserved = Gauge(
            "mha_cuda_memory_reserved_bytes", "torch.cuda.memory_reserved().",
            ["model"], registry=self.registry,
        )  # fmt: skip
        allocated.labels(self.model).set_function(torch.cuda.memory_allocated)
        reserved.labels(self.model).set_function(torch.cuda.memory_reserved)

    # -- request side -----------------------------------------------------------------------
    def set_model_info(self, info: dict[str, Any]) -> None:
        self.info.info({k: str(v) for k, v in info.items()})

    def request_done(self, endpoint: str, status: int, seconds: float, reason: str | None) -> None:
        self.requests.labels(self.model, endpoint, str(status)).inc()
        self.request_duration.labels(self.model, endpoint).observe(seconds)
        if reason is not None:
            self.failures.labels(self.model, endpoint, reason).inc()

    def sequences_received(self, lengths: list[int]) -> None:
        hist = self.sequence_length.labels(self.model)
        for length in lengths:
            hist.observe(length)

    # -- batcher side (BatchObserver) -------------------------------------------------------
    def queue_depth(self, sequences: int) -> None:
        self.queue_depth_gauge.labels(self.model).set(sequences)

    def batch_started(self, works: list[Any]) -> None:
        self.engine_busy.labels(self.model).set(1)

    def expired(self, work: Any) -> None:
        self.queue_wait.labels(self.model).observe(time.monotonic() - work.enqueued_at)

    def batch_done(self, works: list[Any], compute_s: float, ok: bool) -> None:
        self.engine_busy.labels(self.model).set(0)
        self.batches.labels(self.model, "ok" if ok else "error").inc()
        if not ok:
            return
        seqs = sum(w.payload.num_sequences for w in works)
        tokens = sum(w.payload.num_tokens for w in works)
        self.batch_compute.labels(self.model).observe(compute_s)
        self.batch_sequences.labels(self.model).observe(seqs)
        self.batch_tokens.labels(self.model).observe(tokens)
        self.padding_ratio.labels(self.model).observe(0.0)
        self.sequences.labels(self.model).inc(seqs)
        self.tokens.labels(self.model).inc(tokens)
        wait = self.queue_wait.labels(self.model)
        for work in works:
            wait.observe(work.started_at - work.enqueued_at)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

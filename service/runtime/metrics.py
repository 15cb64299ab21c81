"""Prometheus metrics (prefix `mha_`): one registry per app plus the process collectors, or
with `--workers` one exposition merged over the server's processes.

Labels stay low-cardinality: model and version (every per-model series carries both, so
queries by `model` alone still match, summing over versions), endpoint, protocol, HTTP status
code (or its class), failure reason, batch outcome. Request families carry `protocol` ("http"
or "grpc"); a gRPC call's `status` is the HTTP status of the same outcome
(service.grpc.status), so status-class panels and alerts cover both listeners.

One process (the default) uses a plain per-process registry. With `--workers N` (one engine
process, N front-ends) the supervisor sets PROMETHEUS_MULTIPROC_DIR for every child, and
prometheus-client's multiprocess mode takes over: each process writes its values to files
there, and a scrape of any front-end merges them (MultiProcessCollector), so /metrics shows
the whole server: counters and histograms summed over processes, gauges per their
`multiprocess_mode` (chosen per family below). What that mode lacks: the process_*, python_gc_*
and python_info families (each describes one process, and a scrape would show whichever
front-end answered), the `*_created` series, and the CUDA memory gauges (read at scrape time
in the engine process, which no scrape reaches). The supervisor calls `mark_process_dead` for
each child that exits, so the live* gauges of dead processes vanish; their counters stay
counted. One `Metrics` object per process there (its `for_model` views are fine): two objects
with the same series in one process would overwrite each other's values.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    gc_collector,
    platform_collector,
    process_collector,
)

from service.runtime.cuda_gauges import CudaGauges
from service.runtime.exposition import exposition
from service.runtime.response_cache import CacheMetrics

# Buckets are chosen for this workload. Latency: a T=16 forward takes ~0.2 ms on CPU, a full
# batch of long sequences seconds; requests add queue wait (default batch delay 2 ms) and HTTP.
# 0.25 ms .. 20 s, 1.3-2.5x apart, densest at 1-50 ms where a healthy service sits, so p99 is
# interpolated inside a narrow bucket.
LATENCY_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
)  # fmt: skip
# Codec work is smaller: binary bodies of a few KB take tens of µs, JSON of a few MB ~1 s.
CODEC_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
# Sequences per forward: --max-batch-size defaults to 32; finer steps where batches usually are.
BATCH_SEQ_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
# Tokens (per sequence or per forward): powers of two up to 4x the default --max-batch-tokens.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# A fraction in [0, 1]; 0.0 is its own bucket because the packed engine never pads.
RATIO_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)

FAILURE_REASONS = (
    "bad_input", "not_found", "overloaded", "timeout", "inference_error", "client_disconnected",
    "unavailable", "unauthorized", "forbidden",
)  # fmt: skip
PROTOCOLS = ("http", "grpc")  # the `protocol` label of the request families
# The keys of the mha_model_info series besides model and version (service.runtime.loading's
# model_info builds them); fixed because a multiprocess gauge's label names are.
MODEL_INFO_LABELS = (
    "name", "architecture", "embed_dim", "num_heads", "num_layers", "dtype", "device",
    "sdpa_backend", "cpu_capability",
)  # fmt: skip

# Set by the --workers supervisor for each child before it imports anything (prometheus-client
# reads it at import too).
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

log = logging.getLogger(__name__)


_REQUEST_DONE = object()  # Metrics._children key: a request outcome's two series


class Metrics:
    """All of the service's metric families; `model` and `version` are bound once per view, the
    other labels per call."""

    def __init__(self, model: str, version: str = "1") -> None:
        self.model = model
        self.version = version
        self.registry = CollectorRegistry()
        r = self.registry
        if not MULTIPROCESS:  # per-process facts: see the module docstring
            process_collector.ProcessCollector(registry=r)
            platform_collector.PlatformCollector(registry=r)
            gc_collector.GCCollector(registry=r)

        self.requests = Counter(
            "mha_requests", "Requests answered, by endpoint, status code and protocol.",
            ["model", "version", "endpoint", "status", "protocol"], registry=r,
        )  # fmt: skip
        self.failures = Counter(
            "mha_request_failures", "Requests that failed, by reason.",
            ["model", "version", "endpoint", "reason", "protocol"], registry=r,
        )  # fmt: skip
        # status_class (2xx/4xx/5xx) keeps fast rejections out of the success percentiles.
        self.request_duration = Histogram(
            "mha_request_duration_seconds",
            "End-to-end request time inside the server, by status class (2xx, 4xx, 5xx).",
            ["model", "version", "endpoint", "status_class", "protocol"], buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "mha_queue_wait_seconds", "Time a request waited in the batcher queue.",
            ["model", "version"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_compute = Histogram(
            "mha_batch_compute_seconds", "Time of one batched forward (incl. tensor copies).",
            ["model", "version"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode = Histogram(
            "mha_request_decode_seconds", "Time to parse and validate a request body.",
            ["model", "version", "protocol"], buckets=CODEC_BUCKETS, registry=r,
        )  # fmt: skip
        self.encode = Histogram(
            "mha_request_encode_seconds", "Time to serialise a response body.",
            ["model", "version", "protocol"], buckets=CODEC_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_sequences = Histogram(
            "mha_batch_size_sequences", "Sequences per forward.",
            ["model", "version"], buckets=BATCH_SEQ_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_tokens = Histogram(
            "mha_batch_size_tokens", "Tokens per forward.",
            ["model", "version"], buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.sequence_length = Histogram(
            "mha_request_sequence_length", "Query length (tokens) of each sequence received.",
            ["model", "version"], buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        # Kept for dashboards shared with padded servers: the engine packs a batch's sequences
        # end to end and groups attention by exact length, so it computes no padding (always 0).
        self.padding_ratio = Histogram(
            "mha_batch_padding_ratio",
            "Padded tokens / computed tokens per forward (the engine packs sequences, so 0).",
            ["model", "version"], buckets=RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        # Gauge modes matter only in multiprocess mode; live* drop a process's value once
        # mark_process_dead(pid) runs. Every process zeroes its series (_zero_series), which
        # neither sums nor maxima notice.
        # Only the process holding the batcher (the engine) sets a non-zero depth: summed.
        self.queue_depth_gauge = Gauge(
            "mha_queue_depth_sequences",
            "Sequences waiting in the batcher queue (and /v1/embeddings inputs being tokenized).",
            ["model", "version"], registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        # The same bound wherever it is set: the largest live one.
        self.queue_capacity = Gauge(
            "mha_queue_capacity_sequences", "The queue's bound (--max-queue).",
            ["model", "version"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        # Each front-end counts the requests it handles: summed.
        self.in_flight = Gauge(
            "mha_requests_in_flight", "Inference requests being handled.",
            ["model", "version"], registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        # Only the engine process runs forwards (one engine thread per model version): summed.
        self.engine_busy = Gauge(
            "mha_engine_busy",
            "Batches the engine is running: 0 or 1 (up to 2 with --cuda-overlap).",
            ["model", "version"],
            registry=r,
            multiprocess_mode="livesum",
        )
        # 1 when any live process says the model version is ready: the engine after warm-up,
        # front-ends as they learn it; a front-end still at its start-up 0 does not hide the
        # engine's 1, and a dead process's stale 1 vanishes (mark_process_dead). A sum would
        # count processes; a minimum would stay 0 while any process has not published.
        self.ready = Gauge(
            "mha_ready", "1 when ready to serve.", ["model", "version"], registry=r,
            multiprocess_mode="livemax",
        )  # fmt: skip
        info_help = (
            "A served model: name, architecture, embed_dim, num_heads, dtype, device, SDPA backend."
        )
        if MULTIPROCESS:
            # Info has no multiprocess support: the same series (name, labels, value 1, type
            # gauge in this text format) from a gauge; the max, as several processes may set it,
            # and live, so it goes with the process (the engine) that loaded the model.
            self.info: Info | Gauge = Gauge(
                "mha_model_info", info_help, ["model", "version", *MODEL_INFO_LABELS],
                registry=r, multiprocess_mode="livemax",
            )  # fmt: skip
        else:
            self.info = Info("mha_model", info_help, ["model", "version"], registry=r)
        self.sequences = Counter(
            "mha_sequences_processed", "Sequences computed.", ["model", "version"], registry=r
        )
        self.tokens = Counter(
            "mha_tokens_processed", "Tokens computed.", ["model", "version"], registry=r
        )
        self.batches = Counter(
            "mha_batches", "Forwards run, by outcome.", ["model", "version", "outcome"], registry=r
        )
        self.loop_batches = Counter(
            "mha_event_loop_batches",
            "Of mha_batches_total, those run on the event loop itself (--loop-batch-max-ms).",
            ["model", "version"], registry=r,
        )  # fmt: skip
        self._cuda = CudaGauges(r, MULTIPROCESS)  # shared by every model's view (one registry)
        self.cache = CacheMetrics(r)  # the response cache's families
        # label children looked up once (keys carry the model: shared by every view is fine)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._zero_series()

    def for_model(self, model: str, version: str = "1") -> Metrics:
        """The same families and registry with `model` and `version` bound to another served
        model version."""
        view = copy.copy(self)
        view.model, view.version = model, version
        view._zero_series()
        return view

    def _zero_series(self) -> None:
        """Expose the model's series at 0 so rate() and dashboards have them from the start."""
        model, version = self.model, self.version
        for reason in FAILURE_REASONS:
            for protocol in PROTOCOLS:
                self.failures.labels(model, version, "infer", reason, protocol)
        for outcome in ("ok", "error"):
            self.batches.labels(model, version, outcome)
        self.loop_batches.labels(model, version)
        for result in ("hit", "miss"):
            self.cache.lookups.labels(model, version, result)
        self.ready.labels(model, version).set(0)
        self.queue_depth_gauge.labels(model, version).set(0)
        self.in_flight.labels(model, version).set(0)
        self.engine_busy.labels(model, version).set(0)

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once: labels() takes a lock and builds a key on
        every call, which adds up to tens of µs per request over the request path."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:  # a race only creates the same child twice: labels() is idempotent
            found = self._children[key] = metric.labels(*labels)
        return found

    def set_cuda_engine(self, model: Any) -> None:
        """The engine gauges of this model version on CUDA (cuda_gauges.CudaGauges.add_engine)."""
        self._cuda.add_engine(self.model, self.version, model)

    # -- request side -----------------------------------------------------------------------
    def cache_lookups(self, hits: int, misses: int) -> None:
        """Response cache look-ups for this model version."""
        for result, count in (("hit", hits), ("miss", misses)):
            if count:
                self.child(self.cache.lookups, self.model, self.version, result).inc(count)

    def set_model_info(self, info: dict[str, Any]) -> None:
        """Publish mha_model_info (with a `model` label to join on); on CUDA, add memory gauges.
        `info` has exactly the MODEL_INFO_LABELS keys."""
        if set(info) != set(MODEL_INFO_LABELS):
            raise ValueError(
                f"model info keys {sorted(info)} differ from MODEL_INFO_LABELS "
                f"{sorted(MODEL_INFO_LABELS)}: change both together"
            )
        labels = {k: str(v) for k, v in info.items()}
        if isinstance(self.info, Info):
            self.info.labels(self.model, self.version).info(labels)
        else:
            values = [labels[k] for k in MODEL_INFO_LABELS]
            self.info.labels(self.model, self.version, *values).set(1)
        device = str(info.get("device", ""))
        if device.startswith("cuda"):
            self._cuda.add_memory(self.model, self.version, device)

    def set_ready(self, ready: bool) -> None:
        self.child(self.ready, self.model, self.version).set(1 if ready else 0)

    def remove_state_series(self) -> None:
        """Drop this model version's state gauges (mha_ready, mha_model_info, queue, in-flight,
        engine busy, CUDA memory) once an explicit unload has drained it: an unloaded model is
        not a model that is not ready, so MHANotReady and the panels must not see it. Counters
        and histograms stay (rate() over the past keeps working). Multiprocess gauges cannot be
        removed, but explicit model control needs --workers 1, so that case only zeroes ready."""
        if MULTIPROCESS:
            self.set_ready(False)
            return
        key = (self.model, self.version)
        state = [self.ready, self.info, self.queue_depth_gauge, self.queue_capacity]
        for metric in [*state, self.in_flight, self.engine_busy, *self._cuda.families()]:
            # prometheus_client lists a family's children only in its private _metrics; each
            # starts with the (model, version) labels.
            for labels in [labels for labels in list(metric._metrics) if labels[:2] == key]:
                metric.remove(*labels)
        for cached in [k for k in list(self._children) if k[1][:2] == key]:
            self._children.pop(cached, None)  # a reload creates fresh children

    def set_queue_capacity(self, sequences: int) -> None:
        self.child(self.queue_capacity, self.model, self.version).set(sequences)

    @property
    def in_flight_child(self) -> Any:
        """This view's mha_requests_in_flight series."""
        return self.child(self.in_flight, self.model, self.version)

    def request_done(
        self,
        endpoint: str,
        status: int,
        seconds: float,
        reason: str | None,
        protocol: str = "http",
        trace_id: str | None = None,
    ) -> None:
        """One answered request; a traced one's duration carries its trace id as an exemplar
        (OpenMetrics exposition; not with --workers, whose merged exposition has none)."""
        # Both series of this outcome in one look-up, kept with the label children (so
        # remove_state_series forgets them with the model's): this runs on every request.
        key = (_REQUEST_DONE, (self.model, self.version, endpoint, status, protocol))
        pair = self._children.get(key)
        if pair is None:
            status_class = f"{status // 100}xx"
            labels = (self.model, self.version, endpoint)
            pair = self._children[key] = (
                self.child(self.requests, *labels, str(status), protocol),
                self.child(self.request_duration, *labels, status_class, protocol),
            )
        pair[0].inc()
        if trace_id is None or MULTIPROCESS:
            pair[1].observe(seconds)
        else:
            pair[1].observe(seconds, {"trace_id": trace_id})
        if reason is not None:
            self.child(self.failures, self.model, self.version, endpoint, reason, protocol).inc()

    def sequences_received(self, lengths: list[int]) -> None:
        hist = self.child(self.sequence_length, self.model, self.version)
        for length in lengths:
            hist.observe(length)

    def codec(self, histogram: Histogram, protocol: str, seconds: float) -> None:
        """Observe decode or encode time."""
        self.child(histogram, self.model, self.version, protocol).observe(seconds)

    # -- batcher side (BatchObserver) -------------------------------------------------------
    def queue_depth(self, sequences: int) -> None:
        self.child(self.queue_depth_gauge, self.model, self.version).set(sequences)

    def batch_started(self, works: list[Any]) -> None:
        self.child(self.engine_busy, self.model, self.version).inc()

    def expired(self, work: Any) -> None:
        wait = self.child(self.queue_wait, self.model, self.version)
        wait.observe(time.monotonic() - work.enqueued_at)

    def batch_done(self, works: list[Any], compute_s: float, ok: bool) -> None:
        self.child(self.engine_busy, self.model, self.version).dec()
        self.child(self.batches, self.model, self.version, "ok" if ok else "error").inc()
        wait = self.child(self.queue_wait, self.model, self.version)
        if not ok:
            # A failed batch of several requests is retried one request at a time, which
            # reports again; a failed single request reports its wait now, once.
            if len(works) == 1:
                wait.observe(works[0].started_at - works[0].enqueued_at)
            return
        seqs = sum(w.sequences for w in works)
        tokens = sum(w.tokens for w in works)
        self.child(self.batch_compute, self.model, self.version).observe(compute_s)
        self.child(self.batch_sequences, self.model, self.version).observe(seqs)
        self.child(self.batch_tokens, self.model, self.version).observe(tokens)
        self.child(self.padding_ratio, self.model, self.version).observe(0.0)
        self.child(self.sequences, self.model, self.version).inc(seqs)
        self.child(self.tokens, self.model, self.version).inc(tokens)
        for work in works:
            wait.observe(work.started_at - work.enqueued_at)

    def batch_on_loop(self) -> None:
        self.child(self.loop_batches, self.model, self.version).inc()

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """This process's registry, or in multiprocess mode every process's values merged, in
        the format `accept` asks for (service.runtime.exposition)."""
        return exposition(None if MULTIPROCESS else self.registry, accept)

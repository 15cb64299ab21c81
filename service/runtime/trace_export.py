"""Traced requests exported as OpenTelemetry spans over OTLP (HTTP/protobuf or gRPC) by the
OpenTelemetry SDK's exporters, from a thread of their own: the event loop only queues a
finished Trace (about a microsecond); the thread turns it into the SDK's span records (a SERVER
span and its steps) and sends them in batches. When the collector is slow or down, traces past
the queue's bound are dropped (counted in the log at shutdown), never waited for.

The SDK is an optional dependency (`pip install 'mha-serve[tracing]'`), imported only when
--otlp-endpoint is set. The exporters' OTEL_EXPORTER_OTLP_* variables (headers, certificates,
timeout, compression) and OTEL_RESOURCE_ATTRIBUTES apply, and the batch processor's
OTEL_BSP_SCHEDULE_DELAY, OTEL_BSP_MAX_QUEUE_SIZE and OTEL_BSP_MAX_EXPORT_BATCH_SIZE bound this
thread the same way.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from service import __version__

if TYPE_CHECKING:
    from service.runtime.tracing import Trace

log = logging.getLogger("service.tracing")

MISSING = (
    "--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporters: "
    "pip install 'mha-serve[tracing]'"
)


def traces_url(endpoint: str, protocol: str) -> str:
    """The exporter's URL: OTLP/HTTP's base URL gets the signal path (/v1/traces) when it has
    none, as OTEL_EXPORTER_OTLP_ENDPOINT does; gRPC takes host:port as given. ValueError for an
    endpoint that is not an http(s) URL."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--otlp-endpoint must be an http:// or https:// URL (e.g. http://collector:4318 "
            f"for OTLP/HTTP, http://collector:4317 with --otlp-protocol grpc), got {endpoint!r}"
        )
    if protocol == "http/protobuf" and parts.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def exporter_class(protocol: str) -> Any:
    """The SDK's OTLPSpanExporter for `protocol`; RuntimeError saying how to install it."""
    transport = "grpc" if protocol == "grpc" else "http"
    try:
        importlib.import_module("opentelemetry.sdk.trace")
        module = importlib.import_module(
            f"opentelemetry.exporter.otlp.proto.{transport}.trace_exporter"
        )
    except ImportError as exc:
        raise RuntimeError(f"{MISSING} ({exc})") from None
    return module.OTLPSpanExporter


def _env_int(name: str, default: int, least: int = 1) -> int:
    try:
        return max(least, int(os.environ.get(name, default)))
    except ValueError:
        return default


class OtlpSink:
    """Queues finished Traces (from the event loop) and exports them as spans from its thread."""

    def __init__(
        self, endpoint: str, protocol: str = "http/protobuf", service_name: str | None = None
    ):
        exporter = exporter_class(protocol)
        from opentelemetry import trace as api
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.api, self.span_record = api, ReadableSpan
        self.url = traces_url(endpoint, protocol)
        self.exporter = exporter(endpoint=self.url)
        # --otlp-service-name, else OTEL_SERVICE_NAME (the OpenTelemetry operator sets it)
        name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "mha-serve"
        self.resource = Resource.create({"service.name": name, "service.version": __version__})
        self.scope = InstrumentationScope("mha-serve", __version__)
        self.delay_s = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000, least=10) / 1000
        self.max_queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.batch_spans = _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
        self.queue: collections.deque[Trace] = collections.deque()
        self.dropped = 0
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self.thread.start()

    # -- event loop --------------------------------------------------------------------------
    def write(self, trace: Trace) -> None:
        """Queue a finished trace (dropped, and counted, when the queue is full)."""
        if len(self.queue) >= self.max_queue:
            self.dropped += 1
            if self.dropped % 1000 == 1:  # the first, then one line per thousand
                log.warning(
                    "trace queue full (%d): %d traces dropped so far; the collector at %s is "
                    "slow or down", self.max_queue, self.dropped, self.url,
                )  # fmt: skip
            return
        self.queue.append(trace)
        if len(self.queue) * 5 >= self.batch_spans:  # ~5 spans a trace: a batch is ready
            self.wake.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, waiting at most `timeout` seconds in all (a collector that is
        down does not hold the server's stop); then stop the exporter, which ends a retry still
        sleeping (on a thread of its own, inside the same bound: some SDK versions wait for
        the export in progress)."""
        deadline = time.monotonic() + timeout
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout)
        unsent = len(self.queue)
        self.queue.clear()  # what the thread has not taken by now is not sent
        closing = threading.Thread(target=self.exporter.shutdown, name="otlp-close", daemon=True)
        closing.start()
        closing.join(max(0.0, deadline - time.monotonic()))
        if self.dropped or unsent:
            log.warning("%d traces dropped (queue full or collector too slow), %d unsent",
                        self.dropped, unsent)  # fmt: skip

    # -- export thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            stopping = self.stopping
            if not stopping:
                self.wake.wait(self.delay_s)
                self.wake.clear()
            try:
                self._send()
            except Exception:  # one bad trace must not end the thread: the next pass goes on
                log.exception("building or sending spans failed; the traces taken are lost")
            if stopping:
                return

    def _send(self) -> None:
        batch: list[Any] = []
        while self.queue:
            batch += self._records(self.queue.popleft())
            if len(batch) >= self.batch_spans:
                self._export(batch)
                batch = []
        if batch:
            self._export(batch)

    def _export(self, spans: list[Any]) -> None:
        try:
            self.exporter.export(spans)  # the SDK logs a failed export itself
        except Exception:
            log.exception("exporting %d spans to %s failed", len(spans), self.url)

    def _context(self, trace_id: int, state: Any, span_id: int | None = None) -> Any:
        api = self.api
        span_id = span_id or random.getrandbits(64) or 1
        flags = api.TraceFlags(api.TraceFlags.SAMPLED)
        return api.SpanContext(trace_id, span_id, False, flags, state)

    def _records(self, trace: Trace) -> list[Any]:
        """The trace's SERVER span (child of the caller's, if any) and its steps' spans."""
        api, record = self.api, self.span_record
        parent = state = None
        if trace.parent is not None:
            p = trace.parent
            state = api.TraceState.from_header([p.tracestate]) if p.tracestate else None
            flags = api.TraceFlags(api.TraceFlags.SAMPLED)
            parent = api.SpanContext(p.trace_id, p.span_id, True, flags, state)
        trace_id = trace.trace_id  # the caller's, or its own (tracing.Trace)
        root = self._context(trace_id, state, trace.span_id)  # the caller's tracestate goes on
        attributes = dict(trace.attributes)
        status = api.Status(api.StatusCode.UNSET)
        if trace.error is not None:
            reason, message, kind = trace.error
            attributes["error.type"] = reason
            attributes["exception.type"] = kind
            status = api.Status(api.StatusCode.ERROR, message)
        common = {"resource": self.resource, "instrumentation_scope": self.scope}
        records = [
            record(trace.name, root, parent, attributes=attributes, kind=api.SpanKind.SERVER,
                   status=status, start_time=trace.ns(trace.start),
                   end_time=trace.ns(trace.end_s), **common)
        ]  # fmt: skip
        for name, start, end, values in trace.steps:
            records.append(
                record(name, self._context(trace_id, state), root, attributes=values,
                       start_time=trace.ns(start), end_time=trace.ns(end), **common)
            )  # fmt: skip
        return records

"""Traced requests as OpenTelemetry spans, exported over OTLP (HTTP/protobuf or gRPC) by the
OpenTelemetry SDK's batch processor, on its own thread: a request never waits for the collector.
The SDK is an optional dependency (`pip install 'mha-serve[tracing]'`), imported only when
--otlp-endpoint is set. The SDK's own OTEL_EXPORTER_OTLP_* variables (headers, certificates,
timeout, compression) and OTEL_RESOURCE_ATTRIBUTES apply; OTEL_BSP_* tune the batching.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from service import __version__

if TYPE_CHECKING:
    from service.runtime.tracing import Trace

PROTOCOLS = ("http/protobuf", "grpc")
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


class OtlpSink:
    """Writes each Trace as a SERVER span with its steps as children, and exports them."""

    def __init__(self, endpoint: str, protocol: str = "http/protobuf", service_name: str = ""):
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON

            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
        except ImportError as exc:
            raise RuntimeError(f"{MISSING} ({exc})") from None
        from opentelemetry import trace as api

        url = traces_url(endpoint, protocol)
        resource = Resource.create(
            {"service.name": service_name or "mha-serve", "service.version": __version__}
        )
        # Which requests are traced is decided before a Trace exists (tracing.TraceControl)
        self.provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self.tracer = self.provider.get_tracer("mha-serve", __version__)
        self.api = api
        self.url = url

    def _parent_context(self, trace: Trace) -> Any:
        api = self.api
        parent = trace.parent
        if parent is None:
            return None
        state = api.TraceState.from_header([parent.tracestate]) if parent.tracestate else None
        context = api.SpanContext(
            parent.trace_id,
            parent.span_id,
            is_remote=True,
            trace_flags=api.TraceFlags(api.TraceFlags.SAMPLED),
            trace_state=state,
        )
        return api.set_span_in_context(api.NonRecordingSpan(context))

    def write(self, trace: Trace) -> None:
        api = self.api
        root = self.tracer.start_span(
            trace.name,
            context=self._parent_context(trace),
            kind=api.SpanKind.SERVER,
            attributes=trace.attributes,
            start_time=trace.ns(trace.start),
        )
        inside = api.set_span_in_context(root)
        for name, start, end, attributes in trace.steps:
            step = self.tracer.start_span(
                name, context=inside, attributes=attributes, start_time=trace.ns(start)
            )
            step.end(end_time=trace.ns(end))
        if trace.error is not None:
            reason, message = trace.error
            root.set_attribute("error.type", reason)
            root.set_status(api.Status(api.StatusCode.ERROR, message))
        root.end(end_time=trace.ns(trace.end_s))

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what is queued, within the exporter's timeout

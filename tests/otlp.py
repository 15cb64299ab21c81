"""An OTLP trace endpoint for tests: real OTLP/HTTP and OTLP/gRPC servers on loopback that decode
the export requests the server's exporter sends (tests/service/test_tracing.py,
tests/deploy/test_tracing_nginx.py)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Collector:
    """An OTLP trace endpoint on loopback, OTLP/HTTP (`url`) or OTLP/gRPC (`grpc_url`): the
    spans of each export request it is sent, decoded, in a queue (a trace's spans always travel
    in one export request, and traces in the order their requests ended)."""

    def __init__(self) -> None:
        self.exports: queue.Queue = queue.Queue()
        exports = self.exports

        def keep(export: trace_service_pb2.ExportTraceServiceRequest) -> None:
            exports.put(
                [
                    (resource.resource, span)
                    for resource in export.resource_spans
                    for scope in resource.scope_spans
                    for span in scope.spans
                ]
            )

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                keep(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                keep(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.grpc_server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), self.grpc_server)
        self.grpc_url = f"http://127.0.0.1:{self.grpc_server.add_insecure_port('127.0.0.1:0')}"
        self.grpc_server.start()

    def trace(self, root_name: str, count: int, timeout: float = 15.0) -> dict[bytes, list]:
        """Spans until `count` traces with a root named `root_name` have arrived, by span id of
        the root: {root id: [root, *its steps]}."""
        got: list = []
        while True:
            roots = [s for _, s in got if s.name == root_name]
            done = {
                r.span_id: [r, *(s for _, s in got if s.parent_span_id == r.span_id)] for r in roots
            }
            if len(done) >= count:
                return done
            try:
                got += self.exports.get(timeout=timeout)
            except queue.Empty:
                names = sorted(s.name for _, s in got)
                message = f"{len(done)} of {count} '{root_name}' traces; got {names}"
                raise AssertionError(message) from None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.grpc_server.stop(None)


def attributes(span) -> dict:
    values = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        values[kv.key] = getattr(kv.value, kind)
    return values

"""An OTLP/HTTP trace endpoint that counts the spans it is sent and throws them away: the other
end of `--otlp-endpoint` for benchmarks (what a traced request costs the server, not the
collector).

`python -m benchmarks.otlp_sink --port 4318 --seconds 600` (stops by itself; prints the spans
and export requests received). Then e.g. `python -m benchmarks.alternate --root . --case tiny
--variant '' --variant '--otlp-endpoint http://127.0.0.1:4318 --trace-rate 1'`.
"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--seconds", type=float, default=600.0)
    args = parser.parse_args()
    counts = {"spans": 0, "exports": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            export = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            spans = sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
            counts["spans"] += spans
            counts["exports"] += 1
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    threading.Timer(args.seconds, server.shutdown).start()
    print(f"OTLP/HTTP sink on http://127.0.0.1:{args.port} for {args.seconds:.0f} s", flush=True)
    server.serve_forever()
    print(f"received {counts['spans']} spans in {counts['exports']} export requests", flush=True)


if __name__ == "__main__":
    main()

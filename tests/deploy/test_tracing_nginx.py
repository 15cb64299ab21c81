"""Traces through the repo's nginx: a client's W3C traceparent reaches the replica unchanged, so
the replica's spans (sent to an OTLP endpoint here) are children of the client's span."""

from __future__ import annotations

import re

import httpx
import numpy as np

from tests.deploy.nginx import nginx_binary, run_nginx
from tests.otlp import Collector, attributes
from tests.support import fp32_request, run_server, wait_for

TRACE_ID = "5bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "10f067aa0ba902b7"


def test_traceparent_passes_through_nginx(tmp_path):
    nginx_binary()  # skip before starting a replica if there is no nginx
    collector = Collector()
    args = ("--otlp-endpoint", collector.url, "--trace-rate", "1000000")  # callers decide
    try:
        with (
            run_server(tmp_path, *args, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}) as replica,
            run_nginx(f"127.0.0.1:{replica.port}", f"127.0.0.1:{replica.port}") as nginx,
        ):
            body, headers = fp32_request(np.zeros((1, 4, 512), np.float32))  # (B, T, E)
            headers = {**headers, "traceparent": f"00-{TRACE_ID}-{PARENT}-01",
                       "tracestate": "edge=1", "x-request-id": "via-nginx"}  # fmt: skip
            r = httpx.post(f"{nginx.url}/v2/models/mha/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            (spans,) = collector.trace("infer mha", 1).values()
            root = spans[0]
            assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT
            assert root.trace_state == "edge=1"
            assert attributes(root)["mha.request_id"] == "via-nginx"
            assert r.headers["x-request-id"] == "via-nginx"
            # no id, or one the replica would not keep: nginx's own, the same in its log
            for given in (None, "not one id"):
                sent = {**headers} if given else {k: v for k, v in headers.items()
                                                   if k != "x-request-id"}  # fmt: skip
                if given:
                    sent["x-request-id"] = given
                r = httpx.post(f"{nginx.url}/v2/models/mha/infer", content=body, headers=sent)
                rid = r.headers["x-request-id"]
                assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", rid), rid
                (spans,) = collector.trace("infer mha", 1).values()
                assert attributes(spans[0])["mha.request_id"] == rid
                wait_for(lambda rid=rid: any(f"rid={rid}" in line for line in nginx.access_log()))
    finally:
        collector.stop()

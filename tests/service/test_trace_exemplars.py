"""From a metric or a log line to the trace: a traced request's duration carries its trace id
as an OpenMetrics exemplar, and its JSON access-log line names the trace (kept whatever the
sample rate). A real server exporting over OTLP to a collector run here, its /metrics read as
Prometheus asks for it, and a real Prometheus with exemplar storage."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from tests.otlp import Collector, attributes
from tests.service.test_tracing import PARENT, SAMPLED, TRACE_ID, settle, traced_server
from tests.support import Server, binary_request, free_port, wait_for

E = 16
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
# a histogram bucket with an exemplar: ... <count> # {trace_id="..."} <value> <timestamp>
EXEMPLAR = re.compile(
    r"^mha_request_duration_seconds_bucket\{(?P<labels>[^}]*)\} \S+ "
    r'# \{trace_id="(?P<id>[0-9a-f]{32})"\}'
)


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory, collector) -> Iterator[tuple[Server, str]]:
    root = tmp_path_factory.mktemp("exemplars")
    args = ("--log-format", "json", "--access-log-sample-rate", "0")
    with traced_server(root, collector, *args) as served:
        yield served


def _infer(server: Server, **headers: str) -> httpx.Response:
    x = np.random.default_rng(0).standard_normal((1, 3, E)).astype(np.float32)
    header = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": x.nbytes}}]}  # fmt: skip
    body, base = binary_request(header, x.tobytes())
    r = httpx.post(f"{server.url}/v2/models/attn/infer", content=body, headers={**base, **headers})
    assert r.status_code == 200, r.text
    return r


def _exemplars(server: Server) -> list[tuple[str, str]]:
    """(labels, trace id) of every duration bucket that carries an exemplar, read as
    Prometheus reads /metrics (it asks for OpenMetrics)."""
    r = httpx.get(f"{server.url}/metrics", headers={"Accept": OPENMETRICS})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")
    return [(m["labels"], m["id"]) for m in map(EXEMPLAR.match, r.text.splitlines()) if m]


def _access_lines(server: Server) -> list[dict]:
    lines = []
    for line in server.log().splitlines():
        if line.startswith("{") and '"logger":"service.access"' in line:
            lines.append(json.loads(line))
    return lines


def test_a_traced_request_names_its_trace_in_metrics_and_the_access_log(served, collector):
    server, _ = served
    settle(server, collector)
    rid = "exemplar-1"
    _infer(server, traceparent=SAMPLED, **{"x-request-id": rid})
    (spans,) = collector.trace("infer attn", 1).values()
    assert spans[0].trace_id.hex() == TRACE_ID
    exemplars = _exemplars(server)
    assert any('endpoint="infer"' in labels and 'model="attn"' in labels and trace == TRACE_ID
               for labels, trace in exemplars), exemplars  # fmt: skip
    wait_for(lambda: any(e.get("request_id") == rid for e in _access_lines(server)), "the line")
    (line,) = [e for e in _access_lines(server) if e.get("request_id") == rid]
    assert line["trace_id"] == TRACE_ID and line["status"] == 200


def test_a_trace_of_its_own_is_named_by_the_id_it_is_exported_with(served, collector):
    server, _ = served
    settle(server, collector)
    rid = "exemplar-own"
    _infer(server, **{"x-request-id": rid})  # no traceparent: traced at --trace-rate 1
    (spans,) = collector.trace("infer attn", 1).values()
    own = spans[0].trace_id.hex()
    assert own != TRACE_ID and spans[0].parent_span_id == b""
    assert attributes(spans[0])["mha.request_id"] == rid
    assert own in {trace for _, trace in _exemplars(server)}
    wait_for(lambda: any(e.get("request_id") == rid for e in _access_lines(server)), "the line")
    (line,) = [e for e in _access_lines(server) if e.get("request_id") == rid]
    assert line["trace_id"] == own


def test_an_untraced_request_has_no_exemplar_and_its_line_is_sampled_out(served, collector):
    server, _ = served
    settle(server, collector)
    unsampled = f"00-{'1' * 32}-{PARENT}-00"  # the caller decided: not traced
    _infer(server, traceparent=unsampled, **{"x-request-id": "exemplar-none"})
    assert settle(server, collector) == []
    assert "1" * 32 not in {trace for _, trace in _exemplars(server)}
    _infer(server, **{"x-request-id": "after-untraced"})  # a traced one after it: logged
    wait_for(
        lambda: any(e.get("request_id") == "after-untraced" for e in _access_lines(server)),
        "the traced request's line",
    )
    assert not any(e.get("request_id") == "exemplar-none" for e in _access_lines(server))


def test_grpc_and_text_requests_carry_their_trace_ids_too(served, collector):
    server, address = served
    settle(server, collector)
    grpc_trace = "5" * 32
    client = tgrpc.InferenceServerClient(address)
    x = np.ones((1, 2, E), np.float32)
    item = tgrpc.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    client.infer("attn", [item], headers={"traceparent": f"00-{grpc_trace}-{PARENT}-01"})
    text_trace = "6" * 32
    r = httpx.post(f"{server.url}/embed", json={"inputs": "hello world"},
                   headers={"traceparent": f"00-{text_trace}-{PARENT}-01"})  # fmt: skip
    assert r.status_code == 200, r.text
    exemplars = _exemplars(server)
    assert any('protocol="grpc"' in labels and trace == grpc_trace for labels, trace in exemplars)
    assert any('endpoint="embed"' in labels and trace == text_trace for labels, trace in exemplars)

    def grpc_line() -> bool:
        lines = _access_lines(server)
        return any(e.get("trace_id") == grpc_trace and e["method"] == "GRPC" for e in lines)

    wait_for(grpc_line, "the gRPC call's access line")


def test_the_text_exposition_is_unchanged(served):
    server, _ = served
    r = httpx.get(f"{server.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert " # {" not in r.text  # exemplars only in OpenMetrics
    assert "# EOF" not in r.text


# -- a real Prometheus with exemplar storage ---------------------------------------------------
PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed")
def test_prometheus_stores_the_exemplar(served, tmp_path: Path) -> None:
    server, _ = served
    config = tmp_path / "prometheus.yml"
    job = {"job_name": "mha", "static_configs": [{"targets": [server.address]}]}
    settings = {"scrape_interval": "1s", "scrape_timeout": "1s"}
    config.write_text(json.dumps({"global": settings, "scrape_configs": [job]}))  # YAML
    port = free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage",
             "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    trace = "7" * 32
    try:

        def stored() -> list:
            assert process.poll() is None, log.read_text()
            _infer(server, traceparent=f"00-{trace}-{PARENT}-01")
            try:
                r = httpx.get(
                    f"{url}/api/v1/query_exemplars",
                    params={"query": 'mha_request_duration_seconds_bucket{model="attn"}',
                            "start": time.time() - 600, "end": time.time() + 60},
                    timeout=5,
                )  # fmt: skip
            except httpx.HTTPError:
                return []
            if r.status_code != 200:
                return []
            return [e for series in r.json()["data"] for e in series["exemplars"]
                    if e["labels"].get("trace_id") == trace]  # fmt: skip

        found = wait_for(stored, "the exemplar in Prometheus", timeout=30)
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert 0 < float(found[0]["value"]) < 10  # the request's duration, seconds


def test_pipelined_requests_do_not_inherit_the_trace_before_them(served, collector):
    """uvicorn starts a pipelined request's task from the previous request's: a traced infer,
    then a metadata GET and a 404 in the same write; only the infer names the trace."""
    server, _ = served
    settle(server, collector)
    trace = "8" * 32
    x = np.zeros((1, 2, E), np.float32)
    header = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": x.nbytes}}]}  # fmt: skip
    body, headers = binary_request(header, x.tobytes())
    head = "POST /v2/models/attn/infer HTTP/1.1\r\nHost: x\r\n"
    head += f"traceparent: 00-{trace}-{PARENT}-01\r\nx-request-id: piped-0\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(body)}\r\n\r\n"
    then = "".join(
        f"GET {path} HTTP/1.1\r\nHost: x\r\nx-request-id: piped-{i}\r\n\r\n"
        for i, path in ((1, "/v2/models/attn"), (2, "/nope"))
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + body + then.encode())
        received = b""
        while received.count(b"HTTP/1.1 ") < 3:
            received += sock.recv(65536)
    wait_for(lambda: any(e.get("request_id") == "piped-2" for e in _access_lines(server)),
             "the 404's line")  # fmt: skip
    lines = {e["request_id"]: e for e in _access_lines(server) if "piped" in e["request_id"]}
    assert lines["piped-0"]["trace_id"] == trace
    assert "piped-1" not in lines  # a 200 at sample rate 0, not traced: no line
    assert "trace_id" not in lines["piped-2"]


def test_grpc_access_lines_follow_the_sample_rate_as_http_ones_do(served, collector):
    server, address = served
    client = tgrpc.InferenceServerClient(address)

    def lines(path: str) -> int:
        return sum(e.get("path") == path for e in _access_lines(server))

    live, metadata = lines("ServerLive"), lines("ModelMetadata")
    for _ in range(5):
        assert client.is_server_live()  # 200, not traced: sampled out at rate 0
    with pytest.raises(InferenceServerException):
        client.get_model_metadata("nope")  # 404: always logged
    wait_for(lambda: lines("ModelMetadata") == metadata + 1, "the failed call's line")
    assert lines("ServerLive") == live

"""Request tracing: a real server sends OpenTelemetry spans over OTLP/HTTP (the SDK's own
exporter) to a collector endpoint run here (a plain HTTP server decoding the protobuf export
requests), for OIP infer over HTTP (JSON and binary) and gRPC (unary and streaming) and for the
text routes; W3C traceparent from the caller is the parent; Triton's trace extension (the
unmodified tritonclient, HTTP and gRPC) changes the sampling at run time, per model too."""

from __future__ import annotations

import contextlib
import itertools
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from tests import text_models as tm
from tests.otlp import Collector, attributes
from tests.support import Server, binary_request, free_port, run_server

E = 16
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT}-01"
MARKER_TRACE = "0af7651916cd43dd8448eb211c80319c"
STEPS = {"decode", "queue", "compute", "encode"}
START = {
    "trace_level": ["TIMESTAMPS"],
    "trace_rate": "1",
    "trace_count": "-1",
    "trace_file": "",
    "log_frequency": "0",
    "trace_mode": "opentelemetry",
}


_MARKS = itertools.count()


def settle(server: Server, collector: Collector) -> list:
    """The spans that arrive before a marker's: a sampled /embed request with an id of its
    own, sent now. Everything traced before it was queued for export before it, so what this
    returns is every span of the requests made so far that had not arrived yet."""
    rid = f"marker-{next(_MARKS)}"
    headers = {"traceparent": f"00-{MARKER_TRACE}-{PARENT}-01", "x-request-id": rid}
    r = httpx.post(f"{server.url}/embed", json={"inputs": "marker"}, headers=headers)
    assert r.status_code == 200, r.text
    before: list = []
    while True:
        spans = [span for _, span in collector.exports.get(timeout=15)]
        marks = [s for s in spans if attributes(s).get("mha.request_id") == rid]
        if marks:
            trace_id = marks[0].trace_id
            return before + [s for s in spans if s.trace_id != trace_id]
        before += spans


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


@contextlib.contextmanager
def traced_server(root: Path, collector: Collector, *extra: str) -> Iterator[tuple[Server, str]]:
    """An attention model and a sentence-transformer served over HTTP and gRPC, every request
    traced to `collector`; yields the server and its gRPC address."""
    torch.manual_seed(0)
    mha_engine.save_model(nn.MultiheadAttention(E, 2, batch_first=True).eval(), root / "attn")
    tm.sentence_transformer(root / "emb")
    grpc_port = free_port()
    args = ["--model-dir", str(root / "attn"), "--model-dir", str(root / "emb")]
    args += ["--grpc-port", str(grpc_port), "--otlp-endpoint", collector.url, "--trace-rate", "1"]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # export within 50 ms (the SDK's default: 5 s)
    with run_server(root, *args, *extra, env=env) as server:
        yield server, f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory, collector) -> Iterator[tuple[Server, str]]:
    root = tmp_path_factory.mktemp("tracing")
    with traced_server(root, collector, "--otlp-service-name", "mha-test") as served:
        yield served


@pytest.fixture
def clients(
    served, collector
) -> Iterator[tuple[thttp.InferenceServerClient, tgrpc.InferenceServerClient]]:
    server, address = served
    settle(server, collector)
    h, g = thttp.InferenceServerClient(server.address), tgrpc.InferenceServerClient(address)
    yield h, g
    # each test ends with the start-up settings: the global ones back, the model's cleared
    clear = {"trace_rate": None, "trace_level": None, "trace_count": None}
    h.update_trace_settings(settings=clear)
    h.update_trace_settings("attn", clear)


def _infer_body(seq_len: int = 3) -> tuple[bytes, dict[str, str]]:
    x = np.random.default_rng(0).standard_normal((1, seq_len, E)).astype(np.float32)
    header = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": x.nbytes}}]}  # fmt: skip
    return binary_request(header, x.tobytes())


def _infer(server: Server, **headers: str) -> None:
    body, base = _infer_body()
    r = httpx.post(f"{server.url}/v2/models/attn/infer", content=body, headers={**base, **headers})
    assert r.status_code == 200, r.text


def test_http_infer_is_a_child_of_the_callers_span_with_its_steps(served, collector):
    server, _ = served
    settle(server, collector)
    _infer(server, traceparent=SAMPLED, tracestate="vendor=abc", **{"x-request-id": "traced-1"})
    (spans,) = collector.trace("infer attn", 1).values()
    root, *steps = spans
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT
    assert root.trace_state == "vendor=abc"  # the caller's tracestate, kept
    assert root.kind == root.SPAN_KIND_SERVER
    assert abs(root.start_time_unix_nano - time.time_ns()) < 60e9  # epoch time, not a monotonic
    assert {s.name for s in steps} == STEPS
    assert all(s.trace_id == root.trace_id for s in steps)
    assert all(root.start_time_unix_nano <= s.start_time_unix_nano for s in steps)
    assert all(s.end_time_unix_nano <= root.end_time_unix_nano for s in steps)
    by_name = {s.name: s for s in steps}
    order = [by_name[n].start_time_unix_nano for n in ("decode", "queue", "compute", "encode")]
    assert order == sorted(order)
    seen = attributes(root)
    assert seen["mha.model.name"] == "attn" and seen["mha.protocol"] == "binary"
    assert seen["mha.request_id"] == "traced-1" and seen["mha.sequences"] == 1
    assert seen["mha.tokens"] == 3
    assert attributes(by_name["compute"])["mha.batch.sequences"] >= 1
    assert root.status.code == root.status.STATUS_CODE_UNSET
    assert settle(server, collector) == []  # nothing else: one trace per request


def test_resource_names_the_service(served, collector):
    server, _ = served
    settle(server, collector)
    _infer(server)
    resource, span = collector.exports.get(timeout=15)[0]
    names = {kv.key: kv.value.string_value for kv in resource.attributes}
    assert names["service.name"] == "mha-test" and span.name == "infer attn"


def test_a_caller_that_did_not_sample_gets_no_spans_and_a_bad_header_a_new_trace(served, collector):
    server, _ = served
    settle(server, collector)
    _infer(server, traceparent=f"00-{TRACE_ID}-{PARENT}-00")
    assert settle(server, collector) == []
    _infer(server, traceparent="00-zz-not-a-header")
    (spans,) = collector.trace("infer attn", 1).values()
    assert spans[0].trace_id.hex() != TRACE_ID and spans[0].parent_span_id == b""


def test_a_failed_request_has_an_error_status(served, collector):
    server, _ = served
    settle(server, collector)
    body = {"id": "mine", "inputs": [{"name": "input", "shape": [1, 2, E + 1], "datatype": "FP32",
                                      "data": [0.0] * (2 * (E + 1))}]}  # fmt: skip
    r = httpx.post(f"{server.url}/v2/models/attn/infer", json=body)
    assert r.status_code == 400
    (spans,) = collector.trace("infer attn", 1).values()
    root = spans[0]
    assert root.status.code == root.status.STATUS_CODE_ERROR
    assert root.status.message == r.json()["error"]
    seen = attributes(root)
    assert seen["error.type"] == "bad_input" and seen["mha.status_code"] == 400
    assert seen["mha.protocol"] == "json"
    assert seen["mha.request_id"] == r.headers["x-request-id"]  # its body never decoded
    assert seen["exception.type"] == "BadInput"


def test_grpc_unary_and_stream_take_the_parent_from_metadata(served, clients, collector):
    _, g = clients
    x = np.ones((1, 2, E), np.float32)
    inp = tgrpc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    g.infer("attn", [inp], headers={"traceparent": SAMPLED})
    (spans,) = collector.trace("infer attn", 1).values()
    assert spans[0].parent_span_id.hex() == PARENT
    assert attributes(spans[0])["mha.protocol"] == "grpc"
    assert {s.name for s in spans[1:]} == STEPS

    results: queue.Queue = queue.Queue()
    g.start_stream(lambda result, error: results.put((result, error)),
                   headers={"traceparent": SAMPLED})  # fmt: skip
    for i in range(2):
        g.async_stream_infer("attn", [inp], request_id=f"s{i}")
    for _ in range(2):
        result, error = results.get(timeout=15)
        assert error is None and result.as_numpy("output").shape == (1, 2, E)
    g.stop_stream()
    traces = collector.trace("infer attn", 2)
    ids = sorted(attributes(spans[0])["mha.request_id"] for spans in traces.values())
    assert ids == ["s0", "s1"]
    assert all(spans[0].trace_id.hex() == TRACE_ID for spans in traces.values())


def test_text_routes_trace_tokenize_queue_and_compute(served, collector):
    server, _ = served
    settle(server, collector)
    r = httpx.post(f"{server.url}/embed", json={"inputs": ["a few words", "more"]},
                   headers={"traceparent": SAMPLED})  # fmt: skip
    assert r.status_code == 200, r.text
    (spans,) = collector.trace("embed emb", 1).values()
    assert spans[0].parent_span_id.hex() == PARENT
    steps = {s.name: s for s in spans[1:]}
    assert set(steps) == {"tokenize", "queue", "compute"}
    assert attributes(steps["tokenize"])["mha.inputs"] == 2
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello", "model": "emb"})
    assert r.status_code == 200, r.text
    (spans,) = collector.trace("embeddings emb", 1).values()
    assert attributes(spans[0])["mha.model.name"] == "emb"
    # a refused text request: its span says why; /tokenize (no inference) is not traced
    r = httpx.post(f"{server.url}/embed", json={"inputs": [""]})
    assert r.status_code == 400
    (spans,) = collector.trace("embed emb", 1).values()
    assert attributes(spans[0])["error.type"] == "bad_input"
    assert httpx.post(f"{server.url}/tokenize", json={"inputs": "x"}).status_code == 200
    assert settle(server, collector) == []


def test_teis_grpc_calls_trace_each_request(served, collector):
    """TEI's gRPC Embed: a span under the caller's traceparent metadata with the text steps; a
    stream's requests one trace each."""
    import grpc

    from service.grpc import tei_pb2, tei_pb2_grpc

    server, address = served
    settle(server, collector)
    with grpc.insecure_channel(address) as channel:
        stub = tei_pb2_grpc.EmbedStub(channel)
        stub.Embed(tei_pb2.EmbedRequest(inputs="a few words"), metadata=(("traceparent", SAMPLED),))
        (spans,) = collector.trace("embed emb", 1).values()
        assert spans[0].parent_span_id.hex() == PARENT
        assert attributes(spans[0])["mha.protocol"] == "grpc"
        assert {s.name for s in spans[1:]} == {"tokenize", "queue", "compute"}
        requests = (tei_pb2.EmbedRequest(inputs=t) for t in ("one", "two"))
        assert len(list(stub.EmbedStream(requests))) == 2
    traces = collector.trace("embed emb", 2)
    ids = sorted(attributes(spans[0])["mha.request_id"] for spans in traces.values())
    assert len(set(ids)) == 2 and ids[0].endswith("-0") and ids[1].endswith("-1")


def test_trace_extension_over_http_and_grpc(served, clients, collector):
    server, _ = served
    h, g = clients
    assert "trace" in h.get_server_metadata()["extensions"]
    assert h.get_trace_settings() == START
    assert g.get_trace_settings(as_json=True)["settings"]["trace_rate"] == {"value": ["1"]}
    # every 3rd request without a traceparent from now on (the counter starts again)
    assert h.update_trace_settings(settings={"trace_rate": "3"})["trace_rate"] == "3"
    for _ in range(6):
        _infer(server)
    assert len(collector.trace("infer attn", 2)) == 2
    assert settle(server, collector) == []  # the other four: not traced
    # a model's own level: OFF for attn only, over gRPC; the global level is unchanged
    got = g.update_trace_settings("attn", {"trace_level": ["OFF"]}, as_json=True)
    assert got["settings"]["trace_level"] == {"value": ["OFF"]}
    assert h.get_trace_settings("attn")["trace_rate"] == "3"  # still the global rate
    assert h.get_trace_settings()["trace_level"] == ["TIMESTAMPS"]
    for _ in range(3):
        _infer(server, traceparent=SAMPLED)  # not even a sampled caller's
    assert settle(server, collector) == []
    # clearing the override (None over gRPC: no values) follows the global level again
    g.update_trace_settings("attn", {"trace_level": None})
    assert h.get_trace_settings("attn")["trace_level"] == ["TIMESTAMPS"]
    # trace_count: two more traces, then none
    h.update_trace_settings(settings={"trace_rate": "1", "trace_count": "2"})
    for _ in range(4):
        _infer(server)
    assert len(collector.trace("infer attn", 2)) == 2
    assert h.get_trace_settings()["trace_count"] == "0"
    h.update_trace_settings(settings={"trace_count": None})  # the marker needs one
    assert settle(server, collector) == []


def test_a_models_own_rate_and_count(served, clients, collector):
    server, _ = served
    h, _ = clients
    got = h.update_trace_settings("attn", {"trace_rate": "2", "trace_count": "1"})
    assert got["trace_rate"] == "2" and got["trace_count"] == "1"
    assert h.get_trace_settings()["trace_rate"] == "1"  # the global rate is not the model's
    for _ in range(4):
        _infer(server)
    assert len(collector.trace("infer attn", 1)) == 1  # the 2nd; then its count was spent
    assert h.get_trace_settings("attn")["trace_count"] == "0"
    assert h.get_trace_settings()["trace_count"] == "-1"  # the global count is untouched
    assert settle(server, collector) == []


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"trace_rate": "0"}, "'trace_rate' must be an integer >= 1"),
        ({"trace_rate": "often"}, "'trace_rate' must be an integer"),
        ({"trace_count": "-2"}, "'trace_count' must be -1"),
        ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
        ({"trace_level": ["LOUD"]}, "'trace_level' must be one of"),
        ({"trace_file": "/tmp/t.json"}, "'trace_file' can only be ''"),
        ({"trace_mode": "triton"}, "'trace_mode' can only be 'opentelemetry'"),
        ({"trace_colour": "1"}, "unknown trace setting(s) ['trace_colour']"),
    ],
)
def test_bad_settings_are_refused_naming_them(served, clients, settings, words):
    server, _ = served
    h, g = clients
    r = httpx.post(f"{server.url}/v2/trace/setting", json=settings)
    assert r.status_code == 400 and words in r.json()["error"], r.text
    with pytest.raises(InferenceServerException) as caught:
        g.update_trace_settings(settings=settings)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert words in caught.value.message()
    assert h.get_trace_settings() == START  # nothing changed
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_unknown_model_is_404_and_not_found(served, clients):
    server, _ = served
    _, g = clients
    r = httpx.get(f"{server.url}/v2/models/nope/trace/setting")
    assert r.status_code == 404 and "nope" in r.json()["error"]
    with pytest.raises(InferenceServerException) as caught:
        g.get_trace_settings("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_workers_export_over_otlp_grpc(tmp_path: Path):
    """--workers 2: each front-end traces its requests and exports them itself; here over
    OTLP/gRPC. The queue and compute steps come from the engine process's times."""
    collector = Collector()
    torch.manual_seed(0)
    mha_engine.save_model(nn.MultiheadAttention(E, 2, batch_first=True).eval(), tmp_path / "attn")
    args = ["--model-dir", str(tmp_path / "attn"), "--workers", "2", "--trace-rate", "1"]
    args += ["--otlp-endpoint", collector.grpc_url, "--otlp-protocol", "grpc"]
    try:
        with run_server(tmp_path, *args, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}) as server:
            for _ in range(4):
                _infer(server)
            traces = collector.trace("infer attn", 4)
            for _root, *steps in traces.values():
                assert {s.name for s in steps} == STEPS
                compute = next(s for s in steps if s.name == "compute")
                assert compute.end_time_unix_nano > compute.start_time_unix_nano
            r = httpx.post(f"{server.url}/v2/trace/setting", json={"trace_rate": "2"})
            assert r.status_code == 400 and "--workers > 1" in r.json()["error"]
    finally:
        collector.stop()


def test_trace_settings_need_the_api_key(tmp_path: Path, collector):
    port = free_port()
    args = ("--grpc-port", str(port), "--api-key", "k", "--otlp-endpoint", collector.url)
    with run_server(tmp_path, *args) as server:
        assert httpx.get(f"{server.url}/v2/trace/setting").status_code == 401
        g = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException) as caught:
            g.get_trace_settings()
        assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
        got = g.get_trace_settings(headers={"authorization": "Bearer k"}, as_json=True)
        assert got["settings"]["trace_mode"] == {"value": ["opentelemetry"]}

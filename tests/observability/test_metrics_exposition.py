"""GET /metrics after real requests (served, rejected, timed out, abandoned): every family the
dashboard and alerts use is there, with counts that match what was sent."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from service.runtime.metrics import (
    BATCH_SEQ_BUCKETS,
    CODEC_BUCKETS,
    LATENCY_BUCKETS,
    RATIO_BUCKETS,
    TOKEN_BUCKETS,
)
from tests.observability.monitoring import Sample, parse_exposition, total
from tests.support import Server, fp32_request, run_server, wait_for

URL = "/v2/models/mha/infer"
# Batches close at 2 sequences; a lone 1-sequence request waits the full 1 s delay in the
# queue, which leaves time to see it there, overflow the 2-slot queue, or let it time out.
ARGS = ("--max-batch-size", "2", "--max-queue", "2", "--max-batch-delay-ms", "1000")

BINARY_LENGTHS = (3, 7, 16, 33, 64, 100)  # good binary requests, 2 sequences each
JSON_LENGTHS = (2, 5, 9)  # good JSON requests, 2 sequences each

FAMILIES = {
    "mha_requests": "counter",
    "mha_request_failures": "counter",
    "mha_request_duration_seconds": "histogram",
    "mha_queue_wait_seconds": "histogram",
    "mha_batch_compute_seconds": "histogram",
    "mha_request_decode_seconds": "histogram",
    "mha_request_encode_seconds": "histogram",
    "mha_batch_size_sequences": "histogram",
    "mha_batch_size_tokens": "histogram",
    "mha_request_sequence_length": "histogram",
    "mha_batch_padding_ratio": "histogram",
    "mha_queue_depth_sequences": "gauge",
    "mha_queue_capacity_sequences": "gauge",
    "mha_requests_in_flight": "gauge",
    "mha_engine_busy": "gauge",
    "mha_ready": "gauge",
    "mha_model_info": "gauge",  # an Info metric is exposed as a gauge of value 1
    "mha_sequences_processed": "counter",
    "mha_tokens_processed": "counter",
    "mha_batches": "counter",
    "mha_event_loop_batches": "counter",
    "mha_response_cache_lookups": "counter",  # the response cache: off in this run, at 0
    "mha_response_cache_evictions": "counter",
    "mha_response_cache_entries": "gauge",
    "mha_response_cache_bytes": "gauge",
    "mha_response_cache_capacity_bytes": "gauge",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "python_gc_collections": "counter",
    "python_info": "gauge",
}

BUCKETS = {
    "mha_request_duration_seconds": LATENCY_BUCKETS,
    "mha_queue_wait_seconds": LATENCY_BUCKETS,
    "mha_batch_compute_seconds": LATENCY_BUCKETS,
    "mha_request_decode_seconds": CODEC_BUCKETS,
    "mha_request_encode_seconds": CODEC_BUCKETS,
    "mha_batch_size_sequences": BATCH_SEQ_BUCKETS,
    "mha_batch_size_tokens": TOKEN_BUCKETS,
    "mha_request_sequence_length": TOKEN_BUCKETS,
    "mha_batch_padding_ratio": RATIO_BUCKETS,
}


def x(sequences: int, length: int) -> np.ndarray:
    return np.random.default_rng(length).standard_normal((sequences, length, 512), np.float32)


def post_binary(server: Server, array: np.ndarray, **parameters: object) -> httpx.Response:
    content, headers = fp32_request(array, **parameters)
    return httpx.post(f"{server.url}{URL}", content=content, headers=headers, timeout=60)


def post_json(server: Server, array: np.ndarray) -> httpx.Response:
    body = {
        "inputs": [
            {
                "name": "input",
                "shape": list(array.shape),
                "datatype": "FP32",
                "data": array.ravel().tolist(),
            }
        ]
    }
    return httpx.post(f"{server.url}{URL}", json=body, timeout=60)


@pytest.fixture(scope="module")
def exercised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict]]:
    """A server that has answered a known mix of requests; yields it with the mix's
    before/after expositions."""
    with run_server(tmp_path_factory.mktemp("exposition"), *ARGS) as server:
        before_text = server.metrics()
        sent: dict = {"codes": []}

        def code(response: httpx.Response) -> None:
            sent["codes"].append(response.status_code)

        for length in BINARY_LENGTHS:
            code(post_binary(server, x(2, length)))
        for length in JSON_LENGTHS:
            code(post_json(server, x(2, length)))
        # Three bad inputs: wrong embed_dim (binary), malformed JSON, no 'input' tensor.
        code(post_binary(server, np.ones((1, 4, 511), np.float32)))
        code(httpx.post(f"{server.url}{URL}", content=b'{"inputs": [', timeout=10))
        code(httpx.post(f"{server.url}{URL}", json={"inputs": []}, timeout=10))
        code(httpx.post(f"{server.url}/v2/models/nope/infer", json={"inputs": []}, timeout=10))

        # Queue overflow: a lone sequence waits for a batch-mate; 2 more don't fit in 2 slots.
        with ThreadPoolExecutor(1) as pool:
            lone = pool.submit(post_binary, server, x(1, 8))
            wait_for(lambda: server.metric("mha_queue_depth_sequences") == 1, "a queued request")
            sent["in_flight_while_queued"] = server.metric("mha_requests_in_flight")
            code(post_binary(server, x(2, 4)))
            code(lone.result())

        # Deadline: 1000 µs, while the request sits out the batch delay.
        code(post_binary(server, x(1, 4), timeout=1000))

        # Disconnect: the client goes away while its request is queued.
        content, headers = fp32_request(x(1, 4))
        head = f"POST {URL} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(content)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head.encode() + content)
            wait_for(lambda: server.metric("mha_queue_depth_sequences") == 1, "the request queued")
        wait_for(lambda: server.metric("mha_requests_in_flight") == 0, "the handler to finish")
        sent["codes"].append(499)  # what the server records; the client never saw it

        yield server, {"before": before_text, "after": server.metrics(), **sent}


def delta(exercised: tuple[Server, dict], name: str, **labels: str) -> float:
    _, run = exercised
    before = parse_exposition(run["before"])[1]
    after = parse_exposition(run["after"])[1]
    return total(after, name, **labels) - total(before, name, **labels)


def after(exercised: tuple[Server, dict]) -> tuple[dict[str, str], list[Sample]]:
    return parse_exposition(exercised[1]["after"])


def test_the_requests_got_the_expected_answers(exercised) -> None:
    codes = exercised[1]["codes"]
    assert codes == [200] * 9 + [400, 400, 400, 404, 429, 200, 504, 499], codes
    assert exercised[1]["in_flight_while_queued"] == 1


def test_every_family_is_exposed_with_its_type(exercised) -> None:
    types, samples = after(exercised)
    for family, kind in FAMILIES.items():
        assert types.get(family) == kind, f"{family}: {types.get(family)} (want {kind})"
    # Nothing undocumented: every mha_ family is one of the above (or a counter's _created).
    extra = {n for n in types if n.startswith("mha_") and n not in FAMILIES}
    assert {n for n in extra if not n.endswith("_created")} == set(), extra
    assert not any(n.startswith("mha_cuda_") for n in types), "CUDA gauges on a CPU-only run"
    # Counters are exposed as <name>_total (the parser strips the suffix from family names).
    for name, kind in types.items():
        if kind == "counter" and name.startswith("mha_"):
            assert any(s.name == f"{name}_total" for s in samples), name
    assert total(samples, "process_resident_memory_bytes") > 10e6
    assert total(samples, "process_cpu_seconds_total") > 0


def test_request_counters_match_what_was_sent(exercised) -> None:
    codes = exercised[1]["codes"]
    for status in set(codes):
        sent = codes.count(status)
        assert delta(exercised, "mha_requests_total", status=str(status)) == sent, status
    # Every request is labelled with the served model, its version and its endpoint.
    assert delta(exercised, "mha_requests_total", model="mha", endpoint="infer") == len(codes)
    by_version = delta(exercised, "mha_requests_total", model="mha", version="1", endpoint="infer")
    assert by_version == len(codes)


def test_every_per_model_series_carries_the_version(exercised) -> None:
    samples = after(exercised)[1]
    per_model = [s for s in samples if "model" in s.labels]
    assert per_model
    assert [s.name for s in per_model if s.labels.get("version") != "1"] == []
    failures = {
        "bad_input": 3,
        "not_found": 1,
        "overloaded": 1,
        "timeout": 1,
        "client_disconnected": 1,
        "inference_error": 0,
        "unavailable": 0,
    }
    for reason, count in failures.items():
        assert delta(exercised, "mha_request_failures_total", reason=reason) == count, reason
    # Failure series exist before any failure, so rate() over them is never empty.
    _, samples = after(exercised)
    reasons = {s.labels["reason"] for s in samples if s.name == "mha_request_failures_total"}
    assert reasons >= set(failures)


def test_duration_histograms_count_every_request(exercised) -> None:
    name = "mha_request_duration_seconds_count"
    assert delta(exercised, name, status_class="2xx") == 10
    assert delta(exercised, name, status_class="4xx") == 6  # 400 x3, 404, 429, 499
    assert delta(exercised, name, status_class="5xx") == 1  # 504
    # The lone request waited out the 1 s batch delay: it shows in queue wait and latency.
    assert delta(exercised, "mha_request_duration_seconds_sum", status_class="2xx") > 0.9
    assert delta(exercised, "mha_queue_wait_seconds_count") == 10
    assert 0.9 < delta(exercised, "mha_queue_wait_seconds_sum") < 5
    assert delta(exercised, "mha_batch_compute_seconds_count") == 10
    assert 0 < delta(exercised, "mha_batch_compute_seconds_sum") < 5
    # Decode is timed for bodies that parsed and validated, encode for answers sent.
    assert delta(exercised, "mha_request_decode_seconds_count", protocol="binary") == 10
    assert delta(exercised, "mha_request_decode_seconds_count", protocol="json") == 3
    assert delta(exercised, "mha_request_encode_seconds_count", protocol="binary") == 7
    assert delta(exercised, "mha_request_encode_seconds_count", protocol="json") == 3


def test_batch_and_token_accounting(exercised) -> None:
    # Computed: 9 good 2-sequence requests (one forward each) and the lone 1-sequence one.
    tokens = 2 * sum(BINARY_LENGTHS) + 2 * sum(JSON_LENGTHS) + 8
    assert delta(exercised, "mha_sequences_processed_total") == 19
    assert delta(exercised, "mha_tokens_processed_total") == tokens
    assert delta(exercised, "mha_batches_total", outcome="ok") == 10
    assert delta(exercised, "mha_batches_total", outcome="error") == 0
    assert delta(exercised, "mha_batch_size_sequences_count") == 10
    assert delta(exercised, "mha_batch_size_sequences_sum") == 19
    assert delta(exercised, "mha_batch_size_tokens_sum") == tokens
    assert delta(exercised, "mha_batch_padding_ratio_count") == 10
    assert delta(exercised, "mha_batch_padding_ratio_sum") == 0
    # Received: every sequence that validated, computed or not (429, 504, 499 included).
    received = [*BINARY_LENGTHS * 2, *JSON_LENGTHS * 2, 8, 4, 4, 4, 4]  # lone, 429 (x2), 504, 499
    assert delta(exercised, "mha_request_sequence_length_count") == len(received)
    assert delta(exercised, "mha_request_sequence_length_sum") == sum(received)


def test_histogram_buckets_are_the_declared_ones_and_cumulative(exercised) -> None:
    _, samples = after(exercised)
    for family, bounds in BUCKETS.items():
        series: dict[tuple, list[tuple[float, float]]] = {}
        for s in samples:
            if s.name == f"{family}_bucket":
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                series.setdefault(key, []).append((float(s.labels["le"]), s.value))
        assert series, family
        for key, buckets in series.items():
            les = [le for le, _ in buckets]
            assert les == [*map(float, bounds), float("inf")], family
            counts = [count for _, count in buckets]
            assert counts == sorted(counts), f"{family}{key} not cumulative"
            count = total(samples, f"{family}_count", **dict(key))
            assert counts[-1] == count, family


def test_gauges_and_model_info(exercised) -> None:
    _, samples = after(exercised)
    assert total(samples, "mha_queue_depth_sequences", model="mha") == 0
    assert total(samples, "mha_queue_capacity_sequences", model="mha") == 2
    assert total(samples, "mha_requests_in_flight", model="mha") == 0
    assert total(samples, "mha_engine_busy", model="mha") == 0
    assert total(samples, "mha_ready", model="mha") == 1
    (info,) = [s for s in samples if s.name == "mha_model_info"]
    assert info.value == 1
    assert info.labels["model"] == info.labels["name"] == "mha"
    assert info.labels["architecture"] == "transformer_encoder"
    assert (info.labels["embed_dim"], info.labels["num_heads"]) == ("512", "8")
    assert (info.labels["dtype"], info.labels["device"]) == ("float32", "cpu")
    assert info.labels["sdpa_backend"] not in ("", "unknown")
    assert info.labels["cpu_capability"].startswith(torch.backends.cpu.get_cpu_capability())


def test_histograms_keep_growing_with_traffic(exercised) -> None:
    server, run = exercised
    name = "mha_request_duration_seconds_count"
    first = total(parse_exposition(run["after"])[1], name, status_class="2xx")
    for length in (4, 12):
        assert post_binary(server, x(2, length)).status_code == 200
    assert total(parse_exposition(server.metrics())[1], name, status_class="2xx") == first + 2


def test_model_info_json_is_consistent_with_metadata(exercised) -> None:
    server, _ = exercised
    properties = httpx.get(f"{server.url}/v2/models/mha", timeout=10).json()["properties"]
    (info,) = [s for s in after(exercised)[1] if s.name == "mha_model_info"]
    assert properties
    for key, value in properties.items():
        assert info.labels[key] == value, key

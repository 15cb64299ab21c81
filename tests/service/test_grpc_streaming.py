"""gRPC ModelStreamInfer against a real server, with the unmodified tritonclient: the sync
client's start_stream / async_stream_infer / stop_stream and the aio client's stream_infer.
Each request is answered on the stream with its id; a bad one gets an error message and the
stream goes on; cancelling and the stream's deadline end it; statistics and metrics count each
request as a unary call would."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
from torch import nn
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from tests.service.test_grpc import (
    AUTH,
    GrpcServer,
    attention,
    expected,
    fp32_input,
    grpc_error,
    rng_input,
    serving,
)
from tests.service.test_grpc import strict as strict  # a fixture: API key, one-sequence queue
from tests.service.test_triton_statistics import input_data as input_data  # a fixture
from tests.service.test_triton_statistics import measure
from tests.service.test_triton_statistics import perf_analyzer as perf_analyzer  # a fixture
from tests.support import FP32_TOL, wait_for

NAME = "attn"
EMBED_DIM = 32
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
IN_FLIGHT = 4  # the held server's --grpc-stream-in-flight


@pytest.fixture(scope="module")
def module() -> nn.MultiheadAttention:
    return attention(EMBED_DIM)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, module) -> Iterator[GrpcServer]:
    limits = ("--max-seq-len", "64", "--grpc-stream-in-flight", "4")
    with serving(tmp_path_factory.mktemp("models"), module, *limits) as grpc_server:
        yield grpc_server


def _stats(client: tgrpc.InferenceServerClient) -> tuple[int, int]:
    stats = client.get_inference_statistics(NAME, as_json=True)["model_stats"][0]
    inference = stats["inference_stats"]
    return int(inference["success"].get("count", 0)), int(inference["fail"].get("count", 0))


def _requests(server: GrpcServer, **labels: str) -> float:
    """gRPC infer requests counted so far (0 before the first)."""
    try:
        return server.http.metric("mha_requests_total", protocol="grpc", endpoint="infer", **labels)
    except KeyError:
        return 0.0


def _collect(results: queue.Queue, count: int) -> list[tuple[object, object]]:
    return [results.get(timeout=60) for _ in range(count)]


def test_sync_stream_answers_each_request_by_id_and_errors_in_between(server, module) -> None:
    client = server.client()
    success, fail = _stats(client)
    requests_before, bad_before = _requests(server), _requests(server, status="400")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = {f"good-{i}": rng_input(i, 2, 3 + i, EMBED_DIM) for i in range(10)}
    ids = list(inputs)
    for rid in ids[:5]:
        client.async_stream_infer(NAME, [fp32_input(inputs[rid])], request_id=rid)
    # one request in the middle that does not fit the model: its error, then the stream goes on
    wrong = rng_input(99, 1, 4, EMBED_DIM + 1)
    client.async_stream_infer(NAME, [fp32_input(wrong)], request_id="bad")
    for rid in ids[5:]:
        client.async_stream_infer(NAME, [fp32_input(inputs[rid])], request_id=rid)
    answers = _collect(results, len(ids) + 1)
    client.stop_stream()
    errors = [error for result, error in answers if error is not None]
    assert len(errors) == 1 and f"{EMBED_DIM + 1}" in errors[0].message(), errors
    outputs = {result.get_response().id: result for result, error in answers if error is None}
    assert sorted(outputs) == sorted(ids)  # every good request, each under its own id
    for rid, result in outputs.items():
        want = expected(module, inputs[rid]).numpy()
        np.testing.assert_allclose(result.as_numpy("output"), want, **FP32_TOL)
    # each request counted as a unary call would be: statistics and request metrics (which may
    # land just after the answer is sent)
    want = (success + len(ids), fail + 1)
    wait_for(lambda: _stats(client) == want, f"statistics {want}")
    wait_for(lambda: _requests(server) == requests_before + len(ids) + 1, "request metrics")
    assert _requests(server, status="400") == bad_before + 1


def test_stream_error_names_the_request(server) -> None:
    """The error answer carries the failed request's id (Triton's ModelStreamInferResponse)."""
    channel = grpc.insecure_channel(server.grpc_address)
    call = channel.stream_stream(
        STREAM_METHOD,
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
    )
    request = service_pb2.ModelInferRequest(model_name="no-such-model", id="lost")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 1, EMBED_DIM])
    tensor.contents.fp32_contents.extend([0.0] * EMBED_DIM)
    (answer,) = list(call(iter([request]), timeout=60))
    assert "no-such-model" in answer.error_message
    assert answer.infer_response.id == "lost"
    channel.close()


def test_undecodable_message_is_answered_and_the_stream_goes_on(server, module) -> None:
    channel = grpc.insecure_channel(server.grpc_address)
    call = channel.stream_stream(
        STREAM_METHOD,
        request_serializer=lambda data: data,  # raw bytes: the first is no protobuf message
        response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
    )
    x = rng_input(7, 1, 5, EMBED_DIM)
    good = service_pb2.ModelInferRequest(model_name=NAME, id="after")
    good.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    good.raw_input_contents.append(x.tobytes())
    answers = list(call(iter([b"\xff\xff\xff", good.SerializeToString()]), timeout=60))
    assert len(answers) == 2
    failed = [a for a in answers if a.error_message]
    assert len(failed) == 1 and "not a valid protobuf message" in failed[0].error_message
    (ok,) = [a for a in answers if not a.error_message]
    got = np.frombuffer(ok.infer_response.raw_output_contents[0], np.float32).reshape(x.shape)
    np.testing.assert_allclose(got, expected(module, x).numpy(), **FP32_TOL)
    channel.close()


def test_aio_stream_infer_with_an_error_among_good_requests(server, module) -> None:
    inputs = {f"aio-{i}": rng_input(100 + i, 1, 4 + i, EMBED_DIM) for i in range(6)}

    async def requests():
        for i, (rid, x) in enumerate(inputs.items()):
            if i == 3:
                bad = tgrpc_aio.InferInput("input", [1, 2, EMBED_DIM - 1], "FP32")
                bad.set_data_from_numpy(np.zeros((1, 2, EMBED_DIM - 1), np.float32))
                yield {"model_name": NAME, "inputs": [bad], "request_id": "bad"}
            item = tgrpc_aio.InferInput("input", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            yield {"model_name": NAME, "inputs": [item], "request_id": rid}

    async def run() -> list:
        async with tgrpc_aio.InferenceServerClient(server.grpc_address) as client:
            return [answer async for answer in client.stream_infer(requests())]

    answers = asyncio.run(run())
    errors = [error for _, error in answers if error is not None]
    assert len(errors) == 1 and f"{EMBED_DIM - 1}" in errors[0].message(), errors
    outputs = {r.get_response().id: r.as_numpy("output") for r, e in answers if e is None}
    assert sorted(outputs) == sorted(inputs)
    for rid, x in inputs.items():
        np.testing.assert_allclose(outputs[rid], expected(module, x).numpy(), **FP32_TOL)


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory, module) -> Iterator[GrpcServer]:
    """A server whose batches wait 10 s for batch-mates: what a test queues stays queued
    (never computed) while the test cancels it, within milliseconds (the warm-up does not wait:
    the server is ready as fast as with no delay)."""
    hold = ("--max-seq-len", "64", "--max-batch-delay-ms", "10000", "--request-timeout-s", "120")
    bound = ("--grpc-stream-in-flight", str(IN_FLIGHT))
    with serving(tmp_path_factory.mktemp("held"), module, *hold, *bound) as grpc_server:
        yield grpc_server


def _lines(server: GrpcServer, method: str, status: int) -> int:
    return server.http.log().count(f"GRPC {method} {status}\n")


def _queued(server: GrpcServer) -> float:
    return server.http.metric("mha_queue_depth_sequences")


def _batches(server: GrpcServer) -> float:
    """Forwards run so far (warm-up's included)."""
    try:
        return server.http.metric("mha_batches_total")
    except KeyError:
        return 0.0


def test_aio_cancel_cancels_the_queued_requests(held) -> None:
    """The client sends more requests than --grpc-stream-in-flight: the server takes that many
    (the rest wait unread). It cancels: each taken one leaves the queue uncomputed (499 in the
    access log), the others never start, and the stream ends cancelled."""
    x = rng_input(5, 1, 6, EMBED_DIM)
    count = IN_FLIGHT + 3
    batches = _batches(held)

    async def requests():
        item = tgrpc_aio.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        for i in range(count):
            yield {"model_name": NAME, "inputs": [item], "request_id": f"queued-{i}"}
        await asyncio.Event().wait()  # never closes its side: only the cancel ends the stream

    async def run() -> None:
        async with tgrpc_aio.InferenceServerClient(held.grpc_address) as client:
            stream = client.stream_infer(requests())
            pending = asyncio.ensure_future(stream.__anext__())
            await asyncio.to_thread(wait_for, lambda: _queued(held) == IN_FLIGHT, "queued")
            assert stream.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending

    asyncio.run(run())
    wait_for(lambda: _lines(held, "ModelStreamInfer", 499) == 1, "the stream's 499 line")
    assert _lines(held, "ModelStreamInfer.request", 499) == IN_FLIGHT
    assert _queued(held) == 0 and held.http.metric("mha_requests_in_flight") == 0
    assert _batches(held) == batches  # nothing of it was computed


def test_stream_deadline_ends_the_stream_and_its_queued_request(held) -> None:
    """A stream still open at its deadline ends DEADLINE_EXCEEDED; its queued request is never
    computed (it is cancelled, or times out with the stream's deadline)."""
    results: queue.Queue = queue.Queue()
    batches = _batches(held)
    client = held.client()
    client.start_stream(
        callback=lambda result, error: results.put((result, error)), stream_timeout=2
    )
    client.async_stream_infer(NAME, [fp32_input(rng_input(1, 1, 3, EMBED_DIM))], request_id="d")
    answers = _collect(results, 1)
    if answers[0][1].status() != "StatusCode.DEADLINE_EXCEEDED":  # its own 504 came first
        assert "timed out" in answers[0][1].message(), answers[0][1]
        answers += _collect(results, 1)
    client.stop_stream()
    assert all(result is None for result, _ in answers)
    assert answers[-1][1].status() == "StatusCode.DEADLINE_EXCEEDED", answers[-1][1]
    wait_for(lambda: _queued(held) == 0, "the queue emptied")
    wait_for(lambda: held.http.metric("mha_requests_in_flight") == 0, "nothing in flight")
    ended = sum(_lines(held, "ModelStreamInfer.request", s) for s in (499, 504))
    assert ended >= 1 and _batches(held) == batches


def test_perf_analyzer_streams(perf_analyzer, server, input_data) -> None:
    """Triton's perf_analyzer (the tritonclient wheel's) over ModelStreamInfer, for a few
    seconds, bounded. (Its --shared-memory mode refuses models with optional inputs: see
    tests/service/test_required_inputs.py for it against a model served without them.)"""
    options = ("-i", "grpc", "--streaming", "--input-data", str(input_data))
    measure(perf_analyzer, server.grpc_address, *options)
    assert "Traceback" not in server.http.log()


def test_stream_needs_the_api_key_and_keeps_the_queue_limit(strict) -> None:
    """The stream is refused UNAUTHENTICATED without the key; with it, a request past the
    one-sequence queue is answered RESOURCE_EXHAUSTED's message and the stream goes on."""
    results: queue.Queue = queue.Queue()
    client = strict.client()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    # the server may end the stream before the request is written: tritonclient then refuses
    # to send it, and the callback has the reason
    with contextlib.suppress(InferenceServerException):
        client.async_stream_infer("mha", [fp32_input(rng_input(1, 1, 2, 512))])
    ((_, error),) = _collect(results, 1)
    client.stop_stream()
    assert error.status() == "StatusCode.UNAUTHENTICATED", error

    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=AUTH)
    count = 8
    for i in range(count):  # long sequences keep the engine busy: the queue fills
        x = rng_input(10 + i, 1, 1024, 512)
        client.async_stream_infer("mha", [fp32_input(x)], request_id=f"long-{i}")
    answers = _collect(results, count)
    client.stop_stream()
    refused = [e for _, e in answers if e is not None]
    assert all("queue" in e.message() for e in refused), refused
    assert len(refused) < count  # the first one, at least, ran


def test_shared_memory_rpcs_and_routes_need_the_api_key(strict) -> None:
    client = strict.client()
    error = grpc_error(client.get_system_shared_memory_status)
    assert error.status() == "StatusCode.UNAUTHENTICATED"
    assert not client.get_system_shared_memory_status(headers=AUTH).regions
    http = thttp.InferenceServerClient(strict.http.address)
    with pytest.raises(InferenceServerException, match="Authorization"):
        http.get_system_shared_memory_status()
    assert http.get_system_shared_memory_status(headers=AUTH) == []

"""The Open Inference Protocol over gRPC, and Triton's config/statistics extensions, against real
servers on loopback with the unmodified tritonclient (gRPC and HTTP)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import jsonschema
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from google.protobuf import json_format
from torch import nn
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import mha_engine
from tests.support import FP32_TOL, Server, free_port, run_server, validate_oip, wait_for

NAME = "attn"
EMBED_DIM = 64


class GrpcServer:
    """A running server with its HTTP and gRPC addresses."""

    def __init__(self, server: Server, grpc_port: int) -> None:
        self.http = server
        self.grpc_address = f"127.0.0.1:{grpc_port}"

    def client(self) -> tgrpc.InferenceServerClient:
        return tgrpc.InferenceServerClient(self.grpc_address)

    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        """tritonclient's own generated stub, for what its high-level client does not expose."""
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        channel = grpc.insecure_channel(self.grpc_address, options=options)
        return service_pb2_grpc.GRPCInferenceServiceStub(channel)


def attention(embed_dim: int) -> nn.MultiheadAttention:
    """The self-attention module these tests serve (seeded: the same weights every time)."""
    torch.manual_seed(0)
    return nn.MultiheadAttention(embed_dim, 4, batch_first=True).eval()


@contextlib.contextmanager
def serving(root: Path, module: nn.Module, *args: str) -> Iterator[GrpcServer]:
    """`module` saved under `root` as NAME and served over HTTP and gRPC with `args`."""
    model_dir = root / NAME
    mha_engine.save_model(module, model_dir)
    port = free_port()
    with run_server(root, "--model-dir", str(model_dir), "--grpc-port", str(port), *args) as http:
        yield GrpcServer(http, port)


@pytest.fixture(scope="module")
def module() -> nn.MultiheadAttention:
    return attention(EMBED_DIM)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, module) -> Iterator[GrpcServer]:
    limits = ("--max-seq-len", "256", "--max-body-bytes", "1000000")
    with serving(tmp_path_factory.mktemp("models"), module, *limits) as grpc_server:
        yield grpc_server


def expected(module: nn.Module, x: np.ndarray) -> torch.Tensor:
    q = torch.from_numpy(x)
    return module(q, q, q, need_weights=False)[0].detach()


def fp32_input(x: np.ndarray, name: str = "input") -> tgrpc.InferInput:
    item = tgrpc.InferInput(name, list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return item


def rng_input(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def grpc_error(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return info.value


# -- health and metadata ----------------------------------------------------------------------
def test_health_and_metadata_over_grpc(server: GrpcServer) -> None:
    client = server.client()
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(NAME) and client.is_model_ready(NAME, "1")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "mha-serve"
    assert set(meta["extensions"]) == {
        "binary_tensor_data", "model_configuration", "statistics", "logging", "trace",
        "system_shared_memory",
    }  # fmt: skip
    model = client.get_model_metadata(NAME, as_json=True)
    assert model["name"] == NAME and model["versions"] == ["1"]
    shapes = {t["name"]: (t["datatype"], t["shape"]) for t in model["inputs"]}
    assert shapes["input"] == ("FP32", ["-1", "-1", str(EMBED_DIM)])  # int64 as JSON strings
    assert shapes["key_padding_mask"] == ("BOOL", ["-1", "-1"])


def test_http_and_grpc_describe_the_model_alike(server: GrpcServer) -> None:
    http = thttp.InferenceServerClient(server.http.address)
    server_meta = http.get_server_metadata()
    validate_oip("metadata_server_response", server_meta)
    assert (
        server_meta["extensions"] == server.client().get_server_metadata(as_json=True)["extensions"]
    )
    meta = http.get_model_metadata(NAME)
    validate_oip("metadata_model_response", meta)
    grpc_meta = server.client().get_model_metadata(NAME, as_json=True)
    assert [t["name"] for t in meta["inputs"]] == [t["name"] for t in grpc_meta["inputs"]]


def test_model_config_over_http_and_grpc(server: GrpcServer) -> None:
    config = thttp.InferenceServerClient(server.http.address).get_model_config(NAME)
    assert config["name"] == NAME and config["max_batch_size"] == 32
    assert config["input"][0] == {
        "name": "input",
        "data_type": "TYPE_FP32",
        "format": "FORMAT_NONE",
        "dims": [-1, EMBED_DIM],
        "optional": False,
    }
    assert config["output"] == [{"name": "output", "data_type": "TYPE_FP32", "dims": [-1, 64]}]
    assert config["dynamic_batching"] == {
        "preferred_batch_size": [32],
        "max_queue_delay_microseconds": 2000,
    }
    over_grpc = server.client().get_model_config(NAME).config
    assert json_format.ParseDict(config, type(over_grpc)()) == over_grpc
    assert over_grpc.input[0].data_type == over_grpc.input[0].data_type.__class__(11)  # TYPE_FP32
    assert list(over_grpc.input[0].dims) == [-1, EMBED_DIM]


def test_config_and_stats_match_their_openapi_schemas(server: GrpcServer) -> None:
    paths = httpx.get(f"{server.http.url}/openapi.json").json()["paths"]
    for path, route in (
        (f"/v2/models/{NAME}/config", "/v2/models/{model_name}/config"),
        (
            f"/v2/models/{NAME}/versions/1/config",
            "/v2/models/{model_name}/versions/{model_version}/config",
        ),
        (f"/v2/models/{NAME}/stats", "/v2/models/{model_name}/stats"),
        ("/v2/models/stats", "/v2/models/stats"),
    ):
        responses = paths[route]["get"]["responses"]
        assert {"200", "503"} <= set(responses), route
        schema = responses["200"]["content"]["application/json"]["schema"]
        body = httpx.get(f"{server.http.url}{path}").json()
        jsonschema.validate(body, schema)


def test_unknown_model_config_is_404_and_not_found(server: GrpcServer) -> None:
    response = httpx.get(f"{server.http.url}/v2/models/nope/config")
    assert response.status_code == 404
    validate_oip("metadata_model_error_response", response.json())
    assert "nope" in response.json()["error"]
    error = grpc_error(server.client().get_model_config, "nope")
    assert error.status() == "StatusCode.NOT_FOUND" and "nope" in error.message()


# -- inference ---------------------------------------------------------------------------------
def test_raw_infer_matches_pytorch_and_http(server: GrpcServer, module) -> None:
    x = rng_input(1, 3, 17, EMBED_DIM)
    result = server.client().infer(NAME, [fp32_input(x)])
    got = result.as_numpy("output")
    assert got.dtype == np.float32 and got.shape == x.shape
    torch.testing.assert_close(torch.from_numpy(got), expected(module, x), **FP32_TOL)
    item = thttp.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    over_http = thttp.InferenceServerClient(server.http.address).infer(NAME, [item])
    np.testing.assert_array_equal(over_http.as_numpy("output"), got)  # one path: same bits


def test_unbatched_input_with_a_padding_mask(server: GrpcServer, module) -> None:
    x = rng_input(2, 9, EMBED_DIM)  # [T, E]
    mask = np.zeros((9,), dtype=bool)
    mask[6:] = True
    item = tgrpc.InferInput("key_padding_mask", [9], "BOOL")
    item.set_data_from_numpy(mask)
    got = server.client().infer(NAME, [fp32_input(x), item]).as_numpy("output")
    q = torch.from_numpy(x)[None]
    want = module(q, q, q, key_padding_mask=torch.from_numpy(mask)[None], need_weights=False)[0]
    torch.testing.assert_close(torch.from_numpy(got), want[0].detach(), **FP32_TOL)


def test_typed_contents_in_and_out(server: GrpcServer, module) -> None:
    """A request with typed contents (no raw bytes) gets typed fp32_contents back."""
    x = rng_input(3, 2, 5, EMBED_DIM)
    request = service_pb2.ModelInferRequest(model_name=NAME, id="typed-1")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    causal = service_pb2.InferParameter(bool_param=True)
    request.parameters["is_causal"].CopyFrom(causal)
    response = server.stub().ModelInfer(request, timeout=30)
    assert response.id == "typed-1" and not response.raw_output_contents
    out = response.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("output", "FP32", list(x.shape))
    got = np.array(out.contents.fp32_contents, dtype=np.float32).reshape(x.shape)
    q = torch.from_numpy(x)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    want = module(q, q, q, attn_mask=mask, is_causal=True, need_weights=False)[0].detach()
    torch.testing.assert_close(torch.from_numpy(got), want, **FP32_TOL)


def test_request_id_from_metadata_comes_back(server: GrpcServer) -> None:
    x = rng_input(4, 1, 4, EMBED_DIM)
    request = service_pb2.ModelInferRequest(model_name=NAME)
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    response, call = server.stub().ModelInfer.with_call(
        request, metadata=(("x-request-id", "req-42"),), timeout=30
    )
    assert dict(call.initial_metadata())["x-request-id"] == "req-42"
    assert response.id == "req-42"  # the OIP id, when the request has none (as over HTTP)
    assert len(response.raw_output_contents[0]) == x.nbytes


# -- client mistakes: status codes naming the problem, never UNKNOWN/INTERNAL ------------------
def _raw_request(shape: list[int], raw: bytes, datatype: str = "FP32", name: str = "input"):
    request = service_pb2.ModelInferRequest(model_name=NAME)
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request


BAD_REQUESTS = {
    "wrong embed_dim": (_raw_request([1, 4, 63], bytes(4 * 4 * 63)), "embed_dim is 64"),
    "raw size mismatch": (_raw_request([1, 4, 64], bytes(100)), "raw_input_contents has 100"),
    "unknown input": (_raw_request([1, 4, 64], bytes(4 * 4 * 64), name="query"), "'query'"),
    "negative dim": (_raw_request([1, -4, 64], b""), "non-negative"),
    "unsupported datatype": (_raw_request([1, 4, 64], bytes(16 * 64), "BYTES"), "BYTES"),
    "wrong datatype": (_raw_request([1, 4, 64], bytes(8 * 4 * 64), "FP64"), "FP64"),
    "NaN": (
        _raw_request([1, 2, 64], np.full((1, 2, 64), np.nan, np.float32).tobytes()),
        "NaN or Inf",
    ),
    "too long": (_raw_request([1, 300, 64], bytes(4 * 300 * 64)), "--max-seq-len"),
    "no inputs": (service_pb2.ModelInferRequest(model_name=NAME), "'inputs'"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(server: GrpcServer, case: str) -> None:
    request, fragment = BAD_REQUESTS[case]
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert fragment in info.value.details()
    x = rng_input(5, 1, 3, EMBED_DIM)  # the channel stays usable
    assert stub.ModelInfer(_raw_request([1, 3, 64], x.tobytes()), timeout=30).outputs


def test_typed_half_precision_and_both_encodings_are_refused(server: GrpcServer) -> None:
    stub = server.stub()
    request = service_pb2.ModelInferRequest(model_name=NAME)
    request.inputs.add(name="input", datatype="FP16", shape=[1, 1, 64])
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents" in info.value.details()
    both = _raw_request([1, 1, 64], bytes(256))
    both.inputs[0].contents.fp32_contents.extend([0.0] * 64)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(both, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_model_or_version_is_not_found(server: GrpcServer) -> None:
    x = fp32_input(rng_input(6, 1, 2, EMBED_DIM))
    for model, version in (("nope", ""), (NAME, "7")):
        error = grpc_error(server.client().infer, model, [x], model_version=version)
        assert error.status() == "StatusCode.NOT_FOUND", error


def test_message_over_max_body_bytes_is_refused_by_size(server: GrpcServer) -> None:
    x = np.zeros((4, 256, 256), np.float32)  # 1 MiB of raw input, over --max-body-bytes 1e6
    request = _raw_request(list(x.shape), x.tobytes())
    with pytest.raises(grpc.RpcError) as info:
        server.stub().ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in info.value.details()


def test_timeout_parameter_gives_deadline_exceeded(server: GrpcServer) -> None:
    before = server.http.metric("mha_request_failures_total", reason="timeout", protocol="grpc")
    x = fp32_input(rng_input(7, 1, 4, EMBED_DIM))
    # 1 µs: expired before the batcher's 2 ms batch delay is up, so it is never computed
    error = grpc_error(server.client().infer, NAME, [x], timeout=1)
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED", error
    after = server.http.metric("mha_request_failures_total", reason="timeout", protocol="grpc")
    assert after == before + 1


# -- statistics and metrics ----------------------------------------------------------------------
def _stats(server: GrpcServer) -> dict:
    over_http = thttp.InferenceServerClient(server.http.address).get_inference_statistics(NAME)
    over_grpc = server.client().get_inference_statistics(NAME, as_json=True)
    stats = over_http["model_stats"][0]
    assert over_grpc["model_stats"][0]["inference_count"] == str(stats["inference_count"])
    return stats


def test_statistics_count_what_was_sent(server: GrpcServer) -> None:
    before = _stats(server)
    sizes = [1, 3, 2, 4]
    client = server.client()
    for i, batch in enumerate(sizes):
        client.infer(NAME, [fp32_input(rng_input(10 + i, batch, 6, EMBED_DIM))])
    item = thttp.InferInput("input", [2, 6, EMBED_DIM], "FP32")
    item.set_data_from_numpy(rng_input(20, 2, 6, EMBED_DIM))
    thttp.InferenceServerClient(server.http.address).infer(NAME, [item])
    grpc_error(client.infer, NAME, [fp32_input(rng_input(21, 1, 2, 63))])  # a failure
    after = _stats(server)
    assert after["inference_count"] - before["inference_count"] == sum(sizes) + 2
    executions = after["execution_count"] - before["execution_count"]
    assert 1 <= executions <= len(sizes) + 1
    done, start = after["inference_stats"], before["inference_stats"]
    assert done["success"]["count"] - start["success"]["count"] == len(sizes) + 1
    assert done["fail"]["count"] - start["fail"]["count"] == 1
    for kind in ("queue", "compute_infer", "compute_output"):
        assert done[kind]["count"] - start[kind]["count"] == len(sizes) + 1, kind
        assert done[kind]["ns"] > start[kind]["ns"], kind
    assert done["compute_input"]["count"] - start["compute_input"]["count"] == len(sizes) + 1
    assert after["last_inference"] >= before["last_inference"] > 0
    all_models = httpx.get(f"{server.http.url}/v2/models/stats").json()
    assert [m["name"] for m in all_models["model_stats"]] == [NAME]


def test_grpc_requests_carry_the_protocol_label(server: GrpcServer) -> None:
    labels = {"endpoint": "infer", "status": "200"}
    before_grpc = server.http.metric("mha_requests_total", protocol="grpc", **labels)
    before_http = server.http.metric("mha_requests_total", protocol="http", **labels)
    server.client().infer(NAME, [fp32_input(rng_input(30, 1, 3, EMBED_DIM))])
    assert server.http.metric("mha_requests_total", protocol="grpc", **labels) == before_grpc + 1
    assert server.http.metric("mha_requests_total", protocol="http", **labels) == before_http
    grpc_error(server.client().infer, NAME, [fp32_input(rng_input(31, 1, 3, 5))])
    assert (
        server.http.metric("mha_requests_total", protocol="grpc", endpoint="infer", status="400")
        >= 1
    )
    assert server.http.metric("mha_request_decode_seconds_count", protocol="grpc") >= 1


# -- limits: API key, full queue, cancellation ---------------------------------------------------
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    """The demo encoder behind an API key, one sequence per batch and a one-sequence queue."""
    port = free_port()
    args = ("--grpc-port", str(port), "--api-key", KEY, "--max-batch-size", "1")
    limits = ("--max-queue", "1", "--max-batch-delay-ms", "0", "--max-seq-len", "2048")
    with run_server(tmp_path_factory.mktemp("strict"), *args, *limits) as http:
        yield GrpcServer(http, port)


AUTH = {"authorization": f"Bearer {KEY}"}


def test_api_key_is_checked_on_call_metadata(strict: GrpcServer) -> None:
    client = strict.client()
    assert client.is_server_live() and client.is_server_ready()  # open, as /v2/health/*
    for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        error = grpc_error(client.get_model_metadata, "mha", headers=headers)
        assert error.status() == "StatusCode.UNAUTHENTICATED", error
        error = grpc_error(
            client.infer, "mha", [fp32_input(rng_input(40, 1, 2, 512))], headers=headers
        )
        assert error.status() == "StatusCode.UNAUTHENTICATED", error
    assert client.get_model_metadata("mha", headers=AUTH).name == "mha"
    out = client.infer("mha", [fp32_input(rng_input(41, 1, 2, 512))], headers=AUTH)
    assert out.as_numpy("output").shape == (1, 2, 512)


def test_full_queue_is_resource_exhausted_with_retry_pushback(strict: GrpcServer) -> None:
    """Long sequences keep the engine busy; with a one-sequence queue most calls are refused."""
    x = rng_input(50, 1, 1024, 512)  # 2 MiB out: under the client's 4 MiB receive limit
    request = service_pb2.ModelInferRequest(model_name="mha")
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    stub = strict.stub()
    metadata = tuple(AUTH.items())

    def call(_: int):
        try:
            stub.ModelInfer(request, metadata=metadata, timeout=60)
            return "ok", None
        except grpc.RpcError as exc:
            return exc.code(), {**dict(exc.trailing_metadata() or ()), "details": exc.details()}

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    refused = [trailers for code, trailers in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused, results
    assert {code for code, _ in results} <= {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(t.get("grpc-retry-pushback-ms") == "1000" for t in refused), refused
    assert any(code == "ok" for code, _ in results)


def _long_request(model: str, seed: int, length: int = 1024) -> service_pb2.ModelInferRequest:
    x = rng_input(seed, 1, length, 512)
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def test_cancelled_call_leaves_the_queue_uncomputed(strict: GrpcServer) -> None:
    http = strict.http
    computed = http.metric("mha_sequences_processed_total")
    gone = http.metric("mha_request_failures_total", reason="client_disconnected", protocol="grpc")
    stub, metadata = strict.stub(), tuple(AUTH.items())
    first = _long_request("mha", 60, length=2048)  # a long forward keeps the engine busy
    running = stub.ModelInfer.future(first, metadata=metadata, timeout=60)
    wait_for(lambda: http.metric("mha_requests_in_flight") == 1)
    queued = stub.ModelInfer.future(_long_request("mha", 61), metadata=metadata, timeout=60)
    wait_for(lambda: http.metric("mha_requests_in_flight") == 2)  # waiting in the queue
    assert queued.cancel()
    assert running.result().outputs  # the running one is unaffected
    wait_for(lambda: http.metric("mha_requests_in_flight") == 0)
    assert http.metric("mha_sequences_processed_total") == computed + 1  # only the first
    after = http.metric("mha_request_failures_total", reason="client_disconnected", protocol="grpc")
    assert after == gone + 1


def test_sigterm_finishes_accepted_calls_and_refuses_new_ones(tmp_path: Path) -> None:
    """SIGTERM with gRPC calls queued: they finish (or, past the drain grace, get UNAVAILABLE,
    never computed), a new call is refused UNAVAILABLE, and the process exits in the grace."""
    port = free_port()
    args = ("--grpc-port", str(port), "--max-batch-size", "1", "--drain-grace-s", "1")
    with run_server(tmp_path, *args, "--max-seq-len", "2048") as http:
        server = GrpcServer(http, port)
        stub = server.stub()
        calls = [
            stub.ModelInfer.future(_long_request("mha", 70 + i, length=2048), timeout=60)
            for i in range(6)
        ]

        def accepted() -> bool:
            # every call in flight or already answered (on a loaded machine the first may finish
            # before the last arrives); answered ones are read first, so none is counted twice
            answered = sum(call.done() for call in calls)
            return answered + http.metric("mha_requests_in_flight") >= len(calls)

        wait_for(accepted, "all six calls accepted")
        http.process.send_signal(signal.SIGTERM)

        def draining() -> bool:
            # not ready any more, or the listener already stopped (GOAWAY): UNAVAILABLE
            try:
                return not stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return True

        wait_for(draining, "the server draining")
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_long_request("mha", 80, length=4), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        codes = []
        for call in calls:
            try:
                call.result()
                codes.append("ok")
            except grpc.RpcError as exc:
                codes.append(exc.code())
        started = time.monotonic()
        http.process.wait(timeout=30)
        exited_after = time.monotonic() - started
        log = http.log()
    assert set(codes) <= {"ok", grpc.StatusCode.UNAVAILABLE}, codes
    assert "ok" in codes, codes  # at least the forward running at SIGTERM finished
    assert exited_after < 5, exited_after
    assert "Traceback" not in log, log[-3000:]

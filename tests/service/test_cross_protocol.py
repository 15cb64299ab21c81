"""One catalogue of bad inputs sent over every protocol the server speaks: OIP JSON, OIP binary
(Triton's binary tensor extension), OIP gRPC (raw bytes, so undecodable protobuf can be sent),
OpenAI's /v1/embeddings and every TEI route. Each gets its protocol's 4xx (413 for a body over
--max-body-bytes, 404 / NOT_FOUND naming an unknown model) in its protocol's error shape, never a
5xx and never a traceback in the server's log; the connection (or gRPC channel) it came on serves
the next good request; good requests running beside the bad ones get their own numbers.

One real server (tensor + text models, gRPC on): a connection's reuse, the process log and gRPC
need one; every case is one or two requests, so the whole table runs in seconds."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import numpy as np
import pytest
import torch
from torch import nn
from tritonclient.grpc import service_pb2

import mha_engine
from tests.support import FP32_TOL, Server, binary_request, free_port, run_server

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm

LIMIT = 65536  # --max-body-bytes
E = 32  # embed_dim of the tensor model `attn`
HUGE_DIMS = ([0, 2**62, 2**62], [0, 2**63 - 1, E])  # zero elements, absurd dimensions
BAD_UTF8 = b"\xff\xfe"
SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800, which UTF-8 cannot hold
JSON = {"Content-Type": "application/json"}
INFER = "/inference.GRPCInferenceService/ModelInfer"
LOG_ERRORS = re.compile(r"Traceback|\b(ERROR|CRITICAL)\b")


# -- the HTTP routes: a good body, and where the catalogue's items go in it --------------------
@dataclass(frozen=True)
class Route:
    path: str
    shape: str  # its error body: "oip" {"error"}, "openai" {"error": {...}}, "tei"
    good: dict
    text: Callable[[str], dict]  # the good body with `s` as one of its strings
    wrong_type: dict  # a field of the wrong JSON type
    bools: list[dict] = field(default_factory=list)  # booleans as numbers and vice versa
    model_field: str | None = None  # the body field that names a model


def _oip(**tensor: object) -> dict:
    spec = {"name": "input", "shape": [1, 3, E], "datatype": "FP32", "data": [0.25] * (3 * E)}
    return {"inputs": [{**spec, **tensor}]}


RERANK = {"query": "what is deep learning", "texts": ["deep learning", "the cat sat"]}
ROUTES = {
    "oip-json": Route(
        "/v2/models/attn/infer",
        "oip",
        _oip(),
        lambda s: {"id": s, **_oip()},
        _oip(datatype="INT64", data=[1] * (3 * E)),
        [_oip(data=[True] * (3 * E)), {**_oip(), "parameters": {"is_causal": 1}}],
    ),
    "openai": Route(
        "/v1/embeddings",
        "openai",
        {"model": "emb", "input": ["hello world"]},
        lambda s: {"model": "emb", "input": [s]},
        {"model": "emb", "input": 3.5},
        [{"model": "emb", "input": [[True, 5]]}, {"model": "emb", "input": [True]}],
        model_field="model",
    ),
    "embed": Route(
        "/embed",
        "tei",
        {"inputs": ["hello world"]},
        lambda s: {"inputs": [s]},
        {"inputs": 42},
        [{"inputs": "hello", "normalize": "no"}, {"inputs": "hello", "truncate": 1}],
    ),
    "root": Route(  # TEI's POST /, huggingface_hub's: /embed for an embedding model
        "/",
        "tei",
        {"inputs": "hello world"},
        lambda s: {"inputs": [s]},
        {"inputs": {"text": "hello"}},
        [{"inputs": "hello", "normalize": "no"}],
    ),
    "embed_all": Route(
        "/embed_all",
        "tei",
        {"inputs": "hello world"},
        lambda s: {"inputs": s},
        {"inputs": 42},
        [{"inputs": "hello", "truncate": "yes"}],
    ),
    "similarity": Route(
        "/similarity",
        "tei",
        {"inputs": {"source_sentence": "hello", "sentences": ["world"]}},
        lambda s: {"inputs": {"source_sentence": s, "sentences": ["world"]}},
        {"inputs": "hello"},
        [{"inputs": {"source_sentence": "hello", "sentences": ["world"]}, "truncate": 1}],
    ),
    "tokenize": Route(
        "/tokenize",
        "tei",
        {"inputs": "hello world"},
        lambda s: {"inputs": s},
        {"inputs": 42},
        [{"inputs": "hello", "add_special_tokens": "no"}],
    ),
    "decode": Route(
        "/decode",
        "tei",
        {"ids": [2, 40, 3]},
        lambda s: {"ids": [2, 40, 3], s: 1},  # ids hold no text: a key does
        {"ids": "2 40 3"},
        [{"ids": [True, 40]}, {"ids": [2, 40, 3], "skip_special_tokens": "no"}],
    ),
    "rerank": Route(
        "/rerank",
        "tei",
        RERANK,
        lambda s: {**RERANK, "query": s},
        {**RERANK, "texts": 7},
        [{**RERANK, "raw_scores": "yes"}, {**RERANK, "return_text": 1}],
    ),
    "predict": Route(
        "/predict",
        "tei",
        {"inputs": "good movie"},
        lambda s: {"inputs": s},
        {"inputs": 7},
        [{"inputs": "good movie", "raw_scores": "yes"}],
    ),
}


# -- one HTTP request of the catalogue ----------------------------------------------------------
@dataclass(frozen=True)
class Http:
    route: str  # a key of ROUTES (its good request follows on the same connection)
    content: bytes | Callable[[], Iterator[bytes]]  # a callable: sent chunked
    headers: dict[str, str] = field(default_factory=dict)
    status: int | None = None  # exactly this; None: any 4xx
    path: str | None = None  # instead of the route's
    words: str = ""  # the error must contain these


def dumps(body: object) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate stays an escape


def chunked(content: bytes) -> Callable[[], Iterator[bytes]]:
    return lambda: (content[i : i + 16384] for i in range(0, len(content), 16384))


def binary_oip(shape: list[int], datatype: str = "FP32", size: object = None, **extra) -> Http:
    """A binary-extension request to `attn` holding an input of `shape`."""
    count = int(np.prod(shape)) if 0 not in shape else 0
    nbytes = count * np.dtype(np.float32 if datatype == "FP32" else np.int64).itemsize
    tensor = {"name": "input", "shape": shape, "datatype": datatype}
    tensor["parameters"] = {"binary_data_size": nbytes if size is None else size}
    content, headers = binary_request({"inputs": [tensor], **extra}, bytes(nbytes))
    return Http("oip-binary", content, headers)


def http_catalogue() -> dict[str, Http]:
    cases: dict[str, Http] = {}
    for name, route in ROUTES.items():
        oversized = dumps(route.good) + b" " * (LIMIT + 1)  # valid JSON, over the limit
        cases[f"oversized/{name}"] = Http(name, oversized, status=413)
        cases[f"oversized chunked/{name}"] = Http(name, chunked(oversized), status=413)
        cases[f"lone surrogate/{name}"] = Http(name, dumps(route.text(SURROGATE)))
        bad_utf8 = dumps(route.text("@@")).replace(b"@@", BAD_UTF8)
        cases[f"bad utf-8/{name}"] = Http(name, bad_utf8)
        cases[f"malformed json/{name}"] = Http(name, b'{"inputs": [')
        cases[f"wrong type/{name}"] = Http(name, dumps(route.wrong_type))
        for i, body in enumerate(route.bools):
            cases[f"boolean as number {i}/{name}"] = Http(name, dumps(body))
        if route.model_field:
            body = {**route.good, route.model_field: "nope"}
            cases[f"unknown model/{name}"] = Http(name, dumps(body), status=404, words="nope")
    binary = binary_oip([1, 3, E])
    for name, content, headers in (
        ("oip-json", dumps(ROUTES["oip-json"].good), {}),
        ("oip-binary", binary.content, binary.headers),
    ):
        for what, path, words in (
            ("model", "/v2/models/nope/infer", "nope"),
            ("version", "/v2/models/attn/versions/9/infer", "9"),
        ):
            cases[f"unknown {what}/{name}"] = Http(name, content, headers, 404, path, words)
    for i, dims in enumerate(HUGE_DIMS):
        cases[f"zero-size huge dims {i}/oip-json"] = Http("oip-json", dumps(_oip(shape=dims)))
        cases[f"zero-size huge dims {i}/oip-binary"] = binary_oip(dims)
    big = binary_oip([1, 600, E])  # 76800 bytes of tensor
    cases["oversized/oip-binary"] = Http("oip-binary", big.content, big.headers, 413)
    cases["oversized chunked/oip-binary"] = Http(
        "oip-binary", chunked(big.content), big.headers, 413
    )
    for label, text in (("lone surrogate", SURROGATE), ("bad utf-8", "@@")):
        case = binary_oip([1, 3, E], id=text)
        content = case.content.replace(b"@@", BAD_UTF8)  # the same length: the header's stays
        cases[f"{label}/oip-binary"] = Http("oip-binary", content, case.headers)
    header = b'{"inputs": ['
    malformed = {"Inference-Header-Content-Length": str(len(header))}
    cases["malformed json/oip-binary"] = Http("oip-binary", header + bytes(64), malformed)
    cases["wrong type/oip-binary"] = binary_oip([1, 3, E], "INT64")
    cases["boolean as number/oip-binary"] = binary_oip([1, 3, E], size=True)
    return cases


HTTP_CASES = http_catalogue()


# -- the gRPC catalogue: serialized ModelInferRequests, or bytes that are none -----------------
def infer_request(
    shape: list[int] | None = None, model: str = "attn", version: str = "", **typed
) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest for one `input` of `shape`: FP32 raw bytes, or typed contents when
    `typed` names any of datatype, fp32_contents, int_contents."""
    shape = shape or [1, 3, E]
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    tensor = request.inputs.add(name="input", datatype=typed.get("datatype", "FP32"), shape=shape)
    if typed:
        tensor.contents.SetInParent()
        tensor.contents.fp32_contents.extend(typed.get("fp32_contents", []))
        tensor.contents.int_contents.extend(typed.get("int_contents", []))
    else:
        count = int(np.prod(shape)) if 0 not in shape else 0
        request.raw_input_contents.append(np.full(count, 0.25, np.float32).tobytes())
    return request


def _field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field: appended to a message, it replaces a string field."""
    return bytes([number << 3 | 2, len(value)]) + value


GOOD = infer_request().SerializeToString()
INVALID = {grpc.StatusCode.INVALID_ARGUMENT}
causal_as_int = infer_request()
causal_as_int.parameters["is_causal"].int64_param = 1
GRPC_CASES: dict[str, tuple[bytes, set[grpc.StatusCode], str]] = {
    # an over-long message is refused by gRPC itself: RESOURCE_EXHAUSTED, gRPC's 413
    "oversized": (
        infer_request([1, 600, E]).SerializeToString(),
        {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT},
        "",
    ),
    "lone surrogate": (GOOD + _field(3, SURROGATE.encode("utf-8", "surrogatepass")), INVALID, ""),
    "bad utf-8": (GOOD + _field(3, BAD_UTF8), INVALID, ""),
    "bad utf-8 model name": (GOOD + _field(1, BAD_UTF8), INVALID, ""),
    "malformed protobuf": (b"\xff\xff\xff\xff", INVALID, ""),
    "truncated protobuf": (GOOD[: len(GOOD) // 2], INVALID, ""),
    "field past the end": (GOOD + b"\x2a\x40\x0a", INVALID, ""),
    "zero-size huge dims 0 typed": (
        infer_request(HUGE_DIMS[0], fp32_contents=[]).SerializeToString(),
        INVALID,
        "",
    ),
    "zero-size huge dims 1 raw": (infer_request(HUGE_DIMS[1]).SerializeToString(), INVALID, ""),
    "zero-size huge dims 0 raw": (infer_request(HUGE_DIMS[0]).SerializeToString(), INVALID, ""),
    "wrong type": (
        infer_request(datatype="INT32", int_contents=[1] * (3 * E)).SerializeToString(),
        INVALID,
        "INT32",
    ),
    "boolean as number": (causal_as_int.SerializeToString(), INVALID, "is_causal"),
    "unknown model": (
        infer_request(model="nope").SerializeToString(),
        {grpc.StatusCode.NOT_FOUND},
        "nope",
    ),
    "unknown version": (
        infer_request(version="9").SerializeToString(),
        {grpc.StatusCode.NOT_FOUND},
        "9",
    ),
}


# -- the server and the checks -------------------------------------------------------------------
@dataclass
class Served:
    http: Server
    grpc_address: str

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.grpc_address)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """attn (tensors), emb (embeddings), clf (classifier), rr (reranker) in one server."""
    root = tmp_path_factory.mktemp("cross")
    torch.manual_seed(0)
    mha_engine.save_model(nn.MultiheadAttention(E, 4, batch_first=True).eval(), root / "attn")
    tm.sentence_transformer(root / "emb")
    tm.classifier("bert", root / "clf", seed=1)
    tm.classifier("bert", root / "rr", {0: "score"}, seed=2)
    port = free_port()
    dirs = [arg for name in ("attn", "emb", "clf", "rr") for arg in ("--model-dir", root / name)]
    args = [*map(str, dirs), "--grpc-port", str(port), "--max-body-bytes", str(LIMIT)]
    with run_server(root, *args) as http:
        yield Served(http, f"127.0.0.1:{port}")


@pytest.fixture
def client(served: Served) -> Iterator[httpx.Client]:
    """One connection at most: a request after a closed one would show on a new local port.
    A client per case: a connection the server dropped after a 500 fails no later case."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=served.http.url, limits=limits, timeout=60) as client:
        yield client


def good_request(route: str) -> tuple[str, bytes, dict[str, str]]:
    if route == "oip-binary":
        case = binary_oip([1, 3, E])
        return ROUTES["oip-json"].path, case.content, case.headers
    return ROUTES[route].path, dumps(ROUTES[route].good), JSON


def local_port(response: httpx.Response) -> int | None:
    """The client side's port of the connection `response` came on (None: it was closed)."""
    try:
        return response.extensions["network_stream"].get_extra_info("client_addr")[1]
    except OSError:
        return None


def check_error_shape(shape: str, body: object) -> str:
    """The error message, after checking `body` is the protocol's error object."""
    if shape == "tei":
        assert isinstance(body, dict) and set(body) == {"error", "error_type"}, body
        assert isinstance(body["error_type"], str)
        message = body["error"]
    elif shape == "openai":
        assert isinstance(body, dict) and set(body) == {"error"}, body
        assert isinstance(body["error"], dict) and isinstance(body["error"].get("type"), str)
        message = body["error"]["message"]
    else:
        assert isinstance(body, dict) and set(body) == {"error"}, body
        message = body["error"]
    assert isinstance(message, str) and message, body
    return message


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_bad_http_request_is_a_4xx_in_the_protocol_shape(served, client, case) -> None:
    bad = HTTP_CASES[case]
    path, good_body, good_headers = good_request(bad.route)
    warm = client.post(path, content=good_body, headers=good_headers)
    assert warm.status_code == 200, warm.text
    port = local_port(warm)

    content = bad.content() if callable(bad.content) else bad.content
    headers = {**JSON, **bad.headers}
    response = client.post(bad.path or path, content=content, headers=headers)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if bad.status is not None:
        assert response.status_code == bad.status, response.text[:500]
    shape = "oip" if bad.route == "oip-binary" else ROUTES[bad.route].shape
    message = check_error_shape(shape, response.json())
    assert bad.words in message
    assert response.headers.get("connection", "").lower() != "close"
    assert local_port(response) == port, "the server closed the connection"

    after = client.post(path, content=good_body, headers=good_headers)
    assert after.status_code == 200, after.text[:500]
    assert local_port(after) == port, "the connection was not reused"


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_bad_grpc_request_is_a_client_error_status(served, case) -> None:
    content, codes, words = GRPC_CASES[case]
    with served.channel() as channel:
        call = channel.unary_unary(INFER)  # no (de)serializers: bytes in, bytes out
        assert call(GOOD, timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            call(content, timeout=30)
        assert info.value.code() in codes, (info.value.code(), info.value.details())
        assert words in (info.value.details() or "")
        answer = service_pb2.ModelInferResponse.FromString(call(GOOD, timeout=30))
        assert len(answer.raw_output_contents[0]) == 3 * E * 4  # the channel stays usable


# -- batch-mates: good requests beside the bad ones get their own numbers ---------------------
# Compared at fp32 tolerance, as README's "How requests are batched" states the guarantee: the
# same request alone and inside a batch differs in the last bits now and then (measured: 14 of
# 240 OIP requests of 12-16 tokens, up to 3e-8, with good batch-mates only).
def _good_oip(i: int) -> tuple[str, bytes, dict[str, str]]:
    x = np.random.default_rng(i).standard_normal((1, 2 + i % 5, E)).astype(np.float32)
    body = _oip(shape=list(x.shape), data=x.ravel().tolist())
    return "/v2/models/attn/infer", dumps(body), JSON


def _good_embed(i: int) -> tuple[str, bytes, dict[str, str]]:
    texts = ["hello world", "the cat sat on the mat", "deep learning", "paris is a city"]
    return "/embed", dumps({"inputs": texts[i % 4 :] + texts[: i % 4]}), JSON


def _good_rerank(i: int) -> tuple[str, bytes, dict[str, str]]:
    texts = [f"{word} {j}" for j, word in enumerate(tm.WORDS[i : i + 2 + i % 3])]
    return "/rerank", dumps({"query": "what is deep learning", "texts": texts}), JSON


GOOD_MAKERS = (_good_oip, _good_embed, _good_rerank)
GOOD_EACH = 12  # requests per maker


def test_batch_mates_of_bad_requests_are_unaffected(served) -> None:
    url = served.http.url
    requests = [maker(i) for maker in GOOD_MAKERS for i in range(GOOD_EACH)]
    with httpx.Client(base_url=url, timeout=60) as alone:
        want = [alone.post(p, content=c, headers=h) for p, c, h in requests]
    assert [r.status_code for r in want] == [200] * len(want)
    grpc_want = _grpc_output(served)

    stop = threading.Event()
    bad_sent: list[int] = []

    def bad_traffic() -> None:
        with httpx.Client(base_url=url, timeout=60) as bad_client, served.channel() as channel:
            call = channel.unary_unary(INFER)
            while not stop.is_set() or not bad_sent:
                for case in HTTP_CASES.values():
                    content = case.content() if callable(case.content) else case.content
                    path = case.path or good_request(case.route)[0]
                    headers = {**JSON, **case.headers}
                    with contextlib.suppress(httpx.TransportError):  # its own test's concern
                        bad_client.post(path, content=content, headers=headers)
                for content, _, _ in GRPC_CASES.values():
                    with contextlib.suppress(grpc.RpcError):
                        call(content, timeout=30)
                bad_sent.append(1)

    got: list[httpx.Response | None] = [None] * len(requests)
    grpc_got: list[np.ndarray] = []

    def good_traffic(indices: range) -> None:
        with httpx.Client(base_url=url, timeout=60) as good_client:
            for i in indices:
                path, content, headers = requests[i]
                got[i] = good_client.post(path, content=content, headers=headers)

    def grpc_traffic() -> None:
        for _ in range(GOOD_EACH):
            grpc_got.append(_grpc_output(served))

    threads = [threading.Thread(target=bad_traffic)]
    threads += [
        threading.Thread(target=good_traffic, args=(range(k, len(requests), 3),)) for k in range(3)
    ]
    threads.append(threading.Thread(target=grpc_traffic))
    for thread in threads:
        thread.start()
    for thread in threads[1:]:
        thread.join(300)
    stop.set()
    threads[0].join(300)
    assert not any(thread.is_alive() for thread in threads)
    assert bad_sent
    for i, (alone_response, response) in enumerate(zip(want, got, strict=True)):
        assert response is not None and response.status_code == 200, (i, response)
        expected, answered = _values(alone_response), _values(response)
        assert answered.shape == expected.shape, requests[i][0]
        np.testing.assert_allclose(answered, expected, **FP32_TOL, err_msg=requests[i][0])
    for answered in grpc_got:
        np.testing.assert_allclose(answered, grpc_want, **FP32_TOL)


def _values(response: httpx.Response) -> np.ndarray:
    """The numbers of an answer: OIP's output, TEI's vectors, or rerank scores by index."""
    body = response.json()
    if isinstance(body, dict):  # OIP
        (output,) = body["outputs"]
        return np.array(output["data"], np.float32).reshape(output["shape"])
    if body and isinstance(body[0], dict):  # /rerank
        return np.array([rank["score"] for rank in sorted(body, key=_index)])
    return np.array(body)


def _index(rank: dict) -> int:
    return rank["index"]


def _grpc_output(served: Served) -> np.ndarray:
    x = np.random.default_rng(99).standard_normal((1, 6, E)).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name="attn")
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    with served.channel() as channel:
        answer = channel.unary_unary(INFER)(request.SerializeToString(), timeout=60)
    raw = service_pb2.ModelInferResponse.FromString(answer).raw_output_contents[0]
    return np.frombuffer(raw, np.float32).reshape(x.shape)


def test_no_traceback_or_error_in_the_server_log(served) -> None:
    """Last: everything the cases above sent, as the server logged it. One check for all of
    them: uvicorn logs an exception some milliseconds after its 500 went out, when the next
    case may already be running, so a window per case could blame the wrong one."""
    lines = served.http.log().splitlines()
    errors = [i for i, line in enumerate(lines) if LOG_ERRORS.search(line)]
    assert errors == [], "\n".join(lines[i] for i in errors[:30])

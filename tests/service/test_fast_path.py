"""The fast path (service.http.fastpath) answers exactly as the regular path does: the same
requests, good and bad, go to an app with it and to one without it (--no-fast-path), and the
status, headers, body, access-log line and counted metric series must match case by case."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch import nn

import mha_engine
from service.http.fastpath import FastPath, infer_route
from tests import text_models as tm
from tests.inprocess import asgi_client
from tests.support import Server, run_server

E = 32
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
LIMIT = 256 * 1024  # --max-body-bytes
SETTINGS = {"api_key": KEY, "max_body_bytes": LIMIT, "max_header_bytes": 4096}
INFER = "/v2/models/attn/infer"
IGNORED = {"date", "server", "x-request-id"}  # x-request-id: compared on its own


@dataclass
class Case:
    name: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    fast: bool = True  # the fast path answers it itself (else it hands it on)


def oip_json(x: np.ndarray, datatype: str = "FP32", **extra: object) -> bytes:
    tensor = {"name": "input", "shape": list(x.shape), "datatype": datatype}
    return json.dumps({"inputs": [{**tensor, "data": x.ravel().tolist(), **extra}]}).encode()


def oip_binary(x: np.ndarray, binary_output: bool = True) -> tuple[bytes, dict[str, str]]:
    raw = x.astype(np.float32).tobytes()
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
    header = json.dumps(
        {
            "inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}],
            "outputs": [{"name": "output", "parameters": {"binary_data": binary_output}}],
        }
    ).encode()
    return header + raw, {**AUTH, "Inference-Header-Content-Length": str(len(header))}


def cases() -> list[Case]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, E)).astype(np.float32)
    wide = rng.standard_normal((1, 40, E)).astype(np.float32)  # JSON over simdjson's minimum
    binary, binary_headers = oip_binary(x)
    large, large_headers = oip_binary(rng.standard_normal((1, 2100, E)), True)
    embed = {"model": "emb", "input": ["a b c", "d e"]}
    return [
        Case("binary", INFER, binary, {**binary_headers, "X-Request-ID": "given-1"}),
        Case("binary, JSON output", INFER, *oip_binary(x, False)),
        Case("JSON, small", INFER, oip_json(x), JSON),
        Case("JSON, parsed into arrays", INFER, oip_json(wide), JSON),
        Case("JSON, BF16", INFER, oip_json(wide, "BF16"), JSON),
        Case("version 1", "/v2/models/attn/versions/1/infer", oip_json(x), JSON),
        Case("gzip body", INFER, gzip.compress(oip_json(x)), {**JSON, "Content-Encoding": "gzip"}),
        Case("response over a slice", INFER, large, large_headers),
        Case("unknown version", "/v2/models/attn/versions/7/infer", oip_json(x), JSON),
        Case("unknown model", "/v2/models/nope/infer", oip_json(x), JSON),
        Case("malformed JSON", INFER, b'{"inputs": [', JSON),
        Case("JSON not an object", INFER, b"[1, 2]", JSON),
        Case(
            "shape and data disagree", INFER, oip_json(wide).replace(b"[1, 40,", b"[1, 41,"), JSON
        ),
        Case("rank-2 shape", INFER, oip_json(x[0]), JSON),
        Case("wrong datatype", INFER, oip_json(np.ones((1, 3, E), np.int32), "INT32"), JSON),
        Case("unknown datatype", INFER, oip_json(x, "FP8"), JSON),
        Case(
            "string in data", INFER, oip_json(wide).replace(b'"data": [', b'"data": ["1", '), JSON
        ),
        Case(
            "boolean in data",
            INFER,
            oip_json(wide).replace(b'"data": [', b'"data": [true, ', 1),
            JSON,
        ),
        Case(
            "nested irregular data",
            INFER,
            json.dumps(
                {
                    "inputs": [
                        {
                            "name": "input",
                            "shape": [1, 3, E],
                            "datatype": "FP32",
                            "data": [[], x.ravel().tolist()],
                            "pad": "x" * 5000,
                        }
                    ]
                }
            ).encode(),
            JSON,
        ),
        Case("binary size mismatch", INFER, binary[:-4], binary_headers),
        Case("bad binary header", INFER, binary, {**AUTH, "Inference-Header-Content-Length": "x"}),
        Case("non-finite output", INFER, oip_json(np.full((1, 3, E), 3e38, np.float32)), JSON),
        Case("body over the limit", INFER, b"[" + b"1," * LIMIT + b"1]", JSON),
        Case(
            "missing API key", INFER, oip_json(x), {"Content-Type": "application/json"}, fast=False
        ),
        Case("wrong API key", INFER, oip_json(x), {"Authorization": "Bearer no"}, fast=False),
        Case("not a bearer", INFER, oip_json(x), {"Authorization": "Basic eA=="}, fast=False),
        Case(
            "headers over the limit", INFER, oip_json(x), {**JSON, "X-Pad": "p" * 5000}, fast=False
        ),
        Case("GET on infer", INFER, method="GET", headers=AUTH, fast=False),
        Case("trailing slash", INFER + "/", oip_json(x), JSON, fast=False),
        Case("embeddings", "/v1/embeddings", json.dumps(embed).encode(), JSON),
        Case(
            "embeddings, base64",
            "/v1/embeddings",
            json.dumps({**embed, "encoding_format": "base64"}).encode(),
            JSON,
        ),
        Case(
            "embeddings, unknown model",
            "/v1/embeddings",
            json.dumps({**embed, "model": "nope"}).encode(),
            JSON,
        ),
        Case(
            "embeddings, tensor model",
            "/v1/embeddings",
            json.dumps({**embed, "model": "attn"}).encode(),
            JSON,
        ),
        Case(
            "embeddings, bad input",
            "/v1/embeddings",
            json.dumps({"model": "emb", "input": [1.5]}).encode(),
            JSON,
        ),
        Case("embeddings, malformed", "/v1/embeddings", b"{", JSON),
        Case("embeddings, no key", "/v1/embeddings", json.dumps(embed).encode(), fast=False),
        Case("TEI embed", "/embed", tei(inputs=["a b c", "d e"]), JSON),
        Case("TEI embed, one text", "/embed", tei(inputs="a b c", normalize=False), JSON),
        Case("TEI embed, empty list", "/embed", tei(inputs=[]), JSON),
        Case("TEI embed, empty text", "/embed", tei(inputs=[""]), JSON),
        Case("TEI embed, unknown field", "/embed", tei(inputs="a", colour="red"), JSON),
        Case("TEI embed, too many characters", "/embed", tei(inputs="word " * 600), JSON),
        Case("TEI embed, too many tokens", "/embed", tei(inputs="word " * 120), JSON),
        Case("TEI embed, truncated", "/embed", tei(inputs="word " * 120, truncate=True), JSON),
        Case("TEI embed, malformed", "/embed", b'{"inputs": ', JSON),
        Case("TEI embed, no key", "/embed", tei(inputs="a"), fast=False),
        Case("TEI embed, GET", "/embed", method="GET", headers=AUTH, fast=False),
        Case("TEI embed, per-model mount", "/models/emb/embed", tei(inputs="a"), JSON, fast=False),
        Case("TEI rerank", "/rerank", tei(query="a b", texts=["a b c", "d e", "a"]), JSON),
        Case(
            "TEI rerank, texts and raw scores",
            "/rerank",
            tei(query="a b", texts=["a b c", "d e"], return_text=True, raw_scores=True),
            JSON,
        ),
        Case("TEI rerank, empty query", "/rerank", tei(query="", texts=["a"]), JSON),
        Case("TEI rerank, 33 texts", "/rerank", tei(query="a", texts=["b"] * 33), JSON),
        Case("TEI rerank, no texts field", "/rerank", tei(query="a"), JSON),
        Case("TEI predict, one text", "/predict", tei(inputs="a b c"), JSON),
        Case("TEI predict, a pair", "/predict", tei(inputs=["a b", "c d"]), JSON),
        Case("TEI predict, a batch", "/predict", tei(inputs=[["a b"], ["c", "d"]]), JSON),
        Case("TEI predict, raw scores", "/predict", tei(inputs="a b", raw_scores=True), JSON),
        Case("TEI predict, three strings", "/predict", tei(inputs=["a", "b", "c"]), JSON),
        Case("TEI predict, GET", "/predict", method="GET", headers=AUTH, fast=False),
        Case("TEI root, embedding model", "/", tei(inputs="a b c"), JSON),
        Case("TEI root, a classifier's body", "/", tei(inputs="a", parameters={"top_k": 1}), JSON),
        Case("TEI root, malformed", "/", b"{", JSON),
        Case("TEI root, a classifier", "/models/clf", tei(inputs=["a b"]), JSON, fast=False),
    ]


def tei(**body: object) -> bytes:
    return json.dumps(body).encode()


class AccessLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = ("method", "path", "status", "request_id")
        self.lines.append((record.getMessage(), *(getattr(record, f, None) for f in fields)))


@pytest.fixture
def access_lines() -> Iterator[AccessLines]:
    logger = logging.getLogger("service.access")
    handler, level = AccessLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("fast")
    torch.manual_seed(0)
    mha_engine.save_model(nn.MultiheadAttention(E, 4, batch_first=True).eval(), root / "attn")
    tm.sentence_transformer(root / "emb")
    tm.classifier("bert", root / "clf", seed=1)
    tm.classifier("bert", root / "rr", {0: "score"}, seed=2)
    return [root / "attn", root / "emb", root / "clf", root / "rr"]


COUNTED = re.compile(r"^(mha_\w+(?:_total|_count))(\{.*\})? (\S+)$", re.MULTILINE)


# Where a batch ran (the event loop or the engine thread) follows the batches' measured times,
# not the request's path: the one counter that may differ between two equal runs.
PLACEMENT = "mha_event_loop_batches_total"


async def counted(client: httpx.AsyncClient) -> dict[str, float]:
    """Every mha_* counter and histogram count, by series (but the batch placement's)."""
    text = (await client.get("/metrics")).text
    return {
        name + (labels or ""): float(v)
        for name, labels, v in COUNTED.findall(text)
        if name != PLACEMENT
    }


def fast_path(client: httpx.AsyncClient) -> FastPath | None:
    return client.app.fast_path  # type: ignore[attr-defined]


async def answer(client: httpx.AsyncClient, case: Case, log: AccessLines) -> dict:
    """What one request produced: the response, its access-log lines, the metric deltas."""
    before, seen = await counted(client), len(log.lines)
    response = await client.request(case.method, case.path, content=case.body, headers=case.headers)
    after = await counted(client)
    lines = [line for line in log.lines[seen:] if line[2] != "/metrics"]
    deltas = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    headers = {k: v for k, v in response.headers.items() if k not in IGNORED}
    rid = response.headers.get("x-request-id", "")
    return {
        "status": response.status_code,
        "headers": headers,
        "body": response.content.replace(rid.encode(), b"<request id>")
        if rid
        else response.content,
        "request id": rid if "X-Request-ID" in case.headers else len(rid),
        "access log": [(*line[:4], line[4] == rid) for line in lines],
        "metrics": deltas,
    }


def test_fast_path_answers_as_the_regular_path(model_dirs, access_lines) -> None:
    table = cases()

    async def run() -> None:
        regular_app = asgi_client(model_dir=model_dirs, fast_path=False, **SETTINGS)
        fast_app = asgi_client(model_dir=model_dirs, **SETTINGS)
        async with regular_app as regular, fast_app as fast:
            assert fast_path(regular) is None and fast_path(fast) is not None
            differences, statuses = [], set()
            for case in table:
                expected = await answer(regular, case, access_lines)
                statuses.add(expected["status"])
                answered = fast_path(fast).answered
                got = await answer(fast, case, access_lines)
                took = fast_path(fast).answered - answered
                assert took == int(case.fast), f"{case.name}: fast path answered {took}"
                for key, value in expected.items():
                    if got[key] != value:
                        differences.append(
                            f"{case.name}: {key} {got[key]!r:.300} != {value!r:.300}"
                        )
            assert not differences, "\n".join(differences)
            assert {200, 400, 401, 403, 404, 405, 413, 422, 431} <= statuses

            for client in (regular, fast):  # SIGTERM: new work is refused while draining
                client.app.state.service.start_draining()  # type: ignore[attr-defined]
            draining = table[0]
            expected = await answer(regular, draining, access_lines)
            got = await answer(fast, draining, access_lines)
            assert expected["status"] == 503 and got == expected

    asyncio.run(run())


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v2/models/m/infer", ("m", None)),
        ("/v2/models/m/versions/3/infer", ("m", "3")),
        ("/v2/models//infer", None),
        ("/v2/models/m/versions//infer", None),
        ("/v2/models/a/b/infer", None),
        ("/v2/models/m/infer/", None),
        ("/v2/models/m/ready", None),
    ],
)
def test_infer_route_matches_what_the_router_matches(path: str, route: object) -> None:
    assert infer_route(path) == route


def _leave_mid_body(server: Server, times: int) -> dict[str, object]:
    """Send a request's head and part of its body, then close: what the server made of it."""
    path = "/v2/models/mha/infer"
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n".encode()
    for _ in range(times):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + bytes(1000))
            time.sleep(0.1)  # the server waits for the rest of the body; leave
    deadline = time.monotonic() + 30
    while server.metric("mha_requests_total", status="499") < times:
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)
    log = server.log()
    return {
        "499s": server.metric("mha_requests_total", status="499"),
        "failures": server.metric("mha_request_failures_total", reason="client_disconnected"),
        "log lines": log.count(f"INFO service.access: POST {path} 499"),
        "errors": "Traceback" in log or "ERROR" in log,
    }


def test_client_leaving_mid_body_is_the_same_499_on_both_paths(tmp_path: Path) -> None:
    """A real server (the connection's disconnect signal): both paths count and log it alike."""
    answers = []
    for flags in ((), ("--no-fast-path",)):
        with run_server(tmp_path, *flags) as server:
            answers.append(_leave_mid_body(server, 2))
    assert answers[0] == answers[1] == {"499s": 2, "failures": 2, "log lines": 2, "errors": False}

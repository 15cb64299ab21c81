"""/v1/embeddings bounds its cost before and while tokenizing (in process, real MiniLM app):
character limits answered 413 before any tokenizing, tokenizing inside the request's deadline,
counted against the queue bound, and abandoned when the client leaves."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from benchmarks import scrape
from tests.inprocess import asgi_client
from tests.service.test_embeddings import NAME, minilm_dir

WORDS = "the quick brown fox jumps over the lazy dog "


def text(chars: int) -> str:
    return (WORDS * (chars // len(WORDS) + 1))[:chars]


def body(inputs: list[str]) -> bytes:
    return json.dumps({"model": NAME, "input": inputs}).encode()


def metric(exposition: str, name: str, **labels: str) -> float:
    return scrape.value(exposition, name, default=0.0, **labels)


def run(test, **settings: object) -> None:
    async def main() -> None:
        async with asgi_client(model_dir=minilm_dir(), model_name=NAME, **settings) as client:
            await test(client)

    asyncio.run(main())


def test_character_limits_are_413_before_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    async def defaults(client: httpx.AsyncClient) -> None:
        # all-MiniLM-L6-v2 truncates at 256 tokens: 64 x 256 characters per input by default.
        started = time.perf_counter()
        response = await client.post("/v1/embeddings", content=body(["x" * 2_000_000]))
        assert response.status_code == 413, response.text
        assert "16384 per input (--max-input-chars)" in response.json()["error"]["message"]
        assert time.perf_counter() - started < 1.0  # tokenizing it would take ~1.5 s of CPU
        response = await client.post("/v1/embeddings", content=body([text(15_000)] * 100))
        assert response.status_code == 413, response.text
        assert "1048576 per request (--max-request-chars)" in response.json()["error"]["message"]
        assert (await client.post("/v1/embeddings", content=body([text(16_384)]))).is_success

    run(defaults)
    monkeypatch.setenv("MHA_MAX_INPUT_CHARS", "1000")

    async def from_env(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/embeddings", content=body([text(1001)]))
        assert response.status_code == 413 and "limit of 1000 per input" in response.text
        assert (await client.post("/v1/embeddings", content=body([text(1000)]))).is_success

    run(from_env)


def test_tokenizing_stops_at_the_deadline() -> None:
    """100 inputs of 100k characters take seconds to tokenize; the deadline is 0.3 s."""

    async def test(client: httpx.AsyncClient) -> None:
        started = time.perf_counter()
        response = await client.post("/v1/embeddings", content=body([text(100_000)] * 100))
        took = time.perf_counter() - started
        assert response.status_code == 504, response.text
        assert "--request-timeout-s" in response.json()["error"]["message"]
        assert took < 2.0, took

    run(test, request_timeout_s=0.3, max_input_chars=100_000, max_request_chars=20_000_000)


def test_tokenizing_holds_queue_slots() -> None:
    """While a 16-input request is tokenized, its 16 slots count against --max-queue 16."""

    async def test(client: httpx.AsyncClient) -> None:
        first = asyncio.create_task(
            client.post("/v1/embeddings", content=body([text(100_000)] * 16))
        )
        depth = 0.0
        for _ in range(500):
            exposition = (await client.get("/metrics")).text
            depth = metric(exposition, "mha_queue_depth_sequences")
            if depth == 16 or first.done():
                break
            await asyncio.sleep(0.005)
        assert depth == 16, depth
        second = await client.post("/v1/embeddings", content=body(["hello"]))
        assert second.status_code == 429 and "queue full" in second.json()["error"]["message"]
        assert (await first).status_code == 200

    run(test, max_queue=16, max_batch_size=8, max_input_chars=100_000)


def test_tokenizing_is_abandoned_when_the_client_leaves() -> None:
    """A 6.4M-character request (seconds of tokenizing); the client leaves after 0.2 s."""
    content = body([text(16_000)] * 400)

    async def test(client: httpx.AsyncClient) -> None:
        app = client.app  # type: ignore[attr-defined]
        sent: list[dict] = []
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": content, "more_body": False}
            await asyncio.sleep(0.2)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/embeddings", "raw_path": b"/v1/embeddings",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 9), "server": None,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(content)).encode())],
        }  # fmt: skip
        started = time.perf_counter()
        await app(scope, receive, send)
        took = time.perf_counter() - started
        assert sent[0]["status"] == 499, sent[0]
        assert took < 1.5, took
        exposition = (await client.get("/metrics")).text
        failures = 'mha_request_failures_total{endpoint="embeddings",model="all-MiniLM-L6-v2",'
        assert re.search(re.escape(failures) + r'reason="client_disconnected"} 1\.0', exposition)
        assert metric(exposition, "mha_requests_total", status="500") == 0

    run(test, max_request_chars=10_000_000)

"""The dynamic batcher seen from outside: batches form, numbers don't change, the queue is bounded,
deadlines hold, disconnects free their slots, and SIGTERM drains."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import torch
import tritonclient.http as triton

import mha_engine
from tests.support import Server, fp32_request, output_of, run_server

URL = "/v2/models/mha/infer"


def post(server: Server, x: np.ndarray, **parameters: object) -> httpx.Response:
    content, headers = fp32_request(x, **parameters)
    return httpx.post(f"{server.url}{URL}", content=content, headers=headers, timeout=120)


def test_concurrent_requests_are_batched_with_same_numbers(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, int(t), 512)).astype(np.float32) for t in rng.integers(4, 40, 24)]
    with run_server(tmp_path, *BLOCKING_ARGS) as server:
        client = triton.InferenceServerClient(server.address, concurrency=24)
        before = server.metric("mha_batches_total", outcome="ok")
        # Hold the engine so the 24 requests are all waiting when it frees: how many forwards
        # they take is then the batcher's doing, not the arrival timing of a loaded machine.
        pool = _block_engine(server)
        pending = []
        for x in xs:
            item = triton.InferInput("input", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            pending.append(client.async_infer("mha", [item]))
        deadline = time.monotonic() + 30
        while server.metric("mha_queue_depth_sequences") < len(xs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.metric("mha_engine_busy") == 1, "the blocking forward ended too soon"
        assert server.metric("mha_queue_depth_sequences") == len(xs)
        batched = [p.get_result().as_numpy("output") for p in pending]
        pool.shutdown(wait=True)
        batches = server.metric("mha_batches_total", outcome="ok") - before
        # The blocking forward, then the 24 waiting sequences (max batch 32) in one forward.
        assert batches == 2, f"{batches} forwards for 1 blocking and {len(xs)} waiting requests"
        single = [output_of(post(server, x)) for x in xs]
    for one, many in zip(single, batched, strict=True):
        # Batch invariance: grouping by length keeps each sequence's arithmetic the same.
        torch.testing.assert_close(
            torch.from_numpy(many), torch.from_numpy(one), atol=1e-5, rtol=1.3e-6
        )


def test_full_queue_answers_429_with_retry_after(tmp_path: Path) -> None:
    args = ["--max-batch-size", "1", "--max-queue", "2", "--max-batch-delay-ms", "0"]
    x = np.random.default_rng(1).standard_normal((1, 1024, 512)).astype(np.float32)
    with run_server(tmp_path, *args) as server, ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: post(server, x), range(16)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert r.headers["Retry-After"] == "1"
                assert "queue full" in r.json()["error"]
        assert server.metric("mha_request_failures_total", reason="overloaded") == codes.count(429)
        assert server.metric("mha_queue_depth_sequences") == 0
        assert post(server, x[:, :8]).status_code == 200  # and it recovers


def _block_engine(server: Server) -> ThreadPoolExecutor:
    """Start a ~1 s forward (32 sequences of 1024 tokens) and return once it is running."""
    big = np.random.default_rng(2).standard_normal((32, 1024, 512)).astype(np.float32)
    pool = ThreadPoolExecutor(1)
    pool.submit(post, server, big)
    deadline = time.monotonic() + 30
    while server.metric("mha_engine_busy") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metric("mha_engine_busy") == 1
    return pool


BLOCKING_ARGS = ("--max-batch-tokens", "32768", "--max-body-bytes", "100000000")


def test_deadline_expires_in_queue_and_never_runs(tmp_path: Path) -> None:
    small = np.ones((1, 4, 512), dtype=np.float32)
    with run_server(tmp_path, *BLOCKING_ARGS) as server:
        base_sequences = server.metric("mha_sequences_processed_total")
        pool = _block_engine(server)
        # tritonclient's `timeout` parameter is in microseconds: 50 ms here.
        response = post(server, small, timeout=50_000)
        assert response.status_code == 504, response.status_code
        assert "timed out" in response.json()["error"]
        pool.shutdown(wait=True)
        assert server.metric("mha_request_failures_total", reason="timeout") == 1
        # Only the 32 blocking sequences were computed; the expired one never was.
        assert server.metric("mha_sequences_processed_total") - base_sequences == 32


def test_disconnected_client_frees_its_queue_slot(tmp_path: Path) -> None:
    with run_server(tmp_path, *BLOCKING_ARGS) as server:
        base_sequences = server.metric("mha_sequences_processed_total")
        pool = _block_engine(server)
        content, headers = fp32_request(np.ones((3, 4, 512), dtype=np.float32))
        request = (
            f"POST {URL} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(content)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "\r\n"
        )
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request.encode() + content)
            deadline = time.monotonic() + 10
            while server.metric("mha_queue_depth_sequences") != 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.metric("mha_queue_depth_sequences") == 3
        deadline = time.monotonic() + 10  # socket closed: the slot must free before the engine
        while server.metric("mha_queue_depth_sequences") != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.metric("mha_queue_depth_sequences") == 0
        pool.shutdown(wait=True)
        assert server.metric("mha_request_failures_total", reason="client_disconnected") == 1
        assert server.metric("mha_sequences_processed_total") - base_sequences == 32


def test_poisoned_request_fails_alone(tmp_path: Path) -> None:
    """Finite inputs whose outputs overflow to NaN fail with 422, inputs holding NaN with 400
    (found on the batch, not per request); their batch-mates are unharmed."""
    rng = np.random.default_rng(9)
    good = [rng.standard_normal((1, 6, 512)).astype(np.float32) for _ in range(6)]
    poison = np.full((1, 6, 512), 3e38, dtype=np.float32)  # finite, but overflows in the GEMMs
    nan = good[0].copy()
    nan[0, 2, 5] = np.nan
    expected = [mha_engine.demo_module().eval()(torch.from_numpy(x)).detach() for x in good]
    with (
        run_server(tmp_path, "--max-batch-delay-ms", "50") as server,
        ThreadPoolExecutor(8) as pool,
    ):
        before = server.metric("mha_batches_total", outcome="ok")
        futures = [pool.submit(post, server, x) for x in [*good[:3], poison, nan, *good[3:]]]
        responses = [f.result() for f in futures]
        batches = server.metric("mha_batches_total", outcome="ok") - before
    assert responses[3].status_code == 422
    assert "not finite" in responses[3].json()["error"]
    assert responses[4].status_code == 400
    assert "input 'input' holds NaN or Inf" in responses[4].json()["error"]
    for response, want in zip(responses[:3] + responses[5:], expected, strict=True):
        torch.testing.assert_close(
            torch.from_numpy(output_of(response)), want, atol=1e-5, rtol=1.3e-6
        )
    assert batches < 8  # the poisons really shared a forward with others

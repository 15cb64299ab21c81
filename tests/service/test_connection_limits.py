"""Connection limits on a real server: header, body, keep-alive and write timeouts, the cap on
open connections, and the cap on response bytes waiting for slow readers (small values here)."""

from __future__ import annotations

import socket
import time

import httpx
import numpy as np
import pytest

from tests.support import binary_request, run_server

INFER = "/v2/models/mha/infer"
HOST = "127.0.0.1"
LIVE_BODY = b'{"live":true}'  # /v2/health/live's answer


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory):
    """Every timeout short, a 16 MiB cap on response bytes being written."""
    args = (
        "--header-timeout-s", "0.5", "--keep-alive-timeout-s", "0.5",
        "--body-timeout-s", "0.5", "--body-min-rate", "10000",
        "--write-timeout-s", "4", "--max-pending-response-bytes", str(16 * 1024 * 1024),
    )  # fmt: skip
    with run_server(tmp_path_factory.mktemp("quick"), *args) as server:
        yield server


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory):
    """At most 24 connections; timeouts long enough not to be what closes them."""
    args = ("--max-connections", "24", "--header-timeout-s", "60", "--body-timeout-s", "60")
    with run_server(tmp_path_factory.mktemp("capped"), *args) as server:
        yield server


def _connect(port: int, data: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((HOST, port))
    if data:
        sock.sendall(data)
    return sock


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it closed the connection within `timeout`."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


def _post_head(length: int) -> bytes:
    return (
        f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_idle_half_sent_and_kept_alive_connections_are_closed(quick) -> None:
    idle = [_connect(quick.port) for _ in range(4)]
    half_headers = [
        _connect(quick.port, b"GET /v2/health/live HTTP/1.1\r\nHost:") for _ in range(4)
    ]
    half_body = [_connect(quick.port, _post_head(10**6) + b'{"inp') for _ in range(4)]
    kept = [
        _connect(quick.port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n") for _ in range(4)
    ]
    started = time.monotonic()
    results = {
        name: [_read_until_closed(s, 5) for s in socks]
        for name, socks in (("idle", idle), ("headers", half_headers), ("body", half_body),
                            ("kept", kept))
    }  # fmt: skip
    assert time.monotonic() - started < 5
    for name, answers in results.items():
        assert all(closed for _, closed in answers), name
    assert all(data == b"" for data, _ in results["idle"])  # nothing asked, nothing said
    assert all(data.startswith(b"HTTP/1.1 408") for data, _ in results["headers"])
    assert all(data.startswith(b"HTTP/1.1 408") for data, _ in results["body"])
    assert all(data.startswith(b"HTTP/1.1 200") for data, _ in results["kept"])
    for sock in idle + half_headers + half_body + kept:
        sock.close()


def test_half_sent_headers_of_a_later_request_time_out(quick) -> None:
    """The header timer of a kept-alive connection's next request starts with its first bytes
    (uvicorn's keep-alive timer stops there: without ours the connection would stay open)."""
    sock = _connect(quick.port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    first = b""
    while not first.endswith(LIVE_BODY):  # uvicorn writes the head and the body separately:
        first += sock.recv(65536)  # one recv may return the head alone
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost:")
    started = time.monotonic()
    data, closed = _read_until_closed(sock, 5)
    assert closed and time.monotonic() - started < 4
    assert data.startswith(b"HTTP/1.1 408") and b"--header-timeout-s" in data
    sock.close()


def test_slow_uploader_leaves_in_flight(quick) -> None:
    sock = _connect(quick.port, _post_head(10**6) + b"{")
    time.sleep(0.2)
    assert quick.metric("mha_requests_in_flight") == 1
    data, closed = _read_until_closed(sock, 5)
    assert closed and data.startswith(b"HTTP/1.1 408") and b"--body-min-rate" in data
    assert quick.metric("mha_requests_in_flight") == 0
    assert quick.metric("mha_request_failures_total", reason="body_timeout") >= 1
    assert quick.metric("mha_requests_total", status="408") >= 1


def test_health_answers_while_idle_clients_hold_every_slot(capped) -> None:
    base = capped.open_fds()
    holders = [_connect(capped.port) for _ in range(60)]
    holders += [_connect(capped.port, b"GET / HTTP/1.1\r\nHo") for _ in range(20)]
    try:
        for _ in range(10):
            started = time.monotonic()
            assert httpx.get(f"{capped.url}/v2/health/ready", timeout=5).status_code == 200
            assert time.monotonic() - started < 1
        time.sleep(0.2)
        assert capped.open_fds() <= base + 24 + 2  # the cap, not 80 sockets
        assert httpx.post(f"{capped.url}{INFER}", json={"inputs": []}).status_code == 400
    finally:
        for sock in holders:
            sock.close()


def test_connection_over_the_cap_gets_503_when_every_slot_is_busy(capped) -> None:
    time.sleep(0.3)  # the previous test's sockets are gone
    busy = [_connect(capped.port, _post_head(10**6) + b"{") for _ in range(24)]
    try:
        time.sleep(0.3)
        answer = httpx.get(f"{capped.url}/v2/health/live", timeout=5)
        assert answer.status_code == 503 and "--max-connections" in answer.json()["error"]
    finally:
        for sock in busy:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{capped.url}/v2/health/live", timeout=5).status_code == 200


def _json_output_request(seq_len: int) -> tuple[bytes, dict[str, str]]:
    x = np.random.default_rng(0).standard_normal((1, seq_len, 512), np.float32)
    header = {
        "inputs": [
            {"name": "input", "shape": list(x.shape), "datatype": "FP32",
             "parameters": {"binary_data_size": x.nbytes}}
        ],
        "outputs": [{"name": "output", "parameters": {"binary_data": False}}],
    }  # fmt: skip
    return binary_request(header, x.tobytes())


def _raw_post(body: bytes, headers: dict[str, str]) -> bytes:
    head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + body


def test_stalled_reader_is_bounded_then_aborted(quick) -> None:
    body, headers = _json_output_request(2048)  # JSON output of 11 MB: more than the kernel buffers
    stalled = _connect(quick.port, _raw_post(body, headers), rcvbuf=4096)  # never reads
    deadline = time.monotonic() + 20
    stalled.setblocking(False)
    while time.monotonic() < deadline:  # until the server has started writing to it
        try:
            if stalled.recv(1, socket.MSG_PEEK):
                break
        except BlockingIOError:
            time.sleep(0.05)
    stalled.setblocking(True)
    # A second large response would put more than 16 MiB in flight to clients: 503, no work kept.
    second = httpx.post(f"{quick.url}{INFER}", content=body, headers=headers, timeout=30)
    assert second.status_code == 503, (second.status_code, len(second.content))
    assert second.headers["retry-after"] == "1"
    assert "--max-pending-response-bytes" in second.json()["error"]
    assert quick.metric("mha_request_failures_total", reason="backpressure") == 1  # not encoded
    # The stalled reader is cut off after --write-timeout-s; its share of the cap comes back.
    time.sleep(4.5)
    data, closed = _read_until_closed(stalled, 5)
    length = int(data.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    assert closed and len(data.split(b"\r\n\r\n", 1)[1]) < length
    third = httpx.post(f"{quick.url}{INFER}", content=body, headers=headers, timeout=30)
    assert third.status_code == 200 and len(third.content) == length

"""What a hostile client does to a real server's connections: a 4xx (overflowing shape, bad
data) keeps the keep-alive connection usable for the next request, and a client that leaves
mid-body is a 499 `client_disconnected` logged at INFO, never a 500 with a traceback."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support import Server, fp32_request, run_server

INFER = "/v2/models/mha/infer"
HUGE = [4294967296, 4294967296]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(tmp_path_factory.mktemp("conn")) as server:
        yield server


def bad_requests() -> list[tuple[bytes, dict[str, str]]]:
    """Overflowing shapes (JSON and binary, input and mask) and non-number data."""
    json_input = {"inputs": [{"name": "input", "shape": [1, *HUGE], "datatype": "FP32",
                              "data": []}]}  # fmt: skip
    head = json.dumps({"inputs": [
        {"name": "input", "shape": [1, 2, 512], "datatype": "FP32",
         "parameters": {"binary_data_size": 4096}},
        {"name": "key_padding_mask", "shape": HUGE, "datatype": "BOOL",
         "parameters": {"binary_data_size": 0}},
    ]}).encode()  # fmt: skip
    strings = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32",
                           "data": ["0.1"] * 512}]}  # fmt: skip
    return [
        (json.dumps(json_input).encode(), {}),
        (head + bytes(4096), {"Inference-Header-Content-Length": str(len(head))}),
        (json.dumps(strings).encode(), {}),
    ]


def http_exchange(sock: socket.socket, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    """One request on an open socket; the status and headers of its complete response."""
    head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "server closed the connection"
        data += chunk
    raw_head, rest = data.split(b"\r\n\r\n", 1)
    lines = raw_head.decode("latin-1").split("\r\n")
    fields = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(fields["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "server closed the connection mid-response"
        rest += chunk
    return int(lines[0].split()[1]), fields


def test_4xx_keeps_the_keep_alive_connection_usable(server: Server) -> None:
    good, good_headers = fp32_request(np.ones((1, 3, 512), np.float32))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for body, headers in bad_requests():
            status, fields = http_exchange(sock, body, headers)
            assert status == 400, status
            assert fields.get("connection", "").lower() != "close", fields
            # The next valid request goes over the very same socket.
            assert http_exchange(sock, good, good_headers)[0] == 200
    with httpx.Client(base_url=server.url, limits=httpx.Limits(max_connections=1)) as client:
        for body, headers in bad_requests() * 3:
            assert client.post(INFER, content=body, headers=headers).status_code == 400
            assert client.post(INFER, content=good, headers=good_headers).status_code == 200


def test_tritonclient_keeps_working_after_a_bad_shape(server: Server) -> None:
    client = triton.InferenceServerClient(server.address)  # one connection
    x = np.ones((1, 3, 512), np.float32)
    good = triton.InferInput("input", list(x.shape), "FP32")
    good.set_data_from_numpy(x)
    for _ in range(3):
        bad = triton.InferInput("input", [1, 0, 512], "FP32")
        bad.set_data_from_numpy(np.ones((1, 0, 512), np.float32))
        bad.set_shape([1, *HUGE])  # a hostile header: 2**64 elements (0 in int64), 0 bytes sent
        with pytest.raises(InferenceServerException, match="input 'input'"):
            client.infer("mha", [bad])
        assert client.infer("mha", [good]).as_numpy("output").shape == (1, 3, 512)


def test_client_leaving_mid_body_is_499_at_info(server: Server) -> None:
    before_500 = server.metric("mha_requests_total", status="500") if "status=\"500\"" in (
        server.metrics()) else 0.0  # fmt: skip
    head = (
        f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
        "Inference-Header-Content-Length: 100\r\n\r\n"
    )
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head.encode() + bytes(1000))
            time.sleep(0.1)  # the server is waiting for the rest of the body; leave
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.metric("mha_request_failures_total", reason="client_disconnected") >= 3:
            break
        time.sleep(0.05)
    assert server.metric("mha_request_failures_total", reason="client_disconnected") == 3
    assert server.metric("mha_requests_total", status="499") == 3
    assert server.metric("mha_request_failures_total", reason="inference_error") == 0
    metrics = server.metrics()
    after_500 = (
        server.metric("mha_requests_total", status="500") if 'status="500"' in metrics else 0
    )
    assert after_500 == before_500
    log = server.log()
    assert log.count(f"INFO service.access: POST {INFER} 499") == 3, log[-2000:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]

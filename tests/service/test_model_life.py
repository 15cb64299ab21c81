"""A model's life under traffic, on a real server in --model-control-mode explicit, with the
unmodified tritonclient over HTTP and gRPC: reloads never fail a request addressed to the model;
while it is unloaded and loaded again, requests get 200 or a 404 / NOT_FOUND naming the model
(never 503 "shutting down"); after an unload both protocols say "not ready" (gRPC's
is_model_ready returns False, as against Triton, rather than raising)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from tests.support import Server, free_port, run_server

NAME = "attn"
OTHER = "keep"  # a second model, so `attn` is never the last one loaded
EMBED_DIM = 32
CYCLES = 20  # reloads / unload-load cycles per test
LOOP_S = 20.0  # and never longer than this
NOT_FOUND = {"404", "StatusCode.NOT_FOUND"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    root = tmp_path_factory.mktemp("life")
    repo = root / "repository"
    torch.manual_seed(4)
    for name in (NAME, OTHER):
        module = nn.MultiheadAttention(EMBED_DIM, 4, batch_first=True).eval()
        mha_engine.save_model(module, repo / name / "1")
    port = free_port()
    args = ("--model-repository", str(repo), "--model-control-mode", "explicit")
    with run_server(root, *args, "--grpc-port", str(port)) as http:
        yield http, f"127.0.0.1:{port}"


class Traffic:
    """Requests to NAME back to back, two threads per protocol, until stopped; every answer is
    recorded as (protocol, status, message)."""

    def __init__(self, http: Server, address: str) -> None:
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        pairs = [(thttp, http.address), (tgrpc, address)] * 2
        self.threads = [threading.Thread(target=self._loop, args=pair) for pair in pairs]

    def _loop(self, module, address: str) -> None:
        client = module.InferenceServerClient(address)
        x = np.full((8, 64, EMBED_DIM), 0.5, np.float32)  # 16K values: ~100 KB of JSON
        item = module.InferInput("input", list(x.shape), "FP32")
        if module is thttp:  # JSON bodies this large are read and decoded off the event loop:
            item.set_data_from_numpy(x, binary_data=False)  # a request spends a while in flight
        else:
            item.set_data_from_numpy(x)
        protocol = module.__name__.rsplit(".", 1)[1]
        while not self.stop.is_set():
            try:
                shape = client.infer(NAME, [item]).as_numpy("output").shape
            except InferenceServerException as exc:
                with self.lock:
                    self.errors.append((protocol, str(exc.status()), exc.message() or ""))
                continue
            except Exception as exc:  # a dropped connection, a client-side failure
                with self.lock:
                    self.errors.append((protocol, type(exc).__name__, str(exc)))
                continue
            with self.lock:
                if shape == x.shape:
                    self.ok += 1
                else:
                    self.errors.append((protocol, "200", f"output shape {shape}"))

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self.threads)


def cycles() -> Iterator[int]:
    """CYCLES iterations, cut short after LOOP_S seconds."""
    deadline = time.monotonic() + LOOP_S
    for i in range(CYCLES):
        if time.monotonic() > deadline:
            return
        yield i


def ensure_loaded(http: Server) -> None:
    client = thttp.InferenceServerClient(http.address)
    if not client.is_model_ready(NAME):
        client.load_model(NAME)


def test_reloads_under_traffic_fail_no_request(server) -> None:
    http, address = server
    ensure_loaded(http)
    clients = [thttp.InferenceServerClient(http.address), tgrpc.InferenceServerClient(address)]
    with Traffic(http, address) as traffic:
        for i in cycles():
            clients[i % 2].load_model(NAME)  # a reload: the new copy replaces the old
    assert traffic.errors == [], traffic.errors[:5]
    assert traffic.ok > 0


def test_unload_load_under_traffic_answers_200_or_not_found(server) -> None:
    http, address = server
    ensure_loaded(http)
    clients = [thttp.InferenceServerClient(http.address), tgrpc.InferenceServerClient(address)]
    with Traffic(http, address) as traffic:
        for i in cycles():
            clients[i % 2].unload_model(NAME)
            clients[(i + 1) % 2].load_model(NAME)
    wrong = [
        error
        for error in traffic.errors
        if error[1] not in NOT_FOUND or f"'{NAME}'" not in error[2]
    ]
    assert wrong == [], wrong[:5]
    assert traffic.ok > 0


def test_unloaded_model_is_not_ready_over_both_protocols(server) -> None:
    http, address = server
    ensure_loaded(http)
    http_client = thttp.InferenceServerClient(http.address)
    grpc_client = tgrpc.InferenceServerClient(address)
    assert http_client.is_model_ready(NAME) and grpc_client.is_model_ready(NAME)
    http_client.unload_model(NAME)
    try:
        assert http_client.is_model_ready(NAME) is False
        assert grpc_client.is_model_ready(NAME) is False  # Triton's answer, not an exception
        assert grpc_client.is_model_ready(NAME, "1") is False
        assert grpc_client.is_model_ready(OTHER) is True
    finally:
        http_client.load_model(NAME)
    assert http_client.is_model_ready(NAME) and grpc_client.is_model_ready(NAME)

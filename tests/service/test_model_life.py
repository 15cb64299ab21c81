"""A model's life under traffic, on a real server in --model-control-mode explicit, with the
unmodified tritonclient over HTTP and gRPC: reloads never fail a request addressed to the model;
while it is unloaded and loaded again, requests get 200 or a 404 / NOT_FOUND naming the model
(never 503 "shutting down"); after an unload both protocols say "not ready" (gRPC's
is_model_ready returns False, as it does against Triton, rather than raising)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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


@dataclass
class Answers:
    """What the traffic got: successes, and (protocol, status, message) of every failure."""

    ok: int = 0
    errors: list[tuple[str, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def requests_until(stop: threading.Event, module, address: str, answers: Answers) -> None:
    """Requests to NAME over one protocol (tritonclient's `module`), back to back until `stop`."""
    client = module.InferenceServerClient(address)
    x = np.full((8, 64, EMBED_DIM), 0.5, np.float32)  # 16K values: ~100 KB of JSON
    item = module.InferInput("input", list(x.shape), "FP32")
    if module is thttp:  # JSON bodies this large are read and decoded off the event loop:
        item.set_data_from_numpy(x, binary_data=False)  # a request spends a while in flight
    else:
        item.set_data_from_numpy(x)
    protocol = module.__name__.rsplit(".", 1)[1]
    while not stop.is_set():
        try:
            shape = client.infer(NAME, [item]).as_numpy("output").shape
            error = None if shape == x.shape else (protocol, "200", f"output shape {shape}")
        except InferenceServerException as exc:
            error = (protocol, str(exc.status()), exc.message() or "")
        except Exception as exc:  # a dropped connection, a client-side failure
            error = (protocol, type(exc).__name__, str(exc))
        with answers.lock:
            if error:
                answers.errors.append(error)
            else:
                answers.ok += 1


def cycles_under_traffic(server, cycle: Callable[[list, int], None]) -> Answers:
    """`cycle(clients, i)` CYCLES times (cut short after LOOP_S seconds) while two threads per
    protocol send requests to NAME; clients: [HTTP, gRPC] model-control clients."""
    http, address = server
    control = [thttp.InferenceServerClient(http.address), tgrpc.InferenceServerClient(address)]
    if not control[0].is_model_ready(NAME):
        control[0].load_model(NAME)
    answers, stop = Answers(), threading.Event()
    pairs = [(thttp, http.address), (tgrpc, address)] * 2
    threads = [threading.Thread(target=requests_until, args=(stop, *p, answers)) for p in pairs]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + LOOP_S
    try:
        for i in range(CYCLES):
            if time.monotonic() > deadline:
                break
            cycle(control, i)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert answers.ok > 0
    return answers


def test_reloads_under_traffic_fail_no_request(server) -> None:
    def reload(clients: list, i: int) -> None:
        clients[i % 2].load_model(NAME)  # a reload: the new copy replaces the old

    answers = cycles_under_traffic(server, reload)
    assert answers.errors == [], answers.errors[:5]


def test_unload_load_under_traffic_answers_200_or_not_found(server) -> None:
    def unload_load(clients: list, i: int) -> None:
        clients[i % 2].unload_model(NAME)
        clients[(i + 1) % 2].load_model(NAME)

    answers = cycles_under_traffic(server, unload_load)
    wrong = [e for e in answers.errors if e[1] not in NOT_FOUND or f"'{NAME}'" not in e[2]]
    assert wrong == [], wrong[:5]


def test_unloaded_model_is_not_ready_over_both_protocols(server) -> None:
    http, address = server
    http_client = thttp.InferenceServerClient(http.address)
    grpc_client = tgrpc.InferenceServerClient(address)
    if not http_client.is_model_ready(NAME):
        http_client.load_model(NAME)
    assert grpc_client.is_model_ready(NAME)
    http_client.unload_model(NAME)
    try:
        assert http_client.is_model_ready(NAME) is False
        assert grpc_client.is_model_ready(NAME) is False  # Triton's answer, not an exception
        assert grpc_client.is_model_ready(NAME, "1") is False
        assert grpc_client.is_model_ready(OTHER) is True
    finally:
        http_client.load_model(NAME)
    assert http_client.is_model_ready(NAME) and grpc_client.is_model_ready(NAME)

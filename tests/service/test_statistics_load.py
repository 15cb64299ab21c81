"""Triton's statistics under concurrent load with failures mixed in, on a real server: every
snapshot (HTTP /v2/models/{m}/stats and gRPC ModelStatistics, sampled many times while requests
run over both protocols) has success == queue == compute_input == compute_infer ==
compute_output; failed requests are counted in `fail` only. perf_analyzer needs exactly this
(it aborts when the compute counts differ)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
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
EMBED_DIM = 32
EXECUTED = ("success", "queue", "compute_input", "compute_infer", "compute_output")
SAMPLES = 60  # snapshots taken while the load runs
MIN_REQUESTS = 24  # per load thread, at least (it goes on until the sampler is done)
BAD_EVERY = 4  # one request in four fails validation (wrong embed_dim)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    torch.manual_seed(0)
    model_dir = tmp_path_factory.mktemp("stats") / NAME
    mha_engine.save_model(nn.MultiheadAttention(EMBED_DIM, 4, batch_first=True).eval(), model_dir)
    port = free_port()
    args = ("--model-dir", str(model_dir), "--grpc-port", str(port))
    with run_server(model_dir.parent, *args) as http:
        yield http, f"127.0.0.1:{port}"


def http_counts(server: Server) -> dict[str, int]:
    body = httpx.get(f"{server.url}/v2/models/{NAME}/stats", timeout=30).json()
    (stats,) = body["model_stats"]
    return {kind: int(d["count"]) for kind, d in stats["inference_stats"].items()}


def grpc_counts(client: tgrpc.InferenceServerClient) -> dict[str, int]:
    (stats,) = client.get_inference_statistics(NAME).model_stats  # the message: zeros kept
    inference = stats.inference_stats
    return {kind: getattr(inference, kind).count for kind in (*EXECUTED, "fail")}


class Load:
    """Requests over one protocol, every BAD_EVERY-th with the wrong embed_dim, until `stop` is
    set and at least MIN_REQUESTS were sent; counts what was answered and how."""

    def __init__(self, module, address: str, stop: threading.Event) -> None:
        self.module, self.address, self.stop = module, address, stop
        self.good = self.bad = 0
        self.unexpected: list[str] = []
        self.thread = threading.Thread(target=self.run)

    def item(self, embed_dim: int):
        x = np.full((1, 6, embed_dim), 0.25, np.float32)
        item = self.module.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        return item

    def run(self) -> None:
        client = self.module.InferenceServerClient(self.address)
        good, bad = self.item(EMBED_DIM), self.item(EMBED_DIM + 1)
        sent = 0
        while sent < MIN_REQUESTS or not self.stop.is_set():
            failing = sent % BAD_EVERY == BAD_EVERY - 1
            sent += 1
            try:
                result = client.infer(NAME, [bad if failing else good])
            except InferenceServerException as exc:
                if failing and exc.status() in ("400", "StatusCode.INVALID_ARGUMENT"):
                    self.bad += 1
                else:
                    self.unexpected.append(f"{exc.status()}: {exc.message()}")
                continue
            if failing or result.as_numpy("output").shape != (1, 6, EMBED_DIM):
                self.unexpected.append(f"request {sent} (bad: {failing}) answered 200")
            else:
                self.good += 1


def test_counts_agree_in_every_snapshot_under_load(server) -> None:
    http, address = server
    client = tgrpc.InferenceServerClient(address)
    before = http_counts(http)
    assert grpc_counts(client) == before
    stop = threading.Event()
    loads = [Load(module, a, stop) for module, a in ((thttp, http.address), (tgrpc, address)) * 2]
    for load in loads:
        load.thread.start()
    snapshots = []
    try:
        for i in range(SAMPLES):
            snapshots.append(http_counts(http) if i % 2 else grpc_counts(client))
    finally:
        stop.set()
        for load in loads:
            load.thread.join(120)
    assert not any(load.thread.is_alive() for load in loads)
    assert [u for load in loads for u in load.unexpected] == []

    differing = [s for s in snapshots if len({s[kind] for kind in EXECUTED}) != 1]
    assert differing == [], (
        f"{len(differing)} of {len(snapshots)} snapshots differ: {differing[:3]}"
    )
    good, bad = sum(load.good for load in loads), sum(load.bad for load in loads)
    assert good > 0 and bad > 0
    want = {kind: before[kind] + good for kind in EXECUTED} | {"fail": before["fail"] + bad}
    for _ in range(100):  # a request's statistics may land just after its answer is sent
        if http_counts(http) == want:
            break
        time.sleep(0.1)
    assert http_counts(http) == want, (good, bad)
    assert grpc_counts(client) == want

"""The request path's CPU settings and bookkeeping: engine threads, the CLI's threading
defaults, sampled access logging, request ids."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

import mha_engine
from service.__main__ import CPU_DEFAULTS, cpu_defaults
from service.runtime.batcher import DynamicBatcher
from tests.support import ROOT, fp32_request, run_server

URL = "/v2/models/mha/infer"


def _num_threads(model: object) -> int:
    return torch.get_num_threads()


def _threads_on_engine(threads: int | None) -> int:
    """torch.get_num_threads() as the engine thread sees it."""
    model = mha_engine.build_demo_model(device="cpu")
    batcher = DynamicBatcher(
        model, max_batch_size=4, max_batch_tokens=64, max_batch_delay_s=0, max_queue=4,
        threads=threads,
    )  # fmt: skip

    async def ask() -> int:
        item = batcher.run_exclusive(_num_threads, sequences=1, deadline=1e12)
        return await item.future

    batcher.start()
    try:
        return asyncio.run(ask())
    finally:
        batcher.stop(timeout=10)


def test_threads_sets_the_engine_threads_intra_op_threads() -> None:
    assert _threads_on_engine(1) == 1
    assert _threads_on_engine(3) == 3


def test_cli_sets_threading_defaults_before_torch_loads(monkeypatch) -> None:
    # The CLI module does not import torch, so `main` can set the environment first.
    code = "import sys, service.__main__; print('torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in CPU_DEFAULTS}
    found = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "False"
    for key in CPU_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # what the operator set wins
    cpu_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def _access_lines(log: str) -> list[dict]:
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("logger") == "service.access"]


def test_access_log_sampling_keeps_every_failure(tmp_path: Path) -> None:
    content, headers = fp32_request(np.zeros((1, 4, 512), np.float32))
    args = ("--access-log-sample-rate", "0", "--log-format", "json")
    with run_server(tmp_path, *args) as server:
        for _ in range(5):
            assert httpx.post(f"{server.url}{URL}", content=content, headers=headers).is_success
        bad = httpx.post(f"{server.url}{URL}", content=b"{", headers={"X-Request-ID": "bad-1"})
        assert bad.status_code == 400
        deadline = time.monotonic() + 10
        # wait for this route's line: readiness polls answered 503 at start are logged too,
        # and may be all the log holds when the 400's line is still being written
        while time.monotonic() < deadline:
            if any(e["path"] == URL for e in _access_lines(server.log())):
                break
            time.sleep(0.05)
        access = _access_lines(server.log())
        assert server.metric("mha_requests_total", endpoint="infer", status="200") == 5
    # (the launcher's readiness polls answered 503 while warming up: failures, so logged too)
    assert [(e["request_id"], e["status"]) for e in access if e["path"] == URL] == [("bad-1", 400)]

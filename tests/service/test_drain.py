"""SIGTERM past --drain-grace-s on a real server: what had not started when the grace ended is
answered 503 with Retry-After and never computed, what had started finishes, and the process
exits within the grace plus about one forward. And what waits for batch-mates runs as soon as
draining starts: none can join it any more."""

from __future__ import annotations

import asyncio
import math
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import mha_engine
from benchmarks import reliability
from service.runtime.metrics import Metrics
from service.runtime.settings import Settings
from service.runtime.state import LISTENER_ANSWER_S, ServiceState
from tests.support import FP32_TOL, Server, binary_output, fp32_request, run_server, wait_for

GRACE_S = 1.0
SEQ_LEN = 1024  # long forwards, one sequence per batch: the queue outlasts the grace


def test_work_not_started_when_the_grace_ends_gets_503_and_is_never_computed(
    tmp_path: Path,
) -> None:
    args = ("--max-batch-size", "1", "--drain-grace-s", str(GRACE_S), "--request-timeout-s", "120")
    with run_server(tmp_path, *args) as server:
        body, headers = reliability.binary_body(1, SEQ_LEN)
        forward_s = math.inf
        for _ in range(2):  # the warm time: the first request also pays for warming up
            started = time.monotonic()
            assert httpx.post(f"{server.url}{reliability.PATH}", content=body, headers=headers,
                              timeout=60).status_code == 200  # fmt: skip
            forward_s = min(forward_s, time.monotonic() - started)
        # Enough queued forwards to outlast the grace about three times, however fast the
        # engine is here, and never fewer than 48 (a CI run once measured a slow warm forward,
        # sent 26, and all were answered before SIGTERM went out); at most the client's 64
        # connections, so all are in flight at once. What the grace does not reach is shed
        # (503), so more requests cost no time.
        requests = min(64, max(48, math.ceil(3 * GRACE_S / forward_s) + 4))
        r = reliability.drain(server, requests=requests, seq_len=SEQ_LEN)
        log = server.log()
    assert set(r["statuses"]) <= {200, 503}, r  # never a 500, never a dropped connection
    assert r["statuses"].get(503, 0) >= 1 and r["statuses"].get(200, 0) >= 1, r
    assert r["503_without_retry_after"] == 0, r
    # Exit within the grace plus the forward that was running (and a little process teardown).
    assert r["exit_after_s"] < GRACE_S + 2 * forward_s + 2.0, (r, forward_s)
    assert r["returncode"] in (0, -signal.SIGTERM), r
    shed = re.search(r"drain grace over: (\d+) queued requests answered 503, not computed", log)
    assert shed and int(shed.group(1)) == r["statuses"][503], log[-3000:]
    assert "Traceback" not in log and " 500" not in log, log[-3000:]


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one-process", "workers"])
def test_sigterm_runs_queued_batches_without_waiting_out_the_delay(
    tmp_path: Path, workers: tuple[str, ...]
) -> None:
    """A 60 s batch delay holds four requests queued. SIGTERM: no request can join them any
    more, so they run at once (200, PyTorch's numbers) and the server exits in seconds, rather
    than waiting out the delay and being shed at the end of the 20 s grace."""
    args = (*workers, "--max-batch-delay-ms", "60000", "--drain-grace-s", "20",
            "--request-timeout-s", "120")  # fmt: skip
    module = mha_engine.demo_module().eval()
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((1, 6, 512), dtype=np.float32) for _ in range(4)]
    with run_server(tmp_path, *args) as server:
        with ThreadPoolExecutor(len(inputs)) as pool:
            answers = [pool.submit(_post, server.url, x) for x in inputs]
            wait_for(lambda: _queued(server) == len(inputs), "the four requests queued", 30)
            server.process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            responses = [answer.result(timeout=60) for answer in answers]
            answered_s = time.monotonic() - sent
        code = server.process.wait(30)
        log = server.log()
    assert [r.status_code for r in responses] == [200] * len(inputs), log[-3000:]
    assert answered_s < 10, answered_s  # not the 20 s grace, nor the 60 s delay
    for x, r in zip(inputs, responses, strict=True):
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(binary_output(r.content, r.headers), want, **FP32_TOL)
    assert code in (0, -signal.SIGTERM), log[-3000:]  # uvicorn re-raises the signal it caught
    assert "Traceback" not in log and "queued requests answered 503" not in log, log[-3000:]


def _post(url: str, x: np.ndarray) -> httpx.Response:
    body, headers = fp32_request(x)
    return httpx.post(f"{url}{reliability.PATH}", content=body, headers=headers, timeout=60)


def _queued(server: Server) -> float:
    try:
        return server.metric("mha_queue_depth_sequences")
    except (KeyError, httpx.HTTPError):
        return 0.0


def test_the_grpc_listener_is_cut_off_only_after_the_grace_has_shed_the_queue() -> None:
    """gRPC cancels calls at its cut-off from its own timer (UNAVAILABLE "Cancelling all calls",
    without our message or request id); the grace timer on the loop answers queued ones with
    ours. The listener's cut-off must come later."""

    async def scenario() -> tuple[float, float, bool]:
        state = ServiceState(Settings(drain_grace_s=5.0), Metrics("m"), {})
        state.loop = asyncio.get_running_loop()
        seen: list[tuple[float, float, bool]] = []

        async def stop_listener(grace: float) -> None:
            armed = state.grace_timer is not None  # the timer that sheds the queue
            seen.append((grace, state.grace_left(), armed))

        await state.drain(stop_listener)
        return seen[0]

    listener_grace, grace_left, armed = asyncio.run(scenario())
    assert armed and 4.5 < grace_left <= 5.0
    assert listener_grace == pytest.approx(grace_left + LISTENER_ANSWER_S, abs=0.05)

"""Overload, soak and drain, CI-sized (benchmarks.reliability runs the long versions)."""

from __future__ import annotations

import signal

import httpx
import pytest

from benchmarks import reliability
from benchmarks.reliability import QUIET
from benchmarks.server import running

MAX_QUEUE = 48
TIMEOUT_S = 3.0


def test_four_times_capacity_is_shed_with_429_and_recovers() -> None:
    with running(
        *QUIET, "--max-queue", str(MAX_QUEUE), "--request-timeout-s", str(TIMEOUT_S)
    ) as server:
        r = reliability.overload(server.port, factor=4.0, seconds=6.0)
    assert not r["connection_errors"], r
    assert r["answered"] == r["offered"], r  # every request answered
    assert set(r["statuses"]) == {200, 429}, r  # 200 or 429, nothing else
    assert r["429_without_retry_after"] == 0, r
    assert r["p99_accepted_s"] <= TIMEOUT_S + 1.0, r  # accepted ones stay within the deadline
    assert r["max_queue_depth"] <= MAX_QUEUE, r
    assert set(r["ready_probes"]) == {200}, r  # readiness never flapped
    assert r["rss_after"] < r["rss_before"] * 1.25 + 50e6, r
    # Noisy shared machine: "recovers" means most of the capacity is back at once.
    assert r["recovered_rps"] >= 0.6 * r["capacity_rps"], r


def test_short_soak_keeps_memory_fds_and_threads_flat() -> None:
    with running(*QUIET) as server:
        r = reliability.soak(server, seconds=12.0)
    assert r["requests"] > 0 and set(r["statuses"]) == {200}, r
    assert r["rss_growth"] < 0.05, r
    assert r["fds"][1] <= r["fds"][0] + 2, r
    assert r["threads"][1] <= r["threads"][0], r


def test_sigterm_under_load_answers_every_accepted_request() -> None:
    with running(*QUIET, "--max-batch-size", "1") as server:
        r = reliability.drain(server, requests=12)
        with pytest.raises(httpx.ConnectError):  # and new connections are refused
            httpx.get(f"{server.url}/v2/health/live", timeout=2)
    assert r["statuses"] == {200: 12}, r
    assert r["exit_after_s"] < 60, r
    # uvicorn re-raises the signal after its graceful shutdown, so the status is -SIGTERM.
    assert r["returncode"] in (0, -signal.SIGTERM), r

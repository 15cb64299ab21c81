"""Reliability scenarios with figures: overload, soak and drain, against a real server.

`python -m benchmarks.reliability all --seconds 60` runs each scenario on a fresh server
on loopback and prints a RELIABILITY.md table row per scenario. The tests run the same
functions with short durations.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import scrape
from benchmarks.client import binary_infer_body, build_request, run_load, run_open_loop
from benchmarks.server import HOST, ROOT, Proc, running

PATH = "/v2/models/mha/infer"
QUIET = ("--log-level", "warning")  # no access-log line per request during measurements


def binary_body(batch: int, seq_len: int, embed_dim: int = 512) -> tuple[bytes, dict[str, str]]:
    """A binary-extension request of random float32 hidden states (B, T, E)."""
    rng = np.random.default_rng(0)
    return binary_infer_body(rng.standard_normal((batch, seq_len, embed_dim), np.float32))


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples from /metrics (0 when it has none)."""
    return scrape.value(scrape.scrape(url), name, default=0.0)


@dataclass
class Sampler:
    """Polls readiness and queue depth every `every` s in a thread while a load runs."""

    url: str
    every: float = 0.2
    depths: list[float] = field(default_factory=list)
    ready: collections.Counter = field(default_factory=collections.Counter)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.every):
                self.ready[client.get(f"{self.url}/v2/health/ready").status_code] += 1
                self.depths.append(metric(self.url, "mha_queue_depth_sequences"))


def overload(port: int, factor: float = 4.0, seconds: float = 6.0, seq_len: int = 128) -> dict:
    """Offer `factor` × the measured closed-loop capacity, open-loop, then measure recovery."""
    url = f"http://{HOST}:{port}"
    body, headers = binary_body(1, seq_len)
    capacity = asyncio.run(run_load(HOST, port, PATH, body, headers, 16, 3.0, warmup_s=1.0)).rps
    rss_before = metric(url, "process_resident_memory_bytes")
    with Sampler(url) as sampler:
        request = build_request(PATH, body, headers)
        result = asyncio.run(run_open_loop(HOST, port, request, factor * capacity, seconds))
    recovered = asyncio.run(run_load(HOST, port, PATH, body, headers, 16, 3.0, warmup_s=0.5)).rps
    accepted = result.latencies(200)
    return {
        "capacity_rps": capacity,
        "offered": int(factor * capacity * seconds),
        "answered": len(result.records),
        "statuses": dict(result.statuses),
        "connection_errors": dict(result.errors),
        "429_without_retry_after": sum(1 for s, _, r in result.records if s == 429 and not r),
        "p99_accepted_s": accepted[int(0.99 * (len(accepted) - 1))] if accepted else None,
        "max_queue_depth": max(sampler.depths, default=0.0),
        "ready_probes": dict(sampler.ready),
        "rss_before": rss_before,
        "rss_after": metric(url, "process_resident_memory_bytes"),
        "recovered_rps": recovered,
    }


def soak(server: Proc, seconds: float, clients: int = 8, seq_len: int = 64) -> dict:
    """Closed-loop load for `seconds`, sampling RSS, open fds and threads from /proc."""
    body, headers = binary_body(1, seq_len)
    samples: list[tuple[float, int, int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        start = time.monotonic()
        while not stop.wait(max(0.5, seconds / 40)):
            samples.append(
                (
                    time.monotonic() - start,
                    server.status("VmRSS") * 1024,
                    server.open_fds(),
                    server.status("Threads"),
                )
            )

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    result = asyncio.run(run_load(HOST, server.port, PATH, body, headers, clients, seconds, 0.0))
    stop.set()
    thread.join()
    warm = [s for s in samples if s[0] >= seconds * 0.25] or samples  # after warm-up
    rss = [s[1] for s in warm]
    steps = [b - a for a, b in itertools.pairwise(rss)]
    return {
        "requests": result.completed,
        "statuses": dict(result.statuses),
        "rss_warm_mb": warm[0][1] / 2**20,
        "rss_end_mb": warm[-1][1] / 2**20,
        "rss_growth": warm[-1][1] / warm[0][1] - 1,
        # A leak grows across many samples; a one-off step (a malloc arena, a new batch shape
        # on a loaded host) is one jump. Growth less the largest single step tells them apart.
        "rss_trend": (rss[-1] - rss[0] - max([0, *steps])) / rss[0],
        "rss_mb": [round(v / 2**20, 1) for v in rss],
        "rss_max_mb": max(s[1] for s in warm) / 2**20,
        "fds": (warm[0][2], warm[-1][2]),
        "threads": (warm[0][3], warm[-1][3]),
    }


def drain(server: Proc, requests: int = 12, seq_len: int = 512) -> dict:
    """Send `requests` concurrent requests, SIGTERM once all are in (in flight or already
    answered: on a loaded machine the first can finish before the last arrives), count the
    answers."""
    body, headers = binary_body(1, seq_len)
    statuses: collections.Counter = collections.Counter()
    no_retry_after = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal no_retry_after
        try:
            response = await client.post(f"{server.url}{PATH}", content=body, headers=headers)
            statuses[response.status_code] += 1
            if response.status_code == 503 and "retry-after" not in response.headers:
                no_retry_after += 1
        except httpx.HTTPError as exc:
            statuses[type(exc).__name__] += 1

    async def run() -> float:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            tasks = [asyncio.create_task(one(c)) for _ in range(requests)]
            deadline = time.monotonic() + 30
            seen = 0  # consecutive polls that found all in (an answer can be counted on both
            # sides for a moment, between the client reading it and the server's gauge moving)
            while seen < 2 and time.monotonic() < deadline:
                # scraped in a thread: a blocking scrape here would stall this loop, and with
                # it the requests still being sent; answers counted after it (an answer seen
                # on both sides only overcounts, and two polls in a row are asked for)
                in_flight = await asyncio.to_thread(metric, server.url, "mha_requests_in_flight")
                inside = sum(statuses.values()) + in_flight >= requests
                seen = seen + 1 if inside else 0
                await asyncio.sleep(0.02)
            server.process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.gather(*tasks)
            await asyncio.to_thread(server.process.wait, 60)
            return time.monotonic() - sent

    exit_after = asyncio.run(run())
    return {
        "requests": requests,
        "statuses": dict(statuses),
        "exit_after_s": exit_after,
        "returncode": server.process.returncode,
        "503_without_retry_after": no_retry_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=["overload", "soak", "drain", "all"])
    parser.add_argument("--seconds", type=float, default=60.0, help="soak/overload duration")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="source tree to run the server from (default: this)"
    )
    args = parser.parse_args()
    root = args.root
    run: dict[str, Any] = {}
    if args.scenario in ("overload", "all"):
        with running(*QUIET, "--max-queue", "48", "--request-timeout-s", "3", root=root) as server:
            run["overload"] = overload(server.port, seconds=min(args.seconds, 30))
    if args.scenario in ("soak", "all"):
        with running(*QUIET, root=root) as server:
            run["soak"] = soak(server, args.seconds)
    if args.scenario in ("drain", "all"):
        with running(*QUIET, "--max-batch-size", "1", root=root) as server:
            run["drain"] = drain(server, requests=24)
    print(json.dumps(run, indent=2, default=str))


if __name__ == "__main__":
    main()

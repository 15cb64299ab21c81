"""A lean closed-loop HTTP load generator: N keep-alive connections, one request in flight each.

Hand-built HTTP/1.1 over asyncio streams keeps the client's own CPU small, which matters when
client and server share two cores.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

import numpy as np
import orjson


@dataclass
class LoadResult:
    """What a load run measured (latencies of the measured window only)."""

    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: collections.Counter = field(default_factory=collections.Counter)

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def rps(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, nearest rank below; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def binary_infer_body(x: np.ndarray, **parameters: object) -> tuple[bytes, dict[str, str]]:
    """An OIP request carrying float32 `x` as input 'input' in Triton's binary extension, asking
    for a binary 'output'; `parameters` become request parameters (e.g. is_causal, timeout)."""
    header: dict = {
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": "FP32",
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
    }
    if parameters:
        header["parameters"] = parameters
    head = orjson.dumps(header)
    return head + np.ascontiguousarray(x, dtype=np.float32).tobytes(), {
        "Inference-Header-Content-Length": str(len(head)),
        "Content-Type": "application/octet-stream",
    }


def build_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", 0)))
    return int(lines[0].split(" ", 2)[1]), headers


async def _worker(
    host: str, port: int, request: bytes, start: float, stop: float, result: LoadResult
) -> None:
    reader, writer = await asyncio.open_connection(host, port, limit=2**26)
    try:
        while (now := time.perf_counter()) < stop:
            writer.write(request)
            status, _ = await _read_response(reader)
            done = time.perf_counter()
            if now >= start:
                result.latencies.append(done - now)
                result.statuses[status] += 1
    finally:
        writer.close()


async def run_load(
    host: str,
    port: int,
    path: str,
    body: bytes,
    headers: dict[str, str],
    concurrency: int,
    seconds: float,
    warmup_s: float = 1.0,
) -> LoadResult:
    """Keep `concurrency` requests in flight for warmup + `seconds`; measure the last `seconds`."""
    request = build_request(path, body, headers)
    start = time.perf_counter() + warmup_s
    stop = start + seconds
    result = LoadResult(seconds)
    await asyncio.gather(
        *(_worker(host, port, request, start, stop, result) for _ in range(concurrency))
    )
    return result


IDLE_REUSE_S = 4.0


@dataclass
class OpenLoopResult:
    """An open-loop run: every scheduled request with its status and latency."""

    seconds: float
    records: list[tuple[int, float, bool]] = field(default_factory=list)  # status, latency, retry
    errors: collections.Counter = field(default_factory=collections.Counter)  # connection-level

    @property
    def statuses(self) -> collections.Counter:
        return collections.Counter(status for status, _, _ in self.records)

    def latencies(self, status: int) -> list[float]:
        return sorted(latency for s, latency, _ in self.records if s == status)


async def run_open_loop(
    host: str,
    port: int,
    request: bytes,
    rate: float,
    seconds: float,
    connections: int = 128,
    timeout: float = 30.0,
) -> OpenLoopResult:
    """Offer `rate` requests/s for `seconds` whatever the answers, over a pool of connections.

    Each request starts at its scheduled time on a free connection (a new one if all are busy,
    so the offered rate holds); `retry` records whether a 429 carried Retry-After.
    """
    result = OpenLoopResult(seconds)
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
    start = time.perf_counter()

    async def connection() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # Reuse only connections idle for less than uvicorn's 5 s keep-alive; older ones the
        # server may be closing, and a request written into one would be lost by the client.
        while idle:
            reader, writer, since = idle.pop()
            if time.perf_counter() - since < IDLE_REUSE_S:
                return reader, writer
            writer.close()
        return await asyncio.open_connection(host, port, limit=2**26)

    async def one(at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        conn = await connection()
        sent = time.perf_counter()
        try:
            conn[1].write(request)
            status, headers = await asyncio.wait_for(_read_response(conn[0]), timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            result.errors[type(exc).__name__] += 1
            conn[1].close()
            return
        result.records.append((status, time.perf_counter() - sent, "retry-after" in headers))
        if len(idle) < connections and headers.get("connection") != "close":
            idle.append((*conn, time.perf_counter()))
        else:
            conn[1].close()

    total = int(rate * seconds)
    await asyncio.gather(*(one(start + i / rate) for i in range(total)))
    for _, writer, _ in idle:
        writer.close()
    return result

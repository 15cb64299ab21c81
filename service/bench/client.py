"""A lean closed-loop HTTP load generator: N keep-alive connections, one request in flight each.

Hand-built HTTP/1.1 over asyncio streams keeps the client's own CPU small, which matters when
client and server share two cores.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field


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
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def build_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def _worker(
    host: str, port: int, request: bytes, start: float, stop: float, result: LoadResult
) -> None:
    reader, writer = await asyncio.open_connection(host, port, limit=2**26)
    try:
        while (now := time.perf_counter()) < stop:
            writer.write(request)
            status = await _read_response(reader)
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

"""What the batcher measures of its traffic: the arrivals (do batches wait for batch-mates?) and
the rate its queue drains at (will a new request's wait outlast its deadline?).

Whether to wait (`--batch-delay-policy adaptive`): waiting `--max-batch-delay-ms` pays only when
another request is likely to come within it. A lone client that sends its next request after
its last answer (a closed loop) never has a request arrive beside its own, so its requests
never find the engine busy: waiting would only add the delay. A stream of requests that do
overlap, at a rate that brings at least one within the delay, waits as with the fixed policy
and forms the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WINDOW = 16  # arrivals the moving averages span (weight 1/WINDOW each)
GAP_CAP = 4  # a gap counts as at most this many delays: an idle spell says "sparse", no more
MIN_OVERLAP = 0.1  # share of recent arrivals that found work queued or running


class Arrivals:
    """Moving averages of the gap between arrivals and of arrivals that found the engine busy
    (work queued or running); not thread-safe: the batcher calls it under its lock."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.gap_s: float | None = None  # None until two arrivals were seen
        # Starts as if every arrival overlapped: batching is assumed to pay until the arrivals
        # show otherwise (a lone client stops waiting after ~36 requests).
        self.overlap = 1.0
        self._last: float | None = None

    def arrived(self, now: float, busy: bool) -> None:
        """A request was queued at `now` (time.monotonic()); `busy`: other work was queued or
        running then."""
        if self._last is not None:
            gap = min(now - self._last, GAP_CAP * self.delay_s)
            self.gap_s = gap if self.gap_s is None else self.gap_s + (gap - self.gap_s) / WINDOW
        self._last = now
        self.overlap += (float(busy) - self.overlap) / WINDOW

    def worth_waiting(self) -> bool:
        """At least one batch-mate expected within the delay (the mean gap is at most the
        delay) from arrivals that overlap other work; before any gap is known, wait."""
        if self.gap_s is None:
            return True
        return self.overlap >= MIN_OVERLAP and self.gap_s <= self.delay_s


class DrainRate:
    """Tokens/s the queue drains at: each batch's tokens over the wall time since the previous
    batch ended (or since its first arrival), so event-loop and copy overheads count too; a
    moving average (weight 0.2 per batch)."""

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None
        self._last_done = 0.0

    def batch_done(self, works: Sequence[Any], now: float) -> None:
        since = max(self._last_done, min(w.enqueued_at for w in works))
        rate = sum(w.tokens for w in works) / max(now - since, 1e-6)
        old = self.tokens_per_s
        self.tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate
        self._last_done = now

    def wait_s(self, tokens: int) -> float:
        """Seconds `tokens` queued ahead would take at the recent rate (0 before any batch)."""
        return tokens / self.tokens_per_s if self.tokens_per_s else 0.0

"""Whether a batch should wait for batch-mates (`--batch-delay-policy adaptive`): from the recent
arrivals' rate and how often they found other work queued or running.

Waiting `--max-batch-delay-ms` pays only when another request is likely to come within it. A
lone client that sends its next request after its last answer (a closed loop) never has a
request arrive beside its own, so its requests never find the engine busy: waiting would only
add the delay. A stream of requests that do overlap, at a rate that brings at least one within
the delay, waits as with the fixed policy and forms the same batches.
"""

from __future__ import annotations

WINDOW = 16  # arrivals the moving averages span (weight 1/WINDOW each)
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
            gap = now - self._last
            self.gap_s = gap if self.gap_s is None else self.gap_s + (gap - self.gap_s) / WINDOW
        self._last = now
        self.overlap += (float(busy) - self.overlap) / WINDOW

    def worth_waiting(self) -> bool:
        """At least one batch-mate expected within the delay (the mean gap is at most the
        delay) from arrivals that overlap other work; before any gap is known, wait."""
        if self.gap_s is None:
            return True
        return self.overlap >= MIN_OVERLAP and self.gap_s <= self.delay_s

"""Where a CPU model's batch runs: on the event loop itself while batches are short, else on the
engine thread (`--loop-batch-max-ms`).

A batch on the engine thread shares the GIL with the event loop. PyTorch releases the GIL
around every op, and each release lets the busy event loop take it, so a small model's batch
takes 2-3x its time alone and every handoff costs both threads CPU (docs/benchmarks.md, "Front-
end floors"). A batch short enough to hold the loop for is cheaper run there, between the
loop's other callbacks: no handoffs, no thread wake-ups. A long batch would stall every other
connection while it runs, so it belongs on the thread, where the GEMMs' GIL-free time overlaps
the loop's I/O.

The policy learns which case a model is from its batches: it starts on the thread; a batch
there within the limit moves the next batches to the loop (a thread batch is slowed by the
loop, not sped up, so this is safe evidence). On the loop it keeps a moving average of the
batches' times (weight 1/4, so one batch stalled by the machine does not move it); over the
limit, the batches go back to the thread and stay there for a hold-off that doubles each time
(1 s, 2 s, ... 60 s). And the loop never takes a batch of more than twice the tokens of the
largest batch it has seen finish within the limit: with requests of mixed sizes, the big
batches go to the thread and the small ones stay on the loop, and the stall a bigger batch can
cause grows step by step, never all at once.
"""

from __future__ import annotations

FIRST_HOLD_S = 1.0
MAX_HOLD_S = 60.0
LOOP_WINDOW = 4  # batches the moving average of loop batch times spans (weight 1/4 each)
TOKEN_GROWTH = 2  # a loop batch holds at most this times the tokens of the largest short one


class LoopPlacement:
    """`on_loop`: run the next batch on the event loop; not thread-safe: the batcher calls it
    under its lock."""

    def __init__(self, max_s: float) -> None:
        if max_s <= 0:
            raise ValueError(f"max_s must be > 0, got {max_s}")
        self.max_s = max_s
        self.on_loop = False
        self._hold = FIRST_HOLD_S
        self._hold_until = 0.0
        self._loop_since = 0.0  # when batches last moved to the loop
        self.loop_mean_s = 0.0  # moving average of batch times on the loop
        self.short_tokens = 0  # the most tokens of a batch that took at most max_s

    def fits(self, tokens: int) -> bool:
        """A batch of `tokens` may run on the loop now."""
        return self.on_loop and tokens <= TOKEN_GROWTH * self.short_tokens

    def ran(self, seconds: float, tokens: int, on_loop: bool, now: float) -> None:
        """A batch of `tokens` took `seconds`, on the loop or on the thread, ending at `now`
        (time.monotonic())."""
        if seconds <= self.max_s:
            self.short_tokens = max(self.short_tokens, tokens)
        if on_loop:
            self.loop_mean_s += (seconds - self.loop_mean_s) / LOOP_WINDOW
            if self.loop_mean_s > self.max_s:
                self.on_loop = False
                self._hold_until = now + self._hold
                self._hold = min(2 * self._hold, MAX_HOLD_S)
            elif now - self._loop_since > self._hold:
                self._hold = FIRST_HOLD_S  # short batches on the loop for a whole hold-off
        elif seconds <= self.max_s and now >= self._hold_until and not self.on_loop:
            self.on_loop = True
            self._loop_since = now
            self.loop_mean_s = seconds

"""Spike: --spike-base-users, a jump to --spike-users for --spike-seconds, then back to base.

Use with the locustfile (`-f loadtest/locustfile.py,loadtest/shapes/spike.py`, or
`python -m loadtest.run --shape spike`) to see how the queue absorbs a burst: p99 during the
spike, 429s once --max-queue is full, and whether latency recovers afterwards.
"""

from __future__ import annotations

from typing import Any

from locust import LoadTestShape, events


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    parser.add_argument(
        "--spike-base-users", type=int, default=4, env_var="MHA_LT_SPIKE_BASE_USERS",
        help="Users before and after the spike. [env MHA_LT_SPIKE_BASE_USERS]",
    )  # fmt: skip
    parser.add_argument(
        "--spike-users", type=int, default=64, env_var="MHA_LT_SPIKE_USERS",
        help="Users during the spike. [env MHA_LT_SPIKE_USERS]",
    )  # fmt: skip
    parser.add_argument(
        "--spike-start", type=float, default=20.0, env_var="MHA_LT_SPIKE_START",
        help="Seconds of base load before the spike. [env MHA_LT_SPIKE_START]",
    )  # fmt: skip
    parser.add_argument(
        "--spike-seconds", type=float, default=15.0, env_var="MHA_LT_SPIKE_SECONDS",
        help="Length of the spike. [env MHA_LT_SPIKE_SECONDS]",
    )  # fmt: skip
    parser.add_argument(
        "--spike-after", type=float, default=25.0, env_var="MHA_LT_SPIKE_AFTER",
        help="Seconds of base load after the spike, then stop. [env MHA_LT_SPIKE_AFTER]",
    )  # fmt: skip


class Spike(LoadTestShape):
    """Base load, a near-instant jump (all spike users within a second), base load, stop."""

    def tick(self) -> tuple[int, float] | None:
        opts = self.runner.environment.parsed_options
        now = self.get_run_time()
        spike_end = opts.spike_start + opts.spike_seconds
        rate = float(max(opts.spike_users, opts.spike_base_users, 1))
        if now < opts.spike_start:
            return opts.spike_base_users, rate
        if now < spike_end:
            return opts.spike_users, rate
        if now < spike_end + opts.spike_after:
            return opts.spike_base_users, rate
        return None

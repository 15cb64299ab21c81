"""Step ramp: add --step-users every --step-seconds, --steps times, then stop.

Use with the locustfile (`-f loadtest/locustfile.py,loadtest/shapes/step.py`, or
`python -m loadtest.run --shape step`) to find the knee: the step after which req/s stops
growing while p95 keeps climbing. Keep steps >= 10 s: the per-step percentiles in the
report are Locust's 10 s window.
"""

from __future__ import annotations

from typing import Any

from locust import LoadTestShape, events


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    parser.add_argument(
        "--step-users", type=int, default=4, env_var="MHA_LT_STEP_USERS",
        help="Users added per step. [env MHA_LT_STEP_USERS]",
    )  # fmt: skip
    parser.add_argument(
        "--step-seconds", type=float, default=20.0, env_var="MHA_LT_STEP_SECONDS",
        help="Length of each step. [env MHA_LT_STEP_SECONDS]",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=8, env_var="MHA_LT_STEPS",
        help="Number of steps; the run lasts steps x step-seconds. [env MHA_LT_STEPS]",
    )  # fmt: skip


class StepRamp(LoadTestShape):
    """Users = step_users × (step + 1); each level is reached within about a second."""

    def tick(self) -> tuple[int, float] | None:
        opts = self.runner.environment.parsed_options
        step = int(self.get_run_time() // opts.step_seconds)
        if step >= opts.steps:
            return None
        return (step + 1) * opts.step_users, float(max(opts.step_users, 1))

"""Read Locust's CSV reports (`<prefix>_stats.csv`, `_failures.csv`, `_stats_history.csv`)
and render the one-screen summary printed after a headless run."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path


def _number(text: str) -> float:
    """Locust writes 'N/A' for percentiles of rows without requests."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


@dataclass
class StatsRow:
    """One row of `_stats.csv`: a request name, or the 'Aggregated' total."""

    method: str
    name: str
    requests: int
    failures: int
    rps: float
    p50: float
    p95: float
    p99: float
    average_ms: float


@dataclass
class Failure:
    method: str
    name: str
    error: str
    occurrences: int


@dataclass
class Phase:
    """A stretch of the run at one user count (from the stats history; shapes have several)."""

    users: int
    seconds: float
    rps: float
    failures: int
    p50: float
    p95: float
    p99: float


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_stats(prefix: Path | str) -> list[StatsRow]:
    """Rows of `<prefix>_stats.csv`, the 'Aggregated' row last."""
    return [
        StatsRow(
            method=row["Type"],
            name=row["Name"],
            requests=int(row["Request Count"]),
            failures=int(row["Failure Count"]),
            rps=_number(row["Requests/s"]),
            p50=_number(row["50%"]),
            p95=_number(row["95%"]),
            p99=_number(row["99%"]),
            average_ms=_number(row["Average Response Time"]),
        )
        for row in _rows(Path(f"{prefix}_stats.csv"))
    ]


def aggregated(stats: list[StatsRow]) -> StatsRow:
    return next(row for row in stats if row.name == "Aggregated")


def _plain(error: str) -> str:
    """`CatchResponseError('message')` -> `message` (Locust stores the exception's repr)."""
    for wrapper in ("CatchResponseError(", "LocustBadStatusCode("):
        if error.startswith(wrapper) and error.endswith(")"):
            return error[len(wrapper) : -1].strip("'\"")
    return error


def read_failures(prefix: Path | str) -> list[Failure]:
    """Rows of `<prefix>_failures.csv`, most frequent first."""
    failures = [
        Failure(row["Method"], row["Name"], _plain(row["Error"]), int(row["Occurrences"]))
        for row in _rows(Path(f"{prefix}_failures.csv"))
    ]
    return sorted(failures, key=lambda f: -f.occurrences)


def read_phases(prefix: Path | str, min_seconds: float = 2.0) -> list[Phase]:
    """Consecutive history samples at the same user count, merged; req/s from the change in
    total count, percentiles from the phase's last sample (Locust's trailing 10 s window)."""
    path = Path(f"{prefix}_stats_history.csv")
    if not path.exists():
        return []
    samples = [row for row in _rows(path) if row["Name"] == "Aggregated"]
    groups: list[list[dict[str, str]]] = []
    for row in samples:
        if groups and groups[-1][-1]["User Count"] == row["User Count"]:
            groups[-1].append(row)
        else:
            groups.append([row])
    phases: list[Phase] = []
    previous: dict[str, str] | None = None
    for group in groups:
        start = previous or group[0]
        last = group[-1]
        seconds = float(last["Timestamp"]) - float(start["Timestamp"])
        requests = int(last["Total Request Count"]) - int(start["Total Request Count"])
        failures = int(last["Total Failure Count"]) - int(start["Total Failure Count"])
        previous = last
        if int(last["User Count"]) == 0 or seconds < min_seconds or requests < 0:
            continue
        phases.append(
            Phase(
                users=int(last["User Count"]),
                seconds=seconds,
                rps=requests / seconds,
                failures=failures,
                p50=_number(last["50%"]),
                p95=_number(last["95%"]),
                p99=_number(last["99%"]),
            )
        )
    return phases


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.0f}"  # NaN -> '-'


def summary(prefix: Path | str, title: str) -> str:
    """Req/s, p50/p95/p99 per request name, failures by name, and phases if the load changed."""
    stats = read_stats(prefix)
    width = max([len(f"{r.method} {r.name}".strip()) for r in stats] + [20])
    lines = [title, ""]
    lines.append(
        f"{'request':<{width}} {'reqs':>8} {'fails':>7} {'req/s':>8} "
        f"{'p50':>6} {'p95':>6} {'p99':>6}  (ms)"
    )
    for row in stats:
        label = f"{row.method} {row.name}".strip()
        lines.append(
            f"{label:<{width}} {row.requests:>8} {row.failures:>7} {row.rps:>8.1f} "
            f"{_ms(row.p50):>6} {_ms(row.p95):>6} {_ms(row.p99):>6}"
        )
    failures = read_failures(prefix)
    lines.append("")
    if failures:
        lines.append("Failures by name:")
        for failure in failures[:10]:
            lines.append(
                f"  {failure.occurrences:>7} x {failure.method} {failure.name}: {failure.error}"
            )
        if len(failures) > 10:
            lines.append(f"  ... {len(failures) - 10} more in {prefix}_failures.csv")
    else:
        lines.append("Failures: none")
    phases = read_phases(prefix)
    if len(phases) > 1:
        lines += ["", "Phases (load shape):", f"{'users':>7} {'s':>5} {'req/s':>8} {'fails':>6} "
                  f"{'p50':>6} {'p95':>6} {'p99':>6}  (ms, last 10 s of each phase)"]  # fmt: skip
        for phase in phases:
            lines.append(
                f"{phase.users:>7} {phase.seconds:>5.0f} {phase.rps:>8.1f} {phase.failures:>6} "
                f"{_ms(phase.p50):>6} {_ms(phase.p95):>6} {_ms(phase.p99):>6}"
            )
    return "\n".join(lines)

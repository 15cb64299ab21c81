"""Headless Locust run against any mha-serve host: CSV + HTML reports and a one-screen summary.

    python -m loadtest.run --host http://127.0.0.1:8000 --users 16 --run-time 30s
    python -m loadtest.run --host http://127.0.0.1:8080 --shape step --step-users 8
    python -m loadtest.run --classes BinaryUser --seq-len 64 --payload json

Options this script does not know (--seq-len, --payload, --step-users, ...) go to Locust and the
locustfile unchanged. Reports land in loadtest/results/<UTC time>[-tag]/ (git-ignored).
The exit code is Locust's: 0 clean, 1 if any request failed, 2 if the run could not start.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from loadtest import report

HERE = Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
SHAPES = {"step": HERE / "shapes" / "step.py", "spike": HERE / "shapes" / "spike.py"}
RESULTS = HERE / "results"
CSV_NAME = "locust"  # -> locust_stats.csv, locust_failures.csv, locust_stats_history.csv, ...


@dataclass
class RunResult:
    exit_code: int
    results_dir: Path
    csv_prefix: Path
    html: Path
    log: Path

    @property
    def has_csv(self) -> bool:
        return Path(f"{self.csv_prefix}_stats.csv").exists()


def new_results_dir(root: Path, tag: str = "") -> Path:
    """A fresh `<root>/<UTC yyyymmdd-hhmmss>[-tag]` directory (suffixed if it exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + (f"-{tag}" if tag else "")
    for n in range(1000):
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a results directory under {root}")


def locust_command(
    host: str,
    csv_prefix: Path,
    html: Path,
    users: int,
    spawn_rate: float,
    run_time: str,
    shape: str | None = None,
    classes: list[str] | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The `python -m locust` command line of one headless run."""
    files = [str(LOCUSTFILE)] + ([str(SHAPES[shape])] if shape else [])
    cmd = [
        sys.executable, "-m", "locust", "-f", ",".join(files), "--headless",
        "--host", host, "--csv", str(csv_prefix), "--csv-full-history", "--html", str(html),
        "--only-summary", "--stop-timeout", "10", "--exit-code-on-error", "1",
    ]  # fmt: skip
    if not shape:  # a load shape sets users and duration itself
        cmd += ["--users", str(users), "--spawn-rate", str(spawn_rate), "--run-time", run_time]
    return cmd + (extra or []) + (classes or [])


def _stop(process: subprocess.Popen) -> int:
    process.terminate()
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def run(
    host: str,
    results_dir: Path,
    users: int = 16,
    spawn_rate: float = 8,
    run_time: str = "30s",
    shape: str | None = None,
    classes: list[str] | None = None,
    extra: list[str] | None = None,
    timeout: float | None = None,
) -> RunResult:
    """Run Locust in a subprocess (it monkey-patches with gevent), output to `locust.log`."""
    csv_prefix, html, log = (
        results_dir / CSV_NAME,
        results_dir / "report.html",
        results_dir / "locust.log",
    )
    cmd = locust_command(host, csv_prefix, html, users, spawn_rate, run_time, shape, classes, extra)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as log_file:
        log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        log_file.flush()
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            code = process.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            code = _stop(process)  # Locust still writes what it has on SIGTERM
    return RunResult(code, results_dir, csv_prefix, html, log)


def wait_ready(host: str, seconds: float) -> bool:
    """Poll GET /v2/health/ready until it is not 503 and the host answers; False on timeout.
    Lets a run start right after the server (warm-up takes a few seconds)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"{host.rstrip('/')}/v2/health/ready", timeout=5):
                return True
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                return True  # e.g. a proxy without the health route: let Locust find out
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def _errors(log: Path) -> str:
    """The error lines of a Locust log, or its tail if it has none."""
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if "/ERROR/" in line or "error:" in line]
    return "\n".join(lines[:20]) if lines else text[-2000:]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.run",
        description="Headless Locust run against mha-serve; unknown options go to Locust.",
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("LOCUST_HOST", "http://127.0.0.1:8000"),
        help="Base URL of the server or proxy (env LOCUST_HOST; default %(default)s).",
    )
    parser.add_argument("-u", "--users", type=int, default=16, help="Concurrent users.")
    parser.add_argument("-r", "--spawn-rate", type=float, default=8, help="Users started per s.")
    parser.add_argument("-t", "--run-time", default="30s", help="Duration: 30s, 5m, 1h30m.")
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), help="Load shape (then --users/--run-time are unused)."
    )
    parser.add_argument(
        "--classes",
        default="",
        help="Comma-separated user classes (BinaryUser,JsonUser,MixedLengthUser,"
        "MultiSequenceUser); default all.",
    )
    parser.add_argument(
        "--wait", type=float, default=60, help="Seconds to wait for the host to be ready."
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="Parent results folder.")
    parser.add_argument("--tag", default="", help="Suffix of the results folder name.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    classes = [c for c in args.classes.split(",") if c]
    if not wait_ready(args.host, args.wait):
        print(
            f"{args.host} is not ready after {args.wait:g} s (GET /v2/health/ready)",
            file=sys.stderr,
        )
        return 2
    results_dir = new_results_dir(args.results, args.tag)
    load = f"shape {args.shape}" if args.shape else f"{args.users} users, {args.run_time}"
    print(f"Locust -> {args.host} ({load}); log: {results_dir / 'locust.log'}", flush=True)
    result = run(
        args.host, results_dir, args.users, args.spawn_rate, args.run_time, args.shape,
        classes, extra,
    )  # fmt: skip
    if not result.has_csv:
        print(_errors(result.log), file=sys.stderr)
        print(f"Locust exited with {result.exit_code} before writing reports", file=sys.stderr)
        return result.exit_code or 2
    title = f"mha-serve load test: {args.host}, {load}, exit code {result.exit_code}"
    text = report.summary(result.csv_prefix, title)
    text += (
        f"\n\nReports: {result.html}\n"
        f"         {result.csv_prefix}_stats.csv (and _failures, _stats_history)"
    )
    (results_dir / "summary.txt").write_text(text + "\n")
    print(text)
    if result.exit_code == 2:
        print("\n" + _errors(result.log), file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())

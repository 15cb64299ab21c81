"""Headless Locust runs against real servers on loopback, through the README's command
(`python -m loadtest.run`). Locust monkey-patches with gevent, so it only ever runs in a
subprocess: this module must not import it. Every run is a few seconds with a handful of users."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from loadtest import report
from tests.support import ROOT, Server, free_port, run_server

RUN_TIMEOUT = 90  # seconds; the runs below last 3-8 s


def loadtest(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


def locust_run(
    server: Server, results: Path, *args: str
) -> tuple[subprocess.CompletedProcess, Path]:
    """`python -m loadtest.run --host <server> --results <results> args...`; the run's folder."""
    done = loadtest("loadtest.run", "--host", server.url, "--results", str(results), *args)
    folders = sorted(results.iterdir())
    assert len(folders) == 1, (done.stdout, done.stderr)
    return done, folders[0]


def count(server: Server, name: str, **labels: str) -> float:
    """A counter's value; 0 before its first sample (a fresh server has no series yet)."""
    try:
        return server.metric(name, **labels)
    except KeyError:
        return 0.0


def rows(folder: Path) -> dict[str, report.StatsRow]:
    return {row.name: row for row in report.read_stats(folder / "locust")}


def test_smoke_all_user_classes(demo_server: Server, tmp_path: Path) -> None:
    before = count(demo_server, "mha_requests_total", endpoint="infer", status="200")
    done, folder = locust_run(
        demo_server, tmp_path, "-u", "8", "-r", "8", "-t", "4s", "--check-fraction", "1"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    stats = rows(folder)
    expected = [
        "binary B=1 T=16",
        "json B=1 T=16",
        "binary B=4 T=16",
        "binary B=1 T~uniform:16:256",
    ]
    for name in expected:  # every response checked (shape, finite) and none failed
        assert stats[name].requests > 0 and stats[name].failures == 0, stats[name]
    assert set(stats) == {*expected, "Aggregated"}  # the debug trickle is off by default
    total = report.aggregated(list(stats.values()))
    assert total.requests > 0 and total.failures == 0
    assert report.read_failures(folder / "locust") == []
    # Locust's count is the server's: nothing lost or invented between them.
    after = count(demo_server, "mha_requests_total", endpoint="infer", status="200")
    assert after - before == total.requests
    assert (folder / "report.html").stat().st_size > 10_000
    assert (folder / "locust_stats_history.csv").exists()
    assert "Failures: none" in done.stdout and "Aggregated" in done.stdout
    assert (folder / "summary.txt").read_text().strip() in done.stdout
    assert "locust" not in sys.modules  # (gevent may be: tritonclient.http imports it)


def test_attention_trickle_reports_the_endpoint_off(demo_server: Server, tmp_path: Path) -> None:
    """The demo server has no debug endpoint: the trickle's 404s fail under their own name."""
    done, folder = locust_run(
        demo_server, tmp_path, "-u", "4", "-r", "4", "-t", "3s",
        "--classes", "BinaryUser", "--attention-fraction", "0.3",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # Locust: failures happened
    stats = rows(folder)
    assert stats["binary B=1 T=16"].requests > 0 and stats["binary B=1 T=16"].failures == 0
    attention = stats["attention (debug)"]
    assert attention.requests > 0 and attention.failures == attention.requests
    [failure] = report.read_failures(folder / "locust")
    assert failure.name == "attention (debug)" and "404" in failure.error
    assert "debug attention endpoint is off" in done.stdout


def test_attention_trickle_with_token(tmp_path: Path) -> None:
    args = ["--debug-endpoint", "--debug-token", "t0ken", "--debug-max-concurrency", "8"]
    with run_server(tmp_path, *args) as server:
        done, folder = locust_run(
            server, tmp_path / "results", "-u", "4", "-r", "4", "-t", "3s",
            "--classes", "BinaryUser,MultiSequenceUser", "--attention-fraction", "0.3",
            "--attention-token", "t0ken",
        )  # fmt: skip
        served = count(server, "mha_requests_total", endpoint="attention", status="200")
    assert done.returncode == 0, done.stdout + done.stderr
    attention = rows(folder)["attention (debug)"]
    assert attention.requests > 0 and attention.failures == 0
    assert served == attention.requests


def test_spike_overload_shows_429_as_its_own_name(tmp_path: Path) -> None:
    """A queue of one sequence under a 12-user spike: 429s get their own row; phases show it."""
    args = ["--max-batch-size", "1", "--max-queue", "1", "--max-batch-delay-ms", "0"]
    with run_server(tmp_path, *args) as server:
        done, folder = locust_run(
            server, tmp_path / "results", "--shape", "spike", "--classes", "BinaryUser",
            "--seq-len", "64", "--spike-base-users", "1", "--spike-users", "12",
            "--spike-start", "2.5", "--spike-seconds", "3", "--spike-after", "2.5",
        )  # fmt: skip
        refused = count(server, "mha_request_failures_total", endpoint="infer", reason="overloaded")
    assert done.returncode == 1, done.stdout + done.stderr
    stats = rows(folder)
    ok, overloaded = stats["binary B=1 T=64"], stats["binary B=1 T=64 [429 overloaded]"]
    assert ok.requests > 0 and ok.failures == 0
    assert overloaded.requests > 0 and overloaded.failures == overloaded.requests
    assert overloaded.requests == refused
    [failure] = report.read_failures(folder / "locust")
    assert failure.name.endswith("[429 overloaded]") and "--max-queue" in failure.error
    users = [phase.users for phase in report.read_phases(folder / "locust")]
    assert users == [1, 12, 1], users
    assert "Phases (load shape)" in done.stdout


def test_step_ramp_phases(demo_server: Server, tmp_path: Path) -> None:
    done, folder = locust_run(
        demo_server, tmp_path, "--shape", "step", "--classes", "BinaryUser",
        "--step-users", "2", "--step-seconds", "3", "--steps", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    phases = report.read_phases(folder / "locust")
    assert [phase.users for phase in phases] == [2, 4], phases
    assert all(phase.rps > 0 and phase.failures == 0 for phase in phases)


def test_runs_that_cannot_start_exit_2(demo_server: Server, tmp_path: Path) -> None:
    done, _ = locust_run(demo_server, tmp_path / "a", "-t", "5s", "--model-name", "nope")
    assert done.returncode == 2
    assert "cannot read model 'nope'" in done.stderr and "unknown model" in done.stderr
    done, _ = locust_run(demo_server, tmp_path / "b", "--lengths", "uniform:5")
    assert done.returncode == 2
    assert "--lengths" in done.stderr and "bad length distribution" in done.stderr
    nobody = f"http://127.0.0.1:{free_port()}"
    done = loadtest("loadtest.run", "--host", nobody, "--wait", "1", "--results", str(tmp_path))
    assert done.returncode == 2 and "is not ready after 1 s" in done.stderr


def test_sweep_one_setting(tmp_path: Path) -> None:
    done = loadtest(
        "loadtest.sweep", "--batch-sizes", "4", "--delays-ms", "1", "--users", "4",
        "--duration", "3", "--results", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [folder] = tmp_path.iterdir()
    [row] = json.loads((folder / "sweep.json").read_text())
    assert (row["max_batch_size"], row["max_batch_delay_ms"]) == (4, 1.0)
    assert row["requests"] > 0 and row["failures"] == 0 and row["rps"] > 0
    assert 1.0 <= row["mean_batch"] <= 4.0  # from the server's batch-size histogram
    assert "| 4 | 1 |" in (folder / "sweep.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:  # the plot is optional
        assert (folder / "sweep.png").read_bytes().startswith(b"\x89PNG")

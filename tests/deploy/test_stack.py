"""docker-compose.yml up with docker-compose v1: two replicas behind nginx, Prometheus scraping.

The replicas run the image test_image builds; nginx and Prometheus are Debian's packages on the
local base (deploy/ci/docker-compose.ci.yml; no registry here). The project's own load test
(Locust, a subprocess) runs through nginx while one replica is killed (SIGKILL: a crash, which
the restart policy brings back); Locust must see no failure, nginx's log must show the requests
it retried on the other replica, and Prometheus must answer the dashboard's queries with data.
Grafana is not started (no Debian package, no registry): tests/observability checks its files.
"""

from __future__ import annotations

import csv
import math
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.deploy.docker import Built, Container, require_image
from tests.observability.monitoring import dashboard_queries, load_dashboard, substitute
from tests.support import ROOT, free_port

COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CI = ROOT / "deploy" / "ci" / "docker-compose.ci.yml"
REPLICAS = ("mha-serve-1", "mha-serve-2")
SERVICES = (*REPLICAS, "nginx", "prometheus")
USERS, RUN_TIME_S, KILL_AFTER_S = 4, 30, 10
RATE_INTERVAL = "1m"  # four scrapes at prometheus.yml's 15 s
# Dashboard series a clean CPU run may lack: CUDA memory, and failures (none happened).
NO_DATA_EXPECTED = re.compile(r"mha_cuda_|mha_request_failures_total")
# nginx's access log (deploy/nginx/nginx.conf): the final status, then every upstream tried.
ACCESS = re.compile(r'" (\d{3}) \d+ rt=\S+ upstream=(.+?) upstream_status=(.+?) urt=')


@dataclass
class Stack:
    command: list[str]
    env: dict[str, str]
    nginx: str
    prometheus: str

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [*self.command, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert result.returncode == 0, f"docker-compose {' '.join(args)}:\n{result.stderr}"
        return result

    def container(self, service: str) -> Container:
        return Container(self.compose("ps", "-q", service).stdout.strip())

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=30)
        assert response.status_code == 200, (expr, response.text)
        return response.json()["data"]["result"]


@pytest.fixture(scope="module")
def stack(built_image: Built) -> Iterator[Stack]:
    for image in ("mha-serve-ci/nginx", "mha-serve-ci/prometheus"):
        require_image(image)
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose (v1, Debian) not installed; run deploy/ci/docker.sh")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MHA_", "COMPOSE_"))}
    nginx_port, prometheus_port = free_port(), free_port()
    env = {
        **clean,
        "MHA_NGINX_PUBLISH": f"127.0.0.1:{nginx_port}",
        "MHA_PROMETHEUS_PUBLISH": f"127.0.0.1:{prometheus_port}",
        "OMP_NUM_THREADS": "1",  # per replica: two replicas, nginx, Locust share the cores
    }
    project = f"mhaci{uuid.uuid4().hex[:8]}"
    command = [compose, "-p", project, "--project-directory", str(ROOT)]
    command += ["-f", str(COMPOSE), "-f", str(COMPOSE_CI)]
    stack = Stack(
        command, env, f"http://127.0.0.1:{nginx_port}", f"http://127.0.0.1:{prometheus_port}"
    )
    try:
        stack.compose("up", "-d", "--no-build", *SERVICES)
        for service in REPLICAS:  # both replicas serving before the load starts
            stack.container(service).wait_healthy()
        yield stack
    finally:
        logs = subprocess.run(
            [*command, "logs", "--no-color", "--tail", "200"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        print(logs.stdout[-8000:])
        subprocess.run(
            [*command, "down", "-v", "-t", "60"], env=env, capture_output=True, timeout=300
        )


def aggregated(stats_csv: Path) -> dict[str, str]:
    with stats_csv.open() as handle:
        (row,) = [r for r in csv.DictReader(handle) if r["Name"] == "Aggregated"]
    return row


def test_loadtest_through_nginx_survives_a_killed_replica(stack: Stack, tmp_path: Path) -> None:
    assert httpx.get(f"{stack.nginx}/v2/health/ready", timeout=10).status_code == 200
    results = tmp_path / "results"
    command = [
        sys.executable, "-m", "loadtest.run", "--host", stack.nginx, "--users", str(USERS),
        "--spawn-rate", str(USERS), "--run-time", f"{RUN_TIME_S}s", "--results", str(results),
    ]  # fmt: skip
    victim = stack.container(REPLICAS[0])
    locust = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        time.sleep(KILL_AFTER_S)  # load is running on both replicas by now
        pid = int(victim.inspect("{{.State.Pid}}"))
        os.kill(pid, 9)  # the process dies under load, as in a crash or an OOM kill
        output, _ = locust.communicate(timeout=RUN_TIME_S + 120)
    finally:
        if locust.poll() is None:
            locust.kill()
    text = output.decode(errors="replace")
    assert locust.returncode == 0, text[-4000:]
    (stats,) = results.glob("*/locust_stats.csv")
    row = aggregated(stats)
    assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row

    # nginx retried on the other replica what the dead one could not answer, and each of those
    # requests ended in a 200: nothing nginx retried is lost.
    log = stack.compose("logs", "--no-color", "nginx").stdout
    entries = [m.groups() for m in ACCESS.finditer(log)]
    assert entries, log[-2000:]
    retried = [e for e in entries if "," in e[1]]
    assert retried, "no request was retried: the kill did not land under load"
    assert all(status == "200" for status, _, _ in retried), retried
    # The restart policy brings the killed replica back, and it serves again.
    victim.wait_healthy()
    assert int(victim.inspect("{{.RestartCount}}")) >= 1


def test_prometheus_answers_the_dashboard(stack: Stack) -> None:
    deadline = time.monotonic() + 120
    while len(stack.query('up{job="mha-serve"} == 1')) < len(REPLICAS):
        assert time.monotonic() < deadline, stack.query("up")
        time.sleep(2)
    # Enough scrapes for rate() over RATE_INTERVAL.
    while not stack.query(f"rate(mha_requests_total[{RATE_INTERVAL}]) > 0"):
        assert time.monotonic() < deadline, "no request rate after the load"
        time.sleep(2)
    instances = [f"{name}:8000" for name in REPLICAS]
    checked, empty = 0, []
    for query in dashboard_queries(load_dashboard()):
        expr = substitute(
            query.expr, models=["mha"], instances=instances, rate_interval=RATE_INTERVAL
        )
        result = stack.query(expr)
        values = [float(r["value"][1]) for r in result]
        if not values or all(math.isnan(v) for v in values):
            empty.append(f"{query.panel} {query.ref_id}: {expr}")
        else:
            checked += 1
    unexpected = [line for line in empty if not NO_DATA_EXPECTED.search(line)]
    assert not unexpected, "\n".join(unexpected)
    assert checked >= 25, (checked, empty)

"""A real Prometheus (deploy/prometheus/prometheus.yml with loopback targets) scrapes two real
replicas under a short load; every PromQL expression of the Grafana dashboard and of the alert
rules then runs through Prometheus' HTTP API and must return data. This is what makes the
dashboard real rather than plausible-looking JSON."""

from __future__ import annotations

import contextlib
import itertools
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.observability.monitoring import (
    ALERTS_YML,
    PROMETHEUS_YML,
    alert_rules,
    dashboard_queries,
    load_dashboard,
    regex_alternation,
    split_alert,
    substitute,
)
from tests.support import Server, fp32_request, free_port, run_server

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not installed (Debian package 'prometheus'; .ci/run "
    "installs it with apt-get, so this only skips where apt-get could not)",
)

URL = "/v2/models/mha/infer"
SCRAPE_S = 1
LOAD_S = 8
MAX_REQUESTS = 900  # bound on the load, whatever the machine's speed
# What Grafana puts for $__rate_interval, sized so each window holds ~8-10 scrapes of load.
RATE_INTERVAL = "10s"
# Panels only CUDA replicas feed (no GPU here): skipped when the servers don't export them.
CUDA_ONLY = "mha_cuda_"
QUEUED_ONE = 'mha_queue_depth_sequences{model="mha"} 1.0'


@dataclass
class Stack:
    prometheus: str  # base URL
    replicas: list[Server]
    at: float  # unix time to evaluate at: the end of the load
    cuda: bool

    @property
    def instances(self) -> list[str]:
        return [s.address for s in self.replicas]

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(
            f"{self.prometheus}/api/v1/query", params={"query": expr, "time": self.at}, timeout=10
        )
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]


def _request(rng: np.random.Generator, i: int) -> tuple[str, dict]:
    """The i-th request of the load on the main replica: mostly good, some bad, one 404."""
    if i % 25 == 24:
        return "/v2/models/nope/infer", {"json": {"inputs": []}}
    if i % 10 == 9:
        return URL, {"json": {"inputs": [{"name": "input", "shape": [1, 2, 511]}]}}
    if i % 10 == 5:  # the same request again: a response cache hit after the first
        content, headers = fp32_request(np.ones((1, 8, 512), np.float32))
        return URL, {"content": content, "headers": headers}
    x = rng.standard_normal((int(rng.integers(1, 5)), int(rng.integers(4, 65)), 512), np.float32)
    if i % 3 == 0:
        tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
        return URL, {"json": {"inputs": [{**tensor, "data": x.ravel().tolist()}]}}
    content, headers = fp32_request(x)
    return URL, {"content": content, "headers": headers}


def _load_main(server: Server, stop: float, counter: itertools.count) -> None:
    rng = np.random.default_rng()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while time.monotonic() < stop and (i := next(counter)) < MAX_REQUESTS:
            path, kwargs = _request(rng, i)
            client.post(path, **kwargs)


def _load_small_queue(server: Server, stop: float, counter: itertools.count) -> list[int]:
    """On the 2-slot replica: overflow the queue (429) and let requests time out (504)."""
    codes = []
    lone = fp32_request(np.ones((1, 8, 512), np.float32))
    pair = fp32_request(np.ones((2, 4, 512), np.float32))
    hasty = fp32_request(np.ones((1, 4, 512), np.float32), timeout=1000)  # 1 ms deadline
    with httpx.Client(base_url=server.url, timeout=30) as client, ThreadPoolExecutor(1) as pool:
        while time.monotonic() < stop and next(counter) < MAX_REQUESTS:
            waiting = pool.submit(client.post, URL, content=lone[0], headers=lone[1])
            # Once queued, the lone sequence waits out the 300 ms batch delay for a batch-mate.
            queued = time.monotonic() + 0.25
            while time.monotonic() < queued and QUEUED_ONE not in client.get("/metrics").text:
                time.sleep(0.005)
            codes.append(client.post(URL, content=pair[0], headers=pair[1]).status_code)
            codes.append(waiting.result().status_code)
            codes.append(client.post(URL, content=hasty[0], headers=hasty[1]).status_code)
    return codes


@contextlib.contextmanager
def _prometheus(tmp: Path, targets: list[str]) -> Iterator[str]:
    """deploy/prometheus/prometheus.yml with test targets and a 1 s scrape, run for real."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(
        scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s", scrape_timeout="1s"
    )
    config["rule_files"] = [str(ALERTS_YML)]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": targets}]
    config_path = tmp / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, (tmp / "prometheus.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "Prometheus not ready after 30 s"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait_targets_up(url: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        active = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        if len(active) == count and all(t["health"] == "up" for t in active):
            return
        time.sleep(0.2)
    raise AssertionError(f"targets not up: {active}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus")
    with contextlib.ExitStack() as stack:
        # Two replicas like the compose stack; the second has a 2-slot queue so that 429s and
        # timeouts happen for real. Both start at once, then both are waited for.
        main = stack.enter_context(
            run_server(
                tmp, "--max-batch-delay-ms", "5", "--response-cache-bytes", "10000000", wait=False
            )
        )
        small = stack.enter_context(
            run_server(
                tmp,
                *("--max-batch-size", "2", "--max-queue", "2", "--max-batch-delay-ms", "300"),
                wait=False,
            )
        )
        # Prometheus starts meanwhile: its target discovery takes ~5 s to hand over targets.
        url = stack.enter_context(_prometheus(tmp, [main.address, small.address]))
        for server in (main, small):
            server.wait_ready()
        _wait_targets_up(url, 2)

        stop = time.monotonic() + LOAD_S
        counter = itertools.count()
        with ThreadPoolExecutor(4) as pool:
            mains = [pool.submit(_load_main, main, stop, counter) for _ in range(3)]
            small_codes = pool.submit(_load_small_queue, small, stop, counter)
            for future in mains:
                future.result()
            codes = small_codes.result()
        at = time.time()
        assert {429, 504} <= set(codes), codes  # the failure series have data
        time.sleep(2.5 * SCRAPE_S)  # the last scrapes land
        cuda = "mha_cuda_" in main.metrics()
        yield Stack(url, [main, small], at, cuda)


def _check_result(stack: Stack, what: str, expr: str) -> list[dict]:
    result = stack.query(expr)
    assert result, f"{what}: no series for\n  {expr}"
    values = [float(r["value"][1]) for r in result]
    assert any(not math.isnan(v) for v in values), f"{what}: only NaN for\n  {expr}"
    return result


def _dashboard_expr(stack: Stack, expr: str) -> str:
    out = substitute(expr, models=["mha"], instances=stack.instances, rate_interval=RATE_INTERVAL)
    assert "$" not in out, f"unsubstituted variable in {out}"
    return out


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    checked = skipped = 0
    for query in dashboard_queries(load_dashboard()):
        if CUDA_ONLY in query.expr and not stack.cuda:
            skipped += 1  # CPU-only replicas don't export CUDA memory (by design)
            continue
        _check_result(stack, f"{query.panel} {query.ref_id}", _dashboard_expr(stack, query.expr))
        checked += 1
    assert checked >= 30 and skipped <= 2, (checked, skipped)


def _panel_result(stack: Stack, title: str, ref_id: str = "A") -> list[dict]:
    (query,) = [
        q for q in dashboard_queries(load_dashboard()) if (q.panel, q.ref_id) == (title, ref_id)
    ]
    return stack.query(_dashboard_expr(stack, query.expr))


def test_panels_show_what_happened(stack: Stack) -> None:
    """Beyond 'returns data': a few panels checked against what the load did."""
    (ready,) = _panel_result(stack, "Replicas ready")
    assert float(ready["value"][1]) == 2
    statuses = {r["metric"]["status"] for r in _panel_result(stack, "Request rate by status")}
    assert {"200", "400", "404", "429", "504"} <= statuses, statuses
    failing = {
        r["metric"]["reason"]
        for r in _panel_result(stack, "Failures by reason")
        if float(r["value"][1]) > 0
    }
    assert {"bad_input", "not_found", "overloaded", "timeout"} <= failing, failing
    per_replica = _panel_result(stack, "Request latency p99 by replica")
    assert {r["metric"]["instance"] for r in per_replica} == set(stack.instances)
    (padding,) = _panel_result(stack, "Padding ratio")
    assert float(padding["value"][1]) == 0
    (batch,) = _panel_result(stack, "Batch size (sequences per forward)")
    assert float(batch["value"][1]) >= 1
    assert len(_panel_result(stack, "Served model")) == 2
    lookups = {r["metric"]["result"]: float(r["value"][1])
               for r in _panel_result(stack, "Response cache look-ups")}  # fmt: skip
    assert lookups["hit"] > 0 and lookups["miss"] > 0, lookups
    held, capacity = (_panel_result(stack, "Response cache size", ref)[0] for ref in "AB")
    assert 0 < float(held["value"][1]) <= float(capacity["value"][1]) == 10_000_000


def test_one_instance_selected_narrows_the_panels(stack: Stack) -> None:
    one = stack.instances[0]
    for title in ("Request latency p99 by replica", "Process CPU", "Engine utilisation by replica"):
        (query,) = [q for q in dashboard_queries(load_dashboard()) if q.panel == title]
        expr = substitute(query.expr, models=["mha"], instances=[one], rate_interval=RATE_INTERVAL)
        result = _check_result(stack, title, expr)
        assert {r["metric"]["instance"] for r in result} == {one}, title


def test_template_variables_resolve(stack: Stack) -> None:
    """label_values(metric{selector}, label), as Grafana runs it: via /api/v1/series."""
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    expected = {"model": {"mha"}, "instance": set(stack.instances)}
    for name, want in expected.items():
        definition = variables[name]["query"]["query"]
        selector, label = definition.removeprefix("label_values(").removesuffix(")").split(", ")
        selector = selector.replace("$model", regex_alternation(["mha"]))
        response = httpx.get(
            f"{stack.prometheus}/api/v1/series",
            params={"match[]": selector, "start": stack.at - 60, "end": stack.at},
            timeout=10,
        ).json()
        assert response["status"] == "success", response
        assert {series[label] for series in response["data"]} == want, name


def test_every_alert_expression_evaluates(stack: Stack) -> None:
    for rule in alert_rules():
        # The rule as written must evaluate (it is empty unless the alert fires) ...
        stack.query(rule["expr"])
        # ... and what it compares must have data, or the alert could never fire.
        signal, _, _ = split_alert(rule["expr"])
        _check_result(stack, rule["alert"], signal)


def test_prometheus_evaluates_the_rules_without_errors(stack: Stack) -> None:
    groups = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))

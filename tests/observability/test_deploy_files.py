"""The monitoring stack's files hold together: the Grafana dashboard is well-formed and covers
what operators need, provisioning points where docker-compose mounts things, Prometheus'
config and alert rules pass promtool, and the alerts fire on the series they are meant for."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.observability.monitoring import (
    ALERTS_TEST_YML,
    ALERTS_YML,
    DASHBOARD_PROVIDERS,
    DASHBOARD_VARIABLES,
    DATASOURCES,
    PROMETHEUS_YML,
    alert_rules,
    dashboard_queries,
    load_dashboard,
    metric_names,
    panels,
    split_alert,
)
from tests.support import Server

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package 'prometheus'; .ci/run installs it with "
    "apt-get when it can)",
)

# What the issue asks the dashboard to show, as the series that show it.
REQUIRED_SERIES = {
    "request rate by status": "mha_requests_total",
    "latency percentiles": "mha_request_duration_seconds_bucket",
    "queue wait": "mha_queue_wait_seconds_bucket",
    "compute": "mha_batch_compute_seconds_bucket",
    "batch size": "mha_batch_size_sequences_bucket",
    "tokens per batch": "mha_batch_size_tokens_sum",
    "padding ratio": "mha_batch_padding_ratio_sum",
    "queue depth": "mha_queue_depth_sequences",
    "in-flight": "mha_requests_in_flight",
    "sequences per second": "mha_sequences_processed_total",
    "tokens per second": "mha_tokens_processed_total",
    "failures by reason": "mha_request_failures_total",
    "process CPU": "process_cpu_seconds_total",
    "process RSS": "process_resident_memory_bytes",
}


def test_dashboard_identity_and_variables() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "mha-serve" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "instance"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == "${datasource}"
        assert var["multi"] and var["includeAll"], "several replicas: select one, some or all"
        assert var["query"]["query"].startswith("label_values(")
    assert "$model" in variables["instance"]["query"]["query"], "instances follow the model"


def test_every_panel_has_a_query_a_description_and_a_place() -> None:
    dashboard = load_dashboard()
    seen_ids, cells = set(), set()
    for panel in panels(dashboard):
        title = panel["title"]
        assert title and panel["description"].strip(), f"panel {title!r} lacks a description"
        assert panel["id"] not in seen_ids
        seen_ids.add(panel["id"])
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], title
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", title
            assert target["expr"].strip(), title
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, title
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panel {title!r} overlaps another"
                cells.add((x, y))


SERVER_WIDE = ("mha_response_cache_bytes", "mha_response_cache_capacity_bytes")


def test_device_wide_gauges_count_each_device_once() -> None:
    """mha_cuda_memory_* give the device's figure on each model's series: a panel summing them
    over models would count a shared GPU once per model."""
    seen = 0
    for query in dashboard_queries(load_dashboard()):
        if "mha_cuda_memory_" in query.expr:
            assert "max by (instance, device) (mha_cuda_memory_" in query.expr, query.panel
            seen += 1
    assert seen == 2


def test_queries_use_the_template_variables() -> None:
    for query in dashboard_queries(load_dashboard()):
        variables = set(re.findall(r"\$\w+", query.expr))
        assert variables <= set(DASHBOARD_VARIABLES), (query.panel, variables)
        for name in metric_names(query.expr):
            if name.startswith("mha_"):
                # Each selector of our series honours both variables, so picking a model or
                # some replicas narrows every panel (the response cache's size is the
                # server's, shared by its models: no model label).
                for selector in re.findall(rf"\b{name}\b\s*(\{{[^}}]*\}})?", query.expr):
                    if not name.startswith(SERVER_WIDE):
                        assert 'model=~"$model"' in selector, (query.panel, name)
                    assert 'instance=~"$instance"' in selector, (query.panel, name)
            else:
                assert 'instance=~"$instance"' in query.expr, (query.panel, name)
        if "rate(" in query.expr or "increase(" in query.expr:
            assert "[$__rate_interval]" in query.expr, query.panel


def test_dashboard_covers_what_operators_asked_for() -> None:
    exprs = " ".join(q.expr for q in dashboard_queries(load_dashboard()))
    for need, series in REQUIRED_SERIES.items():
        assert re.search(rf"\b{series}\b", exprs), f"no panel shows {need} ({series})"
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(mha_request_duration" in exprs


def test_dashboard_and_alert_series_exist_on_a_real_server(demo_server: Server) -> None:
    """Cheap cross-check that also runs where Prometheus can't (the full check needs it):
    every series the queries name is declared by a real server (series with labels appear
    only after their first request, so the # TYPE lines are what is compared)."""
    declared = set()
    for line in demo_server.metrics().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            declared.add(name)
            if kind == "histogram":
                declared |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    exprs = [q.expr for q in dashboard_queries(load_dashboard())]
    exprs += [rule["expr"] for rule in alert_rules()]
    for expr in exprs:
        for name in metric_names(expr) - {"up"}:
            if name.startswith("mha_cuda_"):
                continue  # CUDA replicas only
            assert name in declared, f"{name} (in {expr}) is not exposed"


def test_grafana_provisioning_matches_the_compose_mounts() -> None:
    (datasource_file,) = DATASOURCES.glob("*.yml")
    (source,) = yaml.safe_load(datasource_file.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    prometheus = yaml.safe_load(PROMETHEUS_YML.read_text())
    # $__rate_interval is only right if Grafana knows the scrape interval.
    assert source["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]
    (provider_file,) = DASHBOARD_PROVIDERS.glob("*.yml")
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_prometheus_scrapes_both_compose_replicas() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "mha-serve" and job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets == ["mha-serve-1:8000", "mha-serve-2:8000"]
    assert config["rule_files"] == [ALERTS_YML.name]


def test_alert_rules_cover_the_asked_conditions() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    exprs = " ".join(rule["expr"] for rule in rules.values())
    assert "mha_queue_capacity_sequences" in exprs, "queue near full"
    assert "histogram_quantile(0.99" in exprs, "p99 over a threshold"
    assert "mha_request_failures_total" in exprs, "error ratio"
    assert "mha_ready" in exprs, "not ready"
    for name, rule in rules.items():
        split_alert(rule["expr"])  # the convention the Prometheus test relies on
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


@needs_promtool
def test_promtool_checks_rules_and_config() -> None:
    for args in (["check", "rules", str(ALERTS_YML)], ["check", "config", str(PROMETHEUS_YML)]):
        result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alerts_fire_on_the_series_they_are_for() -> None:
    """promtool's rule unit tests (tests/observability/alerts_test.yml) on synthetic series."""
    result = subprocess.run(
        [PROMTOOL, "test", "rules", ALERTS_TEST_YML.name],
        cwd=ALERTS_TEST_YML.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", ALERTS_TEST_YML.read_text()))
    assert tested == {rule["alert"] for rule in alert_rules()}, "every alert has a case"

"""Helpers for the observability tests: the deploy files, their PromQL, and /metrics parsing."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "mha.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS_YML = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST_YML = Path(__file__).with_name("alerts_test.yml")

# Variables Grafana substitutes in the dashboard's queries (the tests substitute them too).
DASHBOARD_VARIABLES = ("$model", "$instance", "$__rate_interval")


@dataclass
class Query:
    """One PromQL expression of the dashboard."""

    panel: str
    ref_id: str
    expr: str


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that draws something (rows flattened, rows themselves left out)."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def dashboard_queries(dashboard: dict[str, Any]) -> list[Query]:
    return [
        Query(panel["title"], target["refId"], target["expr"])
        for panel in panels(dashboard)
        for target in panel["targets"]
    ]


def regex_alternation(values: list[str]) -> str:
    """What Grafana puts in `=~"$var"` for several selected values: (a|b), regex-escaped,
    with backslashes doubled for the PromQL string literal."""
    escaped = [re.escape(v).replace("\\", "\\\\") for v in values]
    return "(" + "|".join(escaped) + ")"


def substitute(expr: str, *, models: list[str], instances: list[str], rate_interval: str) -> str:
    """The query Grafana would send with these variable values."""
    out = expr.replace("$__rate_interval", rate_interval)
    out = out.replace("$instance", regex_alternation(instances))
    return out.replace("$model", regex_alternation(models))


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS_YML.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


# `<signal> <comparison> <number>` at the end of an alert expression (see alerts.yml).
_THRESHOLD = re.compile(r"^(?P<signal>.+?)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<value>-?[0-9.]+)\s*$")


def split_alert(expr: str) -> tuple[str, str, float]:
    """(signal, comparison, threshold) of an alert expression; ValueError if it isn't one."""
    match = _THRESHOLD.match(" ".join(expr.split()))
    if match is None:
        raise ValueError(f"alert expression is not '<signal> <op> <number>': {expr}")
    return match["signal"], match["op"], float(match["value"])


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (mha_*, process_*, up)."""
    names = set(re.findall(r"\b(?:mha|process)_[a-z_]+\b", expr))
    return names | ({"up"} if re.search(r"\bup\s*\{", expr) else set())


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_exposition(text: str) -> tuple[dict[str, str], list[Sample]]:
    """({family name: type}, samples) of a Prometheus text exposition."""
    types, samples = {}, []
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        samples += [Sample(s.name, dict(s.labels), s.value) for s in family.samples]
    return types, samples


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )

"""Readiness and alerts across a model's life, in a real Prometheus scraping a real server.

One replica in --model-control-mode explicit serves `attn` at two versions and `enc` at one.
The dashboard's "Replicas ready" counts that as one replica (not three versions). After an
explicit unload of `enc`, its mha_ready and mha_model_info series are gone from the scrape, so
MHANotReady (which is for models meant to serve) does not fire for an unload that was meant,
and the panels drop it; `attn` keeps serving and stays ready.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from torch import nn

import mha_engine
from tests.observability.monitoring import (
    alert_rules,
    dashboard_queries,
    load_dashboard,
    split_alert,
    substitute,
)
from tests.observability.test_prometheus_queries import PROMETHEUS, _prometheus
from tests.support import Server, run_server

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not installed (Debian package 'prometheus'; .ci/run "
    "installs it with apt-get, so this only skips where apt-get could not)",
)

MODELS = ["attn", "enc"]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    root = tmp_path_factory.mktemp("lifecycle")
    repo = root / "repository"
    torch.manual_seed(3)
    for version in ("1", "2"):
        mha_engine.save_model(
            nn.MultiheadAttention(48, 4, batch_first=True), repo / "attn" / version
        )
    (repo / "attn" / "mha-serve.json").write_text(
        json.dumps({"version_policy": {"latest": {"num_versions": 2}}})
    )
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()
    mha_engine.save_model(layer, repo / "enc" / "1")
    args = ("--model-repository", str(repo), "--model-control-mode", "explicit")
    with run_server(root, *args) as server, _prometheus(root, [server.address]) as prometheus:
        yield server, prometheus


def query(prometheus: str, expr: str) -> list[dict]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    assert response.status_code == 200, (expr, response.text)
    return response.json()["data"]["result"]


def panel(prometheus: str, title: str, instance: str) -> list[dict]:
    (found,) = [q for q in dashboard_queries(load_dashboard()) if q.panel == title]
    expr = substitute(found.expr, models=MODELS, instances=[instance], rate_interval="10s")
    return query(prometheus, expr)


def wait_for(prometheus: str, expr: str, want: int, seconds: float = 30) -> list[dict]:
    """Until `expr` has `want` series (scrapes are 1 s apart)."""
    deadline = time.monotonic() + seconds
    while len(result := query(prometheus, expr)) != want:
        assert time.monotonic() < deadline, (expr, result)
        time.sleep(0.5)
    return result


def not_ready_alert() -> str:
    (rule,) = [r for r in alert_rules() if r["alert"] == "MHANotReady"]
    return rule["expr"]


def test_unload_removes_the_series_and_the_alert_stays_quiet(replica) -> None:
    server, prometheus = replica
    instance = server.address
    # Loaded: three ready versions on one replica.
    wait_for(prometheus, "mha_ready == 1", 3)
    (ready,) = panel(prometheus, "Replicas ready", instance)
    assert float(ready["value"][1]) == 1, "one replica, whatever its models and versions"
    assert len(panel(prometheus, "Served model", instance)) == 3

    response = httpx.post(f"{server.url}/v2/repository/models/enc/unload", timeout=60)
    assert response.status_code == 200, response.text
    # The server's own /metrics: enc's gauges are gone, attn's are still there.
    text = server.metrics()
    assert 'model="enc"' not in "".join(
        line for line in text.splitlines() if line.startswith(("mha_ready", "mha_model_info"))
    ), text
    assert server.metric("mha_ready", model="attn") == 2
    # Prometheus sees the same at its next scrapes (a vanished series is marked stale).
    wait_for(prometheus, 'mha_ready{model="enc"}', 0)
    wait_for(prometheus, 'mha_model_info{model="enc"}', 0)
    assert len(query(prometheus, 'mha_ready{model="attn"} == 1')) == 2
    # MHANotReady's expression has nothing for the unloaded model (or anything else).
    assert query(prometheus, not_ready_alert()) == []
    signal, _, _ = split_alert(not_ready_alert())
    assert {r["metric"]["model"] for r in query(prometheus, signal)} == {"attn"}
    (ready,) = panel(prometheus, "Replicas ready", instance)
    assert float(ready["value"][1]) == 1
    assert len(panel(prometheus, "Served model", instance)) == 2

    # Loaded again: its series come back, ready.
    response = httpx.post(f"{server.url}/v2/repository/models/enc/load", timeout=120)
    assert response.status_code == 200, response.text
    wait_for(prometheus, 'mha_ready{model="enc"} == 1', 1)
    assert server.metric("mha_ready", model="enc") == 1

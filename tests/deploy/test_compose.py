"""docker-compose.yml: valid for Docker Compose itself and the compose-spec schema, and whole.

`docker-compose config` (Compose v2's real parser: schema, interpolation, merge keys, profiles,
depends_on) needs no Docker engine, and the rest checks that what the file refers to exists and
agrees with the other deploy files; test_stack.py brings the stack up for real.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.nginx import PLACEHOLDER, TEMPLATE
from tests.deploy.tools import binary, compose_binary, run
from tests.support import ROOT

COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
SERVICES = {"mha-serve-1", "mha-serve-2", "nginx", "prometheus", "grafana"}
LOADTEST = {"locust-master", "locust-worker"}


def compose_config(*args: str, env: dict[str, str] | None = None) -> dict:
    """The resolved model from `docker-compose config --format json`, as Compose sees it."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MHA_", "COMPOSE_"))}
    result = subprocess.run(
        [compose_binary(), "--project-directory", str(ROOT), *args, "config", "--format", "json"],
        cwd=ROOT,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def stack() -> dict:
    return compose_config("-f", str(COMPOSE), "--profile", "loadtest")


def test_compose_spec_schema() -> None:
    for path in (COMPOSE, COMPOSE_GPU):
        result = run(
            binary("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_compose_parses_the_stack(stack: dict) -> None:
    assert set(stack["services"]) == SERVICES | LOADTEST
    default = compose_config("-f", str(COMPOSE))
    assert set(default["services"]) == SERVICES, "the load generator belongs to a profile"


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    """The parser really validates: a misspelt key and a dangling depends_on are errors."""
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["nginx"]["depends_on"].append("mha-serve-3")
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(broken))
    result = run(compose_binary(), "-f", str(tmp_path / "compose.yml"), "config", "-q")
    assert result.returncode != 0 and "mha-serve-3" in result.stderr, result.stderr
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["nginx"]["volumez"] = []
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(broken))
    result = run(compose_binary(), "-f", str(tmp_path / "compose.yml"), "config", "-q")
    assert result.returncode != 0 and "volumez" in result.stderr, result.stderr


def test_every_mounted_file_exists(stack: dict) -> None:
    """Bind mounts are repo paths (a missing one would become an empty dir at `up`)."""
    binds = [
        (name, volume["source"])
        for name, service in stack["services"].items()
        for volume in service.get("volumes", [])
        if volume["type"] == "bind"
    ]
    assert len(binds) >= 5, binds  # nginx x2, prometheus, grafana x2
    missing = [(name, src) for name, src in binds if not Path(src).exists()]
    assert not missing, f"mounted paths missing from the repo: {missing}"
    for name, src in binds:
        assert Path(src).resolve().is_relative_to(ROOT), f"{name} mounts {src} outside the repo"
    # Paths a service is told about inside its container resolve to mounted repo files.
    grafana = stack["services"]["grafana"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    mount = max(
        (v for v in grafana["volumes"] if home.startswith(v["target"] + "/")),
        key=lambda v: len(v["target"]),  # the innermost mount wins, as in the container
    )
    assert mount["type"] == "bind", mount
    assert (Path(mount["source"]) / home.removeprefix(mount["target"] + "/")).is_file(), home
    build_targets = {
        service["build"].get("target", "runtime")
        for service in stack["services"].values()
        if "build" in service
    }
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", (ROOT / "Dockerfile").read_text(), re.M))
    assert build_targets - {"runtime"} <= stages, (build_targets, stages)


def test_replicas_drain_and_reach_nginx_and_prometheus(stack: dict) -> None:
    services = stack["services"]
    replicas = sorted(name for name in services if name.startswith("mha-serve-"))
    assert replicas == ["mha-serve-1", "mha-serve-2"]
    for name in replicas:
        env = services[name]["environment"]
        assert env["MHA_HOST"] == "0.0.0.0" and env["MHA_PORT"] == "8000"
        assert env.get("MHA_MODEL_DIR") is None, "demo model unless the user names one"
        drain = float(env["MHA_DRAIN_GRACE_S"])
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > drain, (grace, drain)
    nginx = services["nginx"]["environment"]
    placeholders = set(PLACEHOLDER.findall(TEMPLATE.read_text()))
    assert placeholders <= nginx.keys(), placeholders - nginx.keys()
    upstreams = {v for k, v in nginx.items() if k.startswith("MHA_UPSTREAM_")}
    assert upstreams == {f"{name}:8000" for name in replicas}
    scraped = {
        target
        for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }
    assert upstreams <= scraped, f"Prometheus must scrape every replica: {upstreams - scraped}"


def test_model_volume_and_gpu_override() -> None:
    mounted = compose_config(
        "-f", str(COMPOSE), env={"MHA_MODELS": "./deploy", "MHA_MODEL_DIR": "/models/x"}
    )
    replica = mounted["services"]["mha-serve-1"]
    (volume,) = replica["volumes"]
    assert volume["type"] == "bind" and volume["target"] == "/models" and volume["read_only"]
    assert replica["environment"]["MHA_MODEL_DIR"] == "/models/x"

    gpu = compose_config("-f", str(COMPOSE), "-f", str(COMPOSE_GPU))
    devices = []
    for name in ("mha-serve-1", "mha-serve-2"):
        replica = gpu["services"][name]
        assert replica["image"] == "mha-serve:cuda"
        assert replica["build"]["args"]["VARIANT"] == "cuda"
        (device,) = replica["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        devices += device["device_ids"]
    assert sorted(devices) == ["0", "1"], "one GPU per replica"

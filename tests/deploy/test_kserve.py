"""deploy/kserve: the ServingRuntime and InferenceServices agree with each other and with the
server they start.

No cluster here, so validation is offline: both kinds against KServe's API types as its pinned
SDK (kserve==0.21.0) generates them from the Go types its CRDs come from (strict: unknown
fields, wrong types and missing required fields fail; tests/deploy/openapi_models.py); the
runtime's container also strictly as a core/v1 Container (inside a Pod) against Kubernetes'
schemas; its args
go through mha-serve's own flag parser (a flag that does not exist fails); the ports KServe
routes to (HTTP, the h2c port of the gRPC InferenceService, the Prometheus annotation) and the
readiness probe are those the parsed settings listen on; each InferenceService names the
runtime, one of its model formats and one of its protocol versions.
"""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from service.__main__ import parse_settings
from service.app import create_app
from service.runtime.repository import model_sources
from tests.deploy.openapi_models import errors_of
from tests.support import ROOT

KSERVE = ROOT / "deploy" / "kserve"


def load(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((KSERVE / name).read_text()) if d]
    return doc


RUNTIME = load("servingruntime.yaml")
SERVICES = {name: load(name) for name in ("inferenceservice.yaml", "inferenceservice-grpc.yaml")}


def container() -> dict:
    (only,) = RUNTIME["spec"]["containers"]
    return only


def settings_for(service: dict):
    """The server's settings as KServe starts it for `service` ({{.Name}} filled in)."""
    name = service["metadata"]["name"]
    return parse_settings([arg.replace("{{.Name}}", name) for arg in container()["args"]])


def test_the_runtime_serves_a_repository_laid_out_as_documented(tmp_path) -> None:
    """A repository as inferenceservice.yaml describes it, at the runtime's path, serves `attn`."""
    args = [a.replace("/mnt/models", str(tmp_path)) for a in container()["args"]]
    (tmp_path / "attn" / "1").mkdir(parents=True)
    sources = model_sources(parse_settings(args))
    assert [(s.name, s.version) for s in sources] == [("attn", "1")]


def test_runtime_kinds_and_container_validate() -> None:
    assert (RUNTIME["apiVersion"], RUNTIME["kind"]) == (
        "serving.kserve.io/v1alpha1",
        "ServingRuntime",
    )
    for service in SERVICES.values():
        assert (service["apiVersion"], service["kind"]) == (
            "serving.kserve.io/v1beta1",
            "InferenceService",
        )
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {"containers": [container()]}}  # fmt: skip
    for version in ("1.28.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(pod, version, strict=True)
    broken = {**pod, "spec": {"containers": [{**container(), "argz": []}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


KINDS = {"ServingRuntime": "V1alpha1ServingRuntime", "InferenceService": "V1beta1InferenceService"}


def test_manifests_validate_against_kserve_api_types() -> None:
    docs = [load(name) for name in ("servingruntime.yaml", *SERVICES)]
    assert errors_of([(doc, KINDS[doc["kind"]]) for doc in docs]) == [[]] * len(docs)


def test_kserve_validation_is_strict() -> None:
    """A misspelt field, a wrong type and a missing required field are each caught."""
    service = load("inferenceservice.yaml")
    model = service["spec"]["predictor"]["model"]
    misspelt = {**service, "spec": {"predictor": {"model": {**model, "protocolVersio": "v2"}}}}
    wrong_type = {**service, "spec": {"predictor": {"minReplicas": "two", "model": model}}}
    no_containers = {
        **RUNTIME,
        "spec": {k: v for k, v in RUNTIME["spec"].items() if k != "containers"},
    }
    unnamed = {k: v for k, v in container().items() if k != "name"}
    no_name = {**RUNTIME, "spec": {**RUNTIME["spec"], "containers": [unnamed]}}
    found = errors_of(
        [
            (misspelt, KINDS["InferenceService"]),
            (wrong_type, KINDS["InferenceService"]),
            (no_containers, KINDS["ServingRuntime"]),
            (no_name, KINDS["ServingRuntime"]),
        ]
    )
    assert any("protocolVersio: unknown field" in e for e in found[0]), found[0]
    assert any("minReplicas: expected int" in e for e in found[1]), found[1]
    assert found[2] == [".spec.containers: required by V1alpha1ServingRuntimeSpec"]
    assert found[3] == [".spec.containers[0].name: required by V1Container"]


@pytest.mark.parametrize("name", list(SERVICES))
def test_services_match_the_runtime_and_the_ports_it_listens_on(name: str) -> None:
    service = SERVICES[name]
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == RUNTIME["metadata"]["name"]
    formats = {f["name"] for f in RUNTIME["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    assert model["protocolVersion"] in RUNTIME["spec"]["protocolVersions"]
    settings = settings_for(service)
    # the repository KServe's storage initializer puts at /mnt/models
    assert str(settings.model_repository) == "/mnt/models" and settings.model_dir == []
    assert settings.host == "0.0.0.0" and settings.port == 8080  # KServe's HTTP port
    assert settings.grpc_port and settings.grpc_port != settings.port
    if model["protocolVersion"] == "grpc-v2":
        (port,) = model["ports"]
        assert (port["name"], port["containerPort"]) == ("h2c", settings.grpc_port)
    else:
        assert "ports" not in model
    annotations = RUNTIME["spec"]["annotations"]
    assert int(annotations["prometheus.kserve.io/port"]) == settings.port
    assert annotations["prometheus.kserve.io/path"] == "/metrics"


def test_readiness_probe_is_the_servers_own() -> None:
    probe = container()["readinessProbe"]["httpGet"]
    settings = settings_for(SERVICES["inferenceservice.yaml"])
    assert probe["port"] == settings.port
    paths = create_app(settings).openapi()["paths"]
    assert probe["path"] in paths

"""Several versions of a model served at once (Triton's version_policy in a model's
mha-serve.json): each version its own entry, addressed over HTTP and gRPC with the unmodified
tritonclient; an unversioned request goes to the highest; statistics, metrics and readiness per
version."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from benchmarks.scrape import samples
from service.runtime.loading import load_entry, warm_up_model
from service.runtime.metrics import Metrics
from service.runtime.repository import ModelSource, RepositoryError, select_versions
from service.runtime.settings import Settings
from service.runtime.state import ServiceState
from tests.inprocess import asgi_client
from tests.support import FP32_TOL, Server, free_port, run_server

EMBED_DIM = 16
# Different weights per version (seed = version), so a request routed to the wrong one fails.
MODULES = {}
for _v in (1, 2, 3):
    torch.manual_seed(_v)
    MODULES[str(_v)] = nn.MultiheadAttention(EMBED_DIM, 2, batch_first=True).eval()
POLICIES = {
    "newest2": {"latest": {"num_versions": 2}},
    "every": {"all": {}},
    "picked": {"specific": {"versions": [1, 3]}},
}
SERVED = {"newest2": ["2", "3"], "every": ["1", "2", "3"], "picked": ["1", "3"]}


def expected(version: str, x: np.ndarray) -> torch.Tensor:
    q = torch.from_numpy(x)
    return MODULES[version](q, q, q, need_weights=False)[0].detach()


def rng_input(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def write_policy(repo: Path, name: str, policy: dict) -> None:
    (repo / name / "mha-serve.json").write_text(json.dumps({"version_policy": policy}))


# -- the policy itself ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ({"latest": {"num_versions": 1}}, [10]),
        ({"latest": {"num_versions": 2}}, [3, 10]),
        ({"latest": {"num_versions": 9}}, [1, 3, 10]),
        ({"latest": {}}, [10]),  # Triton's default num_versions is 1
        ({"all": {}}, [1, 3, 10]),
        ({"specific": {"versions": [10, 1, 1]}}, [1, 10]),
    ],
)
def test_a_policy_picks_versions_in_numeric_order(policy, served) -> None:
    assert select_versions(policy, [10, 1, 3], Path("m/mha-serve.json")) == served


@pytest.mark.parametrize(
    "policy",
    [
        {"latest": {"num_versions": True}},
        {"latest": {"num_versions": 1}, "all": {}},
        {"all": {"x": 1}},
        {"specific": {"versions": ["1"]}},
        {"specific": {"versions": [4]}},
        "all",
    ],
)
def test_a_bad_policy_is_refused_naming_the_file(policy) -> None:
    with pytest.raises(RepositoryError, match=r"m/mha-serve\.json: version_policy"):
        select_versions(policy, [1, 2, 3], Path("m/mha-serve.json"))


def test_a_version_is_ready_only_once_warm_and_not_while_it_drains(tmp_path: Path) -> None:
    mha_engine.save_model(MODULES["1"], tmp_path / "m" / "1")
    settings = Settings(max_batch_delay_ms=0)

    async def scenario() -> list[bool]:
        metrics = Metrics("m")
        source = ModelSource("m", tmp_path / "m" / "1", "1")
        entry = await load_entry(settings, metrics, source)
        state = ServiceState(settings, metrics, {"m": {"1": entry}})
        state.ready = True  # the server is ready; the version is not warm yet
        entry.batcher.start()
        try:
            seen = [state.model_ready(entry)]
            await warm_up_model(entry)
            seen.append(state.model_ready(entry))
            entry.unloading = True  # what ModelControl sets while the version drains
            seen.append(state.model_ready(entry))
        finally:
            await asyncio.to_thread(entry.batcher.stop, 1.0)
        return seen

    assert asyncio.run(scenario()) == [False, True, False]


# -- a real server: three models with versions 1, 2, 3 under each policy -----------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, Path]]:
    root = tmp_path_factory.mktemp("versions")
    repo = root / "repository"
    for name, policy in POLICIES.items():
        for version, module in MODULES.items():
            mha_engine.save_model(module, repo / name / version)
        write_policy(repo, name, policy)
    port = free_port()
    args = ("--model-repository", str(repo), "--model-control-mode", "explicit")
    with run_server(root, *args, "--grpc-port", str(port), "--max-batch-delay-ms", "0") as http:
        yield http, f"127.0.0.1:{port}", repo


def http_infer(http: Server, name: str, x: np.ndarray, version: str = "") -> np.ndarray:
    item = thttp.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    client = thttp.InferenceServerClient(http.address)
    return client.infer(name, [item], model_version=version).as_numpy("output")


def grpc_infer(address: str, name: str, x: np.ndarray, version: str = "") -> np.ndarray:
    item = tgrpc.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    client = tgrpc.InferenceServerClient(address)
    return client.infer(name, [item], model_version=version).as_numpy("output")


def close(got: np.ndarray, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.from_numpy(np.array(got)), want, **FP32_TOL)


def test_metadata_lists_the_versions_each_policy_serves(server) -> None:
    http, address, _ = server
    client, grpc_client = (
        thttp.InferenceServerClient(http.address),
        tgrpc.InferenceServerClient(address),
    )
    for name, versions in SERVED.items():
        assert client.get_model_metadata(name)["versions"] == versions
        assert grpc_client.get_model_metadata(name, as_json=True)["versions"] == versions
        assert client.get_model_metadata(name, versions[0])["versions"] == versions
        assert client.get_model_config(name)["version_policy"] == POLICIES[name]
        policy = grpc_client.get_model_config(name).config.version_policy
        assert policy.WhichOneof("policy_choice") == next(iter(POLICIES[name]))
    grpc_picked = grpc_client.get_model_config("picked").config.version_policy
    assert list(grpc_picked.specific.versions) == [1, 3]


def test_each_version_computes_with_its_own_weights(server) -> None:
    http, address, _ = server
    for name, versions in SERVED.items():
        for version in versions:
            x = rng_input(int(version), 2, 5, EMBED_DIM)
            close(http_infer(http, name, x, version), expected(version, x))
            close(grpc_infer(address, name, x, version), expected(version, x))


def test_an_unversioned_request_goes_to_the_highest_version(server) -> None:
    http, address, _ = server
    x = rng_input(7, 1, 6, EMBED_DIM)
    for name in SERVED:
        close(http_infer(http, name, x), expected("3", x))
        close(grpc_infer(address, name, x), expected("3", x))
    with pytest.raises(AssertionError):  # the versions' numbers do differ
        close(http_infer(http, "every", x), expected("2", x))


def test_an_unknown_version_is_not_found_naming_the_served_ones(server) -> None:
    http, address, _ = server
    x = rng_input(0, 1, 2, EMBED_DIM)
    with pytest.raises(InferenceServerException) as info:
        http_infer(http, "newest2", x, "1")  # on disk, but not served by latest 2
    assert info.value.status() == "404"
    assert "no version '1' (served versions: 2, 3)" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        grpc_infer(address, "picked", x, "2")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "served versions: 1, 3" in info.value.message()
    client = thttp.InferenceServerClient(http.address)
    assert not client.is_model_ready("picked", "2")
    with pytest.raises(InferenceServerException, match="no version '9'"):
        client.get_inference_statistics("every", "9")


def test_statistics_count_each_version(server) -> None:
    http, address, _ = server
    client = thttp.InferenceServerClient(http.address)
    grpc_client = tgrpc.InferenceServerClient(address)

    def counts() -> dict[str, int]:
        stats = client.get_inference_statistics("every")["model_stats"]
        return {s["version"]: s["inference_count"] for s in stats}

    before = counts()
    assert set(before) == {"1", "2", "3"}
    http_infer(http, "every", rng_input(1, 2, 3, EMBED_DIM), "1")
    grpc_infer(address, "every", rng_input(2, 3, 3, EMBED_DIM))  # unversioned: version 3
    after = counts()
    assert {v: after[v] - before[v] for v in after} == {"1": 2, "2": 0, "3": 3}
    one = client.get_inference_statistics("every", "1")["model_stats"]
    assert [(s["name"], s["version"]) for s in one] == [("every", "1")]
    grpc_one = grpc_client.get_inference_statistics("every", "3", as_json=True)["model_stats"]
    assert [(s["version"], s["inference_count"]) for s in grpc_one] == [("3", str(after["3"]))]
    every = client.get_inference_statistics()["model_stats"]
    assert sorted((s["name"], s["version"]) for s in every) == sorted(
        (n, v) for n, versions in SERVED.items() for v in versions
    )


def test_metrics_carry_the_version_and_queries_by_model_still_work(server) -> None:
    http, _, _ = server
    labels = {"model": "picked", "protocol": "http", "status": "200", "endpoint": "infer"}
    before = {v: http.metric("mha_requests_total", version=v, **labels) for v in ("1", "3")}
    total_before = http.metric("mha_requests_total", **labels)
    sequences = http.metric("mha_sequences_processed_total", model="picked", version="1")
    http_infer(http, "picked", rng_input(3, 4, 2, EMBED_DIM), "1")
    http_infer(http, "picked", rng_input(4, 1, 2, EMBED_DIM))  # version 3
    assert http.metric("mha_requests_total", version="1", **labels) == before["1"] + 1
    assert http.metric("mha_requests_total", version="3", **labels) == before["3"] + 1
    assert http.metric("mha_requests_total", **labels) == total_before + 2  # by model alone
    assert (
        http.metric("mha_sequences_processed_total", model="picked", version="1") == sequences + 4
    )
    for name, versions in SERVED.items():
        for version in versions:
            assert http.metric("mha_ready", model=name, version=version) == 1
            assert http.metric("mha_model_info", model=name, version=version) == 1


def test_readiness_and_the_index_are_per_version(server) -> None:
    http, address, _ = server
    client = thttp.InferenceServerClient(http.address)
    grpc_client = tgrpc.InferenceServerClient(address)
    for name, versions in SERVED.items():
        for version in versions:
            assert client.is_model_ready(name, version)
            assert grpc_client.is_model_ready(name, version)
    rows = {(r["name"], r["version"]): r["state"] for r in client.get_model_repository_index()}
    assert rows == {(n, v): "READY" for n, versions in SERVED.items() for v in versions}


def ready_versions(http: Server, model: str) -> set[str]:
    """The versions of `model` that have an mha_ready series on /metrics."""
    return {
        sample.labels["version"]
        for sample in samples(http.metrics())
        if sample.name == "mha_ready" and sample.labels.get("model") == model
    }


def test_explicit_load_and_unload_apply_the_policy(server) -> None:
    http, address, repo = server
    client = thttp.InferenceServerClient(http.address)
    grpc_client = tgrpc.InferenceServerClient(address)
    client.unload_model("picked")
    try:
        assert not client.is_model_ready("picked", "1") and not client.is_model_ready("picked")
        assert grpc_client.is_model_ready("picked", "3") is False  # known, unloaded: as Triton
        # Unloaded on purpose: no readiness series at all (MHANotReady is for models meant to
        # serve), rather than a 0 that looks like a failed warm-up.
        assert ready_versions(http, "picked") == set()
        rows = {(r["name"], r["version"]): r for r in client.get_model_repository_index()}
        assert rows["picked", "1"]["state"] == rows["picked", "3"]["state"] == "UNAVAILABLE"
        write_policy(repo, "picked", {"specific": {"versions": [2]}})
        grpc_client.load_model("picked")  # the policy as it is on disk now
        assert client.get_model_metadata("picked")["versions"] == ["2"]
        assert client.is_model_ready("picked", "2") and not client.is_model_ready("picked", "3")
        x = rng_input(5, 1, 4, EMBED_DIM)
        close(http_infer(http, "picked", x), expected("2", x))
    finally:
        write_policy(repo, "picked", POLICIES["picked"])
        client.load_model("picked")
    assert client.get_model_metadata("picked")["versions"] == SERVED["picked"]
    assert http.metric("mha_ready", model="picked", version="1") == 1
    assert "2" not in ready_versions(http, "picked")  # replaced: drained, then its series gone
    client.load_model("every")  # a reload: the new copies own the same series
    for version in SERVED["every"]:
        assert http.metric("mha_ready", model="every", version=version) == 1


def test_the_debug_routes_refuse_a_version_they_would_not_compute_with(tmp_path: Path) -> None:
    for version in ("1", "2"):
        mha_engine.save_model(MODULES[version], tmp_path / "m" / version)
    write_policy(tmp_path, "m", {"all": {}})

    async def scenario() -> list[tuple[int, str]]:
        settings = {"model_repository": tmp_path, "debug_endpoint": True, "grpc_port": 0}
        async with asgi_client(**settings) as client:
            paths = ("/v2/models/m/heads", "/v2/models/m/versions/2/heads")
            paths += ("/v2/models/m/versions/1/heads",)
            answers = [await client.get(path) for path in paths]
        return [(r.status_code, r.json().get("error", "")) for r in answers]

    (heads, _), (versioned, _), (refused, message) = asyncio.run(scenario())
    assert (heads, versioned, refused) == (200, 200, 400)
    assert "serve only model 'm' version 2" in message and "not 'm' version 1" in message

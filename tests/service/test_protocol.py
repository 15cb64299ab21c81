"""Health, metadata and error bodies over real HTTP, validated against the OIP REST schemas."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from tests.support import Server, validate_oip


def test_health_routes(demo_server: Server) -> None:
    assert httpx.get(f"{demo_server.url}/v2/health/live").status_code == 200
    assert httpx.get(f"{demo_server.url}/v2/health/ready").status_code == 200
    assert httpx.get(f"{demo_server.url}/v2/models/mha/ready").status_code == 200
    assert httpx.get(f"{demo_server.url}/v2/models/mha/versions/1/ready").status_code == 200


def test_server_metadata_matches_schema(demo_server: Server) -> None:
    body = httpx.get(f"{demo_server.url}/v2").json()
    validate_oip("metadata_server_response", body)
    assert "binary_tensor_data" in body["extensions"]


@pytest.mark.parametrize("path", ["/v2/models/mha", "/v2/models/mha/versions/1"])
def test_model_metadata_matches_schema(demo_server: Server, path: str) -> None:
    body = httpx.get(f"{demo_server.url}{path}").json()
    validate_oip("metadata_model_response", body)
    inputs = {t["name"]: t for t in body["inputs"]}
    assert inputs["input"] == {"name": "input", "datatype": "FP32", "shape": [-1, -1, 512]}
    assert inputs["key_padding_mask"]["datatype"] == "BOOL"
    assert "key" not in inputs  # the demo model is a self-attention encoder
    assert body["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, -1, 512]}]
    assert body["properties"]["architecture"] == "transformer_encoder"


def test_tritonclient_sees_server_and_model(demo_server: Server) -> None:
    client = triton.InferenceServerClient(demo_server.address)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mha")
    assert client.get_model_metadata("mha")["name"] == "mha"
    assert client.get_server_metadata()["name"] == "mha-serve"


@pytest.mark.parametrize(
    "path",
    ["/v2/models/nope", "/v2/models/nope/ready", "/v2/models/mha/versions/7", "/v2/nothing"],
)
def test_unknown_things_are_404_with_error_body(demo_server: Server, path: str) -> None:
    response = httpx.get(f"{demo_server.url}{path}")
    assert response.status_code == 404
    validate_oip("metadata_model_error_response", response.json())


def test_unknown_model_infer_is_404(demo_server: Server) -> None:
    body = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0] * 512}]}
    response = httpx.post(f"{demo_server.url}/v2/models/other/infer", json=body)
    assert response.status_code == 404
    assert "other" in response.json()["error"]


def test_json_inference_response_matches_schema(demo_server: Server) -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, 512)).astype(np.float32)
    tensor = {"name": "input", "shape": [2, 3, 512], "datatype": "FP32", "data": x.ravel().tolist()}
    body = {"id": "req-7", "inputs": [tensor]}
    response = httpx.post(f"{demo_server.url}/v2/models/mha/versions/1/infer", json=body)
    assert response.status_code == 200, response.text
    payload = response.json()
    validate_oip("inference_response", payload)
    assert payload["id"] == "req-7"
    assert payload["model_name"] == "mha" and payload["model_version"] == "1"
    out = payload["outputs"][0]
    assert out["shape"] == [2, 3, 512] and len(out["data"]) == 2 * 3 * 512


def test_nested_json_data_is_accepted(demo_server: Server) -> None:
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    tensor = {"name": "input", "shape": [4, 512], "datatype": "FP32"}
    flat = {"inputs": [{**tensor, "data": x.ravel().tolist()}]}
    nested = {"inputs": [{**tensor, "data": x.tolist()}]}
    a = httpx.post(f"{demo_server.url}/v2/models/mha/infer", json=flat).json()
    b = httpx.post(f"{demo_server.url}/v2/models/mha/infer", json=nested).json()
    assert a["outputs"][0]["shape"] == [4, 512]
    np.testing.assert_array_equal(a["outputs"][0]["data"], b["outputs"][0]["data"])

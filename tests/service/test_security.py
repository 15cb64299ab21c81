"""Security basics over real HTTP: API key, request ids, structured logs, no internals in errors,
and a pickle-bearing checkpoint refused at start-up."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support import ROOT, fp32_request, run_server

INFER = "/v2/models/mha/infer"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory):
    env = {"MHA_API_KEY": "s3cret"}
    with run_server(tmp_path_factory.mktemp("key"), "--log-format", "json", env=env) as server:
        yield server


def _post(server, headers: dict[str, str] | None = None) -> httpx.Response:
    body, binary_headers = fp32_request(np.ones((1, 4, 512), dtype=np.float32))
    return httpx.post(
        f"{server.url}{INFER}", content=body, headers={**binary_headers, **(headers or {})}
    )


def test_api_key_guards_inference(keyed_server) -> None:
    missing = _post(keyed_server)
    assert missing.status_code == 401 and "Authorization" in missing.json()["error"]
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert _post(keyed_server, {"Authorization": "Bearer nope"}).status_code == 403
    assert _post(keyed_server, {"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(f"{keyed_server.url}/v2/models/mha").status_code == 401


def test_health_and_metrics_stay_open_by_default(keyed_server) -> None:
    for probe in ("/v2/health/ready", "/health", "/ping", "/metrics"):  # TEI's, SageMaker's
        assert httpx.get(f"{keyed_server.url}{probe}").status_code == 200, probe
    assert httpx.get(f"{keyed_server.url}/v2/logging").status_code == 401


def test_tritonclient_with_the_key(keyed_server) -> None:
    x = np.ones((1, 3, 512), dtype=np.float32)
    item = triton.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    client = triton.InferenceServerClient(keyed_server.address)
    assert client.infer("mha", [item], headers={"Authorization": "Bearer s3cret"}).as_numpy(
        "output"
    ).shape == (1, 3, 512)
    with pytest.raises(InferenceServerException, match="Authorization"):
        client.infer("mha", [item])


def test_closing_health_and_metrics(tmp_path: Path) -> None:
    env = {"MHA_API_KEY": "k"}
    with run_server(tmp_path, "--no-open-health-metrics", env=env, wait=False) as server:
        import time

        deadline = time.monotonic() + 60
        headers = {"Authorization": "Bearer k"}
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.url}/v2/health/ready", headers=headers).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        for probe in ("/v2/health/live", "/health", "/ping", "/metrics"):
            assert httpx.get(f"{server.url}{probe}").status_code == 401, probe
        assert httpx.get(f"{server.url}/metrics", headers=headers).status_code == 200


def test_request_ids_are_echoed_and_logged(keyed_server) -> None:
    auth = {"Authorization": "Bearer s3cret"}
    given = _post(keyed_server, {**auth, "X-Request-ID": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    header_len = int(given.headers["Inference-Header-Content-Length"])
    assert json.loads(given.content[:header_len])["id"] == "trace-42"  # OIP id when none sent
    generated = _post(keyed_server, auth).headers["x-request-id"]
    following = _post(keyed_server, auth).headers["x-request-id"]
    # a random per-process prefix and a counter (no uuid4 per request): unique, log-safe
    assert re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]{12}", generated) and following != generated
    hostile = _post(keyed_server, {**auth, "X-Request-ID": "a b\tc" + "x" * 300})
    assert hostile.headers["x-request-id"] != "a b\tc" + "x" * 300  # replaced, not echoed
    lines = [json.loads(line) for line in keyed_server.log().splitlines() if line.startswith("{")]
    access = [e for e in lines if e.get("logger") == "service.access"]
    assert any(e["request_id"] == "trace-42" and e["status"] == 200 for e in access)
    assert any(e["request_id"] == generated for e in access)
    assert all({"time", "level", "message"} <= set(e) for e in lines)


def test_errors_carry_no_internals(keyed_server) -> None:
    auth = {"Authorization": "Bearer s3cret"}
    bodies = [
        b"{",
        b'{"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": []}]}',
    ]
    for body in bodies:
        response = httpx.post(f"{keyed_server.url}{INFER}", content=body, headers=auth)
        assert response.status_code == 400
        error = response.json()["error"]
        assert "Traceback" not in error and str(ROOT) not in error and ".py" not in error


def test_pickle_checkpoint_is_refused_at_start(tmp_path: Path) -> None:
    """A model.pt whose unpickling would run code: the server refuses it and nothing runs."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    model_dir = tmp_path / "evil"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({"architecture": "multihead_attention", "embed_dim": 8, "num_heads": 2})
    )
    import torch

    torch.save({"in_proj_weight": Payload()}, model_dir / "model.pt")
    assert zipfile.is_zipfile(model_dir / "model.pt")
    assert b"system" in pickle.dumps(Payload())
    result = subprocess.run(
        [sys.executable, "-m", "service", "--model-dir", str(model_dir), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "weights_only" in result.stderr or "refus" in result.stderr.lower(), result.stderr[
        -2000:
    ]
    assert not marker.exists(), "the checkpoint's pickle payload ran"


def test_oversized_headers_get_431(keyed_server) -> None:
    big = {"X-Padding": "a" * 70_000}
    response = httpx.get(f"{keyed_server.url}/v2/health/live", headers=big)
    assert response.status_code == 431
    assert "--max-header-bytes" in response.json()["error"]
    assert httpx.get(f"{keyed_server.url}/v2/health/live").status_code == 200

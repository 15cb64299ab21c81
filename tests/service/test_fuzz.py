"""Schemathesis fuzzes every route of the service's own OpenAPI document against a real server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support import run_server

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
    ]
)


def test_openapi_describes_the_binary_and_json_bodies(demo_server) -> None:
    spec = httpx.get(f"{demo_server.url}/openapi.json").json()
    infer = spec["paths"]["/v2/models/{model_name}/infer"]["post"]
    assert set(infer["requestBody"]["content"]) == {"application/json", "application/octet-stream"}
    assert {"200", "400", "404", "413", "429", "503", "504"} <= set(infer["responses"])


def test_schemathesis_finds_no_server_errors_or_schema_violations(tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    args = ("--max-seq-len", "64", "--max-body-bytes", "1000000", "--request-timeout-s", "5")
    with run_server(tmp_path, *args) as server:
        # The coverage phase is skipped: schemathesis 4.32 crashes internally generating it
        # for our request schema; examples, fuzzing and stateful phases cover every route.
        options = "--phases examples,fuzzing,stateful --max-examples 25 --request-timeout 20"
        options += " --workers 2 --seed 7 --no-color"
        result = subprocess.run(
            [st, "run", f"{server.url}/openapi.json", "--checks", CHECKS, *options.split()],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,  # schemathesis writes a .schemathesis/ folder where it runs
        )
        assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout

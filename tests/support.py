"""Test support: real `mha-serve` processes on loopback, metric reading, OIP schema checks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
OIP_SPEC = ROOT.parent / "shared" / "oip" / "open_inference_rest.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running `python -m service` process."""

    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total, found = 0.0, False
        for line in self.metrics().splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, value = line.rsplit(" ", 1)
            metric_name = series.split("{", 1)[0]
            if metric_name != name:
                continue
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
                found = True
        if not found:
            raise KeyError(f"no sample {name}{labels}")
        return total


def wait_ready(url: str, process: subprocess.Popen, log_path: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {timeout} s:\n{log_path.read_text()}")


@contextlib.contextmanager
def run_server(
    tmp_dir: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True
) -> Iterator[Server]:
    """Start `python -m service` on a free loopback port; stop it (SIGTERM, then SIGKILL) after."""
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=ROOT,
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, port, log_path)
    try:
        if wait:
            wait_ready(server.url, process, log_path)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def oip_schemas() -> dict:
    """The Open Inference Protocol's component schemas (../shared beside the repo)."""
    if not OIP_SPEC.exists():
        raise FileNotFoundError(f"OIP spec missing at {OIP_SPEC}; shared/ must sit beside the repo")
    return yaml.safe_load(OIP_SPEC.read_text())["components"]["schemas"]


def validate_oip(name: str, instance: object) -> None:
    """Validate `instance` against components.schemas[name] of the OIP REST document."""
    schemas = oip_schemas()
    root = {"components": {"schemas": schemas}, "$ref": f"#/components/schemas/{name}"}
    jsonschema.validate(instance, root)


def binary_request(header: dict, *chunks: bytes) -> tuple[bytes, dict[str, str]]:
    """A Triton binary-extension body: JSON header then raw tensor bytes."""
    import json

    head = json.dumps(header).encode()
    return head + b"".join(chunks), {
        "Inference-Header-Content-Length": str(len(head)),
        "Content-Type": "application/octet-stream",
    }


def fp32_request(x, **parameters: object) -> tuple[bytes, dict[str, str]]:
    """A binary request carrying float32 `x` as input 'input'."""
    header: dict = {
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": "FP32",
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
    }
    if parameters:
        header["parameters"] = parameters
    return binary_request(header, x.tobytes())

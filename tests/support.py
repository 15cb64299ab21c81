"""Test support: real `mha-serve` processes on loopback, metric reading, OIP schema checks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import yaml

from benchmarks import scrape
from benchmarks.client import binary_infer_body
from benchmarks.server import ROOT, Proc, free_port, running

__all__ = ["ROOT", "Server", "free_port", "run_server"]
OIP_SPEC = ROOT.parent / "shared" / "oip" / "open_inference_rest.yaml"


class Server(Proc):
    """A running `python -m service` process, with its /metrics readable by name."""

    def metrics(self) -> str:
        return scrape.scrape(self.url)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (KeyError if none)."""
        return scrape.value(self.metrics(), name, **labels)


@contextlib.contextmanager
def run_server(
    tmp_dir: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True
) -> Iterator[Server]:
    """`python -m service ARGS` on a free loopback port, logging to `tmp_dir`; stopped after."""
    log_path = tmp_dir / f"server-{time.monotonic_ns()}.log"
    with running(*args, log_path=log_path, env=env, wait=wait) as proc:
        yield Server(proc.port, proc.process, proc.log_path)


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


fp32_request = binary_infer_body  # the binary OIP request the tests send

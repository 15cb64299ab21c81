"""The committed gRPC stubs are what tools/grpc_stubs.py generates from the committed .proto."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) regenerates the stubs")


def _generator():
    spec = importlib.util.spec_from_file_location("grpc_stubs", ROOT / "tools" / "grpc_stubs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("grpc_stubs", module)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    fresh = _generator().generate(tmp_path)
    names = sorted(p.name for p in fresh)
    committed = sorted(p.name for p in (ROOT / "service" / "grpc").glob("*_pb2*.py*"))
    assert names == committed
    for path in fresh:
        mine = (ROOT / "service" / "grpc" / path.name).read_text()
        assert path.read_text() == mine, (
            f"service/grpc/{path.name} is stale: run `python tools/grpc_stubs.py` and commit"
        )


def test_stubs_keep_the_wire_names_clients_use() -> None:
    """Package, service and method names are what tritonclient and KServe's client call."""
    from service.grpc import grpc_service_pb2

    service = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    assert {m.name for m in service.methods} >= {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
        "ModelInfer", "ModelConfig", "ModelStatistics",
    }  # fmt: skip
    request = grpc_service_pb2.ModelInferRequest.DESCRIPTOR
    assert request.fields_by_name["raw_input_contents"].number == 7
    assert request.fields_by_name["inputs"].number == 5


def test_stubs_and_tritonclient_import_in_one_process() -> None:
    """The stubs live in a private descriptor pool: tritonclient's own `inference.*` definitions
    in the default pool do not collide with them (in-process tests import both), and messages
    cross between the two by their wire bytes."""
    import tritonclient.grpc as triton

    from service.grpc import grpc_service_pb2

    ours = grpc_service_pb2.ModelInferRequest(model_name="m", id="7")
    ours.inputs.add(name="input", datatype="FP32", shape=[1, 2])
    ours.raw_input_contents.append(bytes(8))
    theirs = triton.service_pb2.ModelInferRequest.FromString(ours.SerializeToString())
    assert (theirs.model_name, theirs.id, list(theirs.inputs[0].shape)) == ("m", "7", [1, 2])

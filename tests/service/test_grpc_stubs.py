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


# TEI's proto/tei.proto (TEI 1.9.3), written out: "field=number type" ("?" : proto3 optional,
# "*" : repeated). Clients generate their stubs from TEI's file; these must match it.
TEI_MESSAGES = {
    "InfoResponse": "version=1 string; sha=2 string?; docker_label=3 string?; model_id=4 string; "
    "model_sha=5 string?; model_dtype=6 string; model_type=7 enum; max_concurrent_requests=8 "
    "uint32; max_input_length=9 uint32; max_batch_tokens=10 uint32; max_batch_requests=11 "
    "uint32?; max_client_batch_size=12 uint32; tokenization_workers=13 uint32",
    "Metadata": "compute_chars=1 uint32; compute_tokens=2 uint32; total_time_ns=3 uint64; "
    "tokenization_time_ns=4 uint64; queue_time_ns=5 uint64; inference_time_ns=6 uint64",
    "EmbedRequest": "inputs=1 string; truncate=2 bool; normalize=3 bool?; "
    "truncation_direction=4 enum; prompt_name=5 string?; dimensions=6 uint32?",
    "EmbedResponse": "embeddings=1 float*; metadata=2 message",
    "EmbedSparseRequest": "inputs=1 string; truncate=2 bool; truncation_direction=3 enum; "
    "prompt_name=4 string?",
    "SparseValue": "index=1 uint32; value=2 float",
    "EmbedSparseResponse": "sparse_embeddings=1 message*; metadata=2 message",
    "EmbedAllRequest": "inputs=1 string; truncate=2 bool; truncation_direction=3 enum; "
    "prompt_name=4 string?",
    "TokenEmbedding": "embeddings=1 float*",
    "EmbedAllResponse": "token_embeddings=1 message*; metadata=2 message",
    "PredictRequest": "inputs=1 string; truncate=2 bool; raw_scores=3 bool; "
    "truncation_direction=4 enum",
    "PredictPairRequest": "inputs=1 string*; truncate=2 bool; raw_scores=3 bool; "
    "truncation_direction=4 enum",
    "Prediction": "score=1 float; label=2 string",
    "PredictResponse": "predictions=1 message*; metadata=2 message",
    "RerankRequest": "query=1 string; texts=2 string*; truncate=3 bool; raw_scores=4 bool; "
    "return_text=5 bool; truncation_direction=6 enum",
    "RerankStreamRequest": "query=1 string; text=2 string; truncate=3 bool; raw_scores=4 bool; "
    "return_text=5 bool; truncation_direction=6 enum",
    "Rank": "index=1 uint32; text=2 string?; score=3 float",
    "RerankResponse": "ranks=1 message*; metadata=2 message",
    "EncodeRequest": "inputs=1 string; add_special_tokens=2 bool; prompt_name=3 string?",
    "SimpleToken": "id=1 uint32; text=2 string; special=3 bool; start=4 uint32?; stop=5 uint32?",
    "EncodeResponse": "tokens=1 message*",
    "DecodeRequest": "ids=1 uint32*; skip_special_tokens=2 bool",
    "DecodeResponse": "text=1 string",
}
TEI_SERVICES = {  # method: (request, response, "stream" on the sides that stream)
    "Info": {"Info": "InfoRequest -> InfoResponse"},
    "Embed": {
        "Embed": "EmbedRequest -> EmbedResponse",
        "EmbedStream": "stream EmbedRequest -> stream EmbedResponse",
        "EmbedSparse": "EmbedSparseRequest -> EmbedSparseResponse",
        "EmbedSparseStream": "stream EmbedSparseRequest -> stream EmbedSparseResponse",
        "EmbedAll": "EmbedAllRequest -> EmbedAllResponse",
        "EmbedAllStream": "stream EmbedAllRequest -> stream EmbedAllResponse",
    },
    "Predict": {
        "Predict": "PredictRequest -> PredictResponse",
        "PredictPair": "PredictPairRequest -> PredictResponse",
        "PredictStream": "stream PredictRequest -> stream PredictResponse",
        "PredictPairStream": "stream PredictPairRequest -> stream PredictResponse",
    },
    "Rerank": {
        "Rerank": "RerankRequest -> RerankResponse",
        "RerankStream": "stream RerankStreamRequest -> RerankResponse",
    },
    "Tokenize": {
        "Tokenize": "EncodeRequest -> EncodeResponse",
        "TokenizeStream": "stream EncodeRequest -> stream EncodeResponse",
        "Decode": "DecodeRequest -> DecodeResponse",
        "DecodeStream": "stream DecodeRequest -> stream DecodeResponse",
    },
}


def _field(field) -> str:
    from google.protobuf.descriptor import FieldDescriptor as F

    kind = {F.TYPE_STRING: "string", F.TYPE_BOOL: "bool", F.TYPE_UINT32: "uint32",
            F.TYPE_UINT64: "uint64", F.TYPE_FLOAT: "float", F.TYPE_ENUM: "enum",
            F.TYPE_MESSAGE: "message"}[field.type]  # fmt: skip
    mark = "*" if field.is_repeated else "?" if field.has_presence else ""
    if field.type == F.TYPE_MESSAGE and not field.is_repeated:
        mark = ""  # a message field always has presence
    return f"{field.name}={field.number} {kind}{mark}"


def test_tei_stubs_keep_teis_wire_names_and_numbers() -> None:
    from service.grpc import tei_pb2

    package = tei_pb2.DESCRIPTOR
    assert package.package == "tei.v1"
    for name, spec in TEI_MESSAGES.items():
        fields = package.message_types_by_name[name].fields
        assert "; ".join(_field(f) for f in fields) == spec, name
    enums = {
        e.name: {v.name: v.number for v in e.values} for e in package.enum_types_by_name.values()
    }
    assert enums == {
        "ModelType": {"MODEL_TYPE_EMBEDDING": 0, "MODEL_TYPE_CLASSIFIER": 1,
                      "MODEL_TYPE_RERANKER": 2},
        "TruncationDirection": {"TRUNCATION_DIRECTION_RIGHT": 0, "TRUNCATION_DIRECTION_LEFT": 1},
    }  # fmt: skip
    services = {}
    for service in package.services_by_name.values():
        services[service.name] = {
            m.name: f"{'stream ' if m.client_streaming else ''}{m.input_type.name} -> "
            f"{'stream ' if m.server_streaming else ''}{m.output_type.name}"
            for m in service.methods
        }
    assert services == TEI_SERVICES


def test_health_stubs_are_the_standard_protocol() -> None:
    from service.grpc import health_pb2

    service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    assert service.full_name == "grpc.health.v1.Health"
    assert [(m.name, m.server_streaming) for m in service.methods] == [
        ("Check", False),
        ("Watch", True),
    ]
    status = health_pb2.HealthCheckResponse.DESCRIPTOR.enum_types_by_name["ServingStatus"]
    assert {v.name: v.number for v in status.values} == {
        "UNKNOWN": 0, "SERVING": 1, "NOT_SERVING": 2, "SERVICE_UNKNOWN": 3,
    }  # fmt: skip


def test_reflection_stubs_match_grpcs_own_definition() -> None:
    """Our grpc.reflection.v1 messages against grpcio-reflection's v1alpha ones (the same on
    the wire): every message, field name, number, type and label."""
    theirs = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2")
    from service.grpc import reflection_pb2 as ours

    def shape(module) -> dict:
        return {
            name: [(f.name, f.number, f.type, f.is_repeated) for f in message.fields]
            for name, message in module.DESCRIPTOR.message_types_by_name.items()
        }

    assert shape(ours) == shape(theirs)
    (service,) = ours.DESCRIPTOR.services_by_name.values()
    assert service.full_name == "grpc.reflection.v1.ServerReflection"
    (method,) = service.methods
    assert (method.name, method.client_streaming, method.server_streaming) == (
        "ServerReflectionInfo", True, True,
    )  # fmt: skip

"""gRPC server reflection, asked by gRPC's own Python reflection client (grpcio-reflection's
ProtoReflectionDescriptorDatabase, v1alpha) and over v1: the services listed, every one's
definition fetched with its imports, and a call built from the fetched definitions alone
(as grpcurl builds one) answering as the generated stubs' call does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from tritonclient.grpc import service_pb2 as triton_pb

from service.grpc import reflection_pb2, reflection_pb2_grpc
from service.grpc import tei_pb2 as tei
from service.grpc import tei_pb2_grpc as tei_grpc
from service.grpc.reflection import SERVICES
from tests.inprocess import asgi_client
from tests.support import free_port

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm

KEY = "reflection-key"
TRITON_METHODS = {  # tritonclient 2.46's GRPCInferenceService
    m.name for m in triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
}


def serve(tmp_path, test: Callable, **settings: object) -> None:
    """A sentence-transformer served with gRPC; `test(address)` runs in a thread (the clients
    here are the blocking ones, and the server runs on this loop)."""
    _, directory = tm.sentence_transformer(tmp_path / "emb")

    async def main() -> None:
        port = free_port()
        async with asgi_client(model_dir=[directory], grpc_port=port, **settings):
            await asyncio.to_thread(test, f"127.0.0.1:{port}")

    asyncio.run(main())


def test_grpcurls_way_lists_describes_and_calls(tmp_path):
    def test(address: str) -> None:
        with grpc.insecure_channel(address) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            assert sorted(database.get_services()) == sorted(SERVICES)
            pool = descriptor_pool.DescriptorPool(database)
            for name in SERVICES:  # each definition, with what it imports
                assert pool.FindServiceByName(name).methods
            triton = pool.FindServiceByName("inference.GRPCInferenceService")
            # every RPC of Triton's own service, LogSettings and TraceSetting included
            assert set(triton.methods_by_name) >= TRITON_METHODS
            log = pool.FindMethodByName("inference.GRPCInferenceService.LogSettings")
            assert log.input_type.full_name == "inference.LogSettingsRequest"

            method = pool.FindMethodByName("tei.v1.Embed.Embed")
            request_type = message_factory.GetMessageClass(method.input_type)
            answer_type = message_factory.GetMessageClass(method.output_type)
            call = channel.unary_unary(
                "/tei.v1.Embed/Embed",
                request_serializer=request_type.SerializeToString,
                response_deserializer=answer_type.FromString,
            )
            built = json_format.ParseDict({"inputs": "hello world"}, request_type())  # -d '{...}'
            got = json_format.MessageToDict(call(built, timeout=30))["embeddings"]
            want = tei_grpc.EmbedStub(channel).Embed(tei.EmbedRequest(inputs="hello world"))
            np.testing.assert_array_equal(np.float32(got), np.float32(want.embeddings))

            v1 = reflection_pb2_grpc.ServerReflectionStub(channel)
            asks = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="tei.v1.Nope"),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="inference.GRPCInferenceService"
                ),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="inference.ModelConfig"  # sent already: not again
                ),
                reflection_pb2.ServerReflectionRequest(),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="tei.v1.Embed.Embed"),
                reflection_pb2.ServerReflectionRequest(
                    file_by_filename="service/grpc/health.proto"
                ),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="tei.v1.Embed.Nope"),
            ]
            answers = list(v1.ServerReflectionInfo(iter(asks)))
            listed, missing, triton_files, again, empty, method, health, no_method = answers
            assert [s.name for s in listed.list_services_response.service] == list(SERVICES)
            assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
            files = triton_files.file_descriptor_response.file_descriptor_proto
            assert len(files) == 2  # grpc_service.proto, then the model_config.proto it imports
            assert len(again.file_descriptor_response.file_descriptor_proto) == 1
            assert empty.error_response.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            names = [  # a method's file (grpcurl describe tei.v1.Embed.Embed), a file by name
                FileDescriptorProto.FromString(
                    a.file_descriptor_response.file_descriptor_proto[0]
                ).name
                for a in (method, health)
            ]
            assert names == ["service/grpc/tei.proto", "service/grpc/health.proto"]
            assert no_method.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
            assert "tei.v1.Embed.Nope" in no_method.error_response.error_message

    serve(tmp_path, test)


def test_reflection_needs_the_api_key(tmp_path):
    def test(address: str) -> None:
        with grpc.insecure_channel(address) as channel:
            v1 = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
            with pytest.raises(grpc.RpcError) as info:
                list(v1.ServerReflectionInfo(iter(ask)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            auth = (("authorization", f"Bearer {KEY}"),)
            (listed,) = v1.ServerReflectionInfo(iter(ask), metadata=auth)
            assert len(listed.list_services_response.service) == len(SERVICES)

    serve(tmp_path, test, api_key=KEY)

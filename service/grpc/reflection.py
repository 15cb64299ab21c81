"""gRPC server reflection on --grpc-port: the services this server offers and their .proto
definitions, for grpcurl, Postman, Evans and the other clients that build requests from them
(TEI's documentation calls `grpcurl ... tei.v1.Embed/Embed` with nothing else). Answered from
the descriptor pool of the committed stubs (service.grpc.pool), under grpc.reflection.v1 and
its older, wire-identical name v1alpha. Behind the API key like every other call; a stream
still open when the server drains ends UNAVAILABLE."""

from __future__ import annotations

import grpc

from service.grpc import grpc_service_pb2, health_pb2, tei_pb2
from service.grpc import reflection_pb2 as pb
from service.grpc import reflection_pb2_grpc as pb_grpc
from service.grpc.calls import STREAM_DRAINED, Calls, read_until_drain
from service.grpc.decode_errors import Undecodable
from service.grpc.pool import POOL
from service.pipeline.errors import NotReady

V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
# What the port serves, as list_services answers it: the services of the .proto files the
# listener registers (service/grpc/server.py). v1alpha is served, not listed: its definition
# is v1's under another name, and the pool has only v1's.
SERVICES = tuple(
    service.full_name
    for module in (grpc_service_pb2, tei_pb2, health_pb2, pb)
    for service in module.DESCRIPTOR.services_by_name.values()
)


def _error(request: object, code: grpc.StatusCode, message: str) -> pb.ServerReflectionResponse:
    answer = pb.ServerReflectionResponse(
        error_response=pb.ErrorResponse(error_code=code.value[0], error_message=message)
    )
    if isinstance(request, pb.ServerReflectionRequest):
        answer.valid_host = request.host
        answer.original_request.CopyFrom(request)
    return answer


def _file_of(symbol: str):
    """The file defining `symbol`: a service, message, enum or field, or a method
    (`package.Service.Method`, which protobuf's pool does not look up itself)."""
    try:
        return POOL.FindFileContainingSymbol(symbol)
    except KeyError:
        service, _, method = symbol.rpartition(".")
        if method in POOL.FindServiceByName(service).methods_by_name:  # KeyError if no service
            return POOL.FindFileContainingSymbol(service)
        raise


class ReflectionServicer(Calls, pb_grpc.ServerReflectionServicer):
    """ServerReflectionInfo over the lifespan's ServiceState."""

    def answer(self, request: object, sent: set[str]) -> pb.ServerReflectionResponse:
        """One request's answer; `sent`: the files this stream already has (not sent again)."""
        if isinstance(request, Undecodable):
            message = f"the request is not a valid protobuf message: {request.error}"
            return _error(request, grpc.StatusCode.INVALID_ARGUMENT, message)
        assert isinstance(request, pb.ServerReflectionRequest)
        kind = request.WhichOneof("message_request")
        answer = pb.ServerReflectionResponse(valid_host=request.host, original_request=request)
        try:
            if kind == "list_services":
                services = answer.list_services_response.service
                services.extend(pb.ServiceResponse(name=name) for name in SERVICES)
            elif kind == "file_by_filename":
                self._files(answer, POOL.FindFileByName(request.file_by_filename), sent)
            elif kind == "file_containing_symbol":
                self._files(answer, _file_of(request.file_containing_symbol), sent)
            elif kind == "file_containing_extension":
                wanted = request.file_containing_extension
                message = POOL.FindMessageTypeByName(wanted.containing_type)
                extension = POOL.FindExtensionByNumber(message, wanted.extension_number)
                self._files(answer, extension.file, sent)
            elif kind == "all_extension_numbers_of_type":
                message = POOL.FindMessageTypeByName(request.all_extension_numbers_of_type)
                numbers = answer.all_extension_numbers_response
                numbers.base_type_name = message.full_name
                numbers.extension_number.extend(
                    sorted(e.number for e in POOL.FindAllExtensions(message))
                )
            else:
                return _error(request, grpc.StatusCode.INVALID_ARGUMENT, "no request was set")
        except KeyError:
            asked = getattr(request, kind)
            what = asked if isinstance(asked, str) else str(asked).replace("\n", " ").strip()
            return _error(request, grpc.StatusCode.NOT_FOUND, f"{kind} {what!r}: not found")
        return answer

    @staticmethod
    def _files(answer: pb.ServerReflectionResponse, file: object, sent: set[str]) -> None:
        """The file, then the files it imports (depth first) that the stream does not have."""
        todo, files = [file], answer.file_descriptor_response.file_descriptor_proto
        first = True
        while todo:
            descriptor = todo.pop()
            if descriptor.name in sent and not first:
                continue
            sent.add(descriptor.name)
            files.append(descriptor.serialized_pb)
            todo.extend(descriptor.dependencies)
            first = False

    async def ServerReflectionInfo(self, request_iterator, context):
        async with self._call(f"{V1}/ServerReflectionInfo", context):
            sent: set[str] = set()

            async def read() -> None:
                async for request in request_iterator:
                    await context.write(self.answer(request, sent))

            if await read_until_drain(read(), self.state):  # the server drains: the end
                raise NotReady(STREAM_DRAINED)


def add_to_server(servicer: ReflectionServicer, server: grpc.aio.Server) -> None:
    """Serve `servicer` as v1 and as v1alpha (the same messages on the wire)."""
    pb_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=pb.ServerReflectionRequest.FromString,
        response_serializer=pb.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1ALPHA, {"ServerReflectionInfo": handler}),)
    )

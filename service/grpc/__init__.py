"""The gRPC listener's services: the Open Inference Protocol (Triton's
`inference.GRPCInferenceService`), text-embeddings-inference's `tei.v1`, `grpc.health.v1` and
server reflection.

`*_pb2*.py` are generated from the `.proto` files beside them by `tools/grpc_stubs.py`.
"""

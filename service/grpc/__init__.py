"""The Open Inference Protocol over gRPC (Triton's `inference.GRPCInferenceService`).

`*_pb2*.py` are generated from the `.proto` files beside them by `tools/grpc_stubs.py`.
"""

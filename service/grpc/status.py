"""Service errors as gRPC status codes, with the HTTP status the request metrics record.

A client's mistake never maps to UNKNOWN or INTERNAL: INTERNAL is kept for the server's own
failures (InferenceError, 500).
"""

from __future__ import annotations

import grpc

from service.pipeline.errors import ServiceError

# HTTP status of a ServiceError -> the gRPC code that means the same to a client.
CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,  # inputs whose output overflowed (NonFiniteOutput)
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.UNAUTHENTICATED,  # a wrong key is no valid credential either
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    500: grpc.StatusCode.INTERNAL,
}
CANCELLED_STATUS = 499  # what a cancelled call records in the metrics (nginx's 499)


def grpc_code(error: ServiceError) -> grpc.StatusCode:
    """The status code for `error`: its own (`grpc_status`, e.g. ALREADY_EXISTS) or by its HTTP
    status, 4xx never worse than INVALID_ARGUMENT."""
    named = getattr(error, "grpc_status", None)
    if named is not None:
        return grpc.StatusCode[named]
    code = CODES.get(error.status)
    if code is None:
        code = grpc.StatusCode.INVALID_ARGUMENT if error.status < 500 else grpc.StatusCode.INTERNAL
    return code


def trailing_metadata(error: ServiceError) -> tuple[tuple[str, str], ...]:
    """Retry advice as trailers: `grpc-retry-pushback-ms` (what gRPC's retry policy reads) and
    `retry-after` (seconds, as the HTTP answer's header) when the error says when to retry."""
    retry_after = {k.lower(): v for k, v in error.headers.items()}.get("retry-after")
    if retry_after is None or not retry_after.isdigit():
        return ()
    return (("grpc-retry-pushback-ms", str(int(retry_after) * 1000)), ("retry-after", retry_after))

"""Errors that become HTTP answers: status, a message for the client, a metric reason."""

from __future__ import annotations


class ServiceError(Exception):
    """Answered as `{"error": message}` with `status`; `reason` labels the failure metric."""

    status = 500
    reason = "inference_error"

    def __init__(
        self, message: str, headers: dict[str, str] | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.param = param  # the request field at fault, for OpenAI's error.param


class BadInput(ServiceError):
    """The request is malformed or does not fit the model."""

    status = 400
    reason = "bad_input"


class NonFiniteOutput(BadInput):
    """Valid-looking inputs whose output overflowed to NaN/Inf (e.g. values near float max)."""

    status = 422


class PayloadTooLarge(BadInput):
    status = 413


class WrongModelKind(BadInput):
    """A text route the served model's head does not offer (TEI answers these 424)."""

    status = 424
    reason = "wrong_model_kind"
    grpc_status = "FAILED_PRECONDITION"  # as TEI's gRPC API answers it


class ModelNotFound(ServiceError):
    status = 404
    reason = "not_found"


class Unauthorized(ServiceError):
    status = 401
    reason = "unauthorized"


class Forbidden(ServiceError):
    status = 403
    reason = "forbidden"


class Overloaded(ServiceError):
    """The queue is full: come back later (429 with Retry-After)."""

    status = 429
    reason = "overloaded"


class NotReady(ServiceError):
    """Not ready yet, or draining for shutdown (503)."""

    status = 503
    reason = "unavailable"


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it ran; it was never computed."""

    status = 504
    reason = "timeout"


class InferenceError(ServiceError):
    """The forward pass raised; the message stays generic so internals do not leak."""

    status = 500
    reason = "inference_error"


class ClientDisconnected(ServiceError):
    """The client closed the connection before its answer (nginx's 499); logged at INFO."""

    status = 499
    reason = "client_disconnected"


class BodyTimeout(ServiceError):
    """The request body arrived too slowly (--body-min-rate); the connection is closed."""

    status = 408
    reason = "body_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"connection": "close"})


class ResponsesBacklogged(ServiceError):
    """Too many bytes of responses are waiting for slow clients (--max-pending-response-bytes)."""

    status = 503
    reason = "backpressure"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"retry-after": "1"})


OPENAI_PREFIX = "/v1/"
INFINITY_ROUTES = frozenset({"/embeddings", "/classify", "/models"})  # OpenAI's shape too
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}  # fmt: skip


TEI_ROUTES = frozenset({"/", "/embed", "/embed_all", "/embed_sparse", "/tokenize", "/decode",
                        "/info", "/rerank", "/predict", "/similarity", "/health", "/ping",
                        "/invocations"})  # fmt: skip
TEI_MODEL_PREFIX = "/models/"  # the TEI routes mounted per model: /models/{model_name}/...


def _tei_type(status: int) -> str:
    """text-embeddings-inference's error_type for a status."""
    named = {424: "Backend", 429: "Overloaded", 503: "Unhealthy"}
    return named.get(status, "Backend" if status >= 500 else "Validation")


def error_body(
    path: str, status: int, message: str, code: str | None = None, param: str | None = None
) -> dict:
    """The one place an error becomes JSON: OpenAI's shape on /v1/* (and infinity-emb's routes,
    whose errors are OpenAI's), text-embeddings-inference's
    `{"error", "error_type"}` on its routes, OIP's `{"error": message}` everywhere else.
    OpenAI clients read error.message / error.type / error.param / error.code."""
    if path in TEI_ROUTES or path.startswith(TEI_MODEL_PREFIX):
        return {"error": message, "error_type": _tei_type(status)}
    if not path.startswith(OPENAI_PREFIX) and path not in INFINITY_ROUTES:
        return {"error": message}
    kind = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

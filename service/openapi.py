"""OpenAPI descriptions of the routes whose bodies FastAPI can't infer (raw JSON or binary tensors).

The schemas follow the Open Inference Protocol's REST document, so `/openapi.json` tells clients
and fuzzers the truth about what `/infer` takes and returns.
"""

from __future__ import annotations

from typing import Any

DATATYPES = ["FP32", "FP16", "BF16", "BOOL"]

ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
TENSOR_DATA: dict[str, Any] = {
    "type": "array",
    "description": "Row-major values, flat or nested.",
    "items": {"anyOf": [{"type": "number"}, {"type": "boolean"}, {"type": "array"}]},
}
PARAMETERS = {"type": "object", "additionalProperties": True}
SHAPE = {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8}

INFERENCE_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": {
            "type": "object",
            "properties": {
                "is_causal": {"type": "boolean"},
                "timeout": {"type": "integer", "minimum": 0, "description": "microseconds"},
                "binary_data_output": {"type": "boolean"},
            },
            "additionalProperties": True,
        },
        "inputs": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype"],
                "properties": {
                    "name": {
                        "type": "string",
                        "enum": ["input", "key", "value", "key_padding_mask"],
                    },
                    "shape": SHAPE,
                    "datatype": {"type": "string", "enum": DATATYPES},
                    "parameters": PARAMETERS,
                    "data": TENSOR_DATA,
                },
            },
        },
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "parameters": PARAMETERS},
            },
        },
    },
}
INFERENCE_RESPONSE = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "parameters": PARAMETERS,
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": SHAPE,
                    "datatype": {"type": "string"},
                    "parameters": PARAMETERS,
                    "data": TENSOR_DATA,
                },
            },
        },
    },
}

BINARY_BODY = {
    "schema": {"type": "string", "format": "binary"},
    "description": "Triton binary tensor extension: the JSON header (its length in the "
    "Inference-Header-Content-Length header), then each binary input's raw little-endian bytes.",
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR}}}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("Malformed request or tensors that don't fit the model"),
    404: _error("Unknown model or version"),
    401: _error("--api-key is set and the Bearer token is missing"),
    403: _error("--api-key is set and the Bearer token is wrong"),
    413: _error("Body over --max-body-bytes"),
    422: _error("The model's output for these inputs overflowed to NaN/Inf"),
    431: _error("Request headers over --max-header-bytes"),
    429: _error("Queue full; retry after Retry-After seconds"),
    499: _error("Client disconnected (logged, never seen by the client)"),
    500: _error("The forward pass failed"),
    503: _error("Not ready, or draining for shutdown"),
    504: _error("Deadline passed while queued; never computed"),
}

INFER_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": INFERENCE_REQUEST},
            "application/octet-stream": BINARY_BODY,
        },
    },
    "parameters": [
        {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "schema": {"type": "integer", "minimum": 1},
            "description": "Binary extension: length of the JSON header at the start of the body.",
        }
    ],
}
INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Outputs; binary outputs follow the JSON header",
        "content": {
            "application/json": {"schema": INFERENCE_RESPONSE},
            "application/octet-stream": BINARY_BODY,
        },
    },
    **ERROR_RESPONSES,
}

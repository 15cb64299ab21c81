"""OpenAPI descriptions of the routes whose bodies FastAPI can't infer (raw JSON or binary tensors).

The schemas follow the Open Inference Protocol's REST document, so `/openapi.json` tells clients
and fuzzers the truth about what `/infer` takes and returns.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from service.oip.datatypes import FLOAT_TYPES

DATATYPES = [*FLOAT_TYPES, "BOOL"]  # what /infer accepts

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


# The same errors in the shape each protocol's clients read (service.pipeline.errors.error_body).
OPENAI_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
TEI_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
    "required": ["error", "error_type"],
}

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Malformed request or inputs that don't fit the model",
    404: "Unknown model or version",
    401: "--api-key is set and the Bearer token is missing",
    403: "--api-key is set and the Bearer token is wrong",
    408: "Headers or body arrived too slowly (--header-timeout-s, --body-min-rate)",
    413: "Body over --max-body-bytes, or text over the character or token limits",
    422: "The model's output for these inputs overflowed to NaN/Inf",
    431: "Request headers over --max-header-bytes",
    429: "Queue full; retry after Retry-After seconds",
    499: "Client disconnected (logged, never seen by the client)",
    500: "The forward pass failed",
    503: "Not ready, draining for shutdown, or too many response bytes pending",
    504: "Deadline passed while queued; never computed",
}


def error_responses(
    schema: dict[str, Any], extra: dict[int, str] | None = None
) -> dict[int | str, dict[str, Any]]:
    """Every error status a route may answer, each with the protocol's error body schema."""
    content = {"application/json": {"schema": schema}}
    codes = {**ERROR_DESCRIPTIONS, **(extra or {})}
    return {code: {"description": d, "content": content} for code, d in sorted(codes.items())}


ERROR_RESPONSES = error_responses(ERROR)
OPENAI_ERROR_RESPONSES = error_responses(OPENAI_ERROR)
TEI_ERROR_RESPONSES = error_responses(
    TEI_ERROR, {424: "The model's head does not offer this route (embedding vs classifier)"}
)

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


# Request-body models of the routes that read their body themselves (service.http.body), by
# name: add_body_schemas() puts them in the document's components, as FastAPI would have.
BODY_MODELS: dict[str, type[BaseModel]] = {}


def inlined(model: type[BaseModel]) -> dict:
    """A model's JSON schema with its $defs substituted in place (the route's OpenAPI document
    has no $defs section for them to point into)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


def schema_body(schema: dict) -> dict:
    """openapi_extra documenting a required JSON request body of `schema`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def number_arrays(description: str, depth: int) -> dict[int, dict]:
    """The 200 response of a route answering JSON arrays of numbers nested `depth` deep."""
    schema: dict = {"type": "number"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return {200: {"description": description, "content": {"application/json": {"schema": schema}}}}


def json_body(*models: type[BaseModel]) -> dict:
    """openapi_extra documenting a JSON request body of one of `models` (the route reads the
    body itself, so FastAPI cannot infer it): a reference to the one model's component, or the
    models inlined as alternatives."""
    if len(models) == 1:
        (model,) = models
        BODY_MODELS[model.__name__] = model
        schema: dict = {"$ref": f"#/components/schemas/{model.__name__}"}
    else:
        schema = {"anyOf": [inlined(m) for m in models]}
    return schema_body(schema)


def add_body_schemas(app: FastAPI) -> None:
    """Make app.openapi() carry the BODY_MODELS' schemas among its components."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = default()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, model in BODY_MODELS.items():
                schemas.setdefault(name, inlined(model))
        return app.openapi_schema

    app.openapi = openapi

"""OpenAPI response schemas of Triton's model configuration and statistics extensions (the OIP
REST document defines neither), so /openapi.json describes what those routes return."""

from __future__ import annotations

from typing import Any

from service.runtime.statistics import ModelStats

DIMS = {"type": "array", "items": {"type": "integer", "minimum": -1}}
DATA_TYPE = {"type": "string", "pattern": "^TYPE_[A-Z0-9]+$"}


def _object(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {**required, **optional},
        "required": list(required),
    }


MODEL_CONFIG = _object(
    {
        "name": {"type": "string"},
        "platform": {"type": "string"},
        "backend": {"type": "string"},
        "max_batch_size": {"type": "integer", "minimum": 0},
        "input": {
            "type": "array",
            "items": _object(
                {"name": {"type": "string"}, "data_type": DATA_TYPE, "dims": DIMS},
                format={"type": "string"},
                optional={"type": "boolean"},
            ),
        },
        "output": {
            "type": "array",
            "items": _object({"name": {"type": "string"}, "data_type": DATA_TYPE, "dims": DIMS}),
        },
    },
    version_policy={"type": "object"},
    instance_group={"type": "array", "items": {"type": "object"}},
    dynamic_batching=_object(
        {
            "preferred_batch_size": {"type": "array", "items": {"type": "integer"}},
            "max_queue_delay_microseconds": {"type": "integer", "minimum": 0},
        }
    ),
)

DURATION = _object({"count": {"type": "integer", "minimum": 0}, "ns": {"type": "integer"}})
MODEL_STATISTICS = _object(
    {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "last_inference": {"type": "integer", "description": "ms since the epoch"},
        "inference_count": {"type": "integer", "minimum": 0},
        "execution_count": {"type": "integer", "minimum": 0},
        "inference_stats": _object({kind: DURATION for kind in ModelStats.KINDS}),
        "batch_stats": {
            "type": "array",
            "items": _object({"batch_size": {"type": "integer"}}, compute_infer=DURATION),
        },
    }
)
STATISTICS = _object({"model_stats": {"type": "array", "items": MODEL_STATISTICS}})


def ok(schema: dict[str, Any], description: str) -> dict[int, dict[str, Any]]:
    """A `responses` entry for a 200 JSON answer of `schema`."""
    return {200: {"description": description, "content": {"application/json": {"schema": schema}}}}

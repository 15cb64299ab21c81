"""Prometheus exposition at /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.openapi import ERROR_RESPONSES
from service.routes.common import get_state

router = APIRouter(tags=["monitoring"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        503: ERROR_RESPONSES[503],
    },
)
async def metrics(request: Request) -> Response:
    body, content_type = get_state(request).metrics.exposition()
    return Response(body, media_type=content_type)

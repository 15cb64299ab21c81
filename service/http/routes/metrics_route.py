"""Prometheus exposition at /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from service.http.deps import State
from service.http.openapi import ERROR_RESPONSES

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
async def metrics(state: State) -> Response:
    body, content_type = state.metrics.exposition()
    return Response(body, media_type=content_type)

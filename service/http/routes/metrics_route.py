"""Prometheus exposition at /metrics: the text format, or OpenMetrics (with exemplars: a traced
request's trace id on its duration) for a scraper whose Accept header asks for it, as Prometheus
does."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.http.deps import State
from service.http.openapi import ERROR_RESPONSES

router = APIRouter(tags=["monitoring"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format, or OpenMetrics when accepted)",
    response_class=Response,
    responses={
        200: {
            "content": {
                "text/plain": {"schema": {"type": "string"}},
                "application/openmetrics-text": {"schema": {"type": "string"}},
            }
        },
        503: ERROR_RESPONSES[503],
    },
)
async def metrics(state: State, request: Request) -> Response:
    body, content_type = state.metrics.exposition(request.headers.get("accept", ""))
    return Response(body, media_type=content_type)

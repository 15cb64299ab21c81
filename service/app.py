"""The FastAPI application: lifespan-loaded model, batcher and metrics; routers per concern."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from service import __version__
from service.grpc.server import GrpcListener
from service.http import docs
from service.http.fastpath import FastPath, FastPathApp
from service.http.flow import BodyRate, ResponseBackpressure, ResponseBudget
from service.http.middleware import ApiKeyAuth, HeadAsGet, HeaderLimit, RequestContext
from service.http.openapi import add_body_schemas
from service.http.routes import (
    config_stats,
    debug,
    embeddings,
    health,
    infer,
    infinity,
    logging_route,
    metrics_route,
    openai_models,
    repository,
    rerank_api,
    shared_memory,
    tei_mount,
    trace_route,
)
from service.http.routes.common import error_response, internal_error_response
from service.pipeline.errors import ServiceError, error_body
from service.runtime.loading import load_entries, warm_up_model
from service.runtime.log_settings import LogControl
from service.runtime.model_control import ModelControl
from service.runtime.settings import Settings
from service.runtime.state import ServiceState
from service.runtime.trace_export import OtlpSink
from service.runtime.tracing import TraceControl
from service.workers.frontend import frontend_lifespan
from service.workers.link import EngineLink

log = logging.getLogger("service")


async def _warm_up(state: ServiceState) -> None:
    """Warm every model version up (each is ready once warm), then turn readiness on."""
    try:
        for entry in state.entries():
            await warm_up_model(entry)
            state.publish_ready(entry)
    except Exception:
        log.exception("warm-up failed; the server stays not ready")
        return
    # Everything loaded so far (torch, the model, the app) lives as long as the process: out of
    # the collector's sight, a full collection no longer walks it (~ms each, under load).
    gc.collect()
    gc.freeze()
    state.set_ready(True)
    log.info("ready: %s", ", ".join(repr(name) for name in state.models))


def _trace_sink(settings: Settings) -> OtlpSink | None:
    """Where traced requests' spans go: the OTLP exporter when --otlp-endpoint is set."""
    if not settings.otlp_endpoint:
        return None
    return OtlpSink(settings.otlp_endpoint, settings.otlp_protocol, settings.otlp_service_name)


def create_app(settings: Settings | None = None, engine: EngineLink | None = None) -> FastAPI:
    """Build the app; the model loads in the lifespan, so importing or creating loads nothing.
    With `engine` (a --workers front-end) the models live in the engine process instead."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics, versions = await load_entries(settings)
        state = ServiceState(settings, metrics, versions)
        state.open_response_cache()
        state.log_control = app.state.log_control
        state.trace_control = app.state.trace_control
        state.loop = asyncio.get_running_loop()
        app.state.service = state
        for entry in state.entries():
            entry.batcher.start()
        app.state.model_control = control = ModelControl(state)
        grpc_listener = GrpcListener(state, control) if settings.grpc_port else None
        if grpc_listener is not None:
            await grpc_listener.start()
        app.state.grpc = grpc_listener
        warm_up = asyncio.create_task(_warm_up(state))
        try:
            yield
        finally:
            warm_up.cancel()
            await state.drain(grpc_listener.stop if grpc_listener is not None else None)
            for entry in state.entries():  # as served now (explicit loads included)
                await asyncio.to_thread(entry.batcher.stop, settings.drain_grace_s)
            await asyncio.to_thread(state.trace_control.shutdown)

    app = FastPathApp(
        title="mha-serve",
        version=__version__,
        description="Multi-head attention and transformer blocks over the Open Inference Protocol.",
        lifespan=lifespan if engine is None else frontend_lifespan(settings, engine),
        docs_url=None,  # service.http.docs serves /docs with local assets
        redoc_url=None,  # ReDoc has no offline bundle here
    )
    app.state.settings = settings
    app.state.log_control = log_control = LogControl(settings)
    app.state.trace_control = TraceControl.for_settings(settings, _trace_sink(settings))
    add_body_schemas(app)
    if settings.api_key is not None:
        app.add_middleware(
            ApiKeyAuth,
            api_key=settings.api_key.get_secret_value(),
            open_health_metrics=settings.open_health_metrics,
        )
    app.add_middleware(HeadAsGet)
    app.add_middleware(HeaderLimit, limit=settings.max_header_bytes)
    app.add_middleware(BodyRate, grace_s=settings.body_timeout_s, min_rate=settings.body_min_rate)
    if settings.cors_origins:  # outside the API key: browser preflights carry no credentials
        app.add_middleware(
            CORSMiddleware,
            allow_origins=[o.strip() for o in settings.cors_origins.split(",") if o.strip()],
            allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "inference-header-content-length", "retry-after"],
        )
    app.state.response_budget = ResponseBudget(settings.max_pending_response_bytes)
    app.add_middleware(ResponseBackpressure, budget=app.state.response_budget)
    # outermost: even a 401 gets an id and a log line
    app.add_middleware(RequestContext, sampling=log_control)
    if settings.fast_path:  # ahead of all of it: the hot routes without the layers above
        app.fast_path = FastPath(app.regular, settings, app.state.response_budget, log_control)
    # The hot routes first: the router tries routes in order, so each earlier one costs a match.
    app.include_router(infer.router)
    app.include_router(embeddings.router)
    app.include_router(config_stats.router)  # before health: /v2/models/stats is not a model
    app.include_router(health.router)
    app.include_router(repository.router)
    app.include_router(shared_memory.router)
    app.include_router(logging_route.router)
    app.include_router(trace_route.router)
    app.include_router(metrics_route.router)
    docs.install(app)
    app.include_router(openai_models.router)
    app.include_router(rerank_api.router)
    app.include_router(infinity.router)  # /embeddings, /classify, /models (infinity-emb's)
    tei_mount.install(app)  # TEI and SageMaker routes, at the root and under /models/{name}
    debug.install(app, settings)  # the debug routes exist only with --debug-endpoint

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(request.url.path, exc.status_code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        body = error_body(request.url.path, 400, f"invalid request: {problems}", "bad_input")
        return JSONResponse(body, status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(request.url.path)

    return app

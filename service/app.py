"""The FastAPI application: lifespan-loaded model, batcher and metrics; routers per concern."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

import mha_engine
from mha_engine import ServedModel
from service import __version__, docs
from service.batcher import DynamicBatcher
from service.errors import ServiceError, error_body
from service.flow import BodyRate, ResponseBackpressure, ResponseBudget
from service.forward import hidden_states
from service.inputs import ModelLimits, Payload
from service.metrics import Metrics
from service.middleware import ApiKeyAuth, HeadAsGet, HeaderLimit, RequestContext, log_safe
from service.routes import debug, embeddings, health, infer, metrics_route, openai_models, tei
from service.settings import Settings
from service.state import ModelEntry, ServiceState
from service.text import CharLimits, load_tokenizer, matryoshka
from service.work import Work

log = logging.getLogger("service")


def load_served_model(settings: Settings) -> ServedModel:
    """The model from --model-dir, or the built-in demo model."""
    if settings.model_dir is None:
        return mha_engine.build_demo_model(device=settings.device, dtype=settings.dtype)
    return mha_engine.load_model(settings.model_dir, device=settings.device, dtype=settings.dtype)


def model_info(model: ServedModel, name: str) -> dict[str, Any]:
    """Labels for the mha_model_info metric and the model metadata's properties."""
    diagnostics = model.diagnostics()
    return {
        "name": name,
        "architecture": model.architecture,
        "embed_dim": model.embed_dim,
        "num_heads": model.num_heads,
        "num_layers": model.num_layers,
        "dtype": model.precision,
        "device": str(model.device),
        "sdpa_backend": diagnostics.get("sdpa_backend", "unknown"),
    }


async def _warm_up(state: ServiceState) -> None:
    """Run real batches through the batcher once, then turn readiness on."""
    rng = np.random.default_rng(0)
    seq_len = min(128, state.settings.max_seq_len)
    batch = min(state.settings.max_batch_size, 8)
    loop = asyncio.get_running_loop()
    try:
        limits = state.limits
        for sequences, length in ((batch, seq_len), (1, min(16, seq_len))):
            rows = sequences * length
            query = rng.standard_normal((rows, limits.embed_dim), np.float32)  # (N, E)
            payload = Payload(query, [length] * sequences)
            if limits.needs_key_value:
                payload.key = rng.standard_normal((rows, limits.kdim), np.float32)
                payload.value = rng.standard_normal((rows, limits.vdim), np.float32)
                payload.key_lengths = payload.lengths
            work = Work(
                payload=payload, runner=hidden_states, deadline=time.monotonic() + 600, loop=loop
            )
            state.batcher.submit(work)
            await work.future
    except Exception:
        log.exception("warm-up failed; the server stays not ready")
        return
    # Everything loaded so far (torch, the model, the app) lives as long as the process: out of
    # the collector's sight, a full collection no longer walks it (~ms each, under load).
    gc.collect()
    gc.freeze()
    state.set_ready(True)
    log.info("model %r ready", state.model_name)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the model loads in the lifespan, so importing or creating loads nothing."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        name = settings.served_model_name
        model = await asyncio.to_thread(load_served_model, settings)
        tokenizer = await asyncio.to_thread(
            load_tokenizer, settings.model_dir, model, settings.max_seq_len
        )  # None (/v1/embeddings then answers 400) unless the model dir has a tokenizer.json
        metrics = Metrics(name)
        info = model_info(model, name)
        metrics.set_model_info(info)
        metrics.queue_capacity.labels(name).set(settings.max_queue)
        batcher = DynamicBatcher(
            model,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_batch_delay_s=settings.max_batch_delay_ms / 1000,
            max_queue=settings.max_queue,
            observer=metrics,
            threads=settings.threads,
        )
        limits = ModelLimits.from_config(
            model.config,
            max_seq_len=settings.max_seq_len,
            max_sequences=settings.max_batch_size,
            max_tokens=settings.max_batch_tokens,
        )
        entry = ModelEntry(name, model, batcher, limits, info, tokenizer)
        entry.matryoshka = matryoshka(settings.model_dir)
        if tokenizer is not None:
            entry.char_limits = CharLimits.resolve(
                settings.max_input_chars, settings.max_request_chars, tokenizer.max_length
            )
        state = ServiceState(settings, metrics, {name: entry})
        state.loop = asyncio.get_running_loop()
        app.state.service = state
        batcher.start()
        warm_up = asyncio.create_task(_warm_up(state))
        try:
            yield
        finally:
            state.start_draining()
            warm_up.cancel()
            if state.grace_timer is not None:
                state.grace_timer.cancel()
            state.end_grace()  # no connection is left to answer: nothing queued is computed
            await asyncio.to_thread(batcher.stop, settings.drain_grace_s)

    app = FastAPI(
        title="mha-serve",
        version=__version__,
        description="Multi-head attention and transformer blocks over the Open Inference Protocol.",
        lifespan=lifespan,
        docs_url=None,  # service.docs serves /docs with local assets
        redoc_url=None,  # ReDoc has no offline bundle here
    )
    app.state.settings = settings
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
    app.add_middleware(RequestContext, sample_rate=settings.access_log_sample_rate)
    # The hot routes first: the router tries routes in order, so each earlier one costs a match.
    app.include_router(infer.router)
    app.include_router(embeddings.router)
    app.include_router(health.router)
    app.include_router(metrics_route.router)
    docs.install(app)
    app.include_router(openai_models.router)
    app.include_router(tei.router)
    debug.install(app, settings)  # the debug routes exist only with --debug-endpoint

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        body = error_body(request.url.path, exc.status, exc.message, exc.reason, exc.param)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

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
        log.exception("unhandled error on %s", log_safe(request.url.path))
        body = error_body(request.url.path, 500, "internal server error", "inference_error")
        return JSONResponse(body, status_code=500)

    return app

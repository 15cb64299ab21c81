"""Service configuration: every option is a flag and an env var (`--max-queue`, `MHA_MAX_QUEUE`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from service.runtime.serving_settings import ServingSettings
from service.runtime.trace_export import traces_url


class Settings(ServingSettings):
    """mha-serve settings; CLI flags win over MHA_* env vars, which win over defaults. The
    fields of what is served and its limits come first (ServingSettings); connections, logs,
    tracing, workers, the API key and the debug routes here."""

    model_config = SettingsConfigDict(
        env_prefix="MHA_",
        cli_prog_name="mha-serve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_show_env_vars=True,
        protected_namespaces=(),
    )

    # -- connections (service/http/connections.py, service/http/flow.py; uvicorn's keep-alive) --
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Request line and headers must arrive within this many seconds "
        "of the connection opening (or of the next request starting); else 408 and close.",
    )
    body_timeout_s: float = Field(
        10.0,
        ge=0,
        description="Grace before --body-min-rate applies to a request body.",
    )
    body_min_rate: int = Field(
        64 * 1024,
        ge=0,
        description="After the grace, the body must average at least this many "
        "bytes/s or the request gets 408 and the connection closes (0: no limit).",
    )
    keep_alive_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Close a keep-alive connection idle this long (proxies in front "
        "must drop idle upstream connections sooner: nginx keepalive_timeout 4s).",
    )
    write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Abort a connection whose client reads none of its response "
        "for this long (like nginx's send_timeout).",
    )
    max_connections: int = Field(
        1024,
        ge=1,
        description="Most open client connections; at the cap a new one closes the "
        "longest-idle one (or gets 503 if all are busy). Lowered to fit the open-file limit.",
    )
    max_pending_response_bytes: int = Field(
        512 * 1024 * 1024,
        ge=1024 * 1024,
        description="Most bytes of large responses being "
        "written to clients at once; a response past it gets 503 + Retry-After.",
    )
    cors_origins: str | None = Field(
        None,
        description="Comma-separated origins allowed to call the API from a browser "
        "(CORS; '*' for any). Unset: no CORS headers, preflights get 405.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level (changeable at run time: POST /v2/logging)."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text, or as JSON objects (one per line) for collectors."
    )
    access_log_probes: bool = Field(
        True,
        description="Write access-log lines for /v2/health/*, /health, /ping and /metrics, "
        "and gRPC's ServerLive and ServerReady (--no-access-log-probes drops them; other "
        "requests are always logged).",
    )
    access_log_sample_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of successful requests that get an access-log line (failed ones, "
        "status >= 400, and traced ones always do). Each line costs ~15 us of CPU on the event "
        "loop; 0.01 keeps one in a hundred. Changeable at run time: POST /v2/logging.",
    )
    trace_level: Literal["OFF", "TIMESTAMPS"] | None = Field(
        None,
        description="Triton's trace level: TIMESTAMPS traces inference requests as OpenTelemetry "
        "spans (decode, queue, compute, encode) sent to --otlp-endpoint. Unset: TIMESTAMPS when "
        "--otlp-endpoint is set, else OFF. Changeable at run time: POST /v2/trace/setting.",
    )
    trace_rate: int = Field(
        1000,
        ge=1,
        description="Trace every N-th request that carries no W3C traceparent (one that does "
        "is traced when its caller sampled it). Changeable at run time, per model too.",
    )
    trace_count: int = Field(
        -1, ge=-1, description="Traces to take before tracing stops (-1: no limit)."
    )
    trace_callers: bool = Field(
        True,
        description="A caller's W3C traceparent decides: sampled is traced, not sampled is not. "
        "--no-trace-callers (a public edge, where any client could ask for every request to "
        "be traced): a traceparent only names the parent span, --trace-rate decides.",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector to send traces to (OTLP): http://host:4318 for "
        "OTLP/HTTP (/v1/traces is added), or http://host:4317 with --otlp-protocol grpc. Needs "
        "pip install 'mha-serve[tracing]'.",
    )
    otlp_protocol: Literal["http/protobuf", "grpc"] = Field(
        "http/protobuf", description="OTLP transport for --otlp-endpoint."
    )
    otlp_service_name: str | None = Field(
        None,
        description="service.name of the spans sent to --otlp-endpoint. Unset: "
        "OTEL_SERVICE_NAME, else mha-serve.",
    )
    fast_path: bool = Field(
        True,
        description="Answer POST /v2/models/*/infer, /v1/embeddings and TEI's /embed, /rerank, "
        "/predict and / with a raw-ASGI handler ahead of the router and middleware, doing their "
        "work inline (same statuses, headers, error bodies, metrics and log lines); "
        "--no-fast-path sends them the regular way, to compare.",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads of the engine (torch.set_num_threads on the engine "
        "thread). Unset: torch's default, one per core the process may use. The event loop "
        "needs CPU too: on a CPU-bound host leave it a core.",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Front-end processes. 1: one process does everything. N > 1: one engine "
        "process owns the models, the batchers and the engine threads; N front-end processes "
        "share the port and do HTTP/gRPC, decoding, validation, tokenizing and encoding, "
        "handing tensors to the engine through shared memory (Linux only).",
    )
    worker_start: Literal["forkserver", "spawn"] = Field(
        "forkserver",
        description="--workers N > 1: how the engine and front-end processes start. forkserver: "
        "forked from one process that imported torch once, so a start or a restart costs a fork "
        "(measured in docs/benchmarks.md); spawn: each a fresh interpreter that imports torch "
        "itself, slower and larger.",
    )
    worker_slab_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024 * 1024,
        description="--workers N > 1: shared memory per front-end for the tensors of its "
        "requests in flight (pages are used only as needed); a request that does not fit "
        "travels through the control channel instead, slower but the same.",
    )
    api_key: SecretStr | None = Field(
        None,
        description="When set, every route but /v2/health/live, /v2/health/ready, /health, "
        "/ping and /metrics "
        "(/docs and the debug routes included) needs 'Authorization: Bearer <key>' (401 "
        "without, 403 wrong).",
    )
    open_health_metrics: bool = Field(
        True,
        description="Leave /v2/health/live, /v2/health/ready, /health, /ping and /metrics open "
        "when --api-key is set "
        "(--no-open-health-metrics puts them behind the key too).",
    )

    @model_validator(mode="after")
    def _check_together(self) -> Settings:
        if self.workers > 1 and self.model_control_mode == "explicit":
            raise ValueError(
                "--workers > 1 serves the models loaded at start-up: explicit model control "
                "(--model-control-mode explicit) needs --workers 1"
            )
        if self.trace_level == "TIMESTAMPS" and not self.otlp_endpoint:
            raise ValueError("--trace-level TIMESTAMPS needs --otlp-endpoint (where the spans go)")
        if self.otlp_endpoint:
            traces_url(self.otlp_endpoint, self.otlp_protocol)  # ValueError saying what is wrong
        return self

    # -- attention-weights debug endpoint (service/http/routes/debug.py); off unless asked for -----
    debug_endpoint: bool = Field(
        False,
        description="Serve POST /v2/models/{name}/attention, GET .../heads (slow path that "
        "materialises attention weights) and the /debug page. Off: those routes do not exist "
        "(404).",
    )
    debug_token: SecretStr | None = Field(
        None,
        description="A second secret the debug routes require, on top of --api-key: "
        "'X-Debug-Token: <token>', or 'Authorization: Bearer <token>' when there is no API key. "
        "With neither set the debug routes are open, and a warning is logged at start.",
    )
    debug_max_seq_len: int = Field(
        512, ge=1, description="Longest sequence (T and S) the debug routes accept."
    )
    debug_max_batch_size: int = Field(4, ge=1, description="Most sequences in one debug request.")
    debug_max_concurrency: int = Field(
        2, ge=1, description="Most debug requests handled at once; beyond it they get 429."
    )

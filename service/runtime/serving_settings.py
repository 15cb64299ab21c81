"""The settings of what is served and the limits on it: models and ports, device and dtype,
batching and queues, request bounds, the text routes' (TEI's) options. Settings (settings.py)
adds the rest; every option is a flag and an env var (`--max-queue`, `MHA_MAX_QUEUE`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode


class ServingSettings(BaseSettings):
    """Models, ports, device, batching, limits and text-route options (fields in --help's
    order); validated together where one bounds another."""

    model_dir: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Model directory (config.json + model.safetensors); repeat the flag (or "
        "separate with commas) to serve several, each under its directory's name. Unset, and "
        "no --model-repository: serve the built-in demo model (one encoder layer, d_model=512, "
        "8 heads).",
    )
    model_repository: Path | None = Field(
        None,
        description="Triton-style model repository: DIR/<model>/<version>/ each a model "
        "directory; every model is served under its name, at the versions its "
        "mha-serve.json's version_policy picks (default: the highest).",
    )
    model_control_mode: Literal["none", "explicit"] = Field(
        "none",
        description="Triton's model control: none (every model loads at start-up) or explicit "
        "(POST /v2/repository/models/{name}/load and /unload, and the gRPC "
        "RepositoryModelLoad/Unload, load and unload models while the others serve).",
    )
    model_name: str | None = Field(
        None,
        description="Name under /v2/models/ when one model is served. Default: the model "
        "directory's name, or 'mha'.",
    )
    host: str = Field("127.0.0.1", description="Address to bind (0.0.0.0 in containers).")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 picks a free one).")
    grpc_port: int = Field(
        8001,
        ge=0,
        le=65535,
        description="Port of the gRPC listener (the Open Inference Protocol's "
        "inference.GRPCInferenceService, TEI's tei.v1 services, grpc.health.v1 and server "
        "reflection); 0 disables it.",
    )
    grpc_host: str | None = Field(
        None, description="Address the gRPC listener binds. Default: the same as --host."
    )
    grpc_stream_in_flight: int = Field(
        64,
        ge=1,
        le=4096,
        description="Requests of one gRPC stream (ModelStreamInfer, TEI's *Stream calls) in "
        "progress at once; past it the server reads no more of that stream until one is "
        "answered.",
    )
    shm_max_regions: int = Field(
        64,
        ge=0,
        description="Most shared-memory regions registered at once, system and CUDA (Triton's "
        "/v2/systemsharedmemory and /v2/cudasharedmemory extensions); 0 turns registration "
        "off.",
    )
    shm_max_bytes: int = Field(
        16 * 1024**3,
        ge=0,
        description="Most bytes of client system shared memory mapped at once, over all "
        "registered system regions (address space and page tables, not memory of the server's "
        "own; CUDA regions stay in the client's GPU memory and do not count).",
    )
    device: str | None = Field(None, description="torch device: cuda, cuda:1, cpu. Default: auto.")
    dtype: Literal["float32", "bfloat16", "float16", "int8"] = Field(
        "float32",
        description="Compute dtype; requests in any float type are converted to it. int8: "
        "int8 weights with per-token int8 activations for every Linear, the rest float32 "
        "(CPU only; inputs and outputs stay FP32). bfloat16 on a CPU is faster than float32 "
        "only with bf16 instructions (AVX512-BF16, AMX); elsewhere it halves weight memory "
        "and runs at float32's speed or below (a warning at load says so).",
    )
    max_batch_size: int = Field(32, ge=1, description="Most sequences in one forward.")
    cuda_graphs: bool = Field(
        True,
        description="On CUDA, replay unmasked packed batches from CUDA graphs, one per "
        "(tokens, longest sequence) bucket: self-attention ones captured at load, causal "
        "(every sequence causal) and cross-attention ones (decoders, blocks given key and "
        "value) on first use.",
    )
    cuda_overlap: bool = Field(
        False,
        description="On CUDA, finish each batch on a second engine thread: the next batch is "
        "staged and queued while the previous one computes, its copies on their own streams "
        "(at most 2 batches in flight). Off by default until verified on a GPU.",
    )
    cuda_graph_max_tokens: int = Field(
        16384,
        ge=16,
        description="Largest token bucket captured as a CUDA graph (a power of two; bigger "
        "batches run eagerly, where the GPU, not the launches, bounds them).",
    )
    max_batch_tokens: int = Field(
        16384, ge=1, description="Most tokens (sum of sequence lengths) in one forward."
    )
    max_batch_delay_ms: float = Field(
        2.0, ge=0, description="How long the first queued sequence waits for batch-mates."
    )
    batch_delay_policy: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description="fixed: a batch waits up to --max-batch-delay-ms for batch-mates (Triton's "
        "max_queue_delay). adaptive: it waits only while recent requests overlap (found others "
        "queued or running) and come at least one per delay on average; else it starts at once, "
        "so a lone client never waits.",
    )
    loop_batch_max_ms: float = Field(
        2.0,
        ge=0,
        description="A CPU model's batches run on the event loop itself while they take at most "
        "this long (learned from its batches), else on the engine thread: a small model's batch "
        "costs less there than the GIL handoffs between two threads. 0: always on the engine "
        "thread.",
    )
    max_queue: int = Field(
        1024, ge=1, description="Most sequences waiting; beyond it requests get 429."
    )
    request_timeout_s: float = Field(
        30.0, gt=0, description="Deadline per request; a request still queued then gets 504."
    )
    max_seq_len: int = Field(2048, ge=1, description="Longest sequence (T and S) accepted.")
    optional_inputs: bool = Field(
        True,
        description="Declare and accept the optional inputs (key_padding_mask; key and value of "
        "a cross-attention model; a decoder's masks). Off: the model configuration and metadata "
        "list only the required inputs and a request sending another gets 400, for Triton tools "
        "that refuse optional inputs (perf_analyzer --shared-memory system). Per model: "
        "mha-serve.json or a load's config.",
    )
    response_cache_bytes: int = Field(
        0,
        ge=0,
        description="Bytes of model outputs kept to answer identical requests without running "
        "the model (Triton's response cache; per input text on the text routes); least recently "
        "used out first. 0: off. With --workers, each front-end keeps its own.",
    )
    response_cache: bool = Field(
        True,
        description="Whether a model's outputs use the response cache (when "
        "--response-cache-bytes is set). Per model: mha-serve.json or a load's config "
        '(Triton\'s "response_cache": {"enable": false}).',
    )
    max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest request body; larger gets 413."
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request header block; larger gets 431."
    )
    drain_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long queued requests get to start; those still queued "
        "then get 503 + Retry-After (never computed) and the running forward finishes.",
    )
    max_input_chars: int | None = Field(
        None,
        ge=1,
        description="Text routes (/v1/embeddings, TEI): longest input string, in characters, "
        "checked before "
        "tokenizing (413). Unset: 64 x the model's max length in tokens (16384 for "
        "all-MiniLM-L6-v2), far past where inputs are truncated.",
    )
    max_request_chars: int | None = Field(
        None,
        ge=1,
        description="Text routes (/v1/embeddings, TEI): most characters in one request, all "
        "inputs together, "
        "checked before tokenizing (413). Unset: 64 x --max-input-chars.",
    )
    max_client_batch_size: int = Field(
        32,
        ge=1,
        description="TEI routes: most inputs (or texts to rank, or ids to decode) in one "
        "request; more get 413. TEI's flag of the same name and default. Each input takes a "
        "queue slot: a request with more inputs than the model's --max-queue gets 429.",
    )
    auto_truncate: bool = Field(
        True,
        description="TEI routes: a request that does not set 'truncate' has its inputs longer "
        "than the model's max length cut (at its truncation_direction); off, they are refused "
        "with 413. TEI's flag of the same name and default (TEI 1.9's).",
    )
    pooling: Literal["mean", "cls", "last_token", "last-token"] | None = Field(
        None,
        description="Embedding models pool this way instead of as 1_Pooling/config.json says "
        "(TEI's flag; last-token is its spelling of last_token).",
    )
    default_prompt_name: str | None = Field(
        None,
        description="Embedding and SPLADE models: the prompt (a name in "
        "config_sentence_transformers.json's prompts) put before inputs that name none, "
        "instead of its default_prompt_name (TEI's flag).",
    )
    default_prompt: str | None = Field(
        None,
        description="Embedding and SPLADE models: this text put before inputs that name no "
        "prompt (TEI's flag); not with --default-prompt-name.",
    )
    dense_path: str | None = Field(
        None,
        description="Text models: a folder of the model directory holding the Dense module to "
        "run instead of the one modules.json lists, e.g. 2_Dense_256 (TEI's flag).",
    )

    @field_validator("model_dir", mode="before")
    @classmethod
    def _model_dirs(cls, value: Any) -> Any:
        """One path, comma-separated paths (a repeated flag arrives so), or a list."""
        if value is None:
            return []
        if isinstance(value, str):
            return [part for part in value.split(",") if part]
        if isinstance(value, Path):
            return [value]
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> ServingSettings:
        if self.max_batch_tokens < self.max_seq_len:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_seq_len "
                f"({self.max_seq_len}), or a full-length sequence could never be batched; "
                "raise --max-batch-tokens or lower --max-seq-len"
            )
        if self.max_queue < self.max_batch_size:
            raise ValueError(
                f"max_queue ({self.max_queue}) must be >= max_batch_size "
                f"({self.max_batch_size}); raise --max-queue"
            )
        if self.default_prompt is not None and self.default_prompt_name is not None:
            raise ValueError("--default-prompt and --default-prompt-name exclude each other")
        if self.pooling == "last-token":
            self.pooling = "last_token"  # TEI's spelling
        return self

"""Loading one model: engine module, tokenizer, batcher, limits, statistics, metrics label, and
its warm-up. Used at start-up and by explicit model control (service/runtime/model_control.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

import mha_engine
from mha_engine import ServedModel
from service.oip.decoder_inputs import DECODER_ARCHITECTURES
from service.oip.inputs import ModelLimits, Payload
from service.runtime.batcher import DynamicBatcher
from service.runtime.forward import hidden_states
from service.runtime.metrics import Metrics
from service.runtime.repository import ModelSource, model_settings, model_sources
from service.runtime.response_cache import new_token
from service.runtime.settings import Settings
from service.runtime.startup import load_failure
from service.runtime.state import ModelEntry
from service.runtime.statistics import ModelStats, Observers
from service.runtime.work import Work
from service.text.kinds import text_kind
from service.text.st_config import matryoshka, read_prompts
from service.text.tokenizer import CharLimits, load_tokenizer

log = logging.getLogger(__name__)


def load_served_model(settings: Settings, path: Path | None) -> ServedModel:
    """The model in directory `path`, or the built-in demo model."""
    if path is None:
        model = mha_engine.build_demo_model(device=settings.device, dtype=settings.dtype)
        if settings.dense_path is not None:
            log.warning("dense_path %r not applied to the demo model", settings.dense_path)
    else:
        model = mha_engine.load_model(
            path, device=settings.device, dtype=settings.dtype, dense_path=settings.dense_path
        )
    if settings.pooling is not None:  # TEI's --pooling: embedding models only
        if text_kind(model) == "embedding":
            model.set_pooling(settings.pooling)
        else:
            where = path if path is not None else "the demo model"
            log.warning("pooling %r not applied to %s: not an embedding model, it keeps its "
                        "own", settings.pooling, where)  # fmt: skip
    if settings.cuda_graphs and model.device.type == "cuda":
        _enable_cuda_graphs(model, settings)
    return model


def _enable_cuda_graphs(model: ServedModel, settings: Settings) -> None:
    """Capture the model's CUDA graphs now (mha_engine.cuda_graphs; cross-attention and causal
    buckets on first use); a model whose layers cannot replay (GQA, bias_k, int8) runs
    eagerly, said once in the log."""
    tokens = min(settings.cuda_graph_max_tokens, settings.max_batch_tokens)
    try:
        graphs = model.enable_cuda_graphs(
            max_tokens=1 << (tokens.bit_length() - 1),  # a power of two
            max_sequences=settings.max_batch_size,
            warm_max_len=min(settings.max_seq_len, getattr(model, "max_seq_len", 1 << 30)),
        )
    except (ValueError, NotImplementedError, AttributeError) as exc:
        log.info("CUDA graphs off for this model: %s", exc)
        return
    log.info("CUDA graphs: %d captured, %.1f MiB", graphs.count, graphs.memory_bytes / 2**20)


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
        "cpu_capability": diagnostics.get("cpu_capability", "unknown"),
    }


async def warm_up_model(entry: ModelEntry) -> None:
    """Run real batches through the model's batcher once, each without the batch delay."""
    rng = np.random.default_rng(0)
    limits = entry.limits
    seq_len = min(128, limits.max_seq_len)
    batch = min(limits.max_sequences, 8)
    loop = asyncio.get_running_loop()
    for sequences, length in ((batch, seq_len), (1, min(16, seq_len))):
        rows = sequences * length
        query = rng.standard_normal((rows, limits.embed_dim), np.float32)  # (N, E)
        payload = Payload(query, [length] * sequences)
        if limits.needs_key_value or limits.architecture in DECODER_ARCHITECTURES:
            payload.key = rng.standard_normal((rows, limits.kdim), np.float32)  # or memory/src
            payload.key_lengths = payload.lengths
        if limits.needs_key_value:
            payload.value = rng.standard_normal((rows, limits.vdim), np.float32)
        work = Work(
            payload=payload,
            runner=hidden_states,
            deadline=time.monotonic() + 600,
            loop=loop,
            wait_for_batch=False,  # no batch-mates to wait for: ready sooner by the batch delay
        )
        entry.batcher.submit(work)
        await work.future
    entry.stats.counting = True  # statistics count client requests, not the warm-up
    entry.warm = True


async def load_entries(settings: Settings) -> tuple[Metrics, dict[str, dict[str, ModelEntry]]]:
    """Every served model version (name -> version -> entry, batchers not started) and the
    metrics, whose default labels are the default model's (its highest version)."""
    sources = model_sources(settings)
    first = [s for s in sources if s.name == sources[0].name][-1]  # ServiceState.default
    metrics = Metrics(first.name, first.version)
    versions: dict[str, dict[str, ModelEntry]] = {}
    for source in sources:
        try:
            entry = await load_entry(settings, metrics, source)
        except Exception as exc:  # start-up stops here, in one line naming model and file
            raise load_failure(source, exc) from exc
        versions.setdefault(source.name, {})[source.version] = entry
    return metrics, versions


async def load_entry(settings: Settings, metrics: Metrics, source: ModelSource) -> ModelEntry:
    """Load one model version with its own batcher, limits, statistics and metrics labels (not
    started);
    the model's settings file, if any, overrides the server's limits, dtype and device."""
    settings = model_settings(settings, source)
    name = source.name
    model = await asyncio.to_thread(load_served_model, settings, source.path)
    info = model_info(model, name)
    model_metrics = metrics.for_model(name, source.version)
    model_metrics.set_model_info(info)
    if model.device.type == "cuda":
        model_metrics.set_cuda_engine(model)
    model_metrics.set_queue_capacity(settings.max_queue)
    stats = ModelStats(name, source.version)
    batcher = DynamicBatcher(
        model,
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        max_batch_delay_s=settings.max_batch_delay_ms / 1000,
        max_queue=settings.max_queue,
        observer=Observers(model_metrics, stats),
        threads=settings.threads,
        overlap=settings.cuda_overlap and model.device.type == "cuda",
        adaptive_delay=settings.batch_delay_policy == "adaptive",
        loop_batch_max_s=settings.loop_batch_max_ms / 1000 if model.device.type == "cpu" else 0.0,
    )
    limits = ModelLimits.from_config(
        model.config,
        max_seq_len=settings.max_seq_len,
        max_sequences=settings.max_batch_size,
        max_tokens=settings.max_batch_tokens,
        optional_inputs=settings.optional_inputs,
    )
    entry = ModelEntry(name, model, batcher, limits, info, stats)
    entry.metrics = model_metrics
    entry.version = source.version
    entry.version_policy = source.policy
    entry.cache_token = cache_token(settings)
    await asyncio.to_thread(add_text_parts, entry, settings, source)
    return entry


def resolve_default_prompt(settings: Settings, entry: ModelEntry, name: str | None) -> str | None:
    """The text put before a request's inputs when it names no prompt: the model's default
    prompt (config_sentence_transformers.json's `name`), or for an embedding (or SPLADE) model
    TEI's --default-prompt (literal) or --default-prompt-name (ValueError for an unknown
    name); a classifier or reranker keeps its own, which is logged."""
    if text_kind(entry.model) not in ("embedding", "sparse"):
        if settings.default_prompt is not None or settings.default_prompt_name is not None:
            log.warning("default prompt settings not applied to %s: a %s keeps its own",
                        entry.name, text_kind(entry.model) or "tensor model")  # fmt: skip
        return entry.prompts.get(name) if name else None
    if settings.default_prompt is not None:
        return settings.default_prompt
    if settings.default_prompt_name is not None:
        name = settings.default_prompt_name
        if name not in entry.prompts:
            have = sorted(entry.prompts) or "none (no config_sentence_transformers.json prompts)"
            raise ValueError(f"--default-prompt-name {name!r} is not one of its prompts: {have}")
    return entry.prompts.get(name) if name else None


def cache_token(settings: Settings) -> int | None:
    """A new model copy's token in the response cache; None when its outputs are not cached
    (`settings` are the model's own: mha-serve.json or a load's config may turn it off)."""
    return new_token() if settings.response_cache_bytes and settings.response_cache else None


def renew_cache_tokens(entries: list[ModelEntry]) -> set[int]:
    """New response cache tokens for these (cached) entries, whose outputs now come from another
    engine process; returns the old ones, to drop (their late outputs are refused too)."""
    old = set()
    for entry in entries:
        if entry.cache_token is not None:
            old.add(entry.cache_token)
            entry.cache_token = new_token()
    return old


def add_text_parts(entry: ModelEntry, settings: Settings, source: ModelSource) -> None:
    """A text model's tokenizer (None: the text routes answer 400 unless the model directory
    has a tokenizer.json), prompts, matryoshka flag and character limits; `settings` are the
    model's own (model_settings)."""
    entry.tokenizer = load_tokenizer(source.path, entry.model, settings.max_seq_len)
    entry.matryoshka = matryoshka(source.path)
    entry.prompts, name = read_prompts(source.path)
    entry.default_prompt = resolve_default_prompt(settings, entry, name)
    if entry.tokenizer is not None:
        entry.char_limits = CharLimits.resolve(
            settings.max_input_chars, settings.max_request_chars, entry.tokenizer.max_length
        )

"""Text requests' work, shared by /v1/embeddings and TEI's routes: character bounds before any
tokenizing, tokenizing on worker threads in chunks inside the deadline, and token-id parts
queued on the batcher (split to fit --max-batch-size and --max-batch-tokens), awaited together.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from service.oip.inputs import Payload
from service.pipeline.errors import ClientDisconnected, DeadlineExceeded, PayloadTooLarge
from service.pipeline.models import submit
from service.pipeline.waiting import Gone, await_queued
from service.runtime.response_cache import Key, text_key
from service.runtime.tracing import CURRENT, queue_and_compute
from service.runtime.work import Runner, Work
from service.text.tokenizer import (
    CharLimits,
    Encoded,
    Text,
    TextTokenizer,
    embed_runner,
    token_payload,
)

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

TOKENIZE_CHUNK_CHARS = 64 * 1024  # ~40 ms of tokenizing; deadline and client checked between
INLINE_TOKENIZE_CHARS = 512  # ~0.3 ms: tokenized on the event loop, cheaper than a thread hop


@dataclass
class Timings:
    """Where a text request's time went, for TEI's response metadata: seconds tokenizing (the
    caller's), and its parts' mean wait in the queue and mean forward (none for cache hits)."""

    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0

    def add(self, works: list[Work]) -> None:
        started = [w for w in works if w.started_at is not None]
        if started:
            self.queue_s = sum(w.queue_s for w in started) / len(started)
            self.inference_s = sum(w.infer_s for w in started) / len(started)


def with_default_prompt(entry: ModelEntry, texts: list[str]) -> list[str]:
    """Texts with the model's default prompt (its own, or --default-prompt[-name]) before each,
    for a request that names none."""
    prompt = entry.default_prompt
    return [prompt + text for text in texts] if prompt else texts


def _chars(text: Text) -> int:
    return len(text) if isinstance(text, str) else sum(map(len, text))


def check_chars(
    texts: list[Text], limits: CharLimits, field: str = "input", prompt: str | None = None
) -> None:
    """413 naming the request's field, the limit and its flag, before a single character is
    tokenized (a pair counts both its texts: a query paired with each text counts once per
    text; so does a prompt, an instruction, added to each)."""
    total, extra = 0, len(prompt or "")
    for i, text in enumerate(texts):
        chars = _chars(text) + extra
        if chars > limits.per_input:
            paired = " (with the query it is paired with)" if isinstance(text, tuple) else ""
            told = " (with the instruction)" if extra else ""
            raise PayloadTooLarge(
                f"{field}[{i}] has {chars} characters{paired}{told}, over the limit of "
                f"{limits.per_input} per input (--max-input-chars); inputs are truncated to "
                "the model's max length anyway, so send less text"
            )
        total += chars
    if total > limits.per_request:
        pairs = any(isinstance(text, tuple) for text in texts)
        raise PayloadTooLarge(
            f"'{field}' has {total} characters in all, over the limit of {limits.per_request} "
            "per request (--max-request-chars)"
            + ("; a query counts once per text it is paired with" if pairs else "")
            + "; split it into several requests"
        )


def tokenize_chunks(texts: list[Text]) -> list[list[Text]]:
    """Consecutive inputs cut into chunks of about TOKENIZE_CHUNK_CHARS characters."""
    chunks: list[list[Text]] = [[]]
    chars = 0
    for text in texts:
        if chunks[-1] and chars + _chars(text) > TOKENIZE_CHUNK_CHARS:
            chunks.append([])
            chars = 0
        chunks[-1].append(text)
        chars += _chars(text)
    return chunks


async def tokenize(
    state: ServiceState,
    entry: ModelEntry,
    gone: Gone,
    texts: list[Text],
    deadline: float,
    encode: Callable[[list[Text]], list[Any]] | None = None,
) -> list[Any]:
    """Tokenize on worker threads, chunk by chunk; between chunks, 499 if the client has gone,
    504 past the deadline, 503 once the drain grace has ended (the rest is never tokenized).
    `encode` (default: tokenizer.encode) maps a chunk of texts or pairs to one item each.
    A few short texts are tokenized on the event loop: a thread hop would cost more."""
    tokenizer: TextTokenizer = entry.tokenizer  # type: ignore[assignment]  # a text entry
    encode = encode or tokenizer.encode
    trace = CURRENT.get()
    if trace is None:
        return await _tokenize(state, entry, gone, texts, deadline, encode)
    started = time.perf_counter()
    try:
        return await _tokenize(state, entry, gone, texts, deadline, encode)
    finally:
        trace.step("tokenize", started, time.perf_counter(), **{"mha.inputs": len(texts)})


async def _tokenize(
    state: ServiceState,
    entry: ModelEntry,
    gone: Gone,
    texts: list[Text],
    deadline: float,
    encode: Callable[[list[Text]], list[Any]],
) -> list[Any]:
    if sum(_chars(text) for text in texts) <= INLINE_TOKENIZE_CHARS:
        return encode(texts)
    encoded: list[Any] = []
    for part in tokenize_chunks(texts):
        if gone.happened:
            raise ClientDisconnected("client disconnected while its inputs were tokenized")
        if time.monotonic() > deadline:
            raise DeadlineExceeded(
                f"tokenizing did not finish within the request's deadline "
                f"({state.settings.request_timeout_s} s, --request-timeout-s)"
            )
        entry.batcher.check_open()
        encoded += await run_in_threadpool(encode, part)
    return encoded


def chunk(encoded: list[Encoded], max_sequences: int, max_tokens: int) -> list[list[int]]:
    """Input indices in order, cut so each part fits one batch (sequences and tokens)."""
    parts: list[list[int]] = [[]]
    tokens = 0
    for i, enc in enumerate(encoded):
        n = len(enc.ids)
        if parts[-1] and (len(parts[-1]) >= max_sequences or tokens + n > max_tokens):
            parts.append([])
            tokens = 0
        parts[-1].append(i)
        tokens += n
    return parts


def _retrieve(future: asyncio.Future) -> None:
    """Mark a part's error as seen: after a failed sibling, nobody awaits the others."""
    if not future.cancelled():
        future.exception()


async def run_parts(
    state: ServiceState,
    entry: ModelEntry,
    gone: Gone,
    encoded: list[Encoded],
    deadline: float,
    runner: Runner = embed_runner,
    payload_of: Callable[[list[Encoded]], Payload] | None = None,
    timings: Timings | None = None,
) -> list[np.ndarray]:
    """One result per input, in order: what `runner` makes of it. With the response cache on
    for `entry`, inputs it holds (or that repeat in the request) are not computed again.
    `timings`, if given, gets the parts' queue and forward times."""
    cache = state.response_cache
    if cache is not None:  # a hit is answered as the current copy (after a reload) would be
        entry = state.find(entry.name, entry.version)
    if cache is None or entry.cache_token is None:
        ran = await _run_parts(state, entry, gone, encoded, deadline, runner, payload_of, timings)
        return ran[1]
    name = getattr(runner, "__qualname__", repr(runner))
    keys = [text_key(entry.cache_token, name, enc) for enc in encoded]
    found = [cache.get(key) for key in keys]
    todo: dict[Key, int] = {}  # key -> the first input with it, of those not cached
    for i, (key, hit) in enumerate(zip(keys, found, strict=True)):
        if hit is None:
            todo.setdefault(key, i)
    hits = len(keys) - len(todo)
    (entry.metrics or state.metrics).cache_lookups(hits, len(todo))
    trace = CURRENT.get()
    if trace is not None:
        trace.attributes["mha.response_cache_hits"] = hits
    if not todo:
        return found  # type: ignore[return-value]  # every one a hit
    todo_encoded = [encoded[i] for i in todo.values()]
    ran, computed = await _run_parts(
        state, entry, gone, todo_encoded, deadline, runner, payload_of, timings
    )
    kept = dict(zip(todo, computed, strict=True))
    if ran.cache_token is not None:  # under the copy that computed them (a reload between)
        for key, value in kept.items():
            kept[key] = cache.put((ran.cache_token, key[1]), value)
    return [kept[key] if hit is None else hit for key, hit in zip(keys, found, strict=True)]


async def _run_parts(
    state: ServiceState,
    entry: ModelEntry,
    gone: Gone,
    encoded: list[Encoded],
    deadline: float,
    runner: Runner,
    payload_of: Callable[[list[Encoded]], Payload] | None,
    timings: Timings | None = None,
) -> tuple[ModelEntry, list[np.ndarray]]:
    """Queue every part on the batcher of `entry`'s current copy, await all; on timeout or
    disconnect drop the parts not yet started. payload_of builds a part's payload (default: its
    token ids). `deadline` is time.monotonic()'s: 504 if tokenizing has used it up. Returns the
    copy that computed them, and one result per input."""
    timeout = deadline - time.monotonic()
    if timeout <= 0:
        raise DeadlineExceeded("tokenizing used up the request's deadline (--request-timeout-s)")
    loop = asyncio.get_running_loop()
    settings = state.settings
    works: list[Work] = []
    try:
        for part in chunk(encoded, settings.max_batch_size, settings.max_batch_tokens):
            items = [encoded[i] for i in part]
            payload = payload_of(items) if payload_of else token_payload([e.ids for e in items])
            work = Work(payload=payload, runner=runner, deadline=deadline, loop=loop)
            work.future.add_done_callback(_retrieve)
            if works:
                entry.batcher.submit(work)  # 429 when the queue is full
            else:  # the model's current copy: a reload since the look-up passes it on
                entry = submit(state, entry.name, entry.version, work)
            works.append(work)
        gathered = asyncio.gather(*(w.future for w in works))
        results = await await_queued(entry.batcher, gathered, works, timeout, gone)
    except BaseException:
        for work in works:
            entry.batcher.cancel(work)
        raise
    finally:
        if timings is not None:
            timings.add(works)
        trace = CURRENT.get()
        if trace is not None:
            for work in works:
                queue_and_compute(trace, work)
    return entry, [vector for part in results for vector in part]

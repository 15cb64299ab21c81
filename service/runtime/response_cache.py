"""The response cache (`--response-cache-bytes`): model outputs kept by a digest of the inputs
that made them, so an identical request is answered without running the model. Triton's
response cache for OIP inference (one entry per request); one entry per input text on the text
routes, so a request of eight sentences that repeats six computes two.

Exact: a request's numbers never depend on its batch-mates (batch invariance: every precision
on CPU, fp16/bf16 on CUDA; CUDA fp32 varies by ~1e-6 with the batch), so a cached answer is
the answer computing it again gives. The digest is BLAKE3
(a cryptographic hash, ~5x faster than SHA-256 here) over the inputs' shapes, datatypes, flags
and bytes: no client can craft inputs that collide with another's and be answered with their
outputs. A key also carries its model copy's token
(one per load), so a reload or another version never meets an older copy's outputs.

Bounded in bytes (outputs plus ENTRY_OVERHEAD each), least recently used out first. Used from
the event loop and worker threads (large copies), under one lock; with --workers each front-end
has its own.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
from blake3 import blake3
from prometheus_client import CollectorRegistry, Counter, Gauge

if TYPE_CHECKING:
    from service.oip.inputs import Payload
    from service.text.tokenizer import Encoded

# Bytes counted per entry beyond its output: the key (~120), the array object and the dict slot
# (~220), measured with tracemalloc.
ENTRY_OVERHEAD = 384

_tokens = itertools.count(1)
Key = tuple[int, bytes]  # (model copy's token, BLAKE3 of its inputs)


def new_token() -> int:
    """A loaded model copy's token: never reused in a process, so keys never outlive it."""
    return next(_tokens)


def _digest(header: str, arrays: list[np.ndarray | None]) -> bytes:
    """BLAKE3 (256 bits) of `header` (shapes, datatypes, flags: what tells the arrays apart) and
    of the arrays' bytes."""
    h = blake3(header.encode())
    for array in arrays:
        if array is not None:
            h.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return h.digest()


def payload_key(token: int, payload: Payload) -> Key:
    """An OIP request's key: everything of its validated payload that decides the output
    (queries, keys, values, lengths, masks, is_causal, datatype, batched)."""
    arrays = [
        payload.query, payload.key, payload.value, payload.key_padding_mask,
        payload.tgt_key_padding_mask, payload.src_key_padding_mask, payload.token_types,
    ]  # fmt: skip
    header = repr(
        (
            payload.datatype, payload.batched, payload.is_causal, payload.lengths,
            payload.key_lengths, [None if a is None else (a.dtype.str, a.shape) for a in arrays],
        )
    )  # fmt: skip
    return token, _digest(header, arrays)


def text_key(token: int, runner: str, encoded: Encoded) -> Key:
    """One input text's key on the text routes: what its runner (pooled vector, token states,
    logits) makes of its token ids and token types."""
    header = repr((runner, encoded.ids.dtype.str, len(encoded.ids), encoded.types is not None))
    return token, _digest(header, [encoded.ids, encoded.types])


class CacheMetrics:
    """The cache's metric families in a Metrics registry (service.runtime.metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter(
            "mha_response_cache_lookups",
            "Response cache look-ups by result (hit, miss): one per OIP request, one per input "
            "on the text routes.",
            ["model", "version", "result"], registry=registry,
        )  # fmt: skip
        self.evictions = Counter(
            "mha_response_cache_evictions", "Entries dropped to make room (least recently used).",
            registry=registry,
        )  # fmt: skip
        # each front-end (--workers) holds a cache of its own: summed over live processes
        self.entries = Gauge(
            "mha_response_cache_entries", "Outputs held in the response cache.",
            registry=registry, multiprocess_mode="livesum",
        )  # fmt: skip
        self.bytes = Gauge(
            "mha_response_cache_bytes", "Bytes the response cache holds (outputs and overhead).",
            registry=registry, multiprocess_mode="livesum",
        )  # fmt: skip
        self.capacity = Gauge(
            "mha_response_cache_capacity_bytes", "The cache's bound (--response-cache-bytes).",
            registry=registry, multiprocess_mode="livesum",
        )  # fmt: skip


class ResponseCache:
    """Outputs by Key, at most `max_bytes` in all; `metrics` (None: not exported)."""

    def __init__(self, max_bytes: int, metrics: CacheMetrics | None = None) -> None:
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.bytes = 0
        self._entries: OrderedDict[Key, np.ndarray] = OrderedDict()
        self._dropped: set[int] = set()  # tokens of unloaded copies: their late outputs stay out
        self._lock = threading.Lock()
        if metrics is not None:
            metrics.capacity.set(max_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> np.ndarray | None:
        """The output kept under `key` (read-only), now the most recently used; None if absent."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Key, output: np.ndarray) -> np.ndarray:
        """Keep a read-only copy of `output` (not a view: a batch's buffer is not pinned),
        evicting the least recently used to fit; an output larger than the whole cache is not
        kept. Returns what to answer with (the copy, or `output` when not kept)."""
        size = output.nbytes + ENTRY_OVERHEAD
        if size > self.max_bytes:
            return output
        value = np.array(output, copy=True)
        value.flags.writeable = False
        evicted = 0
        with self._lock:
            if key[0] in self._dropped:
                return output
            old = self._entries.pop(key, None)
            if old is not None:  # two requests computed it at once: keep one
                self.bytes -= old.nbytes + ENTRY_OVERHEAD
            while self._entries and self.bytes + size > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= dropped.nbytes + ENTRY_OVERHEAD
                evicted += 1
            self._entries[key] = value
            self.bytes += size
        self._publish(evicted)
        return value

    def drop(self, tokens: set[int]) -> int:
        """Forget every output of these model copies (unloaded or replaced); returns how many."""
        with self._lock:
            self._dropped |= tokens
            keys = [key for key in self._entries if key[0] in tokens]
            for key in keys:
                self.bytes -= self._entries.pop(key).nbytes + ENTRY_OVERHEAD
        self._publish(0)
        return len(keys)

    def _publish(self, evicted: int) -> None:
        if self.metrics is not None:
            self.metrics.entries.set(len(self._entries))
            self.metrics.bytes.set(self.bytes)
            if evicted:
                self.metrics.evictions.inc(evicted)


__all__ = ["CacheMetrics", "Key", "ResponseCache", "new_token", "payload_key", "text_key"]

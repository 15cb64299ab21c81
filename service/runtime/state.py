"""What request handlers share, created by the app's lifespan: the served models (each version
its own ModelEntry with its batcher), the settings, the metrics, and readiness and drain state."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mha_engine import ServedModel
from service.oip.inputs import ModelLimits
from service.pipeline.errors import ModelNotFound
from service.runtime.log_settings import LogControl
from service.runtime.metrics import Metrics
from service.runtime.response_cache import ResponseCache
from service.runtime.settings import Settings
from service.runtime.statistics import ModelStats
from service.runtime.tracing import TraceControl
from service.runtime.work import Batcher
from service.shm.regions import Regions
from service.text.tokenizer import CharLimits, TextTokenizer

log = logging.getLogger("service")

MODEL_VERSION = "1"
# After the drain grace: how long a second listener (gRPC) still has to write its answers.
LISTENER_ANSWER_S = 2.0


@dataclass
class ModelEntry:
    """One served model: its engine module, batcher, request limits and text pieces."""

    name: str
    model: ServedModel
    batcher: Batcher  # local, or a --workers front-end's remote one
    limits: ModelLimits
    info: dict[str, Any]  # labels of mha_model_info and the metadata's properties
    stats: ModelStats  # Triton's statistics extension, fed by the batcher and the handlers
    tokenizer: TextTokenizer | None = None  # None: the text routes answer 400
    char_limits: CharLimits | None = None  # set with the tokenizer
    matryoshka: bool = False  # vectors may be cut short (`dimensions`)
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers' prompts
    default_prompt: str | None = None  # the prompt's text applied when a request names none
    version: str = MODEL_VERSION
    metrics: Metrics | None = None  # its labels' view of the shared metrics (None: the default)
    version_policy: dict[str, Any] = field(default_factory=lambda: {"latest": {"num_versions": 1}})
    warm: bool = False  # its warm-up has finished
    cache_token: int | None = None  # its outputs' keys in the response cache; None: not cached
    unloading: bool = False  # unloaded or replaced: finishing its accepted work


def _by_number(versions: dict[str, ModelEntry]) -> list[str]:
    return sorted(versions, key=lambda v: (len(v), v))  # numeric order of digit strings


@dataclass
class ServiceState:
    """Everything a request handler needs. `versions` (name -> version -> entry) is what is
    served; `models` (name -> its highest version, which unversioned requests get) follows it,
    changed only through put() and remove()."""

    settings: Settings
    metrics: Metrics
    versions: dict[str, dict[str, ModelEntry]]
    models: dict[str, ModelEntry] = field(init=False)
    ready: bool = False
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    loop: asyncio.AbstractEventLoop | None = None
    grace_timer: asyncio.TimerHandle | None = None
    # Set on the event loop once draining starts: open gRPC streams end (service.grpc.calls)
    drain_started: asyncio.Event = field(default_factory=asyncio.Event)
    shared_memory: Regions = field(init=False)  # Triton's system and CUDA shared memory
    log_control: LogControl | None = None  # the app's (Triton's logging extension)
    trace_control: TraceControl = field(default_factory=TraceControl.off)  # the app's
    # Where requests are answered (not a --workers engine process): open_response_cache()
    response_cache: ResponseCache | None = None

    def __post_init__(self) -> None:
        self.models = {}
        self.shared_memory = Regions.for_settings(self.settings)
        for name in self.versions:
            self._follow(name)

    def open_response_cache(self) -> None:
        """The process that answers requests keeps the response cache (if sized)."""
        size = self.settings.response_cache_bytes
        self.response_cache = ResponseCache(size, self.metrics.cache) if size else None

    def _follow(self, name: str) -> None:
        self.models[name] = self.versions[name][_by_number(self.versions[name])[-1]]

    def put(self, name: str, entries: dict[str, ModelEntry]) -> None:
        """Serve `entries` (version -> entry) as model `name`, replacing what it was."""
        self.versions[name] = entries
        self._follow(name)

    def remove(self, name: str) -> dict[str, ModelEntry]:
        """Stop serving model `name`; its entries (version -> entry) are returned."""
        del self.models[name]
        return self.versions.pop(name)

    def served_versions(self, name: str) -> list[str]:
        """The served versions of model `name`, lowest first."""
        return _by_number(self.versions.get(name, {}))

    def entries(self) -> list[ModelEntry]:
        """Every served model version, by model then version."""
        return [self.versions[n][v] for n in self.versions for v in self.served_versions(n)]

    @property
    def default(self) -> ModelEntry:
        """The first model at its highest version (for the routes that name no model)."""
        return next(iter(self.models.values()))

    def find(self, name: str, version: str | None = None, param: str | None = None) -> ModelEntry:
        """Model `name` at `version`, or at its highest served version when none is given
        (Triton's choice); 404 naming what is served."""
        if version in (None, ""):
            entry = self.models.get(name)
            if entry is not None:
                return entry
        else:
            entry = self.versions.get(name, {}).get(version)
            if entry is not None:
                return entry
        if name not in self.models:
            served = ", ".join(f"'{n}'" for n in self.models)
            raise ModelNotFound(f"unknown model '{name}'; this server serves {served}", param=param)
        raise ModelNotFound(
            f"model '{name}' has no version '{version}' "
            f"(served versions: {', '.join(self.served_versions(name))})",
            param=param,
        )

    def model_ready(self, entry: ModelEntry) -> bool:
        """A model version is ready once its warm-up is over, until it is unloaded or the
        server drains."""
        return entry.warm and not entry.unloading and not self.draining

    def publish_ready(self, entry: ModelEntry) -> None:
        """Set the entry's mha_ready gauge from model_ready()."""
        metrics = entry.metrics or self.metrics
        metrics.set_ready(self.model_ready(entry))

    # Shortcuts to the single served model's parts.
    @property
    def model_name(self) -> str:
        return self.default.name

    @property
    def model(self) -> ServedModel:
        return self.default.model

    @property
    def batcher(self) -> Batcher:
        return self.default.batcher

    @property
    def limits(self) -> ModelLimits:
        return self.default.limits

    @property
    def info(self) -> dict[str, Any]:
        return self.default.info

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self.default.tokenizer

    @property
    def char_limits(self) -> CharLimits | None:
        return self.default.char_limits

    @property
    def matryoshka(self) -> bool:
        return self.default.matryoshka

    def metrics_for(self, name: str | None, version: str | None = None) -> Metrics:
        """Metrics labelled with model `name` (at `version`, else its highest) when served,
        else the default model's."""
        if name is None:
            return self.metrics
        entry = self.versions.get(name, {}).get(version) if version else self.models.get(name)
        if entry is None or entry.metrics is None:
            return self.metrics
        return entry.metrics

    @property
    def serving(self) -> bool:
        """Ready and not draining: new work is accepted."""
        return self.ready and not self.draining

    def set_ready(self, ready: bool) -> None:
        """The server's readiness; each model version's gauge follows model_ready()."""
        self.ready = ready
        for entry in self.entries():
            self.publish_ready(entry)

    def start_draining(self) -> None:
        """SIGTERM: refuse new work (503) and fail readiness; queued and running requests go on,
        and when --drain-grace-s ends, those not yet started are answered 503 (`end_grace`)."""
        if self.draining:
            return
        self.draining = True
        self.set_ready(False)
        if self.loop is not None:
            grace = self.settings.drain_grace_s
            log.info("draining: %.1f s for queued requests to start, then 503", grace)
            self.loop.call_soon_threadsafe(self._drain_on_loop, grace)

    def _drain_on_loop(self, grace: float) -> None:
        """On the event loop: the grace's timer, and queued batches run without waiting."""
        self.grace_timer = asyncio.get_running_loop().call_later(grace, self.end_grace)
        self.drain_started.set()
        self.flush_batches()

    def flush_batches(self) -> None:
        """Draining: queued batches stop waiting for batch-mates (none can come) and run now."""
        for entry in self.entries():
            entry.batcher.flush()

    def grace_left(self) -> float:
        """Seconds of the drain grace still to run (all of it before draining starts)."""
        if self.grace_timer is None:
            return self.settings.drain_grace_s
        return max(0.0, self.grace_timer.when() - asyncio.get_running_loop().time())

    async def drain(self, stop_listener: Callable[[float], Awaitable[None]] | None = None) -> None:
        """A lifespan's end, the same in every process that answers requests: refuse new work,
        give a second listener (gRPC) what is left of the grace to finish its calls, then answer
        503 to whatever has not started."""
        self.start_draining()
        if stop_listener is not None:
            await asyncio.sleep(0)  # let start_draining arm the grace timer
            # gRPC cancels the calls left at its cut-off on a timer of its own (the client sees
            # UNAVAILABLE "Cancelling all calls", none of our answer: no request id, no
            # reason); the grace timer on this loop sheds the queue with our UNAVAILABLE,
            # which says why. gRPC's cut-off comes LISTENER_ANSWER_S later, so a loop running
            # late on a loaded machine still answers first; it returns as soon as the last call
            # is answered.
            await stop_listener(self.grace_left() + LISTENER_ANSWER_S)
        if self.grace_timer is not None:
            self.grace_timer.cancel()
        self.end_grace()  # no connection is left to answer: nothing queued is computed

    def end_grace(self) -> None:
        """The drain grace is over: what has not started is answered 503 and never computed."""
        shed = sum(entry.batcher.close() for entry in self.entries())
        if shed:
            log.info("drain grace over: %d queued requests answered 503, not computed", shed)

"""What request handlers share, created by the app's lifespan: the served model(s) with their
batchers, the settings, the metrics, and the server's readiness and drain state."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from mha_engine import ServedModel
from service.batcher import DynamicBatcher
from service.errors import ModelNotFound
from service.inputs import ModelLimits
from service.metrics import Metrics
from service.settings import Settings
from service.stats import ModelStats
from service.text import CharLimits, TextTokenizer

log = logging.getLogger("service")

MODEL_VERSION = "1"


@dataclass
class ModelEntry:
    """One served model: its engine module, batcher, request limits and text pieces."""

    name: str
    model: ServedModel
    batcher: DynamicBatcher
    limits: ModelLimits
    info: dict[str, Any]  # labels of mha_model_info and the metadata's properties
    stats: ModelStats  # Triton's statistics extension, fed by the batcher and the handlers
    tokenizer: TextTokenizer | None = None  # None: the text routes answer 400
    char_limits: CharLimits | None = None  # set with the tokenizer
    matryoshka: bool = False  # vectors may be cut short (`dimensions`)
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers' prompts
    default_prompt: str | None = None  # the prompt applied when a request names none
    version: str = MODEL_VERSION
    metrics: Metrics | None = None  # its label's view of the shared metrics (None: the default)


@dataclass
class ServiceState:
    """Everything a request handler needs. Holds a dict of models so that several can be served
    later; today the server loads exactly one, and the shortcuts below name it."""

    settings: Settings
    metrics: Metrics
    models: dict[str, ModelEntry]
    ready: bool = False
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    loop: asyncio.AbstractEventLoop | None = None
    grace_timer: asyncio.TimerHandle | None = None

    @property
    def default(self) -> ModelEntry:
        """The served model (the only one, until several are served)."""
        return next(iter(self.models.values()))

    def find(self, name: str, version: str | None = None, param: str | None = None) -> ModelEntry:
        """The model called `name` (and, if given, that version); 404 naming what is served."""
        entry = self.models.get(name)
        if entry is None:
            served = ", ".join(f"'{n}'" for n in self.models)
            raise ModelNotFound(f"unknown model '{name}'; this server serves {served}", param=param)
        if version not in (None, "", entry.version):
            raise ModelNotFound(
                f"model '{name}' has no version '{version}' (versions: {entry.version})"
            )
        return entry

    # Shortcuts to the single served model's parts.
    @property
    def model_name(self) -> str:
        return self.default.name

    @property
    def model(self) -> ServedModel:
        return self.default.model

    @property
    def batcher(self) -> DynamicBatcher:
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

    def metrics_for(self, name: str | None) -> Metrics:
        """Metrics labelled with model `name` when it is served, else the default model's."""
        entry = self.models.get(name) if name is not None else None
        if entry is None or entry.metrics is None:
            return self.metrics
        return entry.metrics

    @property
    def serving(self) -> bool:
        """Ready and not draining: new work is accepted."""
        return self.ready and not self.draining

    def set_ready(self, ready: bool) -> None:
        self.ready = ready
        for name in self.models:
            self.metrics.ready.labels(name).set(1 if ready else 0)

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
            self.loop.call_soon_threadsafe(self._arm_grace_timer, grace)

    def _arm_grace_timer(self, grace: float) -> None:
        self.grace_timer = asyncio.get_running_loop().call_later(grace, self.end_grace)

    def grace_left(self) -> float:
        """Seconds of the drain grace still to run (all of it before draining starts)."""
        if self.grace_timer is None:
            return self.settings.drain_grace_s
        return max(0.0, self.grace_timer.when() - asyncio.get_running_loop().time())

    def end_grace(self) -> None:
        """The drain grace is over: what has not started is answered 503 and never computed."""
        shed = sum(entry.batcher.close() for entry in self.models.values())
        if shed:
            log.info("drain grace over: %d queued requests answered 503, not computed", shed)

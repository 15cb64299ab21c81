"""Triton's model repository extension: the repository index and, with
--model-control-mode explicit, loading and unloading models while the others serve.

Loading builds the model with its own batcher and warms it up off the event loop before it
becomes visible, so traffic to other models goes on; a model that fails to load is reported and
nothing else changes. Unloading removes the model at once (new requests: 404 / NOT_FOUND), then
its batcher finishes the work it had accepted and stops. Loading a loaded model reloads it: the
new copy replaces the old one when warm, and the old one drains.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from service.errors import BadInput, ModelNotFound
from service.loading import load_entry, warm_up_model
from service.repository import ModelSource, RepositoryError, model_sources, repository_models
from service.state import ServiceState

log = logging.getLogger("service.model_control")


class ModelControl:
    """Index, load and unload over the lifespan's ServiceState (one operation at a time)."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.explicit = state.settings.model_control_mode == "explicit"
        self._lock = asyncio.Lock()

    def _sources(self) -> dict[str, ModelSource]:
        """Every model the server could serve now: --model-dir, and the repository as it is on
        disk at this moment (models added since start-up appear)."""
        settings = self.state.settings
        sources = {s.name: s for s in model_sources(settings)}
        if settings.model_repository is not None:
            try:
                sources.update({s.name: s for s in repository_models(settings.model_repository)})
            except RepositoryError as exc:
                raise BadInput(str(exc)) from None
        return sources

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's repository index: name, version, state (READY / UNAVAILABLE), reason."""
        loaded = self.state.models
        rows = []
        for name, source in sorted(self._sources().items()):
            entry = loaded.get(name)
            if entry is not None:
                rows.append({"name": name, "version": entry.version, "state": "READY"})
            elif not ready_only:
                rows.append(
                    {
                        "name": name,
                        "version": source.version,
                        "state": "UNAVAILABLE",
                        "reason": "unloaded",
                    }
                )
        return rows

    def _check_explicit(self, action: str) -> None:
        if not self.explicit:
            raise BadInput(
                f"cannot {action} models: --model-control-mode is 'none' (every model is loaded "
                "at start-up); start the server with --model-control-mode explicit"
            )

    async def load(self, name: str) -> None:
        """Load (or reload) `name` from its source; 400 naming the problem if it fails."""
        self._check_explicit("load")
        async with self._lock:
            source = self._sources().get(name)
            if source is None:
                raise ModelNotFound(f"no model '{name}' in the model repository or --model-dir")
            state = self.state
            try:
                entry = await load_entry(state.settings, state.metrics, source)
            except Exception as exc:  # a bad checkpoint/config: this load fails, nothing else
                log.warning("loading model %r failed: %s", name, exc)
                raise BadInput(f"loading model '{name}' failed: {exc}") from None
            entry.batcher.start()
            try:
                await warm_up_model(entry)
            except Exception as exc:
                await asyncio.to_thread(entry.batcher.stop, 1.0)
                raise BadInput(f"model '{name}' failed its warm-up: {exc}") from None
            old = state.models.get(name)
            state.models[name] = entry
            entry.metrics.ready.labels(name).set(1 if state.serving else 0)
            log.info("model %r version %s loaded", name, entry.version)
            if old is not None:
                await asyncio.to_thread(old.batcher.stop, state.settings.drain_grace_s)

    async def unload(self, name: str) -> None:
        """Unload `name`: gone for new requests now; its accepted work finishes first."""
        self._check_explicit("unload")
        async with self._lock:
            state = self.state
            if name not in state.models:
                raise ModelNotFound(f"model '{name}' is not loaded")
            if len(state.models) == 1:
                raise BadInput(
                    f"cannot unload '{name}': it is the only model loaded (load another first)"
                )
            entry = state.models.pop(name)
            entry.metrics.ready.labels(name).set(0)
            await asyncio.to_thread(entry.batcher.stop, state.settings.drain_grace_s)
            log.info("model %r unloaded", name)

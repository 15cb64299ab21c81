"""Triton's model repository extension: the repository index and, with
--model-control-mode explicit, loading and unloading models while the others serve.

Loading builds the model with its own batcher and warms it up off the event loop before it
becomes visible, so traffic to other models goes on; a model that fails to load is reported and
nothing else changes. A model's version policy picks which of its versions load, each its own
entry; load and unload act on all of them together. Unloading removes the model at once (new
requests: 404 / NOT_FOUND), then its batchers finish the work they had accepted and stop.
Loading a loaded model reloads it: the new copies replace the old ones when warm, and the old
ones drain. A load may carry a config (service/runtime/load_config.py): the model's settings
for that load, over its mha-serve.json; the next load without one goes back to the file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from service.pipeline.errors import BadInput, ModelNotFound
from service.runtime.loading import load_entry, warm_up_model
from service.runtime.repository import ModelSettings, ModelSource, RepositoryError, model_sources
from service.runtime.state import ModelEntry, ServiceState

# Parameters a load / unload request may carry (Triton's); anything else is refused with 400
# (a load's model files, `file:<path>`, among them: a model's directory is on the server).
LOAD_PARAMETERS = frozenset({"config"})
UNLOAD_PARAMETERS = frozenset({"unload_dependents"})

log = logging.getLogger("service.runtime.model_control")


def check_parameters(names: Iterable[str], allowed: frozenset[str]) -> None:
    """400 naming the load/unload parameters (of `names`) this server cannot honour."""
    refused = sorted(set(names) - allowed)
    if refused:
        raise BadInput(
            f"load/unload parameters {refused} are not supported (this one takes "
            f"{sorted(allowed) or 'none'}); model files cannot be uploaded: a model's directory "
            "is on the server"
        )


class ModelControl:
    """Index, load and unload over the lifespan's ServiceState (one operation at a time)."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.explicit = state.settings.model_control_mode == "explicit"
        self._lock = asyncio.Lock()

    def _sources(
        self, configs: dict[str, ModelSettings] | None = None
    ) -> dict[str, list[ModelSource]]:
        """Every model the server could serve now, with the versions its policy picks:
        --model-dir, and the repository as it is on disk at this moment (models and versions
        added since start-up appear); `configs`: a load's config for a model."""
        try:
            sources = model_sources(self.state.settings, configs)
        except RepositoryError as exc:
            raise BadInput(str(exc)) from None
        by_name: dict[str, list[ModelSource]] = {}
        for source in sources:
            by_name.setdefault(source.name, []).append(source)
        return by_name

    def known(self) -> set[str]:
        """Names the server could serve (loaded or not): a readiness probe says "not ready" for
        these rather than "not found"."""
        try:
            return set(self._sources()) | set(self.state.versions)
        except BadInput:  # an unreadable repository: only what is loaded
            return set(self.state.versions)

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's repository index, a row per model version: name, version, state (READY /
        UNAVAILABLE), reason."""
        rows = []
        for name, sources in sorted(self._sources().items()):
            loaded = self.state.versions.get(name, {})
            for version in self.state.served_versions(name):
                rows.append({"name": name, "version": version, "state": "READY"})
            if ready_only:
                continue
            for source in sources:
                if source.version not in loaded:
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

    async def load(self, name: str, config: ModelSettings | None = None) -> None:
        """Load (or reload) `name` at the versions its policy (or `config`'s) picks, with
        `config` over its settings file, each warmed up before the set replaces what was served;
        400 naming the problem if one fails (nothing changes then)."""
        self._check_explicit("load")
        async with self._lock:
            sources = self._sources({name: config} if config is not None else None).get(name)
            if sources is None:
                raise ModelNotFound(f"no model '{name}' in the model repository or --model-dir")
            state = self.state
            entries: dict[str, ModelEntry] = {}
            try:
                for source in sources:
                    entries[source.version] = await self._load_version(source)
            except BadInput:
                for entry in entries.values():
                    await asyncio.to_thread(entry.batcher.stop, 1.0)
                raise
            old = state.versions.get(name, {})
            state.put(name, entries)
            for entry in entries.values():
                state.publish_ready(entry)
            log.info("model %r loaded, versions %s", name, ", ".join(state.served_versions(name)))
            await self._drain(list(old.values()))

    async def _load_version(self, source: ModelSource) -> ModelEntry:
        """One version loaded, its batcher started and warmed up; BadInput if either fails."""
        state = self.state
        label = f"model '{source.name}'"
        try:
            entry = await load_entry(state.settings, state.metrics, source)
        except Exception as exc:  # a bad checkpoint/config: this load fails, nothing else
            log.warning("loading %s version %s failed: %s", label, source.version, exc)
            raise BadInput(f"loading {label} failed (version {source.version}): {exc}") from None
        entry.batcher.start()
        try:
            await warm_up_model(entry)
        except Exception as exc:
            await asyncio.to_thread(entry.batcher.stop, 1.0)
            raise BadInput(f"{label} version {source.version} failed its warm-up: {exc}") from None
        return entry

    async def _drain(self, entries: list[ModelEntry]) -> None:
        """No longer served: not ready while their accepted work finishes, then stopped, and
        (unless a reloaded copy owns them) its state series gone from /metrics."""
        gone = [e for e in entries if self.state.versions.get(e.name, {}).get(e.version) is None]
        for entry in entries:
            entry.unloading = True
        for entry in gone:
            self.state.publish_ready(entry)
        for entry in entries:
            await asyncio.to_thread(entry.batcher.stop, self.state.settings.drain_grace_s)
        cache = self.state.response_cache
        if cache is not None:
            cache.drop({e.cache_token for e in entries if e.cache_token is not None})
        for entry in gone:
            (entry.metrics or self.state.metrics).remove_state_series()

    async def unload(self, name: str) -> None:
        """Unload every version of `name`: gone for new requests now; accepted work finishes."""
        self._check_explicit("unload")
        async with self._lock:
            state = self.state
            if name not in state.models:
                raise ModelNotFound(f"model '{name}' is not loaded")
            if len(state.models) == 1:
                raise BadInput(
                    f"cannot unload '{name}': it is the only model loaded (load another first)"
                )
            entries = state.remove(name)
            await self._drain(list(entries.values()))
            log.info("model %r unloaded", name)
